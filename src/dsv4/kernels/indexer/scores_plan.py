"""Launch plan of the index scores: which kernel, how many queries and key tiles one program takes, its registers.

``plan_scores`` decides from a step's host facts only (requests, the longest request's new tokens, the addressable
entries bound, heads, key format, pool geometry, the device's multiprocessor count and whether it is Hopper), never
from positions or device data: a CUDA graph captured with the plan stays right on later steps of the same shapes.
``index_scores`` (``scores``) launches what the plan says.

Rules:

* Kernel. MXFP4 keys on Hopper run the Gluon kernel (``scores_sm90``) where the layer's shape fits it (16 to 256
  padded heads: the wgmma's N; pages of a multiple of its ``SM90_BLOCK_N``-key tile); everything else — FP8 and FP32
  keys, other devices, the interpreter — runs the Triton kernel (``scores``).
* Queries per program (``QT``: a key tile is read and converted once for all of them, ``N = QT · HP`` MMA columns).
  Gluon: 1 for single-token decode and above 64 heads, else the smallest power of two covering the longest request,
  at most ``SM90_CHUNK_QUERIES`` and ``N`` ≤ 256. Triton: the smallest power of two covering the longest request, at
  most ``N`` ≤ 256, with tiles of 128 keys and 8 warps where ``N`` reaches 256, else 64 keys and 4 warps; FP32 keys
  ``N`` ≤ 128.
* Key tiles per program. Each request's tiles are split until about ``PROGRAMS_PER_SM`` programs per
  multiprocessor run (many short programs: the last wave's tail stays small); a Gluon program takes at least
  ``MIN_TILES_PER_PROGRAM`` tiles (shorter ones spend their time filling the pipeline); a Triton program holding its
  pages in registers (``page_vector``) at most ``MAX_TILES_PER_SPLIT``.
* Registers. The Gluon kernel is capped at ``SM90_MAX_REGISTERS`` per thread for ``QT`` = 1 (4 programs per SM), 168
  for ``QT`` = 2 (3 per SM), uncapped for ``QT`` = 4.

Why these numbers: see benchmarks/RESULTS.md, "Indexer scores: Gluon decode kernel" and "H200 runs: indexer prefill
in Gluon, the key conversion, HCA's kernel choice".
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "MAX_TILES_PER_SPLIT", "MIN_TILES_PER_PROGRAM", "PROGRAMS_PER_SM", "SCORE_FORMATS", "SM90_BLOCK_N",
    "SM90_CHUNK_QUERIES", "SM90_MAX_REGISTERS", "SM90_NUM_WARPS", "ScoresPlan", "cdiv", "head_pad", "plan_scores",
    "sm90_applies", "sm90_queries_per_program", "sm90_register_cap",
]

#: key formats the scores kernels read (``dsv4.cache.storage``'s names)
SCORE_FORMATS = ("mxfp4", "fp8", "fp32")
#: programs per multiprocessor the split of each request's key tiles aims at
PROGRAMS_PER_SM = 16
#: most key tiles a Triton program takes when it holds its pages in registers (the kernel's ``MAX_TPS``)
MAX_TILES_PER_SPLIT = 32
#: fewest key tiles per Gluon program when a request's tiles are split
MIN_TILES_PER_PROGRAM = 8
#: the Gluon kernel's keys per tile (the wgmma M of one warpgroup) and warps
SM90_BLOCK_N = 64
SM90_NUM_WARPS = 4
#: the Gluon kernel's queries per program on multi-token steps (prefill chunks, 2-4-token decodes)
SM90_CHUNK_QUERIES = 4
#: the Gluon kernel's register cap per thread for single-token decode: 4 programs of 4 warps per SM
SM90_MAX_REGISTERS = 128


def cdiv(a: int, b: int) -> int:
    """``⌈a / b⌉`` of non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def head_pad(num_heads: int) -> int:
    """MMA width of the heads: the next power of two, at least 16."""
    return max(16, 1 << (max(num_heads, 1) - 1).bit_length())


