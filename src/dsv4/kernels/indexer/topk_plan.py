"""Launch plan of the row-wise top-k: which algorithm (``topk`` describes them), its launch constants, its scratch.

``plan_topk`` decides from host facts only — rows (tokens), columns (the score buffer's width, a bound from the
step's shapes), k, the score dtype, the device's multiprocessor count and whether it is Hopper — so a CUDA graph
captured with the plan stays right on later steps of the same shapes. ``topk.radix_topk`` launches what it says.

Rules (``topk_algorithm``):

* decode steps, ``FILTER_MIN_ROWS`` rows up to one per multiprocessor: ``"bisect"`` on rows of at most
  ``BISECT_DEFAULT_MAX_COLUMNS`` columns — ``BISECT_GLUON_DEFAULT_MAX_COLUMNS`` where ``"bisect"`` runs in Gluon —,
  ``"filter"`` on longer rows;
* prefill chunks, more rows than multiprocessors: ``"bisect"`` on rows of at most ``BISECT_PREFILL_MAX_COLUMNS``,
  ``"split"`` beyond;
* fewer rows: ``"split"``.

Whatever is asked, what cannot run falls back (``launched_algorithm``): ``"bisect"`` holds at most
``BISECT_MAX_COLUMNS`` columns in registers (longer rows: ``"filter"``), and ``"filter"`` needs every program of a
row resident at once, up to one row per multiprocessor (more rows: ``"split"``). ``"bisect"`` runs the Gluon kernel
(``topk_bisect_sm90``) on Hopper for BF16 rows of whole 8-column vectors and 8 to 32 columns per thread
(``bisect_sm90_fits``), the Triton kernel (``topk_bisect``) elsewhere.

Why these thresholds: see benchmarks/RESULTS.md, "Top-k and the CSA write path", "Prefill top-k: "bisect" by
default" and "Top-k "bisect" in Gluon for BF16 rows of 1K–16K columns".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .scores_plan import cdiv

__all__ = [
    "ALGORITHMS", "BISECT_DEFAULT_MAX_COLUMNS", "BISECT_GLUON_DEFAULT_MAX_COLUMNS", "BISECT_MAX_COLUMNS",
    "BISECT_PREFILL_MAX_COLUMNS", "BISECT_SM90_VECTOR", "FILTER_CANDIDATES_PER_ROW", "FILTER_MIN_ROWS", "TopkPlan",
    "bisect_block", "bisect_plan", "bisect_sm90_fits", "bound_group", "filter_plan", "key_bits", "launched_algorithm",
    "next_power_of_2", "plan_topk", "split_plan", "topk_algorithm",
]

ALGORITHMS = ("bisect", "filter", "split")

#: the most columns ``"bisect"`` holds in registers (one program per row; 64 keys per thread at 16 warps)
BISECT_MAX_COLUMNS = 32768
#: fewest rows for which decode steps take ``"bisect"`` or ``"filter"`` rather than ``"split"``
FILTER_MIN_ROWS = 32
#: longest rows for which decode steps take ``"bisect"`` rather than ``"filter"``
BISECT_DEFAULT_MAX_COLUMNS = 8192
#: the same where ``"bisect"`` runs the Gluon kernel (``bisect_sm90_fits``)
BISECT_GLUON_DEFAULT_MAX_COLUMNS = 16384
#: longest rows for which steps of more rows than multiprocessors (prefill chunks) take ``"bisect"`` rather than
#: ``"split"``
BISECT_PREFILL_MAX_COLUMNS = BISECT_MAX_COLUMNS

#: ``"split"``: columns per loop step, warps, and programs per multiprocessor its rows are cut for
SPLIT_BLOCK = 1024
SPLIT_NUM_WARPS = 4
SPLIT_PROGRAMS_PER_SM = 4
#: ``"filter"``: the largest register block, the columns a program takes at least when a row is cut, the most
#: candidates selected in registers (more: histogram passes over the list in blocks), candidates per register-block
#: row, warps
FILTER_MAX_BLOCK = 16384
FILTER_MIN_COLUMNS_PER_PROGRAM = 1024
FILTER_CANDIDATE_BLOCK = 8192
FILTER_CANDIDATES_PER_ROW = 64
FILTER_NUM_WARPS = 16
#: the Gluon ``"bisect"``: the fewest and most contiguous columns per thread (fewer, more: the Triton kernel), and the
#: vector its loads read (rows and their stride must be multiples of it)
BISECT_SM90_MIN_COLUMNS_PER_THREAD = 8
BISECT_SM90_MAX_COLUMNS_PER_THREAD = 32
BISECT_SM90_VECTOR = 8


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ ``n`` (1 for ``n`` ≤ 1)."""
    return 1 << max(0, n - 1).bit_length()


