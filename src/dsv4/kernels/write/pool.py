"""Pooling one compressed entry (SPEC §4.1–4.2): a per-channel softmax over its slots' gates weighting its slots'
features, in the order torch computes ``(gate.softmax(1) * kv).sum(1)`` on CUDA.

* softmax: max, then a sequential sum of ``exp(z − max)`` over the slots, then each weight as an IEEE division
  (torch's spatial softmax, one thread per channel); a zero numerator gives +0 without dividing (what the
  division returns, without its slow path);
* the weighted sum in the order of torch's reduce kernel (4 accumulators, split over warps for long windows:
  ``torch_order.pool_warps``).

Every channel pools on its own, so a program may pool a slice of the channels (``c0``, ``CS``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..quant import DIV_FAST_DEN_MAX, divide_by_reciprocal, divide_rn, expf, reciprocal_rn, seq_accumulate_rows, seq_sum4_last
from ..torch_order import halve_rows
from .slots import slot_tile

__all__ = ["EXP_FAST_GAP", "FLT_LOWEST", "pool_entry", "pool_in_step", "softmax_weight"]

FLT_LOWEST: tl.constexpr = tl.constexpr(-3.4028234663852886e38)

#: A softmax over slots whose gates all lie within this of the channel's max has every ``exp(z − max)`` ≥ e⁻⁴⁰
#: > 2⁻⁶⁴: in the range where ``divide_by_reciprocal`` equals the IEEE division.
EXP_FAST_GAP: tl.constexpr = tl.constexpr(-40.0)


@triton.jit
def softmax_weight(e, den):
    """``e / den`` rounded as IEEE division (``tl.math.div_rn``): a slot's softmax weight, ``e = exp(z − max)``.

    A zero ``e`` (a gate far below the channel's max: most of an HCA window's 128 slots) gives +0 without dividing —
    what the division returns for a positive ``den`` — because a zero dividend fails the division's fast-path check
    and sends the warp through its slow-path subroutine. ``den`` ≤ 0 or NaN still divides."""
    skip = (e == 0.0) & (den > 0.0)
    return tl.where(skip, 0.0, tl.math.div_rn(tl.where(skip, 1.0, e), den))


@triton.jit
def pool_entry(
    a_ptr, z_ptr, AZ_STRIDE: tl.constexpr, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr,
    i, start, cu, slot,
    C: tl.constexpr, M: tl.constexpr, OVERLAP: tl.constexpr, NW: tl.constexpr, c0, CS: tl.constexpr,
    IN_STEP: tl.constexpr = False,
):
    """``Σ_slot softmax_slot(z)·a`` of entry ``i`` as torch computes ``(gate.softmax(1) * kv).sum(1)``, channels
    ``c0 … c0+CS−1`` of its ``C``: fp32 ``[CS]`` (every channel is pooled on its own: a slice is exact). ``a_ptr`` /
    ``z_ptr``: the step's projections, rows ``AZ_STRIDE`` elements apart (``slots``).

    ``NW``: 0 when torch's reduce kernel sums a channel's ``S`` slots in one thread (4 accumulators, slot d into
    accumulator d mod 4), else the number of warps it splits them over (warp y, accumulator i takes slots
    ``y + NW·i + 4·NW·k``; the warps' partials are then halved pairwise, offsets NW/2 … 1). See
    ``pool_warps`` for how the launcher derives it.

    ``IN_STEP`` (no overlap): every slot is a token of the step (``load_step_slots``), and the softmax weights
    divide by each channel's reciprocal (``divide_by_reciprocal``) when the whole slice is in that division's exact
    range — every gate within ``EXP_FAST_GAP`` of its channel's max, one test per entry —, else as below.
    """
    S: tl.constexpr = 2 * M if OVERLAP else M
    CH: tl.constexpr = 4 if NW == 0 else 4 * NW
    N: tl.constexpr = S // CH
    # softmax max (order-free: elementwise over the tiles, one reduction over the rows after the loop — the rows
    # span the program's warps); IN_STEP: the min too, for the division's range test
    mx_rows = tl.full([CH, CS], FLT_LOWEST, tl.float32)
    mn_rows = tl.full([CH, CS], float("inf"), tl.float32)
    for k in range(0, N):
        z, _ = slot_tile(k * CH, CH, False, a_ptr, z_ptr, AZ_STRIDE, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr,
                         prev_gate_ptr, i, start, cu, slot, C, M, OVERLAP, c0, CS, IN_STEP)
        if IN_STEP:
            mn_rows = tl.minimum(mn_rows, z)
        mx_rows = tl.maximum(mx_rows, z)
    mx = tl.max(mx_rows, axis=0)
    mn = tl.min(mn_rows, axis=0)
    # softmax denominator: a sequential sum over the slots, slot 0 first (a tile of CH slots per iteration,
    # added row by row in order)
    den = tl.zeros([CS], dtype=tl.float32)
    for k in range(0, N):
        z, _ = slot_tile(k * CH, CH, False, a_ptr, z_ptr, AZ_STRIDE, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr,
                         prev_gate_ptr, i, start, cu, slot, C, M, OVERLAP, c0, CS, IN_STEP)
        den = seq_accumulate_rows(den, expf(z - mx[None, :]), CH)
    fast = False
    rcp = den
    if IN_STEP:  # den ∈ [1, S] unless a gate is NaN / infinite (then the test fails)
        in_range = (den >= 1.0) & (den <= DIV_FAST_DEN_MAX) & (mn - mx >= EXP_FAST_GAP)
        fast = tl.min(in_range.to(tl.int32), axis=0) == 1
        rcp = reciprocal_rn(den)
    # weighted sum: accumulator row j collects slots j, j + CH, j + 2·CH, … in order
    acc = tl.zeros([CH, CS], dtype=tl.float32)
    for k in range(0, N):
        z, a = slot_tile(k * CH, CH, True, a_ptr, z_ptr, AZ_STRIDE, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr,
                         prev_gate_ptr, i, start, cu, slot, C, M, OVERLAP, c0, CS, IN_STEP)
        e = expf(z - mx[None, :])
        if fast:
            w = divide_by_reciprocal(e, den[None, :], rcp[None, :])
        else:
            w = softmax_weight(e, den[None, :])
        acc = acc + w * a
    if NW == 0:
        # one thread per channel, 4 accumulators: ((acc0 + acc1) + acc2) + acc3
        pooled = tl.reshape(seq_sum4_last(tl.trans(acc)), (CS,))
    else:
        # warp y: ((acc[y] + acc[NW + y]) + acc[2NW + y]) + acc[3NW + y]; then halve over y
        part = seq_sum4_last(tl.permute(tl.reshape(acc, (4, NW, CS)), (1, 2, 0)))  # [NW, CS]
        if NW >= 16:
            part = halve_rows(part, 16, CS)
        if NW >= 8:
            part = halve_rows(part, 8, CS)
        if NW >= 4:
            part = halve_rows(part, 4, CS)
        if NW >= 2:
            part = halve_rows(part, 2, CS)
        pooled = tl.reshape(part, (CS,))
    return pooled


@triton.jit
def pool_in_step(a_ptr, z_ptr, AZ_STRIDE: tl.constexpr, ape_ptr, i, start, cu, C: tl.constexpr, M: tl.constexpr, c0,
                 CS: tl.constexpr):
    """``pool_entry`` of a CSA entry (m = 4, one thread per channel: ``NW`` = 0) whose 2m slots are all tokens of
    this step — every entry past a request's first two — for channels ``c0 … c0+CS−1`` of its ``C``: fp32 ``[CS]``.
    Same operations in the same order, but each slot row is read once (``pool_entry`` reads the gates three times
    through the general slot sources, whose masked tail and state loads and their 64-bit address arithmetic were
    half of a prefill chunk's instructions)."""
    S: tl.constexpr = 2 * M
    W: tl.constexpr = 2 * C
    d = tl.arange(0, S)
    col0 = tl.where(d < M, 0, C) + c0  # slot d < m: previous window, first half of the columns
    row = (cu + (i - 1) * M + d - start).to(tl.int64)  # slot d is token (i − 1)·m + d
    cols = tl.arange(0, CS)[None, :]
    off = row[:, None] * AZ_STRIDE + col0[:, None] + cols
    z = tl.load(z_ptr + off) + tl.load(ape_ptr + ((d % M) * W + col0)[:, None] + cols)
    a = tl.load(a_ptr + off)
    mx = tl.maximum(tl.max(z, axis=0), FLT_LOWEST)
    e = expf(z - mx[None, :])
    den = seq_accumulate_rows(tl.zeros([CS], dtype=tl.float32), e, S)
    w = divide_rn(e, den[None, :])  # den ∈ [1, 8]: the reciprocal once per channel
    lo, hi = tl.split(tl.permute(tl.reshape(w * a, (2, M, CS)), (1, 2, 0)))
    acc = (tl.zeros([M, CS], dtype=tl.float32) + lo) + hi  # accumulator j: slot j, then slot j + 4
    return tl.reshape(seq_sum4_last(tl.trans(acc)), (CS,))
