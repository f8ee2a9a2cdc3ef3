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
def _sortable_key(bits, KEY_BITS: tl.constexpr):
    """Order-preserving unsigned key of IEEE bits (int32 holding 16 or 32 bits)."""
    if KEY_BITS == 16:
        u = bits & 0xFFFF
        return tl.where(u >= 0x8000, u ^ 0xFFFF, u | 0x8000)
    else:
        u = bits.to(tl.uint32, bitcast=True)
        neg = (u >> 31) != 0
        return tl.where(neg, u ^ 0xFFFFFFFF, u | 0x80000000)


@triton.jit
def _load_keys(row_ptr, offs, mask, KEY_BITS: tl.constexpr):
    if KEY_BITS == 16:
        bits = tl.load(row_ptr + offs, mask=mask, other=0).to(tl.int32)
    else:
        bits = tl.load(row_ptr + offs, mask=mask, other=0)
    return _sortable_key(bits, KEY_BITS)


@triton.jit
def _address_operand(ptr, like):
    """The scalar pointer ``ptr`` as an int64 block shaped like ``like``: the address operand of the inline PTX
    loads and stores below (each element adds its own 32-bit slot)."""
    return ptr.to(tl.int64, bitcast=True) + tl.zeros_like(like).to(tl.int64)


@triton.jit
def _gather_keys(row_ptr, cols, mask, KEY_BITS: tl.constexpr, PTX: tl.constexpr):
    """``_load_keys`` of scattered columns. With ``PTX`` the loads are inline PTX in the columns' own register layout
    (``tl.load`` would first move the block's 64-bit pointers to another layout through shared memory)."""
    if PTX:
        if KEY_BITS == 16:
            asm: tl.constexpr = """{ .reg .pred p; .reg .b64 a; .reg .b16 h;
            setp.ne.b32 p, $3, 0;
            mad.wide.s32 a, $2, 2, $1;
            mov.b32 $0, 0;
            @p ld.global.b16 h, [a];
            @p cvt.u32.u16 $0, h; }"""
        else:
            asm: tl.constexpr = """{ .reg .pred p; .reg .b64 a;
            setp.ne.b32 p, $3, 0;
            mad.wide.s32 a, $2, 4, $1;
            mov.b32 $0, 0;
            @p ld.global.b32 $0, [a]; }"""
        bits = tl.inline_asm_elementwise(
            asm=asm, constraints="=r,l,r,r",
            args=[_address_operand(row_ptr, cols), cols, mask.to(tl.int32)],
            dtype=tl.int32, is_pure=True, pack=1)
        return _sortable_key(bits, KEY_BITS)
    else:
        return _load_keys(row_ptr, cols, mask, KEY_BITS)


@triton.jit
def _largest_key(KEY_BITS: tl.constexpr):
    """The largest key (0xFFFF / 0xFFFFFFFF, of the same type as ``_sortable_key``'s): the neutral element of a
    minimum over keys."""
    if KEY_BITS == 16:
        return tl.full((), 0xFFFF, tl.int32)
    else:
        return tl.full((), 0xFFFFFFFF, tl.uint32)


@triton.jit
def _empty_prefix(KEY_BITS: tl.constexpr):
    """A key prefix of no digits yet (uint32 for 32-bit keys, int32 for 16-bit ones)."""
    if KEY_BITS == 32:
        return tl.zeros((), tl.int32).to(tl.uint32)
    else:
        return tl.zeros((), tl.int32)


