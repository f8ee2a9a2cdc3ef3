"""Where a compressor's pooling slot comes from: this step's projections, the request's tail, or the CSA
previous-window state (SPEC §4.2, §4.4).

Entry ``i`` of ratio ``m`` pools ``S`` slots: HCA the ``m`` tokens of window ``i``; CSA ``2m`` — slots ``d < m`` the
previous window's tokens ``(i−1)·m + d`` with the first-half columns, the others window ``i``'s tokens with the second
half. A token at ``p ≥ start`` (the request's first position of the step) is a row of the step's projections ``a`` /
``z_raw`` (gate biased by ``ape[p mod m]`` here); an earlier one is in the tail; a CSA entry's previous window closed
before the step (``i = start // m``) comes from the previous-window state.

``a`` and ``z_raw`` share one row stride ``AZ_STRIDE`` (elements, ≥ width; unit column stride): they may be column
blocks of one GEMM output (``ops.projections.stacked_compressor_projections``). Tails, previous-window state and the
position bias are contiguous.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["load_slots", "load_step_slots", "slot_tile"]


@triton.jit
def load_slots(
    k0, NR: tl.constexpr, LOAD_A: tl.constexpr,
    a_ptr, z_ptr, AZ_STRIDE: tl.constexpr, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr,
    i, start, cu, slot,
    C: tl.constexpr, M: tl.constexpr, OVERLAP: tl.constexpr, c0, CS: tl.constexpr,
):
    """Gate logits (biased) and features of pooling slots ``k0 … k0+NR−1`` of entry ``i``, channels ``c0 … c0+CS−1``:
    ``(z, a)`` fp32 ``[NR, CS]``.

    Slot d < m of a CSA entry is token ``(i−1)·m + d`` with first-half columns ``[:C]``; the others are token
    ``i·m + r`` (``r`` = offset in the window) with the second half ``[C:]`` (CSA) or all columns (HCA). A token
    comes from the step (``a`` / ``z_raw + ape``, row ``cu + p − start``) if ``p ≥ start``, else from the tail;
    a CSA entry's previous window comes from the previous-window state when ``i = start // m`` (it closed before
    this step; reset to 0 / −inf for window 0).
    """
    W: tl.constexpr = 2 * C if OVERLAP else C
    d = k0 + tl.arange(0, NR)
    cols = c0 + tl.arange(0, CS)[None, :]
    if OVERLAP:
        is_prev = d < M
        r = tl.where(is_prev, d, d - M)
        p = tl.where(is_prev, (i - 1) * M + r, i * M + r)
        col0 = tl.where(is_prev, 0, C)[:, None]
        use_state = is_prev & (i == start // M)
    else:
        r = d
        p = i * M + r
        col0 = tl.zeros([NR, 1], dtype=tl.int32)
        use_state = d < 0
    in_step = (p >= start) & (~use_state)
    in_tail = (p < start) & (~use_state)
    row = (cu + p - start).to(tl.int64)
    srow = (slot * M + r).to(tl.int64)
    step_off = row[:, None] * AZ_STRIDE + col0 + cols
    tail_off = srow[:, None] * W + col0 + cols
    ms = in_step[:, None]
    mt = in_tail[:, None]
    z = tl.load(z_ptr + step_off, mask=ms, other=0.0) + tl.load(ape_ptr + r[:, None] * W + col0 + cols, mask=ms, other=0.0)
    z = tl.where(mt, tl.load(tail_gate_ptr + tail_off, mask=mt, other=0.0), z)
    a = z
    if LOAD_A:
        a = tl.load(a_ptr + step_off, mask=ms, other=0.0)
        a = tl.where(mt, tl.load(tail_kv_ptr + tail_off, mask=mt, other=0.0), a)
    if OVERLAP:
        mp = use_state[:, None]
        prev_off = srow[:, None] * C + cols
        z = tl.where(mp, tl.load(prev_gate_ptr + prev_off, mask=mp, other=0.0), z)
        if LOAD_A:
            a = tl.where(mp, tl.load(prev_kv_ptr + prev_off, mask=mp, other=0.0), a)
    return z, a


@triton.jit
def load_step_slots(
    k0, NR: tl.constexpr, LOAD_A: tl.constexpr, a_ptr, z_ptr, AZ_STRIDE: tl.constexpr, ape_ptr, i, start, cu,
    C: tl.constexpr, M: tl.constexpr, c0, CS: tl.constexpr,
):
    """``load_slots`` of an entry without overlap whose slots are all tokens of the step (``i·m ≥ start``: every
    HCA entry but a request's first in a step): slot d is step row ``cu + i·m − start + d``; no tail sources, no
    masks."""
    d = k0 + tl.arange(0, NR)
    cols = c0 + tl.arange(0, CS)[None, :]
    off = (cu + i * M - start + d).to(tl.int64)[:, None] * AZ_STRIDE + cols
    z = tl.load(z_ptr + off) + tl.load(ape_ptr + d[:, None] * C + cols)
    a = z
    if LOAD_A:
        a = tl.load(a_ptr + off)
    return z, a


@triton.jit
def slot_tile(
    k0, NR: tl.constexpr, LOAD_A: tl.constexpr,
    a_ptr, z_ptr, AZ_STRIDE: tl.constexpr, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr,
    i, start, cu, slot,
    C: tl.constexpr, M: tl.constexpr, OVERLAP: tl.constexpr, c0, CS: tl.constexpr, IN_STEP: tl.constexpr,
):
    """``load_step_slots`` when ``IN_STEP`` (no overlap), else ``load_slots``: ``(z, a)`` fp32 ``[NR, CS]``."""
    if IN_STEP:
        z, a = load_step_slots(k0, NR, LOAD_A, a_ptr, z_ptr, AZ_STRIDE, ape_ptr, i, start, cu, C, M, c0, CS)
    else:
        z, a = load_slots(k0, NR, LOAD_A, a_ptr, z_ptr, AZ_STRIDE, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr,
                          prev_gate_ptr, i, start, cu, slot, C, M, OVERLAP, c0, CS)
    return z, a