def key_bits(score_dtype: torch.dtype) -> int:
    """Bits of the order-preserving key of a score: 16 for BF16, 32 for FP32."""
    if score_dtype == torch.bfloat16:
        return 16
    if score_dtype == torch.float32:
        return 32
    raise ValueError(f"top-k: scores must be bfloat16 or float32, got {score_dtype}")


def bisect_block(columns: int) -> tuple[int, int]:
    """``(block, num_warps)`` of ``"bisect"`` on rows of ``columns``: the row as one power-of-two register block
    (at least 16); 16 warps from 8,192 columns, 8 from 2,048, else 4."""
    block = max(next_power_of_2(columns), 16)
    return block, 16 if block >= 8192 else 8 if block >= 2048 else 4


def bound_group(columns: int, k: int, block: int) -> int:
    """Columns per group of the lower bound (``"filter"``, ``"bisect"``): a power of two, at most 64 and ``block``,
    with at least ``k`` groups in a full row of ``columns``."""
    return max(1, min(64, block, 1 << max(0, (columns // max(k, 1)).bit_length() - 1)))


def bisect_sm90_fits(bits: int, columns: int) -> bool:
    """Whether the Gluon kernel can run ``"bisect"`` on rows of ``columns`` keys of ``bits`` bits (the rows' stride
    is the buffer's width, ``columns``): BF16 keys, whole vectors, 8 to 32 columns of the block per thread."""
    block, warps = bisect_block(columns)
    per_thread = block // (32 * warps)
    return (bits == 16 and columns % BISECT_SM90_VECTOR == 0
            and BISECT_SM90_MIN_COLUMNS_PER_THREAD <= per_thread <= BISECT_SM90_MAX_COLUMNS_PER_THREAD)


def topk_algorithm(rows: int, columns: int, sm_count: int, gluon_bisect: bool) -> str:
    """The rule (module docstring): the algorithm for ``rows`` × ``columns`` scores on ``sm_count`` multiprocessors;
    ``gluon_bisect``: ``"bisect"`` would run the Gluon kernel on these rows."""
    if FILTER_MIN_ROWS <= rows <= sm_count:
        longest = BISECT_GLUON_DEFAULT_MAX_COLUMNS if gluon_bisect else BISECT_DEFAULT_MAX_COLUMNS
        return "bisect" if columns <= longest else "filter"
    if rows > sm_count and columns <= BISECT_PREFILL_MAX_COLUMNS:
        return "bisect"
    return "split"


def launched_algorithm(algorithm: str, rows: int, columns: int, sm_count: int, interpreted: bool) -> str:
    """The algorithm that runs when ``algorithm`` is asked for: ``"bisect"`` on rows longer than
    ``BISECT_MAX_COLUMNS`` runs ``"filter"``, and ``"filter"`` beyond one row per multiprocessor runs ``"split"``
    (the interpreter runs a row's programs one after another: any number of rows there)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"top-k: unknown algorithm {algorithm!r} (one of {ALGORITHMS})")
    if algorithm == "bisect" and columns > BISECT_MAX_COLUMNS:
        algorithm = "filter"
    if algorithm == "filter" and not (rows > 0 and (rows <= sm_count or interpreted)):
        algorithm = "split"
    return algorithm


@dataclass(frozen=True)
class TopkPlan:
    """Every launch decision of one top-k over ``rows`` × ``columns`` scores (``plan_topk``; consumed by
    ``topk.radix_topk``).

    Attributes:
        algorithm: ``"bisect"``, ``"filter"`` or ``"split"``.
        gluon: ``"bisect"`` runs the Gluon kernel (``topk_bisect_sm90``).
        rows, columns: the score matrix's shape (its row stride is ``columns``).
        k: indices selected per row.
        key_bits: 16 (BF16 scores) or 32 (FP32).
        block: columns per register block — ``"bisect"``: the whole row; ``"filter"``: a program's block;
            ``"split"``: per loop step.
        num_warps: warps per program.
        chunk: ``"filter"`` / ``"split"``: columns per program (a row's programs: ``programs_per_row``); 0 for
            ``"bisect"``.
        candidate_block: ``"filter"``: the most candidates selected in registers; 0 otherwise.
        interpreted: planned for Triton's CPU interpreter (one program per row for ``"filter"``, loops to host
            bounds, no PTX).
    """

    algorithm: str
    gluon: bool
    rows: int
    columns: int
    k: int
    key_bits: int
    block: int
    num_warps: int
    chunk: int
    candidate_block: int
    interpreted: bool

    @property
    def programs_per_row(self) -> int:
        """Programs per row (grid axis 1)."""
        return cdiv(self.columns, self.chunk) if self.chunk else 1

    @property
    def group(self) -> int:
        """``"filter"`` / ``"bisect"``: columns per group of the lower bound."""
        return bound_group(self.columns, self.k, self.block)

    @property
    def fill(self) -> int:
        """Output slots written per step of the −1 fill."""
        return min(next_power_of_2(self.k), 4096)

    @property
    def radix_bits(self) -> int:
        """Digit width of the histogram passes: ``"split"`` 8, ``"filter"``'s blocked fallback 4."""
        return 8 if self.algorithm == "split" else 4

    def scratch(self) -> dict[str, tuple[tuple[int, int], bool]]:
        """The int32 scratch the launch takes, by keyword argument of ``radix_topk``: ``{name: (shape,
        zero_kept)}`` (``zero_kept``: must be zero when passed and is left zero — allocate it zeroed once)."""
        if self.algorithm == "filter":
            return {"header": ((self.rows, 4), True), "candidates": ((self.rows, self.columns), False)}
        if self.algorithm == "split":
            return {"workspace": ((self.rows, (self.key_bits // 8) * 256 + 2), False)}
        return {}

    def describe(self) -> str:
        """One line: the algorithm, its grid and its scratch."""
        what = f"top-k: {self.algorithm}{' (Gluon sm_90)' if self.gluon else ''}, {self.rows} rows × {self.columns} " \
               f"columns, k={self.k}"
        if self.algorithm == "bisect":
            how = f"one program per row ({self.block}-column block, {self.num_warps} warps)"
        elif self.algorithm == "filter":
            how = (f"{self.programs_per_row} program(s) per row of {self.chunk} columns ({self.num_warps} warps), "
                   f"candidates in registers up to {self.candidate_block}")
        else:
            how = (f"{self.key_bits // 8 + 1} launches of {self.programs_per_row} program(s) per row of {self.chunk} "
                   f"columns ({self.num_warps} warps)")
        scratch = ", ".join(f"{n} {list(s)}{' kept zero' if z else ''}" for n, (s, z) in self.scratch().items())
        return f"{what}: {how}" + (f"; scratch {scratch}" if scratch else "")


def bisect_plan(rows: int, columns: int, k: int, bits: int, *, gluon: bool, interpreted: bool) -> TopkPlan:
    """``"bisect"``: one program per row, the row one register block (``bisect_block``); ``gluon``: the Gluon kernel
    (only where ``bisect_sm90_fits``)."""
    if gluon and not bisect_sm90_fits(bits, columns):
        raise ValueError(f"top-k: the Gluon bisect does not take {columns} columns of {bits}-bit keys")
    block, warps = bisect_block(columns)
    return TopkPlan("bisect", gluon, rows, columns, k, bits, block, warps, 0, 0, interpreted)


def filter_plan(rows: int, columns: int, k: int, bits: int, *, sm_count: int, interpreted: bool,
                max_block: int = FILTER_MAX_BLOCK, candidate_block: int = FILTER_CANDIDATE_BLOCK) -> TopkPlan:
    """``"filter"``: each row cut over up to ``sm_count // rows`` programs of at least
    ``FILTER_MIN_COLUMNS_PER_PROGRAM`` columns (one in the interpreter, which runs programs one after another);
    a program's columns in one register block of up to ``max_block`` (else looped); up to ``candidate_block``
    candidates selected in registers (tests pass small blocks to reach the looped paths on small rows)."""
    splits = 1 if interpreted else max(1, min(sm_count // max(rows, 1), cdiv(columns, FILTER_MIN_COLUMNS_PER_PROGRAM)))
    per = cdiv(columns, splits)
    block = min(max_block, next_power_of_2(per))
    chunk = cdiv(per, block) * block
    return TopkPlan("filter", False, rows, columns, k, bits, block, FILTER_NUM_WARPS, chunk,
                    max(next_power_of_2(candidate_block), 128), interpreted)


def split_plan(rows: int, columns: int, k: int, bits: int, *, sm_count: int, interpreted: bool,
               block: int = SPLIT_BLOCK) -> TopkPlan:
    """``"split"``: each row cut into chunks of whole ``block``-column steps until the rows' programs reach
    ``SPLIT_PROGRAMS_PER_SM`` per multiprocessor."""
    blocks = cdiv(columns, block)
    splits = max(1, min(blocks, cdiv(SPLIT_PROGRAMS_PER_SM * sm_count, max(rows, 1))))
    return TopkPlan("split", False, rows, columns, k, bits, block, SPLIT_NUM_WARPS, cdiv(blocks, splits) * block, 0,
                    interpreted)


def plan_topk(rows: int, columns: int, k: int, score_dtype: torch.dtype, *, sm_count: int, sm90: bool,
              interpreted: bool = False, algorithm: str | None = None) -> TopkPlan:
    """The top-k launch for ``rows`` × ``columns`` scores of ``score_dtype`` (module docstring: the rules).

    Args:
        rows, columns: the score matrix (columns: its width and row stride, ≥ 1).
        k: indices per row.
        score_dtype: ``torch.bfloat16`` or ``torch.float32``.
        sm_count: the device's multiprocessors (``device.sm_count``).
        sm90: the device runs the Gluon kernels (``device.is_sm90``).
        interpreted: the kernels run in Triton's CPU interpreter (``device.interpreting``; never with ``sm90``).
        algorithm: run this one instead of the rule's (tests, benchmarks); the fallbacks still apply.
    Raises:
        ValueError: another score dtype, no columns, an unknown algorithm, ``sm90`` with ``interpreted``.
    """
    bits = key_bits(score_dtype)
    if columns < 1:
        raise ValueError(f"top-k: the score matrix needs at least one column, got {columns}")
    if sm90 and interpreted:
        raise ValueError("plan_topk: the interpreter runs no Gluon kernel (sm90 and interpreted both set)")
    gluon = sm90 and bisect_sm90_fits(bits, columns)
    if algorithm is None:
        algorithm = topk_algorithm(rows, columns, sm_count, gluon)
    algorithm = launched_algorithm(algorithm, rows, columns, sm_count, interpreted)
    if algorithm == "bisect":
        return bisect_plan(rows, columns, k, bits, gluon=gluon, interpreted=interpreted)
    if algorithm == "filter":
        return filter_plan(rows, columns, k, bits, sm_count=sm_count, interpreted=interpreted)
    return split_plan(rows, columns, k, bits, sm_count=sm_count, interpreted=interpreted)