def sm90_applies(head_pad: int, entries_per_page: int) -> bool:
    """Whether the Gluon kernel serves a layer's shape: ``head_pad`` 16 to 256 (the wgmma N), pages of a multiple of
    ``SM90_BLOCK_N`` entries (a key tile lies in one page)."""
    return 16 <= head_pad <= 256 and entries_per_page % SM90_BLOCK_N == 0


def sm90_queries_per_program(max_new: int, head_pad: int) -> int:
    """The Gluon kernel's ``QT``: 1 for single-token decode and above 64 heads (N = 256 with 128 heads spills), else
    the smallest power of two ≥ ``min(max_new, SM90_CHUNK_QUERIES)``, at most ``256 // head_pad``."""
    if max_new == 1 or head_pad > 64:
        return 1
    qt = 1
    while qt < min(max_new, SM90_CHUNK_QUERIES) and 2 * qt * head_pad <= 256:
        qt *= 2
    return qt


def sm90_register_cap(qt: int) -> int:
    """The Gluon kernel's ``maxnreg`` for ``qt`` queries per program (0: none): ``SM90_MAX_REGISTERS`` for 1, 168 for
    2 (ptxas takes 174 unasked: 2 programs per SM instead of 3), none for 4 (254 registers, no spill)."""
    return {1: SM90_MAX_REGISTERS, 2: 168}.get(qt, 0)


