"""Row-wise top-k without a sort: the indices of the ``k`` largest of each row's first ``n_t`` scores.

Each score becomes an order-preserving unsigned key (BF16 → 16 bits, FP32 → 32 bits: flip all bits of negatives,
set the sign bit of the others). Ties at the threshold: any valid choice; exactly ``min(k, n_t)`` indices are
written, then −1.

Four algorithms (``radix_topk(..., algorithm=)``; with none named, ``default_variant`` picks by the shape):

* ``"row"`` — radix select, one program per row: the threshold key (the k-th largest) one byte at a time, most
  significant first (a histogram of the digit among the elements matching the digits found so far, then the highest
  bin whose suffix count still reaches the number yet to choose); a last pass writes the elements above it and as
  many equal ones as are still needed. A row is read ``passes + 1`` times. Few rows leave most SMs idle.
* ``"split"`` — the same radix select with each row cut into chunks over enough programs for every SM, one launch per
  pass: each program adds its chunk's digit histogram to the row's with atomics (int32 workspace
  ``topk_workspace_shape``, zeroed first); the last launch compacts with one atomic per block on two per-row
  counters. ``radix_bits`` 8 (2 passes for BF16) or 4.
* ``"filter"`` — one launch, rows up to one per SM, each cut over ``splits`` programs that are all resident at once
  (at most one per SM) and meet at per-row barriers (global atomics):

  1. each program loads its columns once into a register block of ``[BLOCK / C, C]`` and takes the maximum of every
     row of C columns; the smallest of those maxima over the whole row (an atomic max exchange, then a barrier) is a
     lower bound of the k-th largest whenever at least k rows are nonempty — the k maxima are k distinct elements
     at or above it;
  2. the columns at or above the bound (about 10% of a 32K row of index scores) are appended to the row's candidate
     list (int32 scratch ``[T, N]``; one atomic per block, in-block slots by a scan along the rows and one over the
     row totals);
  3. the row's first program waits for every append, loads the candidates and their keys into registers, finds the
     threshold by bisection on the key bits — only the bits below the highest one where the bound and the largest
     candidate differ, one block-wide count each — and writes the selection; then it zeroes the row's int32 header
     (bound, arrivals, candidate count), which must be zero on entry (``filter_header_shape``).

  Rows beyond one per SM fall back to ``"split"``; rows of more than ``CBLOCK`` candidates (a weak bound, e.g. scores
  increasing with the column) select with 4-bit histogram passes over the list in blocks.
* ``"bisect"`` — one launch, one program per row holding the whole row in registers (up to ``BISECT_MAX_COLUMNS``;
  longer rows fall back to ``"filter"``): the same lower bound, then the bisection over the row itself, then one
  scan that places the selection. No candidate list and no barrier, so no residency limit; but the bisection's
  counts run over every column (64 per thread at 32K), which only pays on short rows. On Hopper, BF16 rows of
  1,024 to 16,384 columns run the same steps in Gluon (``topk_sm90``: each thread's columns contiguous, the same
  output bits, 1.1–1.5× faster); ``gluon=False`` (variant ``"bisect_triton"``) keeps this Triton kernel.

Measured on an H100 (2026-11-25, k=512, index scores of the scores kernel on random MXFP4 pools, CUDA-graph replays,
``benchmarks/bench_indexer.py --topk-only``), µs:

    columns (context)  rows   filter4   bisect   split8   row
    32,768 (128K)        8      20.3     32.3     19.5   105.0
                        64      21.5     38.2     45.6   105.0
                       128      28.6     42.6     75.5   105.5
     8,192 (32K)         8      20.4     19.4     18.6    30.1
                        64      22.1     16.8     22.9    33.9
                       128      21.3     16.8     27.8    30.3
     2,048 (8K)         64      20.1     19.5     20.1    21.6
                       128      16.5     12.1     19.1    21.1

Before the scattered loads and stores became inline PTX (``_store_columns``, ``_gather_keys``) the filter took
31.7 / 41.5 µs at 64 / 128 rows × 32,768 in the same run. 32,768 rows × 4,096 (a 4K prefill chunk of 8 requests at
32K context, H200, 2026-11-24): split 3.9 ms, row 6.8 ms; on the index scores of 4K-token chunks (H200, 2026-11-25)
bisect is faster still at every measured width (``BISECT_PREFILL_MAX_COLUMNS``). Hence the default for
``FILTER_MIN_ROWS`` rows up to one per SM (decode steps): ``"bisect"`` up to ``BISECT_DEFAULT_MAX_COLUMNS`` columns
(``BISECT_GLUON_DEFAULT_MAX_COLUMNS`` where it runs the Gluon kernel of ``topk_sm90``), ``"filter4"`` beyond; for
more rows (prefill chunks) ``"bisect"`` up to ``BISECT_PREFILL_MAX_COLUMNS`` (32K), ``"split8"`` beyond;
``"split8"`` for fewer rows.

Triton notes learnt here: a ``tl.histogram`` mask that went through ``tl.reshape`` miscounted on the GPU (the
interpreter was right), so ``_block_histogram`` masks by value instead; the layout pass duplicates inline-asm ops
even when they are marked impure (a warp-aggregated append in PTX appended several times), so the appends here are
plain scans and atomics and the PTX ops are idempotent loads and stores; and a ``tl.store`` / ``tl.load`` through a
block of scattered addresses gets its own layout, into which Triton first converts the 64-bit pointer block through
shared memory (128 KB per 16K-column block here) — the PTX versions form each address from a 32-bit slot in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import topk_bisect_sm90
from ..device import interpreting
from .topk_bisect import _bisect_topk_kernel
from .topk_common import empty_prefix, load_keys, push_digit
from .topk_filter import _filter_topk_kernel
from .topk_split import _split_hist_kernel, _split_select_kernel

__all__ = ["radix_topk", "ALGORITHMS", "VARIANTS", "DEFAULT_VARIANT", "default_variant", "bisect_runs_gluon",
           "scratch_shapes", "topk_workspace_shape", "filter_header_shape", "filter_rows_fit", "sm_count"]


ALGORITHMS = ("row", "split", "filter", "bisect")


#: named launch options (tests and the benchmark run each)
VARIANTS: dict[str, dict] = {
    "row": dict(algorithm="row"),
    "split8": dict(algorithm="split", radix_bits=8),
    "filter4": dict(algorithm="filter", radix_bits=4),
    "bisect": dict(algorithm="bisect"),
    "bisect_triton": dict(algorithm="bisect", gluon=False),  # the Triton kernel where the Gluon one would run
}


#: the variant ``radix_topk`` runs when no algorithm is named (the indexer names none); None: by rows
#: (``default_variant``)
DEFAULT_VARIANT: str | None = None


@triton.jit
def _radix_topk_kernel(
    s_ptr, s_stride,            # int16 / int32 [T, s_stride]: score bits (BF16 / FP32)
    n_ptr,                      # int64 [T]: candidates of each row (the first n_t columns)
    out_ptr, out_stride,        # int64 [T, K] out: selected column indices, −1 padded
    K: tl.constexpr, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr, FILL: tl.constexpr,
    HOST_BOUND: tl.constexpr, N_HINT: tl.constexpr,  # interpreter: loop to the host bound N_HINT
):
    row = tl.program_id(0).to(tl.int64)
    n = tl.load(n_ptr + row).to(tl.int32)
    k_eff = tl.minimum(n, K)
    row_ptr = s_ptr + row * s_stride
    out_row = out_ptr + row * out_stride
    bins = tl.arange(0, 256)
    lanes = tl.arange(0, BLOCK)

    remaining = k_eff  # elements still to choose among those matching `prefix`
    prefix = empty_prefix(KEY_BITS)
    for p in tl.static_range(KEY_BITS // 8):
        shift = KEY_BITS - 8 * (p + 1)
        hist = tl.zeros((256,), tl.int32)
        for start in range(0, N_HINT if HOST_BOUND else n, BLOCK):
            offs = start + lanes
            valid = offs < n
            key = load_keys(row_ptr, offs, valid, KEY_BITS)
            if p > 0:
                valid = valid & ((key >> (shift + 8)) == prefix)
            digit = ((key >> shift) & 0xFF).to(tl.int32)
            hist += tl.histogram(digit, 256, mask=valid)
        suffix = tl.sum(hist) - tl.cumsum(hist, 0) + hist  # elements in bins >= i
        b = tl.max(tl.where(suffix >= remaining, bins, 0))
        remaining -= tl.sum(tl.where(bins > b, hist, 0))
        prefix = push_digit(prefix, b, 8, KEY_BITS)
    thr = prefix
    n_gt = k_eff - remaining  # elements strictly above the threshold; `remaining` ties are taken

    n_above = 0
    n_tied = 0
    for start in range(0, N_HINT if HOST_BOUND else n, BLOCK):
        offs = start + lanes
        valid = offs < n
        key = load_keys(row_ptr, offs, valid, KEY_BITS)
        gt = valid & (key > thr)
        eq = valid & (key == thr)
        gt_i = gt.to(tl.int32)
        eq_i = eq.to(tl.int32)
        pos_gt = n_above + tl.cumsum(gt_i, 0) - 1
        rank_eq = n_tied + tl.cumsum(eq_i, 0) - 1
        tl.store(out_row + pos_gt, offs.to(tl.int64), mask=gt)
        tl.store(out_row + n_gt + rank_eq, offs.to(tl.int64), mask=eq & (rank_eq < remaining))
        n_above += tl.sum(gt_i)
        n_tied += tl.sum(eq_i)

    for start in tl.static_range(0, K, FILL):
        o = start + tl.arange(0, FILL)
        tl.store(out_row + o, tl.full(o.shape, -1, tl.int64), mask=(o >= k_eff) & (o < K))


#: the most columns ``"bisect"`` holds in registers (one program per row; 64 keys per thread at 16 warps)
BISECT_MAX_COLUMNS = 32768


def topk_workspace_shape(rows: int, score_dtype: torch.dtype, radix_bits: int = 8) -> tuple[int, int]:
    """Shape of the int32 workspace of ``algorithm="split"``: per-pass histograms and two counters per row (the
    ``radix_bits=8`` shape is also large enough for 4)."""
    key_bits = 16 if score_dtype == torch.bfloat16 else 32
    return rows, (key_bits // radix_bits) * (1 << radix_bits) + 2


def _checked_view(t: Tensor | None, shape: tuple[int, int], what: str, device, zero: bool) -> Tensor:
    """``shape`` int32 viewed from the caller's flat scratch ``t`` (checked), or allocated (zeroed if ``zero``)."""
    if t is None:
        return (torch.zeros if zero else torch.empty)(shape, dtype=torch.int32, device=device)
    if t.dtype != torch.int32 or t.numel() < shape[0] * shape[1]:
        raise ValueError(f"radix_topk: {what} must be int32 with >= {shape[0] * shape[1]} elements")
    return t.view(-1)[: shape[0] * shape[1]].view(shape)


