"""Every launch decision of one step's sparse attention, taken once on the host from plain numbers.

``plan_attention`` builds an ``AttentionPlan`` from the step's fixed-shape geometry (tokens, requests, heads, the
layer's window / ratio / block size, the width of the entry lists or the bound on the visible entries) and two
device facts (multiprocessors, whether the Hopper kernels run). It never looks at positions or other device data,
so a CUDA graph captured with a plan stays right for every later step of the same shape. The launcher
(``launch.run``) only consumes the plan. Importing this module needs neither a GPU nor Triton.

The rules (the measurements behind them: ``benchmarks/RESULTS.md``, the "Sparse attention" sections):

* **kernel** — ``"triton"`` off Hopper. On Hopper, when the query and new-entry rows can be read as 16-byte words:
  ``"gluon_pipelined"`` for a step without splits from ``PIPELINED_MIN_CHUNKS`` key chunks per token (over FP8
  pages only for windows of at most ``FP8_MAX_WINDOW`` keys), else ``"gluon_ws"`` from ``WS_MIN_CHUNKS`` chunks per
  split (``WS_MIN_CHUNKS_ALL`` where every visible entry is attended: HCA), else the serial ``"gluon"``. Without
  aligned rows, ``"gluon"``. A step over BF16 key rows runs ``"gluon_pipelined"`` without splits, else ``"gluon"``.
* **splits** — each token's key chunks are split so that the programs (tokens × head blocks × splits) fill the
  GPU in one wave, a split keeping at least 1 chunk (Gluon) or 2 (Triton, whose programs start dearer); none for
  the pipelined kernel, whose persistent programs share the step's items.
* **keys** — the step's keys are dequantized once into BF16 rows (``bf16_keys``) where those rows are at most
  1/``BF16_KEYS_MAX_SHARE`` of the FP8 key bytes the step would read (prefill chunks), on Hopper, with a bound on
  the visible entries; else each program dequantizes the FP8 pages it reads.
* **merge** — split partials are merged by the combine kernel, or, for the serial Gluon kernel with 2 to
  ``MAX_CLUSTER`` splits, by the splits themselves run as one thread-block cluster per token, where the device
  holds every cluster of the step at once (a device fact: ``resident_clusters``).

A request (``impl``, ``keys``, ``combine``, ``num_splits``) overrides a rule where it can run and raises
``ValueError`` naming why where it cannot. Tests and benchmarks that need another plan ``dataclasses.replace`` one;
``AttentionPlan`` checks its own consistency.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..device import KV_DIM, KV_ENTRY_BYTES
from .cluster_launch import MAX_CLUSTER

__all__ = [
    "AttentionPlan", "BF16_KEYS_MAX_SHARE", "FP8_MAX_WINDOW", "GLUON_BLOCK", "KERNELS", "MERGES", "MODES",
    "PIPELINED_MIN_CHUNKS", "WS_MIN_CHUNKS", "WS_MIN_CHUNKS_ALL", "choose_kernel", "choose_merge", "choose_splits",
    "plan_attention", "step_splits", "use_bf16_keys",
]

KERNELS = ("triton", "gluon", "gluon_ws", "gluon_pipelined")
#: where a token's compressed entries come from; the index is the kernels' ``MODE`` constexpr
MODES = ("window", "list", "all")
MERGES = ("none", "combine_kernel", "cluster")
#: heads per program and keys per chunk of every Gluon kernel (the wgmma M; one chunk)
GLUON_BLOCK = 64
#: the pipelined kernel from this many key chunks per token (steps without splits)
PIPELINED_MIN_CHUNKS = 8
#: the warp-specialized kernel from this many chunks per split: entry lists (CSA) / every visible entry (HCA)
WS_MIN_CHUNKS = 32
WS_MIN_CHUNKS_ALL = 8
#: the longest window the pipelined kernel reads from FP8 pages: its copy warpgroup looks up window chunks only in
#: an item's prologue (its first four chunks)
FP8_MAX_WINDOW = 4 * GLUON_BLOCK
#: BF16 key rows pay off where they are at most 1/8 of the FP8 key bytes the step would read
BF16_KEYS_MAX_SHARE = 8
#: fewest key chunks per split: a Gluon program starts cheaply, a Triton one does not
GLUON_MIN_CHUNKS = 1
TRITON_MIN_CHUNKS = 2


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class AttentionPlan:
    """The launch decisions of one step's sparse attention (build with ``plan_attention``).

    Geometry (as given): ``tokens`` queries of ``requests`` requests, ``heads`` heads; the layer's ``window``,
    ``ratio`` (0: window only) and ``block_size``; ``mode`` where compressed entries come from (``"window"``: none,
    ``"list"``: each token's entry list of ``num_compressed`` entries, ``"all"``: every visible entry, at most
    ``num_compressed``).

    Decisions: ``kernel`` (one of ``KERNELS``); ``keys`` ``"fp8"`` (the pages, dequantized per chunk) or ``"bf16"``
    (the step's keys dequantized once: ``key_entries`` compressed entries per request after its window rows);
    ``splits`` of each token's key chunks, ``chunks_per_split`` each; ``merge`` of the split partials (one of
    ``MERGES``); tiling ``block_h`` heads per program and ``block_n`` keys per chunk (64 / 64 for Gluon), the Triton
    kernel's ``num_warps`` / ``num_stages``; ``persistent_programs`` of the pipelined kernel (0 for the others).
    """

    tokens: int
    requests: int
    heads: int
    window: int
    ratio: int
    block_size: int
    mode: str
    num_compressed: int
    kernel: str
    keys: str
    key_entries: int
    splits: int
    chunks_per_split: int
    merge: str
    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    persistent_programs: int

    def __post_init__(self) -> None:
        problem = self._inconsistency()
        if problem:
            raise ValueError(f"inconsistent attention plan: {problem} ({self})")

    def _inconsistency(self) -> str | None:
        if self.kernel not in KERNELS:
            return f"unknown kernel {self.kernel!r}"
        if self.mode not in MODES or (self.mode == "window") != (self.num_compressed == 0):
            return f"mode {self.mode!r} with {self.num_compressed} compressed entries"
        if self.keys not in ("fp8", "bf16") or (self.keys == "fp8" and self.key_entries):
            return f"keys {self.keys!r} with {self.key_entries} BF16 entry rows"
        if self.keys == "bf16" and self.kernel not in ("gluon", "gluon_pipelined"):
            return f"BF16 key rows are read by 'gluon' and 'gluon_pipelined', not {self.kernel!r}"
        if self.kernel != "triton" and (self.block_h, self.block_n) != (GLUON_BLOCK, GLUON_BLOCK):
            return f"the Gluon kernels take {GLUON_BLOCK} heads and {GLUON_BLOCK} keys per program"
        chunks = self.max_chunks
        if self.splits < 1 or self.chunks_per_split * self.splits < chunks or (
                self.splits > 1 and self.chunks_per_split * (self.splits - 1) >= chunks):
            return f"{self.splits} splits of {self.chunks_per_split} chunks for {chunks} chunks (none may be empty)"
        if self.merge not in MERGES or (self.merge == "none") != (self.splits == 1):
            return f"merge {self.merge!r} with {self.splits} splits"
        if self.merge == "cluster" and (self.kernel != "gluon" or self.splits > MAX_CLUSTER):
            return f"clusters merge the splits of 'gluon' (2-{MAX_CLUSTER} of them)"
        if self.kernel == "gluon_pipelined":
            if self.splits != 1:
                return "the pipelined kernel takes no splits (its persistent programs share the step's items)"
            if self.keys == "fp8" and self.window > FP8_MAX_WINDOW:
                return (f"the pipelined kernel reads FP8 pages for windows of at most {FP8_MAX_WINDOW} keys "
                        f"(got {self.window}): BF16 key rows or another kernel")
            if (self.persistent_programs < 1) != (self.items == 0):
                return f"{self.persistent_programs} persistent programs for {self.items} items"
        elif self.persistent_programs:
            return f"persistent programs for {self.kernel!r}"
        return None

    @property
    def head_blocks(self) -> int:
        """Programs per token and split: ``ceil(heads / block_h)``."""
        return _cdiv(self.heads, self.block_h)

    @property
    def items(self) -> int:
        """(token, head block) pairs of the step."""
        return self.tokens * self.head_blocks

    @property
    def max_chunks(self) -> int:
        """The most key chunks any token has: its window's, then its compressed entries'."""
        return _cdiv(self.window, self.block_n) + _cdiv(self.num_compressed, self.block_n)

    @property
    def grid(self) -> tuple[int, ...]:
        """The attention launch's grid: ``(persistent programs,)`` for the pipelined kernel, else ``(tokens · head
        blocks, splits)`` (a cluster merge launches each token's splits as one cluster along x)."""
        if self.kernel == "gluon_pipelined":
            return (self.persistent_programs,)
        return (self.items, self.splits)

    @property
    def constexprs(self) -> dict[str, int | bool]:
        """The geometry constexprs every attention kernel takes."""
        return dict(WINDOW=self.window, RATIO=max(self.ratio, 1), BLOCK_SIZE=self.block_size,
                    PAGE_ENTRIES=self.block_size // self.ratio if self.ratio else 1, MODE=MODES.index(self.mode),
                    SPLIT=self.splits > 1)

    @property
    def combine_blocks(self) -> tuple[int, int]:
        """The combine kernel's ``(BLOCK_S, BLOCK_H)``: 16 partial rows (splits × heads) per load — many small
        programs, all their loads in flight."""
        block_s = min(16, _next_power_of_2(self.splits))
        return block_s, max(1, min(16 // block_s, _next_power_of_2(self.heads)))

    def describe(self) -> str:
        """One line for ``dsv4 run --explain``."""
        source = {"window": "window only", "list": f"window + lists of {self.num_compressed} entries",
                  "all": f"window + all visible entries (≤ {self.num_compressed})"}[self.mode]
        keys = (f"BF16 rows ({self.window} + {self.key_entries} per request)" if self.keys == "bf16"
                else "FP8 pages")
        split = (f"{self.splits} splits × {_count(self.chunks_per_split, 'chunk')}" if self.splits > 1
                 else _count(self.chunks_per_split, "chunk"))
        merge = {"none": "", "combine_kernel": ", combine kernel", "cluster": ", merged in clusters"}[self.merge]
        programs = f", {self.persistent_programs} persistent programs" if self.persistent_programs else ""
        return (f"attention {self.kernel}: {_count(self.tokens, 'token')} × {_count(self.head_blocks, 'head block')} "
                f"of {self.block_h}, {source}, {split} of {self.block_n} keys from {keys}{merge}{programs}")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def choose_kernel(impl: str, sm90: bool, rows_in_words: bool, chunks_per_split: int, all_entries: bool = False,
                  unsplit: bool = False) -> str:
    """The kernel for a step over FP8 pages: ``impl`` ``"auto"`` by the rule of this module's docstring
    (``chunks_per_split``; ``all_entries``: HCA; ``unsplit``: no splits and a window the pipelined kernel takes
    over FP8 pages), or one of ``KERNELS``, checked.

    Raises:
        ValueError: an unknown ``impl``, a Gluon kernel off Hopper (``sm90``), or ``"gluon_ws"`` /
            ``"gluon_pipelined"`` without ``rows_in_words``.
    """
    if impl == "auto":
        if not sm90:
            return "triton"
        if rows_in_words and unsplit and chunks_per_split >= PIPELINED_MIN_CHUNKS:
            return "gluon_pipelined"
        least = WS_MIN_CHUNKS_ALL if all_entries else WS_MIN_CHUNKS
        return "gluon_ws" if rows_in_words and chunks_per_split >= least else "gluon"
    if impl not in KERNELS:
        raise ValueError(f"unknown impl {impl!r}")
    if impl != "triton" and not sm90:
        raise ValueError(f"impl={impl!r} needs a CUDA device of compute capability 9.x")
    if impl in ("gluon_ws", "gluon_pipelined") and not rows_in_words:
        raise ValueError(f"impl={impl!r} reads q and kv_new rows as 16-byte words: their strides must be "
                         "multiples of 8 and their data 16-byte aligned")
    return impl


def choose_splits(programs: int, max_chunks: int, sms: int, min_chunks: int) -> tuple[int, int]:
    """``(num_splits, chunks_per_split)``: the most splits of each token's ``max_chunks`` key chunks whose
    ``programs · splits`` programs still fit in one wave (one program per multiprocessor), each split at least
    ``min_chunks`` chunks; none when ``programs`` (tokens × head blocks) fill the ``sms`` multiprocessors already."""
    if programs == 0 or programs >= sms or max_chunks <= min_chunks:
        return 1, max(max_chunks, 1)
    splits = min(max(sms // programs, 1), max(max_chunks // min_chunks, 1))
    per = _cdiv(max_chunks, splits)
    return _cdiv(max_chunks, per), per


def step_splits(impl: str, num_splits: int | None, programs: int, max_chunks: int, sms: int,
                min_chunks: int) -> tuple[int, int]:
    """``(num_splits, chunks_per_split)`` for a requested ``impl`` / ``num_splits``: none for
    ``"gluon_pipelined"``, a given ``num_splits`` as closely as ``max_chunks`` allows (no empty split), else
    ``choose_splits``."""
    if impl == "gluon_pipelined":
        return 1, max(max_chunks, 1)
    if num_splits is None:
        return choose_splits(programs, max_chunks, sms, min_chunks)
    per = _cdiv(max_chunks, max(1, min(num_splits, max_chunks)))
    return _cdiv(max_chunks, per), per


def use_bf16_keys(keys: str, impl: str, gluon_ok: bool, tokens: int, requests: int, window: int,
                  entries: int | None, keys_per_token: int) -> bool:
    """Whether the step's keys are dequantized once into BF16 rows, for a request ``keys`` (``"auto"``, ``"bf16"``,
    ``"fp8"``) and ``impl``: ``gluon_ok`` — Hopper and rows read as words; ``entries`` the bound on any token's
    visible compressed entries (``None``: unknown); ``keys_per_token`` the keys each token attends.

    Raises:
        ValueError: an unknown ``keys``, or ``"bf16"`` where the rows cannot be read.
    """
    if keys not in ("auto", "bf16", "fp8"):
        raise ValueError(f"unknown keys {keys!r}")
    if keys == "fp8":
        return False
    applies = gluon_ok and impl in ("auto", "gluon", "gluon_pipelined") and entries is not None
    if keys == "bf16":
        if not applies:
            raise ValueError("keys='bf16' needs a Gluon kernel (a Hopper GPU, impl 'auto', 'gluon' or "
                             f"'gluon_pipelined', 16-byte aligned q / kv_new rows; impl {impl!r}) and a bound on the "
                             "visible entries (max_visible with entry_idx)")
        return True
    if not applies:
        return False
    rows_bytes = requests * (window + entries) * KV_DIM * 2
    return rows_bytes * BF16_KEYS_MAX_SHARE <= tokens * keys_per_token * KV_ENTRY_BYTES


def choose_merge(combine: str, kernel: str, splits: int, clusters: int,
                 resident_clusters: Callable[[int], int] | None) -> str:
    """How the ``splits`` partials of each token are merged, for a request ``combine`` (``"auto"``, ``"kernel"``,
    ``"cluster"``): ``"none"`` for one split; ``"cluster"`` where it applies (``kernel`` ``"gluon"``, 2 to
    ``MAX_CLUSTER`` splits, not ``"kernel"``) and the device holds all ``clusters`` (tokens × head blocks) at once
    — ``resident_clusters(n)``: how many clusters of ``n`` one-multiprocessor programs it holds (``None``: unknown,
    no clusters); else ``"combine_kernel"``.

    Raises:
        ValueError: an unknown ``combine``, or ``"cluster"`` where it does not apply or fit.
    """
    if combine not in ("auto", "cluster", "kernel"):
        raise ValueError(f"unknown combine {combine!r}")
    if splits == 1:
        return "none"
    if combine == "kernel":
        return "combine_kernel"
    if kernel != "gluon" or splits > MAX_CLUSTER:
        if combine == "cluster":
            raise ValueError(f"combine='cluster' needs impl 'gluon' (got {kernel!r}) and 2-{MAX_CLUSTER} splits "
                             f"(got {splits})")
        return "combine_kernel"
    if resident_clusters is not None and resident_clusters(splits) >= clusters:
        return "cluster"
    if combine == "cluster":
        raise ValueError(f"combine='cluster': the device does not hold all {clusters} clusters of {splits} programs "
                         "at once")
    return "combine_kernel"


def plan_attention(
    *,
    tokens: int,
    requests: int,
    heads: int,
    window: int,
    ratio: int = 0,
    block_size: int = 1,
    mode: str = "window",
    num_compressed: int = 0,
    max_visible: int | None = None,
    sm_count: int,
    sm90: bool,
    rows_in_words: bool = True,
    resident_clusters: Callable[[int], int] | None = None,
    impl: str = "auto",
    keys: str = "auto",
    combine: str = "auto",
    num_splits: int | None = None,
    block_h: int = 64,
    block_n: int = 64,
    num_warps: int = 8,
    num_stages: int = 1,
) -> AttentionPlan:
    """The plan of one step's attention (the rules: this module's docstring).

    Args:
        tokens, requests, heads: the step's query tokens, its requests (rows of the block table), query heads.
        window, ratio, block_size: the layer's geometry (``ratio`` 0: window only).
        mode: ``"window"`` (no compressed entries), ``"list"`` (CSA: each token's list of ``num_compressed``
            entries) or ``"all"`` (HCA: every visible entry, at most ``num_compressed``); ``num_compressed`` 0 makes
            it ``"window"``.
        max_visible: a bound on the compressed entries any token of the step sees (``"list"``; needed for BF16
            key rows; ``"all"`` uses ``num_compressed``).
        sm_count, sm90: the device's multiprocessors, and whether it runs the Hopper (Gluon) kernels.
        rows_in_words: whether the query and new-entry rows are 16-byte aligned (``args.rows_are_words``).
        resident_clusters: how many clusters of ``n`` one-multiprocessor programs the device holds at once
            (``sm90_serial.resident_clusters``); ``None``: split partials go to the combine kernel.
        impl, keys, combine, num_splits: requests overriding the rules (``"auto"`` / ``None``: the rules).
        block_h, block_n, num_warps, num_stages: the Triton kernel's tiling (the Gluon kernels' is fixed).

    Raises:
        ValueError: a request that cannot run here, or an unknown mode / request.
    """
    if mode not in MODES or (mode == "window" and num_compressed):
        raise ValueError(f"mode {mode!r} with {num_compressed} compressed entries")
    if num_compressed == 0:
        mode = "window"
    gluon = choose_kernel(impl, sm90, rows_in_words, 0) != "triton"  # checks the request before anything else
    if gluon:  # (64 heads per program whatever ``heads``: the same head blocks as the Triton kernel's clamp)
        block_h = block_n = GLUON_BLOCK
    else:
        block_h = max(16, min(block_h, _next_power_of_2(heads)))
    items = tokens * _cdiv(heads, block_h)
    max_chunks = _cdiv(window, block_n) + _cdiv(num_compressed, block_n)
    splits, per = step_splits(impl, num_splits, items, max_chunks, sm_count,
                              GLUON_MIN_CHUNKS if gluon else TRITON_MIN_CHUNKS)
    entries = num_compressed if mode == "all" else (max_visible if mode == "list" else 0)
    bf16 = use_bf16_keys(keys, impl, sm90 and rows_in_words, tokens, requests, window, entries,
                         window + min(num_compressed, entries or num_compressed))
    if bf16 and impl != "gluon_pipelined":
        kernel = "gluon_pipelined" if impl == "auto" and splits == 1 else "gluon"
    else:
        kernel = choose_kernel(impl, sm90, rows_in_words, per, mode == "all",
                               splits == 1 and window <= FP8_MAX_WINDOW)
    return AttentionPlan(
        tokens=tokens, requests=requests, heads=heads, window=window, ratio=ratio, block_size=block_size, mode=mode,
        num_compressed=num_compressed, kernel=kernel, keys="bf16" if bf16 else "fp8",
        key_entries=entries if bf16 else 0, splits=splits, chunks_per_split=per,
        merge=choose_merge(combine, kernel, splits, items, resident_clusters), block_h=block_h, block_n=block_n,
        num_warps=num_warps, num_stages=num_stages,
        persistent_programs=min(items, sm_count) if kernel == "gluon_pipelined" else 0,
    )
