"""Row-wise top-k by radix select (no sort): the indices of the ``k`` largest of each row's first ``n_t`` scores.

Each score becomes an order-preserving unsigned key (BF16 → 16 bits, FP32 → 32 bits: flip all bits of negatives,
set the sign bit of the others). The threshold key — the k-th largest — is found one digit (a byte, or 4 bits for
``radix_bits=4``) at a time, most significant first: a histogram of the current digit among the elements that match
the digits found so far, then the highest bin whose suffix count still reaches the number of elements yet to choose.
Two byte passes for BF16, four for FP32. A last pass writes every element above the threshold and, in index order, as many elements equal to
it as are still needed (ties: any valid choice). Slots past ``min(k, n_t)`` get −1.

Two algorithms (``radix_topk(..., algorithm=)``; ``VARIANTS[DEFAULT_VARIANT]`` is what the indexer runs):

* ``"row"`` — one program per row does every pass; a row is read ``passes + 1`` times (it is usually still in L2
  from the scores kernel). Few rows (decode) leave most SMs idle: 105 µs at 64 rows × 32K on the H200. (A
  register-resident variant — one read, threshold by bisection on the key bits — measured slower: 167 µs.)
* ``"split"`` — each row is cut into chunks handled by ``splits`` programs (enough programs for every SM), one
  launch per pass: each program histograms its chunk's digit and adds the nonzero bins to the row's global
  histogram with atomics (int32 workspace ``[T, passes · 2**radix_bits + 2]``, zeroed first); the next launch
  re-derives the prefix found so far from those histograms (a few hundred loads per program). The last launch
  compacts: each program reserves output slots for its elements above the threshold, and for its tied ones, with one
  atomic per block on two per-row counters (ties: any valid choice; exactly ``min(k, n_t)`` indices are written).
  ``radix_bits`` 8 (2 passes for BF16) or 4 (4 cheaper passes: ``tl.histogram``'s cost grows with the bin count).

Measured on an H200 (2026-11-22, k=512; ``benchmarks/bench_indexer.py --quick``), 64 rows × 32,768 BF16 scores:
``"split"`` (8-bit digits, blocks of 1024, 4 warps) 45.8 µs as a CUDA-graph replay (176 µs eager: its 4 launches
pay the host launch cost), ``"row"`` 105 µs either way, ``torch.topk`` 128 µs; 32,768 rows × 4,096 (a 4K prefill
chunk of 8 requests at 32K context): split 3.9 ms, row 6.8 ms. The default is ``"split8"``: decode steps run as graph
replays, and prefill gains too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .indexer import interpreting

__all__ = ["radix_topk", "ALGORITHMS", "VARIANTS", "DEFAULT_VARIANT", "topk_workspace_shape"]

ALGORITHMS = ("row", "split")
#: named launch options (tests and the benchmark run each); delete the losers, promote the winner
VARIANTS: dict[str, dict] = {
    "row": dict(algorithm="row"),
    "split8": dict(algorithm="split", radix_bits=8),
}
#: the variant ``radix_topk`` runs when no algorithm is named (the indexer names none)
DEFAULT_VARIANT = "split8"


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
    prefix = tl.zeros((), tl.int32).to(tl.uint32) if KEY_BITS == 32 else tl.zeros((), tl.int32)
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
        if KEY_BITS == 32:
            prefix = (prefix << 8) | b.to(tl.uint32)
        else:
            prefix = (prefix << 8) | b
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
    prefix = tl.zeros((), tl.int32).to(tl.uint32) if KEY_BITS == 32 else tl.zeros((), tl.int32)
    for p in tl.static_range(PASSES):
        hist = tl.load(ws_row + p * NB + bins)
        b, remaining = _pick_bin(hist, remaining, bins)
        if KEY_BITS == 32:
            prefix = (prefix << RADIX) | b.to(tl.uint32)
        else:
            prefix = (prefix << RADIX) | b
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


def topk_workspace_shape(rows: int, score_dtype: torch.dtype, radix_bits: int = 8) -> tuple[int, int]:
    """Shape of the int32 workspace of ``algorithm="split"``: per-pass histograms and two counters per row (the
    ``radix_bits=8`` shape is also large enough for 4)."""
    key_bits = 16 if score_dtype == torch.bfloat16 else 32
    return rows, (key_bits // radix_bits) * (1 << radix_bits) + 2


def _split_launch(bits, key_bits, counts, k, out, workspace, radix_bits, block, num_warps, programs_per_sm, num_sms):
    T, N = bits.shape
    shape = topk_workspace_shape(T, torch.bfloat16 if key_bits == 16 else torch.float32, radix_bits)
    if workspace is None:
        ws = torch.zeros(shape, dtype=torch.int32, device=bits.device)
    else:
        if workspace.dtype != torch.int32 or workspace.numel() < shape[0] * shape[1]:
            raise ValueError(f"radix_topk: workspace must be int32 with >= {shape[0] * shape[1]} elements")
        ws = workspace.view(-1)[: shape[0] * shape[1]].view(shape)
        ws.zero_()
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(bits.device).multi_processor_count if bits.is_cuda else 4
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


def radix_topk(scores: Tensor, counts: Tensor, k: int, out: Tensor | None = None, block: int | None = None,
               num_warps: int | None = None, *, algorithm: str | None = None, workspace: Tensor | None = None,
               radix_bits: int | None = None, programs_per_sm: int = 4, num_sms: int | None = None) -> Tensor:
    """Top-``k`` column indices of each row among its first ``counts[t]`` scores.

    Args:
        scores: ``[T, N]`` BF16 or FP32 (row stride may exceed the counts; columns ≥ ``counts[t]`` are ignored).
        counts: integer ``[T]`` candidates per row (each ≤ N).
        k: how many to select.
        out: optional int64 ``[T, k]`` destination.
        block, num_warps: chunk size per loop step / warps (defaults: ``"row"`` 4096 / 16 for BF16, 2048 / 8 for
            FP32; ``"split"`` 2048 / 8).
        algorithm: ``"row"`` or ``"split"`` (module docstring); when omitted, ``VARIANTS[DEFAULT_VARIANT]`` (its
            algorithm and radix bits).
        workspace: ``"split"`` only: int32 scratch of at least ``topk_workspace_shape(T, dtype, radix_bits)``
            elements (zeroed here); allocated when omitted.
        radix_bits: ``"split"`` only: digit width per pass, 8 (default) or 4.
        programs_per_sm, num_sms: ``"split"`` only: rows are cut into chunks until ``T · splits`` reaches
            ``programs_per_sm · num_sms`` (default: the device's multiprocessor count).
    Returns:
        int64 ``[T, k]``: the selected indices (order unspecified; ties at the threshold broken by lowest index for
        ``"row"``, arbitrarily for ``"split"``), −1 in the slots past ``min(k, counts[t])``.
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
    if algorithm is None:
        opts = VARIANTS[DEFAULT_VARIANT]
        algorithm = opts["algorithm"]
        radix_bits = radix_bits or opts.get("radix_bits")
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
