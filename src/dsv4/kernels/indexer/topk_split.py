"""Top-k ``"split"`` (``topk`` describes the algorithms): radix select with each row cut into chunks over many
programs, one histogram launch per digit (atomics into the row's int32 workspace), then one select launch."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .topk_common import empty_prefix, load_keys, pick_bin, push_digit
from .topk_plan import TopkPlan


@triton.jit
def _prefix_from_hists(ws_row, k_eff, PASSES: tl.constexpr, RADIX: tl.constexpr, KEY_BITS: tl.constexpr):
    """Key prefix (the top ``PASSES · RADIX`` bits of the threshold) and the count still to choose among the elements
    that match it, from the row's global histograms of passes ``0 … PASSES − 1``."""
    NB: tl.constexpr = 1 << RADIX
    bins = tl.arange(0, NB)
    remaining = k_eff
    prefix = empty_prefix(KEY_BITS)
    for p in tl.static_range(PASSES):
        hist = tl.load(ws_row + p * NB + bins)
        b, remaining = pick_bin(hist, remaining, bins)
        prefix = push_digit(prefix, b, RADIX, KEY_BITS)
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
        key = load_keys(row_ptr, offs, valid, KEY_BITS)
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
        key = load_keys(row_ptr, offs, valid, KEY_BITS)
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


def launch(bits: Tensor, counts: Tensor, out: Tensor, workspace: Tensor, plan: TopkPlan) -> Tensor:
    """``"split"`` over ``bits`` (int16 / int32 ``[rows, columns]`` score bits) as ``plan`` says: one histogram launch
    per ``radix_bits``-bit digit, then the select launch; ``workspace``: int32 ``[rows, ≥ plan.scratch()'s]``, zero.
    Returns ``out`` (int64 ``[rows, k]``)."""
    grid = (plan.rows, plan.programs_per_row)
    common = dict(K=plan.k, KEY_BITS=plan.key_bits, RADIX=plan.radix_bits, BLOCK=plan.block,
                  HOST_BOUND=plan.interpreted, CHUNK_HINT=plan.chunk if plan.interpreted else 0,
                  num_warps=plan.num_warps)
    for p in range(plan.key_bits // plan.radix_bits):
        _split_hist_kernel[grid](bits, bits.stride(0), counts, workspace, workspace.stride(0), plan.chunk, PASS=p,
                                 **common)
    _split_select_kernel[grid](bits, bits.stride(0), counts, workspace, workspace.stride(0), out, out.stride(0),
                               plan.chunk, FILL=plan.fill, **common)
    return out
