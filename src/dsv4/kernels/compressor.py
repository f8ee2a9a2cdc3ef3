"""The compressors' writes (SPEC §4): accumulate the step's projected tokens into the tails, pool every window that
closes, post-process and quantize the entries, scatter them into the paged pool — fused, for a whole layer, with
the step's window entries into **one launch** (``write_before_attention``).

Inputs per compressor are the FP32 projections ``a = x W_kv^T`` and ``z_raw = x W_gate^T`` (``[T, width]``,
torch GEMMs exactly as ``reference.compressor.project``; the position bias ``ape[p mod m]`` is added here, in
the same FP32 add). Everything after the GEMMs is bit-exact with ``torch_ops.compress`` on CUDA, including the
reduction orders torch's kernels use (reproduced on purpose; see ``pool_entry`` and ``torch_sum_sq``):

* softmax over the ``S`` slots per channel (``S = 2m`` for CSA with the previous window's first half, ``m``
  for HCA): max, then a sequential sum of ``exp(z − max)`` over the slots, then ``exp(z − max) / sum``
  (torch's spatial softmax, one thread per channel);
* the weighted sum over slots in the order of torch's reduce kernel (4 accumulators, split over 4 warps when
  ``S ≥ 64``);
* BF16 cast, weighted RMSNorm whose sum of squares follows torch's block reduction, which depends on how many
  entries the step emits (``E``, read on the device: ``num_emit_device``);
* RoPE at ``i·m``; main entries: FP8 block-64 quantize→dequantize, then the 584-B encoding of the result;
  indexer keys: Hadamard, MXFP4 quantize→dequantize, then the 68-B encoding of the result.

Grid of the fused launch (program ids in this order):

====================  ============================================================================================
``B`` main leads      request b: its first emitted entry (and, CSA, the second: the only entries that read the
                      tails / previous-window state), then — after a barrier — rotate the previous-window state
                      (CSA) and write the tokens of the still-open window into the tail
``Ecap`` main         one program per other emitted entry (``emit_pad_*``, padding rows exit at once); every
                      slot of such an entry is a token of the step, so CSA ones pool through ``pool_in_step``
``⌈T/BT⌉`` window     the step's window entries (``swa_write.window_entries_block``)
``B`` index leads     the same as the main leads for the CSA indexer's compressor (CSA layers only)
``Ecap`` index        likewise for the indexer's other entries
====================  ============================================================================================

Reads of a tail happen before its writes because both are done by the same program (lead) with a barrier
between; no other program touches that request's tail or state. The entry programs are launched only when a
request can emit more than the leads take (host-known from ``max_new``), so a decode step's grid has just the
leads and the window blocks — and its binary no entry-program code (the ``ENTRY_PROGRAMS`` constexpr: fewer registers,
a smaller kernel). Nothing here branches on the host on whether anything flushed.

Long CSA steps (a request can emit more than two entries: prefill chunks) take two launches instead: first
``csa_entries`` (every entry and the window entries, one warp per program, reading the old tails / state), then
this kernel with the lead programs' state updates only (``STATE_ONLY``) — see
``separate_csa_entries``.

Pool page layouts (``n = block_size / m`` entries per block): KV ``[n × 576 data | n × 8 scales | pad]``;
indexer ``[n × 64 packed E2M1 | n × 4 UE8M0]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from .quant import (
    DIV_FAST_DEN_MAX,
    bf16_round,
    divide_by_reciprocal,
    divide_rn,
    expf,
    fp8_block_qdq,
    hadamard128,
    mxfp4_block_qdq,
    pack_nibbles,
    reciprocal_rn,
    rsqrtf,
    seq_accumulate_rows,
    seq_sum4_last,
    shuffle_down_sum,
    split_halves,
)
from .swa_write import rope_pairs, window_entries_block

__all__ = ["CompressorArgs", "scratch_rows", "write_before_attention"]

FLT_LOWEST: tl.constexpr = tl.constexpr(-3.4028234663852886e38)

#: Bytes of a main entry's row in its page: 448 E4M3 codes + 64 BF16 rope values (its 8 scale bytes follow the
#: page's rows).
DATA_BYTES: tl.constexpr = tl.constexpr(576)

#: Threads per block of torch's CUDA reduce kernel (``ReduceConfig``'s ``MAX_NUM_THREADS``); the kernels here
#: reproduce the reduction orders it implies (see ``pool_warps`` and ``rms_norm_bf16``).
TORCH_REDUCE_MAX_THREADS = 512


def pool_warps(slots: int, max_threads: int = TORCH_REDUCE_MAX_THREADS) -> int:
    """Warps torch's reduce kernel splits a per-channel sum over ``slots`` (strided, non-innermost, 4 outputs per
    thread) across, or 0 when one thread sums them: block height ``min(pow2floor(slots), max_threads/128)``,
    split when ``slots ≥ min(16·height, 256)``."""
    height = min(1 << (slots.bit_length() - 1), max_threads // 128)
    return height if slots >= min(16 * height, 256) else 0


# =========================================================================================== slot loads
@triton.jit
def load_slots(
    k0, NR: tl.constexpr, LOAD_A: tl.constexpr,
    a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr,
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
    step_off = row[:, None] * W + col0 + cols
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
    k0, NR: tl.constexpr, LOAD_A: tl.constexpr, a_ptr, z_ptr, ape_ptr, i, start, cu,
    C: tl.constexpr, M: tl.constexpr, c0, CS: tl.constexpr,
):
    """``load_slots`` of an entry without overlap whose slots are all tokens of the step (``i·m ≥ start``: every
    HCA entry but a request's first in a step): slot d is step row ``cu + i·m − start + d``; no tail sources, no
    masks."""
    d = k0 + tl.arange(0, NR)
    cols = c0 + tl.arange(0, CS)[None, :]
    off = (cu + i * M - start + d).to(tl.int64)[:, None] * C + cols
    z = tl.load(z_ptr + off) + tl.load(ape_ptr + d[:, None] * C + cols)
    a = z
    if LOAD_A:
        a = tl.load(a_ptr + off)
    return z, a


@triton.jit
def slot_tile(
    k0, NR: tl.constexpr, LOAD_A: tl.constexpr,
    a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr,
    i, start, cu, slot,
    C: tl.constexpr, M: tl.constexpr, OVERLAP: tl.constexpr, c0, CS: tl.constexpr, IN_STEP: tl.constexpr,
):
    """``load_step_slots`` when ``IN_STEP`` (no overlap), else ``load_slots``: ``(z, a)`` fp32 ``[NR, CS]``."""
    if IN_STEP:
        z, a = load_step_slots(k0, NR, LOAD_A, a_ptr, z_ptr, ape_ptr, i, start, cu, C, M, c0, CS)
    else:
        z, a = load_slots(k0, NR, LOAD_A, a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr,
                          prev_gate_ptr, i, start, cu, slot, C, M, OVERLAP, c0, CS)
    return z, a


# =========================================================================================== pooling
#: A softmax over slots whose gates all lie within this of the channel's max has every ``exp(z − max)`` ≥ e⁻⁴⁰
#: > 2⁻⁶⁴: in the range where ``divide_by_reciprocal`` equals the IEEE division.
EXP_FAST_GAP: tl.constexpr = tl.constexpr(-40.0)

@triton.jit
def softmax_weight(e, den, ZERO_FAST: tl.constexpr):
    """``e / den`` rounded as IEEE division (``tl.math.div_rn``): a slot's softmax weight, ``e = exp(z − max)``.

    With ``ZERO_FAST`` a zero ``e`` (a gate far below the channel's max: most of an HCA window's 128 slots) gives
    +0 without dividing — what the division returns for a positive ``den`` — because a zero dividend fails the
    division's fast-path check and sends the warp through its slow-path subroutine (ncu, HCA decode B=256: that
    subroutine was 23% of the kernel's instructions). ``den`` ≤ 0 or NaN still divides."""
    if ZERO_FAST:
        skip = (e == 0.0) & (den > 0.0)
        return tl.where(skip, 0.0, tl.math.div_rn(tl.where(skip, 1.0, e), den))
    else:
        return tl.math.div_rn(e, den)


@triton.jit
def halve_rows(part, N: tl.constexpr, C: tl.constexpr):
    """``part[y] + part[y + N/2]`` for ``y < N/2`` (one shared-memory halving step of a block reduction)."""
    lo, hi = tl.split(tl.permute(tl.reshape(part, (2, N // 2, C)), (1, 2, 0)))
    return lo + hi


@triton.jit
def pool_entry(
    a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr,
    i, start, cu, slot,
    C: tl.constexpr, M: tl.constexpr, OVERLAP: tl.constexpr, NW: tl.constexpr, c0, CS: tl.constexpr,
    IN_STEP: tl.constexpr = False,
):
    """``Σ_slot softmax_slot(z)·a`` of entry ``i`` as torch computes ``(gate.softmax(1) * kv).sum(1)``, channels
    ``c0 … c0+CS−1`` of its ``C``: fp32 ``[CS]`` (every channel is pooled on its own: a slice is exact).

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
        z, _ = slot_tile(k * CH, CH, False, a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr,
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
        z, _ = slot_tile(k * CH, CH, False, a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr,
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
        z, a = slot_tile(k * CH, CH, True, a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr,
                         prev_gate_ptr, i, start, cu, slot, C, M, OVERLAP, c0, CS, IN_STEP)
        e = expf(z - mx[None, :])
        if fast:
            w = divide_by_reciprocal(e, den[None, :], rcp[None, :])
        else:
            w = softmax_weight(e, den[None, :], ZERO_FAST_DIVISION)
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
def pool_in_step(a_ptr, z_ptr, ape_ptr, i, start, cu, C: tl.constexpr, M: tl.constexpr, c0, CS: tl.constexpr):
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
    off = row[:, None] * W + col0[:, None] + cols
    z = tl.load(z_ptr + off) + tl.load(ape_ptr + ((d % M) * W + col0)[:, None] + cols)
    a = tl.load(a_ptr + off)
    mx = tl.maximum(tl.max(z, axis=0), FLT_LOWEST)
    e = expf(z - mx[None, :])
    den = seq_accumulate_rows(tl.zeros([CS], dtype=tl.float32), e, S)
    w = divide_rn(e, den[None, :])  # den ∈ [1, 8]: the reciprocal once per channel
    lo, hi = tl.split(tl.permute(tl.reshape(w * a, (2, M, CS)), (1, 2, 0)))
    acc = (tl.zeros([M, CS], dtype=tl.float32) + lo) + hi  # accumulator j: slot j, then slot j + 4
    return tl.reshape(seq_sum4_last(tl.trans(acc)), (CS,))


# =========================================================================================== RMSNorm
@triton.jit
def thread_partials(x_ptr, l0, C: tl.constexpr, BW: tl.constexpr):
    """Per-thread partial sums of squares of threads ``l0 … l0+31`` of torch's block reduction of
    ``x.pow(2).mean(-1)`` over a row of ``C`` fp32 (``x_ptr``) with ``BW`` threads per row: ``[32]``.

    Thread l reads the float4 vectors ``l, l+BW, …`` into 4 accumulators (one per vector lane, in vector order),
    then adds them ``((a0 + a1) + a2) + a3``. The values are read back from memory in this arrangement (cheap,
    L1-resident) instead of being reshaped in registers: the reshape/permute/split chains cost ~50 µs per entry
    on an H200.
    """
    K: tl.constexpr = C // (4 * BW)  # float4 vectors per thread
    lane = l0 + tl.arange(0, 32)
    acc = tl.zeros([32, 4], tl.float32)
    for k in tl.static_range(K):
        v = tl.load(x_ptr + 4 * (lane[:, None] + k * BW) + tl.arange(0, 4)[None, :])
        acc = acc + v * v
    return seq_sum4_last(acc)


@triton.jit
def torch_sum_sq(x_ptr, C: tl.constexpr, BW: tl.constexpr):
    """``Σ x²`` over the ``[C]`` fp32 at ``x_ptr`` in the order of torch's block reduction with ``BW`` threads per
    row: per-thread partials (``thread_partials``), shared-memory halving down to 32 lanes (offsets BW/2 … 32),
    then the warp's shuffle-down tree (offsets 16 … 1). Returns ``[1]``."""
    if BW == 32:
        p = thread_partials(x_ptr, 0, C, 32)
    elif BW == 64:
        p = thread_partials(x_ptr, 0, C, 64) + thread_partials(x_ptr, 32, C, 64)
    else:
        p = ((thread_partials(x_ptr, 0, C, 128) + thread_partials(x_ptr, 64, C, 128))
             + (thread_partials(x_ptr, 32, C, 128) + thread_partials(x_ptr, 96, C, 128)))
    return shuffle_down_sum(p, 32, 5)


@triton.jit
def rms_norm_bf16(x, w, eps, num_emit, scratch_ptr, C: tl.constexpr, MAXT: tl.constexpr):
    """``reference.rms_norm(x.bf16(), w, eps)`` of one entry: x fp32 ``[C]`` → BF16-valued fp32 ``[C]``.

    torch's reduction reads float4 vectors, ``C/4`` per row, with ``min(C/4, MAXT/h)`` threads per row where
    ``h = min(pow2floor(num_emit), MAXT/32)`` rows share a block: for C = 512 (MAXT = 512) 128 threads below 8
    rows, 64 below 16, else 32 (chosen on the device); for C = 128 always 32. ``scratch_ptr``: this program's fp32 ``[C]`` scratch row (the BF16-rounded entry is stored
    there and read back in the reduction's arrangement).
    """
    xb = bf16_round(x)
    tl.store(scratch_ptr + tl.arange(0, C), xb)
    tl.debug_barrier()  # the row is read back by other threads of the program
    if C == 512:  # a branch on the device (uniform over the program), not on the host
        if num_emit >= MAXT // 32:
            s = torch_sum_sq(scratch_ptr, C, 32)
        elif num_emit >= MAXT // 64:
            s = torch_sum_sq(scratch_ptr, C, 64)
        else:
            s = torch_sum_sq(scratch_ptr, C, 128)
    else:
        s = torch_sum_sq(scratch_ptr, C, 32)
    tl.debug_barrier()  # all reads done before the program's next entry overwrites the row
    r = rsqrtf(s * (1.0 / C) + eps)
    return bf16_round(w * (xb * r))


@triton.jit
def rope_last64(x, pos_f, inv_freq_ptr, C: tl.constexpr):
    """RoPE of the last 64 of ``x`` fp32 ``[C]`` at ``pos_f``: returns ``(first C−64, rotated 64)`` — the rotated
    part BF16-valued fp32 (rounded once), the rest untouched."""
    if C == 512:
        h0, t0 = split_halves(x, 512)
        h1, t1 = split_halves(t0, 256)
        h2, tail = split_halves(t1, 128)
        head = h0  # (only C = 128 callers use the head)
    else:
        head, tail = split_halves(x, 128)
    re, im = tl.split(tl.reshape(tail, (32, 2)))
    re2, im2 = rope_pairs(re, im, pos_f, tl.load(inv_freq_ptr + tl.arange(0, 32)))
    rot = tl.reshape(tl.join(bf16_round(re2), bf16_round(im2)), (64,))
    return head, rot


# =========================================================================================== one entry
@triton.jit
def compress_entry(
    a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr, norm_ptr, inv_freq_ptr,
    pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, eps, num_emit, scratch_ptr,
    b, i, start, cu, slot,
    C: tl.constexpr, M: tl.constexpr, OVERLAP: tl.constexpr, KIND: tl.constexpr, NW: tl.constexpr,
    MAXT: tl.constexpr, IN_STEP: tl.constexpr = False,
):
    """Pool, normalize, RoPE, quantize entry ``i`` of request ``b`` and write it into its pool page.

    ``KIND`` 0: main entry (C = 512) → 584-B ``fp8_ds_mla``; 1: indexer key (C = 128) → 68-B MXFP4 after the
    Hadamard rotation. ``IN_STEP``: every slot is a token of this step and the entry is a CSA one with m = 4
    (``pool_in_step``).
    """
    if IN_STEP:
        pooled = pool_in_step(a_ptr, z_ptr, ape_ptr, i, start, cu, C, M, 0, C)
    else:
        pooled = pool_entry(a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr,
                            i, start, cu, slot, C, M, OVERLAP, NW, 0, C)
    finish_entry(pooled, norm_ptr, inv_freq_ptr, pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, eps,
                 num_emit, scratch_ptr, b, i, C, M, KIND, MAXT)


@triton.jit
def page_row(pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, b, i, M: tl.constexpr):
    """Entry ``i`` of request ``b`` (ratio ``M``): ``(its page's base pointer, its row j in the page, entries per
    page)``."""
    first = i * M
    blk = tl.load(block_tables_ptr + b.to(tl.int64) * bt_stride + first // block_size).to(tl.int64)
    return pages_ptr + blk * page_bytes, (first % block_size) // M, block_size // M


@triton.jit
def store_fp8_blocks(y, data, scales, NBLK: tl.constexpr):
    """Encode the 64-channel blocks of ``y`` fp32 ``[64·n]`` (BF16 values) as the torch backend does — FP8
    quantize→dequantize, then the codes and scale bytes of the result — and store the first ``NBLK``: codes at
    ``data`` (uint8 pointer), scale bytes at ``scales`` (a block past ``NBLK`` stores a zero scale byte). Rounds by
    the bit arithmetic (``fp8_block_qdq``'s ``BITS``: here the hardware conversion costs registers)."""
    NB: tl.constexpr = y.shape[0] // 64
    blk = tl.arange(0, NB)
    _, v1, _ = fp8_block_qdq(tl.reshape(y, (NB, 64)), 1, BITS=True)
    code, _, ebyte = fp8_block_qdq(v1, 1, BITS=True)
    tl.store(data + blk[:, None] * 64 + tl.arange(0, 64)[None, :], code.to(tl.uint8), mask=(blk < NBLK)[:, None])
    tl.store(scales + blk, tl.where(blk < NBLK, ebyte, 0).to(tl.uint8))


@triton.jit
def store_mxfp4_key(key, packed, scales):
    """An indexer key ``key`` fp32 ``[128]`` (BF16 values, rope dims rotated) as the torch backend encodes it —
    Hadamard, MXFP4 quantize→dequantize, then the codes and scale bytes of the result: 64 packed bytes at
    ``packed``, 4 UE8M0 bytes at ``scales`` (uint8 pointers)."""
    h = tl.reshape(hadamard128(key), (4, 32))
    _, v1, _ = mxfp4_block_qdq(h, 1)
    code, _, ebyte = mxfp4_block_qdq(v1, 1)
    tl.store(packed + tl.arange(0, 64), pack_nibbles(tl.reshape(code, (128,)), 128).to(tl.uint8))
    tl.store(scales + tl.arange(0, 4), ebyte.to(tl.uint8))


@triton.jit
def finish_entry(
    pooled, norm_ptr, inv_freq_ptr, pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, eps, num_emit,
    scratch_ptr, b, i, C: tl.constexpr, M: tl.constexpr, KIND: tl.constexpr, MAXT: tl.constexpr,
):
    """Entry ``i`` of request ``b`` from its pooled channels (fp32 ``[C]``): RMSNorm, RoPE, quantize, write."""
    y = rms_norm_bf16(pooled, tl.load(norm_ptr + tl.arange(0, C)), eps, num_emit, scratch_ptr, C, MAXT)
    head, rot = rope_last64(y, (i * M).to(tl.float32), inv_freq_ptr, C)
    page, j, n_per_page = page_row(pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, b, i, M)
    if KIND == 0:
        # block 7 (the pre-RoPE rope dims) is not stored; the stored bytes encode the rounded values (as torch)
        store_fp8_blocks(y, page + j * DATA_BYTES, page + n_per_page * DATA_BYTES + j * 8, 7)
        rdst = (page + j * DATA_BYTES + 448 + tl.arange(0, 64) * 2).to(tl.pointer_type(tl.bfloat16))
        tl.store(rdst, rot.to(tl.bfloat16))
    else:
        key = tl.reshape(tl.trans(tl.join(head, rot)), (128,))  # [first 64 | rotated 64]
        store_mxfp4_key(key, page + j * 64, page + n_per_page * 64 + j * 4)


# =========================================================================================== per-role programs
@triton.jit
def lead_program(
    b,
    a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr, norm_ptr, inv_freq_ptr,
    pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, eps, num_emit_ptr, scratch_ptr,
    start_ptr, end_ptr, cu_ptr, slots_ptr,
    C: tl.constexpr, M: tl.constexpr, OVERLAP: tl.constexpr, KIND: tl.constexpr, NW: tl.constexpr,
    MAXT: tl.constexpr, ENTRIES: tl.constexpr = True,
):
    """Request ``b``: its first emitted entries (those that read the tail / state; not with ``ENTRIES`` False:
    ``csa_entries`` wrote them before this launch), then the state updates."""
    W: tl.constexpr = 2 * C if OVERLAP else C
    L: tl.constexpr = 2 if OVERLAP else 1
    start = tl.load(start_ptr + b)
    end = tl.load(end_ptr + b)
    cu = tl.load(cu_ptr + b).to(tl.int64)
    slot = tl.load(slots_ptr + b)
    num_emit = tl.load(num_emit_ptr)
    i0 = start // M
    i_end = end // M
    for k in range(0, L if ENTRIES else 0):
        i = i0 + k
        if i < i_end:
            compress_entry(a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr, norm_ptr,
                           inv_freq_ptr, pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, eps,
                           num_emit, scratch_ptr, b, i, start, cu, slot, C, M, OVERLAP, KIND, NW, MAXT)
    cols = tl.arange(0, C)[None, :]
    r = tl.arange(0, M)
    if OVERLAP:
        # The last closed window's first half becomes the next entry's previous window: the "previous" slots of
        # entry i_end (read here, before any write below).
        pz, pa = load_slots(0, M, True, a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr,
                            prev_gate_ptr, i_end, start, cu, slot, C, M, OVERLAP, 0, C)
    tl.debug_barrier()
    if OVERLAP:
        emitted = i_end > i0
        prev_off = (slot * M + r).to(tl.int64)[:, None] * C + cols
        pm = emitted & (r[:, None] >= 0)
        tl.store(prev_kv_ptr + prev_off, pa, mask=pm)
        tl.store(prev_gate_ptr + prev_off, pz, mask=pm)
    write_open_window(a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, start, end, cu, slot, W, M)


@triton.jit
def write_open_window(a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, start, end, cu, slot, W: tl.constexpr,
                      M: tl.constexpr):
    """The tail of a request: its step tokens of the final, still open window (positions ≥ ⌊end/m⌋·m), all
    ``W`` columns, gate biased, at rows ``p mod m``."""
    first_open = tl.maximum(start, (end // M) * M)
    wcols = tl.arange(0, W)[None, :]
    RB: tl.constexpr = 4
    for k in range(0, (M - 1 + RB - 1) // RB):  # at most m − 1 open-window tokens
        p0 = first_open + k * RB
        if p0 < end:
            p = p0 + tl.arange(0, RB)
            pm = (p < end)[:, None]
            rr = p % M
            src = (cu + p - start).to(tl.int64)[:, None] * W + wcols
            dst = (slot * M + rr).to(tl.int64)[:, None] * W + wcols
            a = tl.load(a_ptr + src, mask=pm, other=0.0)
            z = tl.load(z_ptr + src, mask=pm, other=0.0) + tl.load(ape_ptr + rr[:, None] * W + wcols, mask=pm,
                                                                    other=0.0)
            tl.store(tail_kv_ptr + dst, a, mask=pm)
            tl.store(tail_gate_ptr + dst, z, mask=pm)


@triton.jit
def entry_program(
    e,
    a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr, norm_ptr, inv_freq_ptr,
    pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, eps, num_emit_ptr, scratch_ptr,
    start_ptr, cu_ptr, slots_ptr, emit_req_ptr, emit_entry_ptr,
    C: tl.constexpr, M: tl.constexpr, OVERLAP: tl.constexpr, KIND: tl.constexpr, NW: tl.constexpr,
    MAXT: tl.constexpr,
):
    """Emitted entry ``e`` of the padded list, unless it is padding or one its request's lead program takes."""
    L: tl.constexpr = 2 if OVERLAP else 1
    b = tl.load(emit_req_ptr + e)
    if b >= 0:
        i = tl.load(emit_entry_ptr + e)
        start = tl.load(start_ptr + b)
        if i >= start // M + L:  # past the lead's entries: every slot is a token of this step
            cu = tl.load(cu_ptr + b).to(tl.int64)
            slot = tl.load(slots_ptr + b)
            compress_entry(a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr, norm_ptr,
                           inv_freq_ptr, pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, eps,
                           tl.load(num_emit_ptr), scratch_ptr, b, i, start, cu, slot, C, M, OVERLAP, KIND, NW, MAXT,
                           OVERLAP and M == 4 and NW == 0)


# =========================================================================================== split entries
@triton.jit
def last_arrival(count_ptr, parts):
    """Arrive at the int32 counter ``count_ptr`` after this program's writes; True for the ``parts``-th (last)
    arrival, which also resets the counter to zero for the next launch. Nobody waits: the last arriver reads what
    the others wrote (release / acquire through the counter)."""
    tl.debug_barrier()
    last = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == parts - 1
    if last:
        tl.store(count_ptr, 0)
    tl.debug_barrier()
    return last


@triton.jit
def pool_slice(
    part, a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, scratch_ptr, i, start, cu, slot,
    C: tl.constexpr, M: tl.constexpr, NW: tl.constexpr, PARTS: tl.constexpr, IN_STEP: tl.constexpr = False,
):
    """Pool channel slice ``part`` of ``PARTS`` of HCA entry ``i`` into its place in the entry's scratch row
    (``IN_STEP``: every slot is a token of the step, see ``pool_entry``)."""
    CS: tl.constexpr = C // PARTS
    c0 = part * CS
    pooled = pool_entry(a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, tail_kv_ptr, tail_gate_ptr,
                        i, start, cu, slot, C, M, False, NW, c0, CS, IN_STEP)
    tl.store(scratch_ptr + c0 + tl.arange(0, CS), pooled)


@triton.jit
def finish_from_scratch(
    scratch_ptr, norm_ptr, inv_freq_ptr, pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, eps,
    num_emit, b, i, C: tl.constexpr, M: tl.constexpr, MAXT: tl.constexpr,
):
    """The last part's work: ``finish_entry`` of the pooled row the parts wrote (read past L1)."""
    full = tl.load(scratch_ptr + tl.arange(0, C), cache_modifier=".cg")
    tl.debug_barrier()  # every thread has read the row before the RMSNorm reuses it
    finish_entry(full, norm_ptr, inv_freq_ptr, pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, eps,
                 num_emit, scratch_ptr, b, i, C, M, 0, MAXT)


@triton.jit
def lead_part_program(
    b, part,
    a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, norm_ptr, inv_freq_ptr,
    pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, eps, num_emit_ptr, scratch_ptr, count_ptr,
    start_ptr, end_ptr, cu_ptr, slots_ptr,
    C: tl.constexpr, M: tl.constexpr, NW: tl.constexpr, PARTS: tl.constexpr, MAXT: tl.constexpr,
):
    """``lead_program`` of an HCA request split over ``PARTS`` programs: each pools a channel slice of the first
    emitted entry; the last to arrive finishes it, then writes the tail (after every part has read it)."""
    start = tl.load(start_ptr + b)
    end = tl.load(end_ptr + b)
    cu = tl.load(cu_ptr + b).to(tl.int64)
    slot = tl.load(slots_ptr + b)
    i0 = start // M
    emits = i0 < end // M
    if emits:
        pool_slice(part, a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, scratch_ptr, i0, start, cu, slot, C, M,
                   NW, PARTS)
    if last_arrival(count_ptr, PARTS):
        if emits:
            finish_from_scratch(scratch_ptr, norm_ptr, inv_freq_ptr, pages_ptr, page_bytes, block_tables_ptr,
                                bt_stride, block_size, eps, tl.load(num_emit_ptr), b, i0, C, M, MAXT)
        write_open_window(a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, start, end, cu, slot, C, M)


@triton.jit
def entry_part_program(
    e, part,
    a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, norm_ptr, inv_freq_ptr,
    pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, eps, num_emit_ptr, scratch_ptr, count_ptr,
    start_ptr, cu_ptr, slots_ptr, emit_req_ptr, emit_entry_ptr,
    C: tl.constexpr, M: tl.constexpr, NW: tl.constexpr, PARTS: tl.constexpr, MAXT: tl.constexpr,
    STEP_POOL: tl.constexpr = True,
):
    """``entry_program`` of an HCA entry split over ``PARTS`` programs (padding and the leads' entries: none).
    Such an entry's slots are all tokens of the step; ``STEP_POOL`` pools them as such (``pool_entry``'s
    ``IN_STEP``)."""
    b = tl.load(emit_req_ptr + e)
    if b >= 0:
        i = tl.load(emit_entry_ptr + e)
        start = tl.load(start_ptr + b)
        if i >= start // M + 1:
            pool_slice(part, a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, scratch_ptr, i, start,
                       tl.load(cu_ptr + b).to(tl.int64), tl.load(slots_ptr + b), C, M, NW, PARTS, STEP_POOL)
            if last_arrival(count_ptr, PARTS):
                finish_from_scratch(scratch_ptr, norm_ptr, inv_freq_ptr, pages_ptr, page_bytes, block_tables_ptr,
                                    bt_stride, block_size, eps, tl.load(num_emit_ptr), b, i, C, M, MAXT)


# =========================================================================================== the fused launch
@triton.jit
def _write_before_attention_kernel(
    kv_ptr, pos_ptr, inv_freq_ptr, kv_out_ptr, T,
    start_ptr, end_ptr, cu_ptr, slots_ptr, block_tables_ptr, bt_stride, block_size, B,
    emit_req_ptr, emit_entry_ptr, num_emit_ptr, n_entry, eps, scratch_ptr, count_ptr,
    ma_ptr, mz_ptr, mape_ptr, mtkv_ptr, mtg_ptr, mpkv_ptr, mpg_ptr, mnorm_ptr, mpages_ptr, mpage_bytes,
    xa_ptr, xz_ptr, xape_ptr, xtkv_ptr, xtg_ptr, xpkv_ptr, xpg_ptr, xnorm_ptr, xpages_ptr, xpage_bytes,
    C: tl.constexpr, M: tl.constexpr, OVERLAP: tl.constexpr, HAS_INDEX: tl.constexpr, BT: tl.constexpr,
    NW: tl.constexpr, NW_INDEX: tl.constexpr, MAXT: tl.constexpr, PARTS: tl.constexpr,
    STATE_ONLY: tl.constexpr = False, STEP_POOL: tl.constexpr = True, ENTRY_PROGRAMS: tl.constexpr = True,
):
    # STATE_ONLY: the CSA launch of a long step after csa_entries (which wrote every entry and the window entries):
    # the lead programs' state updates only. ENTRY_PROGRAMS: the grid has entry programs (n_entry > 0); without, their
    # code is not compiled in (a smaller binary and allocation: the state-only launch 156 -> 108 registers)
    pid = tl.program_id(0)
    n_win = 0 if STATE_ONLY else tl.cdiv(T, BT)
    if PARTS > 1:  # HCA, every entry split over PARTS programs; scratch row and counter per entry slot
        q = pid // PARTS
        row = scratch_ptr + q.to(tl.int64) * 512
        if q < B:
            lead_part_program(q, pid % PARTS, ma_ptr, mz_ptr, mape_ptr, mtkv_ptr, mtg_ptr, mnorm_ptr, inv_freq_ptr,
                              mpages_ptr, mpage_bytes, block_tables_ptr, bt_stride, block_size, eps, num_emit_ptr,
                              row, count_ptr + q, start_ptr, end_ptr, cu_ptr, slots_ptr, C, M, NW, PARTS, MAXT)
        elif ENTRY_PROGRAMS and q < B + n_entry:
            entry_part_program(q - B, pid % PARTS, ma_ptr, mz_ptr, mape_ptr, mtkv_ptr, mtg_ptr, mnorm_ptr,
                               inv_freq_ptr, mpages_ptr, mpage_bytes, block_tables_ptr, bt_stride, block_size, eps,
                               num_emit_ptr, row, count_ptr + q, start_ptr, cu_ptr, slots_ptr, emit_req_ptr,
                               emit_entry_ptr, C, M, NW, PARTS, MAXT, STEP_POOL)
        else:
            window_entries_block(kv_ptr, pos_ptr, inv_freq_ptr, kv_out_ptr, (pid - (B + n_entry) * PARTS) * BT, T, BT)
    else:
        # each compressor program's fp32 [512] scratch row (RMSNorm): main programs 0 … B+n_entry−1, then the index's
        main_scratch = scratch_ptr + pid.to(tl.int64) * 512
        index_scratch = scratch_ptr + (pid - n_win).to(tl.int64) * 512
        if pid < B:
            lead_program(pid, ma_ptr, mz_ptr, mape_ptr, mtkv_ptr, mtg_ptr, mpkv_ptr, mpg_ptr, mnorm_ptr, inv_freq_ptr,
                         mpages_ptr, mpage_bytes, block_tables_ptr, bt_stride, block_size, eps, num_emit_ptr,
                         main_scratch, start_ptr, end_ptr, cu_ptr, slots_ptr, C, M, OVERLAP, 0, NW, MAXT, not STATE_ONLY)
        elif ENTRY_PROGRAMS and pid < B + n_entry:
            entry_program(pid - B, ma_ptr, mz_ptr, mape_ptr, mtkv_ptr, mtg_ptr, mpkv_ptr, mpg_ptr, mnorm_ptr,
                          inv_freq_ptr, mpages_ptr, mpage_bytes, block_tables_ptr, bt_stride, block_size, eps,
                          num_emit_ptr, main_scratch, start_ptr, cu_ptr, slots_ptr, emit_req_ptr, emit_entry_ptr, C, M,
                          OVERLAP, 0, NW, MAXT)
        elif pid < B + n_entry + n_win:
            window_entries_block(kv_ptr, pos_ptr, inv_freq_ptr, kv_out_ptr, (pid - B - n_entry) * BT, T, BT)
        else:
            if HAS_INDEX:  # the CSA indexer's compressor: leads, then entries
                q = pid - B - n_entry - n_win
                if q < B:
                    lead_program(q, xa_ptr, xz_ptr, xape_ptr, xtkv_ptr, xtg_ptr, xpkv_ptr, xpg_ptr, xnorm_ptr,
                                 inv_freq_ptr, xpages_ptr, xpage_bytes, block_tables_ptr, bt_stride, block_size, eps,
                                 num_emit_ptr, index_scratch, start_ptr, end_ptr, cu_ptr, slots_ptr, 128, M, True, 1,
                                 NW_INDEX, MAXT, not STATE_ONLY)
                elif ENTRY_PROGRAMS:
                    entry_program(q - B, xa_ptr, xz_ptr, xape_ptr, xtkv_ptr, xtg_ptr, xpkv_ptr, xpg_ptr, xnorm_ptr,
                                  inv_freq_ptr, xpages_ptr, xpage_bytes, block_tables_ptr, bt_stride, block_size, eps,
                                  num_emit_ptr, index_scratch, start_ptr, cu_ptr, slots_ptr, emit_req_ptr,
                                  emit_entry_ptr, 128, M, True, 1, NW_INDEX, MAXT)


@dataclass
class CompressorArgs:
    """One compressor's tensors for ``write_before_attention`` (all on the cache's device, contiguous).

    Attributes:
        a, z_raw: fp32 ``[T, width]``: ``x W_kv^T`` and ``x W_gate^T`` (no bias).
        ape: fp32 ``[m, width]`` position bias; norm: fp32 ``[c]`` RMSNorm weight.
        tail_kv, tail_gate: fp32 ``[R, m, width]``; prev_kv, prev_gate: fp32 ``[R, m, c]`` (CSA; else ``None``).
        pages: uint8 ``[num_blocks, page_bytes]`` (KV pages for the main compressor, indexer pages for the index).
    """

    a: Tensor
    z_raw: Tensor
    ape: Tensor
    norm: Tensor
    tail_kv: Tensor
    tail_gate: Tensor
    prev_kv: Tensor | None
    prev_gate: Tensor | None
    pages: Tensor


WINDOW_BT = 4

#: ``softmax_weight``'s zero shortcut. A global constexpr of the kernels: Triton refuses a changed global after the
#: first compile, so set it before any launch of the process (``bench_write.py --divide-zeros`` turns it off: A/B).
ZERO_FAST_DIVISION = tl.constexpr(True)

#: HCA entries past a request's first pooled from the step's rows with the per-channel reciprocal division
#: (``pool_entry``'s ``IN_STEP``); False: through the general slot sources (for A/B timing; the bytes are the same).
HCA_STEP_POOL = True

#: CSA entries past a request's first two in their own launch, one warp each (``csa_entries``); False: as entry
#: programs of the fused launch (for A/B timing; the bytes are the same).
CSA_ENTRY_KERNEL = True


def separate_csa_entries(m: int, overlap: bool, main: CompressorArgs, index: CompressorArgs | None) -> bool:
    """Whether ``write_before_attention`` hands a long step's entries and window entries to ``csa_entries`` (CSA
    geometry: m = 4 with overlap, 512-channel entries, 128-channel indexer keys) instead of launching entry
    programs."""
    return (CSA_ENTRY_KERNEL and overlap and m == 4 and main.norm.shape[0] == 512
            and (index is None or index.norm.shape[0] == 128))


def pool_parts(m: int, overlap: bool) -> int:
    """Programs an entry of the fused launch is split over, by channel slices: 8 for HCA-like ratios (``m`` ≥ 64
    slots × 512 channels, two ``exp`` and a division each: one program took 85 µs per entry on an H200, and a
    decode step waits for it), else 1. The last slice to finish normalises, quantizes and writes the entry."""
    return 8 if m >= 64 and not overlap else 1


#: Longest step (tokens of one request) for which CSA-style writes keep 4 warps per program; longer chunks take 2.
CSA_PREFILL_TOKENS = 256


def pool_program_warps(m: int, overlap: bool = False, max_new: int = 1) -> int:
    """Warps per program of the fused launch (when it has entry programs; the state-only launch of a long CSA step
    takes 4). The results do not depend on it: every order-sensitive sum is spelled
    out. 2 for CSA-style (``overlap``) steps of more than ``CSA_PREFILL_TOKENS`` tokens per request — the programs
    hold 191 registers per thread at 4 warps (2 programs per SM), 255 at 2 (4 per SM), and a prefill chunk's
    latency-bound entry programs gain from the extra ones in flight (H200, V4-Flash CSA, write kernel: 8K chunk
    141 → 123 µs, 3 × 2K 110 → 101 µs; decode B=64 17.4 → 26.8 µs, so decode steps keep 4), else 4 (HCA prefill:
    4 warps measured faster, 47 vs 49 µs).
    """
    return 2 if overlap and max_new > CSA_PREFILL_TOKENS else 4


def entry_program_count(batch, m: int, overlap: bool) -> int:
    """Entry programs of the fused launch per compressor: one per emitted-entry slot (``emit_capacity[m]``) when a
    request can emit more entries than its lead program takes (host-known geometry), else 0."""
    return batch.emit_capacity[m] if -(-batch.max_new // m) > (2 if overlap else 1) else 0


def scratch_rows(batch, m: int, overlap: bool, has_index: bool) -> int:
    """Rows of the fp32 ``[rows, 512]`` RMSNorm scratch ``write_before_attention`` needs: one per lead and entry
    slot of the main and, CSA, the indexer's compressor. Also the length of the int32 arrival counters."""
    return (batch.num_requests + entry_program_count(batch, m, overlap)) * (1 + has_index)


def write_before_attention(
    kv: Tensor, positions: Tensor, inv_freq: Tensor, batch, m: int, overlap: bool, eps: float,
    main: CompressorArgs, index: CompressorArgs | None, scratch: Tensor | None = None,
    arrivals: Tensor | None = None,
) -> Tensor:
    """One launch: the step's window entries, and every compressor's accumulate + flush (see the module doc).

    Args:
        kv: bf16 ``[T, 512]`` ``RMSNorm(W_kv x)``; positions: int64 ``[T]``; inv_freq: fp32 ``[32]``.
        batch: the ``StepBatch`` (its fixed-shape device tensors only: graph-safe).
        m, overlap: compression ratio; CSA-style overlap (then ``index`` is the indexer's compressor, or ``None``).
        eps: RMSNorm epsilon.
        scratch: fp32 ``[≥ scratch_rows(...), 512]`` RMSNorm scratch (contents undefined; a workspace buffer so
            that steps do not allocate), else allocated here.
        arrivals: int32 ``[≥ scratch_rows(...)]``, zero, left zero: the counters of entries split over programs
            (``pool_parts``); allocated zeroed here when omitted (reuse one across steps to save the fill).
    Returns:
        bf16 ``[T, 512]`` the window entries as stored.
    """
    kv = kv.contiguous()
    out = torch.empty_like(kv)
    T, B = kv.shape[0], batch.num_requests
    n_entry = entry_program_count(batch, m, overlap)
    has_index = index is not None
    x = index if has_index else main
    c = main.norm.shape[0]
    parts = pool_parts(m, overlap)
    grid = ((B + n_entry) * (1 + has_index) * parts + triton.cdiv(T, WINDOW_BT),)
    rows = scratch_rows(batch, m, overlap, has_index)
    if arrivals is None:
        arrivals = torch.zeros(rows, dtype=torch.int32, device=kv.device)
    elif arrivals.dtype != torch.int32 or arrivals.dim() != 1 or arrivals.shape[0] < rows:
        raise ValueError(f"arrivals must be an int32 [>= {rows}] tensor, got {arrivals.dtype} {list(arrivals.shape)}")
    if scratch is None:
        scratch = torch.empty((rows, 512), dtype=torch.float32, device=kv.device)
    elif scratch.dtype != torch.float32 or scratch.dim() != 2 or scratch.shape[0] < rows or scratch.shape[1] != 512 \
            or not scratch.is_contiguous():
        raise ValueError(f"scratch must be a contiguous float32 [>= {rows}, 512] tensor, got "
                         f"{scratch.dtype} {list(scratch.shape)}")
    separate = n_entry > 0 and separate_csa_entries(m, overlap, main, index)
    if separate:
        # Every entry and the window entries: one-warp programs of their own launch (csa_entries), which reads the
        # tails and previous-window state before this launch's lead programs update them.
        from .csa_entries import write_csa_entries

        write_csa_entries(kv, positions, inv_freq, out, batch, eps, main, index, n_entry,
                          scratch[B * (1 + has_index):])
        n_entry = 0
        grid = (B * (1 + has_index),)
    dummy = main.tail_kv
    _write_before_attention_kernel[grid](
        kv, positions, inv_freq, out, T,
        batch.start_pos, batch.end_pos, batch.cu_seqlens, batch.slots, batch.block_tables,
        batch.block_tables.stride(0), batch.block_size, B,
        batch.emit_pad_request[m], batch.emit_pad_entry[m], batch.num_emit_device[m], n_entry, eps, scratch, arrivals,
        main.a, main.z_raw, main.ape, main.tail_kv, main.tail_gate,
        main.prev_kv if overlap else dummy, main.prev_gate if overlap else dummy, main.norm, main.pages,
        main.pages.shape[1],
        x.a, x.z_raw, x.ape, x.tail_kv, x.tail_gate, x.prev_kv if has_index else dummy,
        x.prev_gate if has_index else dummy, x.norm, x.pages, x.pages.shape[1],
        C=c, M=m, OVERLAP=overlap, HAS_INDEX=has_index, BT=WINDOW_BT,
        NW=pool_warps(2 * m if overlap else m, TORCH_REDUCE_MAX_THREADS), NW_INDEX=pool_warps(2 * m, TORCH_REDUCE_MAX_THREADS),
        MAXT=TORCH_REDUCE_MAX_THREADS, PARTS=parts, STATE_ONLY=separate, STEP_POOL=HCA_STEP_POOL,
        ENTRY_PROGRAMS=n_entry > 0,
        num_warps=4 if separate else pool_program_warps(m, overlap, batch.max_new), enable_fp_fusion=False,
    )
    return out