def _triton_config(key_format: str, head_pad: int, max_new: int) -> tuple[int, int, int, int]:
    """``(QT, block_n, num_warps, num_stages)`` of the Triton kernel. Three pipeline stages: a tile's keys are read
    two tiles ahead (with two the copy is issued after a tile's compute and awaited before the next one's)."""
    qt = 1
    while qt < max_new and qt * 2 * head_pad <= 256:
        qt *= 2
    if key_format == "fp32":
        return max(1, min(qt, 128 // head_pad)), 64, 4, 2
    if qt * head_pad >= 256:
        return qt, 128, 8, 3
    return qt, 64, 4, 3


@dataclass(frozen=True)
class ScoresPlan:
    """Every launch decision of one step's index scores (``plan_scores``; consumed by ``scores.index_scores``).

    Grid ``(splits, chunks, requests)``: program ``(s, c, b)`` scores request ``b``'s queries ``c · QT …`` against
    its key tiles ``s · tiles_per_split …``.

    Attributes:
        kernel: ``"sm90"`` (Gluon, ``scores_sm90``) or ``"triton"`` (``scores._scores_kernel``).
        key_format: ``"mxfp4"``, ``"fp8"`` or ``"fp32"``.
        head_pad: ``HP``, the heads padded to the MMA width (the query operand's third dimension).
        ratio, block_size, entries_per_page: the layer's compression ratio and pool geometry.
        requests: requests of the step (grid axis 2).
        max_new: the longest request's new tokens.
        entries: the addressable entries bound (the widest score row; the score buffer is at least this wide).
        queries_per_program: ``QT``.
        block_n: keys per tile.
        tiles_per_split: key tiles per program (0: nothing to launch).
        num_warps: warps per program.
        num_stages: the Triton kernel's pipeline depth (0 for the Gluon kernel, which pipelines by hand).
        page_vector: the Triton kernel holds a split's block-table entries in registers (tiles lie within pages).
        max_registers: ``maxnreg`` per thread (0: ptxas's own allocation).
        inline_ptx: the Triton kernel's key conversion and stores as inline PTX (False: their plain-integer and
            ``tl.store`` twins, the same bits).
        interpreted: planned for Triton's CPU interpreter (loops to host bounds, no PTX).
    """

    kernel: str
    key_format: str
    head_pad: int
    ratio: int
    block_size: int
    entries_per_page: int
    requests: int
    max_new: int
    entries: int
    queries_per_program: int
    block_n: int
    tiles_per_split: int
    num_warps: int
    num_stages: int
    page_vector: bool
    max_registers: int
    inline_ptx: bool
    interpreted: bool

    @property
    def chunks(self) -> int:
        """Query groups of ``QT`` per request (grid axis 1)."""
        return cdiv(self.max_new, self.queries_per_program)

    @property
    def tiles(self) -> int:
        """Key tiles of the widest score row."""
        return cdiv(self.entries, self.block_n)

    @property
    def splits(self) -> int:
        """Programs per request and query group (grid axis 0)."""
        return cdiv(self.tiles, self.tiles_per_split) if self.tiles_per_split else 0

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.splits, self.chunks, self.requests

    @property
    def launches(self) -> bool:
        """Whether there is anything to score (requests, tokens and entries)."""
        return self.splits > 0 and self.chunks > 0 and self.requests > 0

    def describe(self) -> str:
        """One line: the kernel and its grid."""
        if not self.launches:
            return f"scores: {self.key_format}, nothing to launch"
        if self.kernel == "sm90":
            how = "Gluon sm_90" + (f", maxnreg {self.max_registers}" if self.max_registers else "")
        else:
            how = (f"Triton, {self.num_warps} warps, {self.num_stages} stages"
                   + (", pages in registers" if self.page_vector else "")
                   + (f", maxnreg {self.max_registers}" if self.max_registers else ""))
        return (f"scores: {self.key_format} keys, {how}; {self.queries_per_program} quer"
                f"{'y' if self.queries_per_program == 1 else 'ies'} × {self.head_pad} heads per program, "
                f"{self.tiles_per_split} × {self.block_n}-key tiles per program; grid {self.splits} × {self.chunks} × "
                f"{self.requests}")


def plan_scores(*, key_format: str, heads: int, requests: int, max_new: int, entries: int, ratio: int,
                block_size: int, entries_per_page: int, sm_count: int, sm90: bool,
                interpreted: bool = False) -> ScoresPlan:
    """The launch of one step's index scores (module docstring: the rules).

    Args:
        key_format: ``"mxfp4"``, ``"fp8"`` or ``"fp32"`` (``SCORE_FORMATS``).
        heads: indexer heads (``head_pad(heads)`` is the query operand's width).
        requests, max_new: the step's requests and its longest request's new tokens.
        entries: the addressable entries bound of the step (``StepBatch.addressable_entries``).
        ratio, block_size, entries_per_page: the layer's compression ratio and pool geometry.
        sm_count: the device's multiprocessors (``device.sm_count``).
        sm90: the device runs the Gluon kernels (``device.is_sm90``: Hopper with Gluon).
        interpreted: the kernels run in Triton's CPU interpreter (``device.interpreting``; never with ``sm90``).
    Raises:
        ValueError: an unknown key format, or ``sm90`` with ``interpreted``.
    """
    if key_format not in SCORE_FORMATS:
        raise ValueError(f"plan_scores: no scores kernel for key format {key_format!r} (one of {SCORE_FORMATS})")
    if sm90 and interpreted:
        raise ValueError("plan_scores: the interpreter runs no Gluon kernel (sm90 and interpreted both set)")
    hp = head_pad(heads)
    gluon = sm90 and key_format == "mxfp4" and sm90_applies(hp, entries_per_page)
    if gluon:
        qt, block_n, warps, stages = sm90_queries_per_program(max_new, hp), SM90_BLOCK_N, SM90_NUM_WARPS, 0
        registers = sm90_register_cap(qt)
    else:
        qt, block_n, warps, stages = _triton_config(key_format, hp, max_new)
        registers = 0
    page_vector = entries_per_page % block_n == 0
    chunks, tiles = cdiv(max_new, qt), cdiv(entries, block_n)
    per_split = 0
    if requests > 0 and chunks > 0 and tiles > 0:
        splits = max(1, min(tiles, cdiv(PROGRAMS_PER_SM * sm_count, requests * chunks)))
        if gluon:
            splits = min(splits, cdiv(tiles, MIN_TILES_PER_PROGRAM))
        per_split = cdiv(tiles, splits)
        if page_vector and not gluon:
            per_split = min(per_split, MAX_TILES_PER_SPLIT)
    return ScoresPlan(
        kernel="sm90" if gluon else "triton", key_format=key_format, head_pad=hp, ratio=ratio, block_size=block_size,
        entries_per_page=entries_per_page, requests=requests, max_new=max_new, entries=entries,
        queries_per_program=qt, block_n=block_n, tiles_per_split=per_split, num_warps=warps, num_stages=stages,
        page_vector=page_vector, max_registers=registers, inline_ptx=not interpreted, interpreted=interpreted)