def _zeroed_workspace(bits: Tensor, key_bits: int, workspace: Tensor | None, radix_bits: int) -> Tensor:
    """The row workspace of ``"split"`` (histograms + counters) viewed from ``workspace`` (or allocated), zeroed."""
    shape = topk_workspace_shape(bits.shape[0], torch.bfloat16 if key_bits == 16 else torch.float32, radix_bits)
    ws = _checked_view(workspace, shape, "workspace", bits.device, zero=True)
    return ws if workspace is None else ws.zero_()


def sm_count(t: Tensor, num_sms: int | None = None) -> int:
    """``num_sms`` if given, else the multiprocessor count of ``t``'s device (4 on the CPU: interpreter runs)."""
    if num_sms is not None:
        return num_sms
    return torch.cuda.get_device_properties(t.device).multi_processor_count if t.is_cuda else 4


def _split_launch(bits, key_bits, counts, k, out, workspace, radix_bits, block, num_warps, programs_per_sm, num_sms):
    T, N = bits.shape
    ws = _zeroed_workspace(bits, key_bits, workspace, radix_bits)
    num_sms = sm_count(bits, num_sms)
    blocks = triton.cdiv(N, block)
    splits = max(1, min(blocks, triton.cdiv(programs_per_sm * num_sms, T)))
    chunk = triton.cdiv(blocks, splits) * block
    grid = (T, triton.cdiv(N, chunk))
    common = dict(K=k, KEY_BITS=key_bits, RADIX=radix_bits, BLOCK=block, HOST_BOUND=interpreting(),
                  CHUNK_HINT=chunk if interpreting() else 0, num_warps=num_warps)
    for p in range(key_bits // radix_bits):
        _split_hist_kernel[grid](bits, bits.stride(0), counts, ws, ws.stride(0), chunk, PASS=p, **common)
    _split_select_kernel[grid](bits, bits.stride(0), counts, ws, ws.stride(0), out, out.stride(0), chunk,
                               FILL=min(triton.next_power_of_2(k), 4096), **common)
    return out


def filter_header_shape(rows: int) -> tuple[int, int]:
    """Shape of the int32 header of ``algorithm="filter"`` (bound, barrier arrivals, candidate count, pad per row).
    It must be zero when ``radix_topk`` is called and is zero again when the launch completes."""
    return rows, 4


def filter_rows_fit(rows: int, num_sms: int) -> bool:
    """Whether ``algorithm="filter"`` can run its own kernel for ``rows`` rows (else it falls back to ``"split"``):
    up to one row per multiprocessor (any number in the interpreter, which runs one program per row)."""
    return rows > 0 and (rows <= num_sms or interpreting())


#: fewest rows for which the default is ``"filter4"`` or ``"bisect"`` (H200, 128K context, graph replays: 8 rows
#: 23.7 µs vs 18.9 µs for ``"split8"``; 64 rows 31.1 vs 45.4 µs; 128 rows 38.7 vs 75.5 µs)
FILTER_MIN_ROWS = 32


#: longest rows for which the default is ``"bisect"`` rather than ``"filter4"`` (H100, graph replays, 8,192 columns
#: = 32K context: 64 rows 17.6 vs 27.0 µs, 128 rows 21.7 vs 33.0; 32,768 columns: 39.1 vs 30.7 at 64 rows)
BISECT_DEFAULT_MAX_COLUMNS = 8192


#: the same where ``"bisect"`` runs the Gluon kernel (``bisect_runs_gluon``: Hopper, BF16 rows of whole vectors;
#: ``topk_sm90`` serves up to 16,384 columns) — H100, 2026-11-26, graph replays at 64K context (16,384 columns),
#: 8 / 64 / 128 rows: 18.8 / 19.3 / 18.3 µs vs 20.1 / 21.1 / 24.1 for ``"filter4"`` (the Triton bisect: 24.7-25.4)
BISECT_GLUON_DEFAULT_MAX_COLUMNS = 16384


#: longest rows for which steps of more rows than multiprocessors (prefill chunks) default to ``"bisect"`` rather
#: than ``"split8"`` (H200, 2026-11-25, the index scores of 4K-token chunks, eager, ``bench_indexer.py
#: --topk-prefill``: 4,096 rows × 2,048 columns 73.7 vs 149.5 µs, × 8,192 396.5 vs 528.9, × 32,768 1,346 vs 1,991;
#: 32,768 × 8,192 3,062 vs 3,916 — an earlier probe on uniformly random BF16 bits favoured ``"split8"`` at 32,768
#: rows: the index scores' distribution is what counts)
BISECT_PREFILL_MAX_COLUMNS = BISECT_MAX_COLUMNS


def default_variant(rows: int, num_sms: int, columns: int = 0, gluon: bool = False) -> str:
    """The variant ``radix_topk`` runs when no algorithm is named: ``DEFAULT_VARIANT`` when set, else for
    ``FILTER_MIN_ROWS`` to one row per multiprocessor (decode steps) ``"bisect"`` on rows of at most
    ``BISECT_DEFAULT_MAX_COLUMNS`` columns — ``BISECT_GLUON_DEFAULT_MAX_COLUMNS`` where ``"bisect"`` runs the Gluon
    kernel on these rows (``gluon``: ``bisect_runs_gluon``) — and ``"filter4"`` on longer ones; for more rows
    (prefill chunks) ``"bisect"`` on rows of at most ``BISECT_PREFILL_MAX_COLUMNS``; ``"split8"`` otherwise."""
    if DEFAULT_VARIANT is not None:
        return DEFAULT_VARIANT
    if FILTER_MIN_ROWS <= rows <= num_sms:
        longest = BISECT_GLUON_DEFAULT_MAX_COLUMNS if gluon else BISECT_DEFAULT_MAX_COLUMNS
        return "bisect" if columns <= longest else "filter4"
    if rows > num_sms and columns <= BISECT_PREFILL_MAX_COLUMNS:
        return "bisect"
    return "split8"


def _bound_group(columns: int, k: int, block: int) -> int:
    """Columns per group of the lower bound (``"filter"``, ``"bisect"``): a power of two, at most 64 and ``block``,
    with at least ``k`` groups in a full row of ``columns``."""
    return max(1, min(64, block, 1 << max(0, (columns // max(k, 1)).bit_length() - 1)))


def _bisect_block(columns: int, num_warps: int | None = None) -> tuple[int, int]:
    """``(block, num_warps)`` of a ``"bisect"`` launch on rows of ``columns``: the row as one power-of-two block;
    16 warps from 8,192 columns, 8 from 2,048, else 4, unless given."""
    block = max(triton.next_power_of_2(columns), 16)
    return block, num_warps or (16 if block >= 8192 else 8 if block >= 2048 else 4)


def _gluon_bisect_fits(rows: Tensor, key_bits: int, num_warps: int | None) -> bool:
    """Whether ``topk_sm90`` serves a ``"bisect"`` launch on ``rows`` (``[T, N]``, keys of ``key_bits``): a Hopper
    GPU, BF16 rows of whole vectors, 8-32 columns per thread."""
    block, warps = _bisect_block(rows.shape[1], num_warps)
    return (not interpreting() and topk_bisect_sm90.available(rows.device)
            and topk_bisect_sm90.applies(key_bits, rows.shape[1], rows.stride(0), block, warps))


def bisect_runs_gluon(scores: Tensor, num_warps: int | None = None) -> bool:
    """Whether ``"bisect"`` on ``scores`` (``[T, N]``) runs the Gluon kernel (``topk_sm90``: a Hopper GPU, BF16 rows
    of whole vectors, 8-32 columns per thread) rather than the Triton one."""
    return scores.dtype == torch.bfloat16 and scores.dim() == 2 and _gluon_bisect_fits(scores, 16, num_warps)


def _bisect_launch(bits, key_bits, counts, k, out, num_warps, ptx, gluon: bool):
    """``"bisect"`` over ``bits``: the Gluon kernel where ``gluon`` (``_gluon_bisect_fits``), else the Triton one."""
    T, N = bits.shape
    block, num_warps = _bisect_block(N, num_warps)
    group, fill = _bound_group(N, k, block), min(triton.next_power_of_2(k), 4096)
    if gluon:
        return topk_bisect_sm90.launch(bits, counts, k, out, block=block, group=group, fill=fill, num_warps=num_warps)
    _bisect_topk_kernel[(T,)](bits, bits.stride(0), counts, out, out.stride(0), K=k, KEY_BITS=key_bits,
                              BLOCK=block, C=group, FILL=fill, PTX=ptx, num_warps=num_warps)
    return out


def _filter_launch(bits, key_bits, counts, k, out, header, candidates, radix_bits, block, cblock, num_warps,
                   num_sms, ptx):
    T, N = bits.shape
    hdr = _checked_view(header, filter_header_shape(T), "header", bits.device, zero=True)
    cand = _checked_view(candidates, (T, N), "candidates", bits.device, zero=False)
    # The programs of a row wait for each other once, so the whole grid must be resident at once: at most one
    # program per multiprocessor. The interpreter runs programs one after another: one per row there.
    splits = 1 if interpreting() else max(1, min(num_sms // T, triton.cdiv(N, 1024)))
    per = triton.cdiv(N, splits)
    block = min(block, triton.next_power_of_2(per))  # a register block; chunk = block when a chunk fits
    chunk = triton.cdiv(per, block) * block
    splits = triton.cdiv(N, chunk)
    group = _bound_group(N, k, block)
    if num_warps is None:
        num_warps = 16
    _filter_topk_kernel[(T, splits)](
        bits, bits.stride(0), counts, hdr, hdr.stride(0), cand, cand.stride(0), out, out.stride(0), chunk, splits,
        K=k, KEY_BITS=key_bits, RADIX=radix_bits, BLOCK=block, C=group, CBLOCK=max(triton.next_power_of_2(cblock), 128),
        CC=64, FILL=min(triton.next_power_of_2(k), 4096), SPLIT=splits > 1, PTX=ptx,
        HOST_BOUND=interpreting(), CHUNK_HINT=chunk if interpreting() else 0, num_warps=num_warps)
    return out


def _launched_algorithm(algorithm: str, rows: int, columns: int, num_sms: int) -> str:
    """The algorithm that runs when ``algorithm`` is asked for: ``"bisect"`` on rows of more than
    ``BISECT_MAX_COLUMNS`` columns runs ``"filter"``, and ``"filter"`` beyond one row per multiprocessor
    (``filter_rows_fit``) runs ``"split"``; anything else runs as asked."""
    if algorithm == "bisect" and columns > BISECT_MAX_COLUMNS:
        algorithm = "filter"
    if algorithm == "filter" and not filter_rows_fit(rows, num_sms):
        algorithm = "split"
    return algorithm


def scratch_shapes(rows: int, columns: int, score_dtype: torch.dtype, num_sms: int, gluon: bool = False
                   ) -> dict[str, tuple[tuple[int, int], bool]]:
    """The int32 scratch ``radix_topk`` uses without a named algorithm, by keyword argument: ``{name: (shape,
    zero_kept)}`` (``zero_kept``: must be zero when passed, and is left zero — allocate it zeroed once).
    ``gluon``: ``bisect_runs_gluon`` of the scores (``default_variant``)."""
    algorithm = _launched_algorithm(VARIANTS[default_variant(rows, num_sms, columns, gluon)]["algorithm"], rows,
                                    columns, num_sms)
    if algorithm == "filter":
        return {"header": (filter_header_shape(rows), True), "candidates": ((rows, columns), False)}
    if algorithm == "split":
        return {"workspace": (topk_workspace_shape(rows, score_dtype), False)}
    return {}


def radix_topk(scores: Tensor, counts: Tensor, k: int, out: Tensor | None = None, block: int | None = None,
               num_warps: int | None = None, *, algorithm: str | None = None, workspace: Tensor | None = None,
               radix_bits: int | None = None, programs_per_sm: int = 4, num_sms: int | None = None,
               header: Tensor | None = None, candidates: Tensor | None = None, cblock: int = 8192,
               inline_ptx: bool | None = None, gluon: bool | None = None) -> Tensor:
    """Top-``k`` column indices of each row among its first ``counts[t]`` scores.

    Args:
        scores: ``[T, N]`` BF16 or FP32 (row stride may exceed the counts; columns ≥ ``counts[t]`` are ignored).
        counts: integer ``[T]`` candidates per row (each ≤ N).
        k: how many to select.
        out: optional int64 ``[T, k]`` destination.
        block, num_warps: ``"row"`` / ``"split"``: columns per loop step and warps (defaults: ``"row"`` 4096 / 16
            for BF16, 2048 / 8 for FP32; ``"split"`` 1024 / 4); ``"filter"``: the largest register block (16384) and
            warps (16); ``"bisect"``: warps only (the block is the row; default 16 from 8,192 columns, 8 from 2,048,
            else 4).
        algorithm: ``"row"``, ``"split"``, ``"filter"`` or ``"bisect"`` (module docstring; ``"bisect"`` on rows of
            more than ``BISECT_MAX_COLUMNS`` runs ``"filter"``); when omitted, the options of
            ``VARIANTS[default_variant(T, num_sms, N)]``.
        workspace: ``"split"`` (also ``"filter"`` falling back to it): int32 scratch of at least
            ``topk_workspace_shape(T, dtype, radix_bits)`` elements (zeroed here); allocated when omitted.
        radix_bits: digit width of the histogram passes, 8 or 4 (``"split"``: 8; ``"filter"``'s rare blocked path: 4).
        programs_per_sm: ``"split"`` only: rows are cut into chunks until ``T · splits`` reaches
            ``programs_per_sm · num_sms``.
        num_sms: multiprocessors to plan for (default: the device's count).
        header: ``"filter"`` only: int32 of at least ``filter_header_shape(T)`` elements, all zero, left zero
            (allocated zeroed when omitted; reuse one across calls to save the fill).
        candidates: ``"filter"`` only: int32 scratch of at least ``T · N`` elements (allocated when omitted).
        cblock: ``"filter"`` only: the most candidates selected in registers (more: blocked histogram passes).
        inline_ptx: ``"filter"`` / ``"bisect"``: scattered loads and stores as inline PTX (``store_columns``);
            default on the GPU, never in the interpreter; False: ``tl.load`` / ``tl.store`` (for A/B timing).
        gluon: ``"bisect"`` only: False keeps the Triton kernel where the Gluon one (``topk_sm90``: BF16 scores on
            sm_90, rows of a multiple of 8 columns, 8 to 32 columns per thread: ``topk_bisect_sm90.applies``) would run.
    Returns:
        int64 ``[T, k]``: the selected indices (order unspecified; ties at the threshold broken by lowest index for
        ``"row"``, arbitrarily otherwise), −1 in the slots past ``min(k, counts[t])``.
    """
    T = scores.shape[0]
    if out is None:
        out = torch.empty((T, k), dtype=torch.int64, device=scores.device)
    if T == 0 or k == 0:
        return out
    if scores.dtype == torch.bfloat16:
        bits, key_bits = scores.view(torch.int16), 16
    elif scores.dtype == torch.float32:
        bits, key_bits = scores.view(torch.int32), 32
    else:
        raise ValueError(f"radix_topk: scores must be bfloat16 or float32, got {scores.dtype}")
    num_sms = sm_count(scores, num_sms)
    gluon_bisect = gluon is not False and _gluon_bisect_fits(bits, key_bits, num_warps)
    if algorithm is None:
        opts = VARIANTS[default_variant(T, num_sms, scores.shape[1], gluon_bisect)]
        algorithm = opts["algorithm"]
        radix_bits = radix_bits or opts.get("radix_bits")
    launched = _launched_algorithm(algorithm, T, scores.shape[1], num_sms)
    if launched == "split" and algorithm != "split":  # a fallback: the 8-bit passes
        radix_bits = 8
    algorithm = launched
    ptx = not interpreting() and inline_ptx is not False
    if algorithm == "bisect":
        return _bisect_launch(bits, key_bits, counts, k, out, num_warps, ptx, gluon_bisect)
    if algorithm == "filter":
        return _filter_launch(bits, key_bits, counts, k, out, header, candidates, radix_bits or 4,
                              block or 16384, cblock, num_warps, num_sms, ptx)
    if algorithm == "split":
        radix_bits = radix_bits or 8
        if radix_bits not in (4, 8):
            raise ValueError(f"radix_topk: radix_bits must be 4 or 8, got {radix_bits}")
        return _split_launch(bits, key_bits, counts, k, out, workspace, radix_bits, block or 1024, num_warps or 4,
                             programs_per_sm, num_sms)
    if algorithm != "row":
        raise ValueError(f"radix_topk: unknown algorithm {algorithm!r} (one of {ALGORITHMS})")
    fill = min(triton.next_power_of_2(k), 4096)
    if block is None:
        block = 4096 if key_bits == 16 else 2048
    if num_warps is None:
        num_warps = 16 if block >= 4096 else 8
    _radix_topk_kernel[(T,)](bits, bits.stride(0), counts, out, out.stride(0),
                             K=k, KEY_BITS=key_bits, BLOCK=block,
                             FILL=fill,
                             HOST_BOUND=interpreting(),
                             N_HINT=scores.shape[1] if interpreting() else 0, num_warps=num_warps)
    return out