@triton.jit
def _push_digit(prefix, b, RADIX: tl.constexpr, KEY_BITS: tl.constexpr):
    """``prefix`` with the ``RADIX``-bit digit ``b`` (int32) appended."""
    if KEY_BITS == 32:
        return (prefix << RADIX) | b.to(tl.uint32)
    else:
        return (prefix << RADIX) | b


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
    prefix = _empty_prefix(KEY_BITS)
    for p in tl.static_range(KEY_BITS // 8):
        shift = KEY_BITS - 8 * (p + 1)
        hist = tl.zeros((256,), tl.int32)
        for start in range(0, N_HINT if HOST_BOUND else n, BLOCK):
            offs = start + lanes
            valid = offs < n
            key = _load_keys(row_ptr, offs, valid, KEY_BITS)
            if p > 0:
                valid = valid & ((key >> (shift + 8)) == prefix)
            digit = ((key >> shift) & 0xFF).to(tl.int32)
            hist += tl.histogram(digit, 256, mask=valid)
        suffix = tl.sum(hist) - tl.cumsum(hist, 0) + hist  # elements in bins >= i
        b = tl.max(tl.where(suffix >= remaining, bins, 0))
        remaining -= tl.sum(tl.where(bins > b, hist, 0))
        prefix = _push_digit(prefix, b, 8, KEY_BITS)
    thr = prefix
    n_gt = k_eff - remaining  # elements strictly above the threshold; `remaining` ties are taken

    n_above = 0
    n_tied = 0
    for start in range(0, N_HINT if HOST_BOUND else n, BLOCK):
        offs = start + lanes
        valid = offs < n
        key = _load_keys(row_ptr, offs, valid, KEY_BITS)
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




# ------------------------------------------------------------------------------------------------ split rows
@triton.jit
def _pick_bin(hist, remaining, bins):
    """Highest bin whose suffix count reaches ``remaining``, and what is still to choose inside it."""
    suffix = tl.sum(hist) - tl.cumsum(hist, 0) + hist  # elements in bins >= i
    b = tl.max(tl.where(suffix >= remaining, bins, 0))
    return b, remaining - tl.sum(tl.where(bins > b, hist, 0))


@triton.jit
def _prefix_from_hists(ws_row, k_eff, PASSES: tl.constexpr, RADIX: tl.constexpr, KEY_BITS: tl.constexpr):
    """Key prefix (the top ``PASSES · RADIX`` bits of the threshold) and the count still to choose among the elements
    that match it, from the row's global histograms of passes ``0 … PASSES − 1``."""
    NB: tl.constexpr = 1 << RADIX
    bins = tl.arange(0, NB)
    remaining = k_eff
    prefix = _empty_prefix(KEY_BITS)
    for p in tl.static_range(PASSES):
        hist = tl.load(ws_row + p * NB + bins)
        b, remaining = _pick_bin(hist, remaining, bins)
        prefix = _push_digit(prefix, b, RADIX, KEY_BITS)
    return prefix, remaining


@triton.jit
def _split_hist_kernel(
    s_ptr, s_stride,            # int16 / int32 [T, s_stride]: score bits
    n_ptr,                      # int64 [T]: candidates per row
    ws_ptr, ws_stride,          # int32 [T, ws_stride]: per-pass histograms (2**RADIX bins each), then 2 counters
    chunk,                      # elements per program (a multiple of BLOCK)
    K: tl.constexpr, KEY_BITS: tl.constexpr, RADIX: tl.constexpr, PASS: tl.constexpr, BLOCK: tl.constexpr,
    HOST_BOUND: tl.constexpr, CHUNK_HINT: tl.constexpr,  # interpreter: loop to the host bound CHUNK_HINT = chunk
):
    row = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * chunk
    n = tl.load(n_ptr + row).to(tl.int32)
    if lo >= n:
        return
    NB: tl.constexpr = 1 << RADIX
    ws_row = ws_ptr + row * ws_stride
    prefix, remaining = _prefix_from_hists(ws_row, tl.minimum(n, K), PASS, RADIX, KEY_BITS)
    shift: tl.constexpr = KEY_BITS - RADIX * (PASS + 1)
    row_ptr = s_ptr + row * s_stride
    lanes = tl.arange(0, BLOCK)
    hist = tl.zeros((NB,), tl.int32)
    for start in range(0, CHUNK_HINT if HOST_BOUND else tl.minimum(chunk, n - lo), BLOCK):
        offs = lo + start + lanes
        valid = offs < n
        key = _load_keys(row_ptr, offs, valid, KEY_BITS)
        if PASS > 0:
            valid = valid & ((key >> (shift + RADIX)) == prefix)
        digit = ((key >> shift) & (NB - 1)).to(tl.int32)
        hist += tl.histogram(digit, NB, mask=valid)
    bins = tl.arange(0, NB)
    tl.atomic_add(ws_row + PASS * NB + bins, hist, mask=hist > 0, sem="relaxed")


@triton.jit
def _split_select_kernel(
    s_ptr, s_stride, n_ptr, ws_ptr, ws_stride,
    out_ptr, out_stride,        # int64 [T, K] out
    chunk,
    K: tl.constexpr, KEY_BITS: tl.constexpr, RADIX: tl.constexpr, BLOCK: tl.constexpr, FILL: tl.constexpr,
    HOST_BOUND: tl.constexpr, CHUNK_HINT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    lo = split * chunk
    n = tl.load(n_ptr + row).to(tl.int32)
    k_eff = tl.minimum(n, K)
    out_row = out_ptr + row * out_stride
    if split == 0:
        for start in tl.static_range(0, K, FILL):
            o = start + tl.arange(0, FILL)
            tl.store(out_row + o, tl.full(o.shape, -1, tl.int64), mask=(o >= k_eff) & (o < K))
    if lo >= n:
        return
    PASSES: tl.constexpr = KEY_BITS // RADIX
    ws_row = ws_ptr + row * ws_stride
    thr, remaining = _prefix_from_hists(ws_row, k_eff, PASSES, RADIX, KEY_BITS)
    n_gt = k_eff - remaining  # elements strictly above the threshold (all taken); `remaining` ties are taken
    cnt = ws_row + PASSES * (1 << RADIX)  # [0]: slots taken above the threshold, [1]: ties seen
    row_ptr = s_ptr + row * s_stride
    lanes = tl.arange(0, BLOCK)
    for start in range(0, CHUNK_HINT if HOST_BOUND else tl.minimum(chunk, n - lo), BLOCK):
        offs = lo + start + lanes
        valid = offs < n
        key = _load_keys(row_ptr, offs, valid, KEY_BITS)
        gt_i = (valid & (key > thr)).to(tl.int32)
        eq_i = (valid & (key == thr)).to(tl.int32)
        c_gt = tl.sum(gt_i)
        c_eq = tl.sum(eq_i)
        base_gt = tl.atomic_add(cnt, c_gt, mask=c_gt > 0, sem="relaxed")
        base_eq = tl.atomic_add(cnt + 1, c_eq, mask=c_eq > 0, sem="relaxed")
        pos_gt = base_gt + tl.cumsum(gt_i, 0) - 1
        rank_eq = base_eq + tl.cumsum(eq_i, 0) - 1
        tl.store(out_row + pos_gt, offs.to(tl.int64), mask=gt_i != 0)
        tl.store(out_row + n_gt + rank_eq, offs.to(tl.int64), mask=(eq_i != 0) & (rank_eq < remaining))


# ------------------------------------------------------------------------------------------------ filtered rows
#: polls of a row barrier before a program gives up waiting (~seconds): the launcher keeps every program resident, so
#: this never triggers unless that assumption breaks (e.g. another process holds SMs); a stuck GPU would be worse
_MAX_POLLS: tl.constexpr = tl.constexpr(1 << 24)


@triton.jit
def _wait_arrivals(arrive_ptr, target):
    """Poll the int32 counter ``arrive_ptr`` (acquire) until it reaches ``target``."""
    seen = tl.atomic_add(arrive_ptr, 0, sem="acquire", scope="gpu")
    polls = 0
    while (seen < target) & (polls < _MAX_POLLS):
        seen = tl.atomic_add(arrive_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    tl.debug_barrier()


@triton.jit
def _row_barrier(arrive_ptr, target):
    """Arrive at the int32 counter ``arrive_ptr`` and wait until it reaches ``target``.

    Every thread's earlier global writes are ordered before the arrival (CTA barrier, then a release atomic); the
    acquiring poll orders the caller's later reads after the other programs' arrivals. Only safe when all programs
    that arrive are resident at once (the launcher keeps the grid within one program per multiprocessor)."""
    tl.debug_barrier()
    tl.atomic_add(arrive_ptr, 1, sem="release", scope="gpu")
    _wait_arrivals(arrive_ptr, target)


@triton.jit
def _half_key(key, KEY_BITS: tl.constexpr):
    """The key halved as a non-negative int32 (16-bit keys are already)."""
    if KEY_BITS == 32:
        return (key >> 1).to(tl.int32, bitcast=True)
    else:
        return key


@triton.jit
def _block_columns(start, R: tl.constexpr, C: tl.constexpr):
    """Columns ``start + r·C + c`` of a ``[R, C]`` register block (rows of C columns: scans along a row stay inside
    a few threads of one warp)."""
    return start + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]


@triton.jit
def _row_maxima(key, valid, KEY_BITS: tl.constexpr):
    """``[R]`` maxima of the halved keys of each row of a ``[R, C]`` block (−1 for a row without a valid element)."""
    return tl.max(tl.where(valid, _half_key(key, KEY_BITS), -1), axis=1)


@triton.jit
def _smallest_maximum(row_max):
    """The smallest of the nonempty groups' maxima (``INT32_MAX`` when every group is empty)."""
    return tl.min(tl.where(row_max >= 0, row_max, 2147483647), axis=0)


@triton.jit
def _list_slots(take, base):
    """Slots ``base, base + 1, …`` of the taken elements of a ``[R, C]`` block in row-major order (undefined
    elsewhere): a scan along each row plus a scan over the row totals."""
    in_row = tl.cumsum(take, axis=1)
    totals = tl.sum(take, axis=1)
    before = tl.cumsum(totals, axis=0) - totals
    return base + before[:, None] + in_row - 1


@triton.jit
def _store_columns(base, slot, col, PTX: tl.constexpr):
    """``base[slot] = col`` where ``slot >= 0``; ``base``: int32 or int64 elements (``col``: int32 block).

    With ``PTX`` the store is inline PTX that runs in the operands' own register layout and forms each address
    itself: ``tl.store`` of a scattered block first moves its 64-bit pointers to another layout through shared
    memory (measured in the TTGIR of these kernels). Triton may replicate the impure op; a replicated store writes
    the same value again."""
    if PTX:
        if base.dtype.element_ty == tl.int64:
            asm: tl.constexpr = """{ .reg .pred p; .reg .b64 a, v;
            setp.ge.s32 p, $2, 0;
            mad.wide.s32 a, $2, 8, $1;
            cvt.s64.s32 v, $3;
            @p st.global.b64 [a], v;
            mov.b32 $0, 0; }"""
        else:
            asm: tl.constexpr = """{ .reg .pred p; .reg .b64 a;
            setp.ge.s32 p, $2, 0;
            mad.wide.s32 a, $2, 4, $1;
            @p st.global.b32 [a], $3;
            mov.b32 $0, 0; }"""
        tl.inline_asm_elementwise(asm=asm, constraints="=r,l,r,r",
                                  args=[_address_operand(base, slot), slot, col],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(base + slot, col.to(base.dtype.element_ty), mask=slot >= 0)


@triton.jit
def _append_candidates(key, valid, cols, bound, n_cand, cand, KEY_BITS: tl.constexpr, PTX: tl.constexpr):
    """Append the block's columns whose halved key reaches ``bound`` to the row's candidate list (one atomic)."""
    take = (valid & (_half_key(key, KEY_BITS) >= bound)).to(tl.int32)
    c = tl.sum(tl.sum(take, axis=1), axis=0)
    if c > 0:
        base = tl.atomic_add(n_cand, c, sem="relaxed", scope="gpu")
        _store_columns(cand, tl.where(take != 0, _list_slots(take, base), -1), cols, PTX)


@triton.jit
def _block_histogram(digit, live, NB: tl.constexpr):
    """``[NB]`` counts of the live elements' digits of a ``[R, C]`` block. The dead ones are counted in bin 0 and
    taken off again: the block is flattened for ``tl.histogram`` and no mask needs to follow it."""
    hist = tl.histogram(tl.reshape(tl.where(live, digit, 0), (digit.numel,)), NB)
    dead = digit.numel - tl.sum(tl.sum(live.to(tl.int32), axis=1), axis=0)
    return hist - tl.where(tl.arange(0, NB) == 0, dead, 0)


@triton.jit
def _search_start(lo_key, hi_key, KEY_BITS: tl.constexpr):
    """Where the bisection starts: ``hi_key`` with its bits below the highest one where ``lo_key`` and ``hi_key``
    differ cleared (the bits above it are the threshold's too), and the number of those searched bits."""
    diff = lo_key ^ hi_key
    width = 0  # bit length of diff
    for b in tl.static_range(KEY_BITS):
        width += ((diff >> b) != 0).to(tl.int32)
    thr = hi_key
    for b in tl.static_range(KEY_BITS):
        if b < width:
            thr = thr ^ (thr & (tl.full((), 1, thr.dtype) << b))
    return thr, width


@triton.jit
def _bisect_threshold(key, valid, k_eff, lo_key, hi_key, KEY_BITS: tl.constexpr):
    """The ``k_eff``-th largest of the valid keys of a register block, found bit by bit (the largest ``t`` with at
    least ``k_eff`` keys ``>= t``), and how many keys equal to it are still to take. ``lo_key`` / ``hi_key``: a lower
    bound of the valid keys and their maximum; the bits above their highest differing bit are the threshold's too,
    so only the rest costs a count (a block-wide reduction) each."""
    thr, width = _search_start(lo_key, hi_key, KEY_BITS)
    for i in tl.static_range(KEY_BITS):
        b = KEY_BITS - 1 - i
        if b < width:
            t = thr | (tl.full((), 1, thr.dtype) << b)
            if tl.sum(tl.sum((valid & (key >= t)).to(tl.int32), axis=1), axis=0) >= k_eff:
                thr = t
    n_gt = tl.sum(tl.sum((valid & (key > thr)).to(tl.int32), axis=1), axis=0)
    return thr, k_eff - n_gt


@triton.jit
def _emit_selected(key, valid, col, thr, n_gt, remaining, n_above, n_tied, out_row, PTX: tl.constexpr):
    """Write a block's columns above the threshold (slots from ``n_above``) and its tied ones (slots ``n_gt + n_tied
    + rank`` below ``n_gt + remaining``) to the output row; returns the updated ``(n_above, n_tied)``.

    One scan places both: the count above in the low 16 bits, the tied count in the high ones (blocks of at most
    32,768 elements)."""
    gt = valid & (key > thr)
    eq = valid & (key == thr)
    seen = _list_slots(gt.to(tl.int32) | (eq.to(tl.int32) << 16), 0) + 1  # inclusive counts
    rank = n_tied + (seen >> 16) - 1
    slot = tl.where(gt, n_above + (seen & 0xFFFF) - 1, tl.where(eq & (rank < remaining), n_gt + rank, -1))
    _store_columns(out_row, slot, col, PTX)
    total = tl.max(tl.max(seen, axis=1), axis=0)  # the last element's counts: both fields only grow
    return n_above + (total & 0xFFFF), n_tied + (total >> 16)


@triton.jit
def _select_in_registers(row_ptr, cand, nc, k_eff, lo_key, out_row, CB: tl.constexpr, CC: tl.constexpr,
                         KEY_BITS: tl.constexpr, PTX: tl.constexpr):
    """Top ``k_eff`` of the ``nc <= CB`` listed candidates, held in one ``[CB // CC, CC]`` register block."""
    ci = _block_columns(0, CB // CC, CC)
    cvalid = ci < nc
    col = tl.load(cand + ci, mask=cvalid, other=0, cache_modifier=".cg")
    ckey = _gather_keys(row_ptr, col, cvalid, KEY_BITS, PTX)
    hi_key = tl.max(tl.max(tl.where(cvalid, ckey, lo_key), axis=1), axis=0)
    thr, remaining = _bisect_threshold(ckey, cvalid, k_eff, lo_key, hi_key, KEY_BITS)
    _emit_selected(ckey, cvalid, col, thr, k_eff - remaining, remaining, 0, 0, out_row, PTX)


@triton.jit
def _filter_topk_kernel(
    s_ptr, s_stride,            # int16 / int32 [T, s_stride]: score bits (BF16 / FP32)
    n_ptr,                      # int64 [T]: candidates of each row (the first n_t columns)
    hdr_ptr, hdr_stride,        # int32 [T, 4]: bound, arrivals, candidate count, pad; zero on entry and on exit
    cand_ptr, cand_stride,      # int32 [T, cand_stride >= columns]: the candidates' columns (scratch)
    out_ptr, out_stride,        # int64 [T, K] out
    chunk,                      # columns per program; the last program of a row may get fewer, or none
    splits,                     # programs per row (grid axis 1)
    K: tl.constexpr, KEY_BITS: tl.constexpr, RADIX: tl.constexpr,
    BLOCK: tl.constexpr,        # columns per register block; chunk <= BLOCK: one load per column
    C: tl.constexpr,            # columns per register-block row = per group of the bound (a power of two)
    CBLOCK: tl.constexpr,       # candidates per register block of the selection (also tried: CBLOCK / 2)
    CC: tl.constexpr,           # candidates per row of those blocks
    FILL: tl.constexpr,
    SPLIT: tl.constexpr,        # splits > 1: group maxima exchanged through hdr, one row barrier
    PTX: tl.constexpr,          # scattered stores as inline PTX (``_store_columns``; not in the interpreter)
    HOST_BOUND: tl.constexpr, CHUNK_HINT: tl.constexpr,  # interpreter: loop bound (one program per row there)
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    n = tl.load(n_ptr + row).to(tl.int32)
    k_eff = tl.minimum(n, K)
    out_row = out_ptr + row * out_stride
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n)
    R: tl.constexpr = BLOCK // C
    CR: tl.constexpr = CBLOCK // CC
    if split == 0:
        for start in tl.static_range(0, K, FILL):
            o = start + tl.arange(0, FILL)
            tl.store(out_row + o, tl.full(o.shape, -1, tl.int64), mask=(o >= k_eff) & (o < K))
    if n <= K:  # every candidate is selected (row-uniform: no program of this row reaches a barrier)
        for start in range(0, CHUNK_HINT if HOST_BOUND else hi - lo, BLOCK):
            cols = _block_columns(lo + start, R, C)
            tl.store(out_row + cols, cols.to(tl.int64), mask=cols < hi)
    else:
        row_ptr = s_ptr + row * s_stride
        hdr = hdr_ptr + row * hdr_stride
        bound_c = hdr          # INT32_MAX − (the smallest group maximum seen so far): atomic max, zero = none yet
        arrive = hdr + 1       # row barrier arrivals
        n_cand = hdr + 2       # candidates appended so far
        cand = cand_ptr + row * cand_stride
        # 1. A lower bound of the k-th largest: groups of columns, at least K of them nonempty; the smallest group
        #    maximum is <= the k-th largest (the maxima are >= K distinct elements >= it). A group is a row of C
        #    consecutive columns of a register block.
        #    Keys are compared halved (non-negative int32 also for 32-bit keys); halving keeps the bound a bound.
        # 2. Append the columns whose key reaches the bound to the row's candidate list.
        bound = 0
        # enough nonempty groups for a bound (row-uniform: every program of the row waits at the barrier or none)
        use_bound = tl.cdiv(n, C) >= K
        if chunk <= BLOCK:  # the program's columns stay in registers from 1 to 2
            cols = _block_columns(lo, R, C)
            valid = cols < hi
            key = _load_keys(row_ptr, cols, valid, KEY_BITS)
            if use_bound:
                bound = _smallest_maximum(_row_maxima(key, valid, KEY_BITS))
                if SPLIT:
                    tl.atomic_max(bound_c, 2147483647 - bound, sem="relaxed", scope="gpu")
                    _row_barrier(arrive, splits)
                    bound = 2147483647 - tl.load(bound_c, volatile=True)
            _append_candidates(key, valid, cols, bound, n_cand, cand, KEY_BITS, PTX)
        else:
            if use_bound:
                bound = 2147483647
                for start in range(0, CHUNK_HINT if HOST_BOUND else hi - lo, BLOCK):
                    cols = _block_columns(lo + start, R, C)
                    valid = cols < hi
                    key = _load_keys(row_ptr, cols, valid, KEY_BITS)
                    bound = tl.minimum(bound, _smallest_maximum(_row_maxima(key, valid, KEY_BITS)))
                if SPLIT:
                    tl.atomic_max(bound_c, 2147483647 - bound, sem="relaxed", scope="gpu")
                    _row_barrier(arrive, splits)
                    bound = 2147483647 - tl.load(bound_c, volatile=True)
            for start in range(0, CHUNK_HINT if HOST_BOUND else hi - lo, BLOCK):
                cols = _block_columns(lo + start, R, C)
                valid = cols < hi
                key = _load_keys(row_ptr, cols, valid, KEY_BITS)
                _append_candidates(key, valid, cols, bound, n_cand, cand, KEY_BITS, PTX)
        # 3. The row's first program selects among the candidates; the others only arrive.
        if SPLIT:
            tl.debug_barrier()
            tl.atomic_add(arrive, 1, sem="release", scope="gpu")
        if split == 0:
            if SPLIT:  # every program's appends are done: splits arrivals here, plus splits at the bound's barrier
                _wait_arrivals(arrive, splits * (1 + use_bound.to(tl.int32)))
            tl.debug_barrier()
            nc = tl.load(n_cand, volatile=True)
            lo_key = bound
            if KEY_BITS == 32:
                lo_key = (bound << 1).to(tl.uint32, bitcast=True)  # every candidate's key is >= this
            if nc <= CBLOCK // 2:  # usual: all candidates in registers
                _select_in_registers(row_ptr, cand, nc, k_eff, lo_key, out_row, CBLOCK // 2, CC, KEY_BITS, PTX)
            elif nc <= CBLOCK:
                _select_in_registers(row_ptr, cand, nc, k_eff, lo_key, out_row, CBLOCK, CC, KEY_BITS, PTX)
            else:  # a weak bound (e.g. rows sorted by column): radix passes over the list in blocks
                NB: tl.constexpr = 1 << RADIX
                bins = tl.arange(0, NB)
                remaining = k_eff
                thr = _empty_prefix(KEY_BITS)
                for p in tl.static_range(KEY_BITS // RADIX):
                    shift = KEY_BITS - RADIX * (p + 1)
                    hist = tl.zeros((NB,), tl.int32)
                    for start in range(0, CHUNK_HINT if HOST_BOUND else nc, CBLOCK):
                        ci = _block_columns(start, CR, CC)
                        live = ci < nc
                        col = tl.load(cand + ci, mask=live, other=0, cache_modifier=".cg")
                        ckey = _gather_keys(row_ptr, col, live, KEY_BITS, PTX)
                        if p > 0:
                            live = live & ((ckey >> (shift + RADIX)) == thr)
                        hist += _block_histogram(((ckey >> shift) & (NB - 1)).to(tl.int32), live, NB)
                    b, remaining = _pick_bin(hist, remaining, bins)
                    thr = _push_digit(thr, b, RADIX, KEY_BITS)
                taken_above = 0
                tied = 0
                for start in range(0, CHUNK_HINT if HOST_BOUND else nc, CBLOCK):
                    ci = _block_columns(start, CR, CC)
                    cvalid = ci < nc
                    col = tl.load(cand + ci, mask=cvalid, other=0, cache_modifier=".cg")
                    ckey = _gather_keys(row_ptr, col, cvalid, KEY_BITS, PTX)
                    taken_above, tied = _emit_selected(ckey, cvalid, col, thr, k_eff - remaining, remaining,
                                                       taken_above, tied, out_row, PTX)
            # leave the header zero for the next call (every other program of the row has arrived: none reads it)
            tl.debug_barrier()
            tl.store(hdr + tl.arange(0, 4), tl.zeros((4,), tl.int32))


@triton.jit
def _bisect_topk_kernel(
    s_ptr, s_stride,            # int16 / int32 [T, s_stride]: score bits (BF16 / FP32)
    n_ptr,                      # int64 [T]: candidates of each row (the first n_t columns)
    out_ptr, out_stride,        # int64 [T, K] out
    K: tl.constexpr, KEY_BITS: tl.constexpr,
    BLOCK: tl.constexpr,        # register block: every column of a row (>= n_t)
    C: tl.constexpr,            # columns per group of the bound
    FILL: tl.constexpr,
    PTX: tl.constexpr,          # the selection's stores as inline PTX (``_store_columns``; not in the interpreter)
):
    """One program per row, the whole row in registers: a lower bound of the threshold (the smallest maximum of
    groups of C columns, as ``"filter"``), then bisection on the key bits over the row itself, then one scan that
    places the selection — no candidate list, no barrier, one read of the row."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.load(n_ptr + row).to(tl.int32)
    k_eff = tl.minimum(n, K)
    out_row = out_ptr + row * out_stride
    for start in tl.static_range(0, K, FILL):
        o = start + tl.arange(0, FILL)
        tl.store(out_row + o, tl.full(o.shape, -1, tl.int64), mask=(o >= k_eff) & (o < K))
    R: tl.constexpr = BLOCK // C
    cols = _block_columns(0, R, C)
    valid = cols < n
    if n <= K:  # every candidate is selected
        tl.store(out_row + cols, cols.to(tl.int64), mask=valid)
    else:
        # Invalid columns get key 0, the smallest key: every threshold tried below is >= 1, so they never count.
        key = tl.where(valid, _load_keys(s_ptr + row * s_stride, cols, valid, KEY_BITS), 0)
        top = _largest_key(KEY_BITS)
        g_max = tl.max(key, axis=1)  # of each row of the block: a group of C columns
        hi_key = tl.max(g_max, axis=0)
        groups = tl.cdiv(n, C)
        if groups >= K:  # at least K nonempty groups: their smallest maximum is <= the k-th largest
            lo_key = tl.min(tl.where(tl.arange(0, R) < groups, g_max, top), axis=0)
        else:
            lo_key = tl.min(tl.min(tl.where(valid, key, top), axis=1), axis=0)
        thr, width = _search_start(lo_key, hi_key, KEY_BITS)
        b = width - 1
        while b >= 0:  # the largest thr with at least k_eff keys >= thr, one bit at a time
            t = thr | (tl.full((), 1, thr.dtype) << b.to(thr.dtype))
            if tl.sum(tl.sum((key >= t).to(tl.int32), axis=1), axis=0) >= k_eff:
                thr = t
            b -= 1
        n_gt = tl.sum(tl.sum((key > thr).to(tl.int32), axis=1), axis=0)
        _emit_selected(key, valid, cols, thr, n_gt, k_eff - n_gt, 0, 0, out_row, PTX)


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
        inline_ptx: ``"filter"`` / ``"bisect"``: scattered loads and stores as inline PTX (``_store_columns``);
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
