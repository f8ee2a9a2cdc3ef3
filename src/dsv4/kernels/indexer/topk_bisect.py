"""Top-k ``"bisect"`` in Triton (``topk`` describes the algorithms): one program per row, the whole row in
registers; ``topk_bisect_sm90`` is the same in Gluon for Hopper."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .topk_common import block_columns, emit_selected, largest_key, load_keys, search_start
from .topk_plan import TopkPlan


@triton.jit
def _bisect_topk_kernel(
    s_ptr, s_stride,            # int16 / int32 [T, s_stride]: score bits (BF16 / FP32)
    n_ptr,                      # int64 [T]: candidates of each row (the first n_t columns)
    out_ptr, out_stride,        # int64 [T, K] out
    K: tl.constexpr, KEY_BITS: tl.constexpr,
    BLOCK: tl.constexpr,        # register block: every column of a row (>= n_t)
    C: tl.constexpr,            # columns per group of the bound
    FILL: tl.constexpr,
    PTX: tl.constexpr,          # the selection's stores as inline PTX (``store_columns``; not in the interpreter)
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
    cols = block_columns(0, R, C)
    valid = cols < n
    if n <= K:  # every candidate is selected
        tl.store(out_row + cols, cols.to(tl.int64), mask=valid)
    else:
        # Invalid columns get key 0, the smallest key: every threshold tried below is >= 1, so they never count.
        key = tl.where(valid, load_keys(s_ptr + row * s_stride, cols, valid, KEY_BITS), 0)
        top = largest_key(KEY_BITS)
        g_max = tl.max(key, axis=1)  # of each row of the block: a group of C columns
        hi_key = tl.max(g_max, axis=0)
        groups = tl.cdiv(n, C)
        if groups >= K:  # at least K nonempty groups: their smallest maximum is <= the k-th largest
            lo_key = tl.min(tl.where(tl.arange(0, R) < groups, g_max, top), axis=0)
        else:
            lo_key = tl.min(tl.min(tl.where(valid, key, top), axis=1), axis=0)
        thr, width = search_start(lo_key, hi_key, KEY_BITS)
        b = width - 1
        while b >= 0:  # the largest thr with at least k_eff keys >= thr, one bit at a time
            t = thr | (tl.full((), 1, thr.dtype) << b.to(thr.dtype))
            if tl.sum(tl.sum((key >= t).to(tl.int32), axis=1), axis=0) >= k_eff:
                thr = t
            b -= 1
        n_gt = tl.sum(tl.sum((key > thr).to(tl.int32), axis=1), axis=0)
        emit_selected(key, valid, cols, thr, n_gt, k_eff - n_gt, 0, 0, out_row, PTX)


def launch(bits: Tensor, counts: Tensor, out: Tensor, plan: TopkPlan) -> Tensor:
    """``"bisect"`` in Triton over ``bits`` (int16 / int32 ``[rows, columns]`` score bits) as ``plan`` says: one
    program per row. Returns ``out`` (int64 ``[rows, k]``)."""
    _bisect_topk_kernel[(plan.rows,)](bits, bits.stride(0), counts, out, out.stride(0), K=plan.k,
                                      KEY_BITS=plan.key_bits, BLOCK=plan.block, C=plan.group, FILL=plan.fill,
                                      PTX=not plan.interpreted, num_warps=plan.num_warps)
    return out
