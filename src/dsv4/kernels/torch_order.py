"""torch's CUDA reduction orders, spelled out for Triton kernels that must give the torch backend's bits.

A floating-point sum depends on its order. The write path's entries (compressor pooling, RMSNorm) are bit-exact
with the torch backend on CUDA, so the kernels add in the order torch's reduce kernel does; these helpers say what
that order is (``ReduceConfig`` with ``MAX_NUM_THREADS = 512``; ``tools/diag_reduce_order.py`` finds it on a GPU):

* ``pool_warps``: how torch splits a per-channel sum over a window's slots across warps;
* ``thread_partials`` / ``torch_sum_sq`` / ``rms_norm_bf16``: ``x.pow(2).mean(-1)`` of one row through a scratch row
  read back in the reduce kernel's arrangement (float4 loads, shared-memory halving, shuffle-down tree);
* ``zero_square_sums`` / ``add_chunk_squares`` / ``entry_rms_scale``: the same sums of a 512-channel row held by one
  warp as four 128-channel chunks (thread l: channels ``128k + 4l + q``), for all three of torch's orders at once
  (the step's entry count picks one on the device); ``sum_sq_128`` / ``rms_norm_128`` for 128-channel rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .quant import bf16_round, rsqrtf, seq_sum4_last, shuffle_down_sum

__all__ = [
    "TORCH_REDUCE_MAX_THREADS", "add_chunk_squares", "entry_rms_scale", "halve_rows", "pool_warps", "rms_norm_128",
    "rms_norm_bf16", "sum_sq_128", "torch_sum_sq", "zero_square_sums",
]

#: Threads per block of torch's CUDA reduce kernel (``ReduceConfig``'s ``MAX_NUM_THREADS``).
TORCH_REDUCE_MAX_THREADS = 512


def pool_warps(slots: int, max_threads: int = TORCH_REDUCE_MAX_THREADS) -> int:
    """Warps torch's reduce kernel splits a per-channel sum over ``slots`` (strided, non-innermost, 4 outputs per
    thread) across, or 0 when one thread sums them: block height ``min(pow2floor(slots), max_threads/128)``,
    split when ``slots ≥ min(16·height, 256)``."""
    height = min(1 << (slots.bit_length() - 1), max_threads // 128)
    return height if slots >= min(16 * height, 256) else 0


@triton.jit
def halve_rows(part, N: tl.constexpr, C: tl.constexpr):
    """``part[y] + part[y + N/2]`` for ``y < N/2`` (one shared-memory halving step of a block reduction)."""
    lo, hi = tl.split(tl.permute(tl.reshape(part, (2, N // 2, C)), (1, 2, 0)))
    return lo + hi


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
def zero_square_sums():
    """The running sums of ``add_chunk_squares`` before the first chunk."""
    return (tl.zeros([32, 4], tl.float32), tl.zeros([32, 4], tl.float32), tl.zeros([32, 4], tl.float32),
            tl.zeros([32], tl.float32), tl.zeros([32], tl.float32))


@triton.jit
def add_chunk_squares(x, k, acc32, acc64_even, acc64_odd, p128_even, p128_odd):
    """Chunk ``k`` (0…3) of a 512-channel entry into the running sums of squares of torch's RMSNorm block reduction
    (see ``rms_norm_bf16``); returns the updated sums.

    ``x`` fp32 ``[128]``: channels ``128k … 128k+127`` (BF16 values); thread l of the warp holds ``128k + 4l + q``,
    i.e. the float4 vectors ``l + 32k`` torch's threads read. With ``BW`` threads per row thread t sums its vectors
    ``t, t + BW, …`` per vector lane, adds the four lanes in order, then the block halves its partials down to 32
    (offsets BW/2 … 32). So per lane l: BW = 32: ``seq4(((v0 + v1) + v2) + v3)`` (``acc32``); BW = 64:
    ``seq4(v0 + v2) + seq4(v1 + v3)`` (``acc64_*``); BW = 128: ``(P0 + P2) + (P1 + P3)`` with ``Pk = seq4(vk)``
    (``p128_*``) — all sums of this thread's own values, accumulated chunk by chunk in those orders (a leading
    ``0 +`` is exact: squares are ≥ +0).
    """
    v = tl.reshape(x * x, (32, 4))
    odd = (k % 2) == 1
    pk = seq_sum4_last(v)
    return (acc32 + v, tl.where(odd, acc64_even, acc64_even + v), tl.where(odd, acc64_odd + v, acc64_odd),
            tl.where(odd, p128_even, p128_even + pk), tl.where(odd, p128_odd + pk, p128_odd))


@triton.jit
def entry_rms_scale(acc32, acc64_even, acc64_odd, p128_even, p128_odd, num_emit, eps):
    """``rsqrt(mean(x²) + eps)`` of a 512-channel entry from ``add_chunk_squares``' sums: ``Σ x²`` in the order
    torch uses for a step emitting ``num_emit`` entries (BW = 32 threads per row from 16 entries, 64 from 8, else
    128: chosen on the device), finished by the warp's shuffle-down tree. ``[1]`` fp32."""
    bw32 = seq_sum4_last(acc32)
    bw64 = seq_sum4_last(acc64_even) + seq_sum4_last(acc64_odd)
    bw128 = p128_even + p128_odd
    part = tl.where(num_emit >= 16, bw32, tl.where(num_emit >= 8, bw64, bw128))
    return rsqrtf(shuffle_down_sum(part, 32, 5) * (1.0 / 512) + eps)


@triton.jit
def sum_sq_128(x):
    """``Σ x²`` over a 128-channel indexer key ``x`` fp32 ``[128]`` (thread l: channels ``4l + q``) in the order of
    torch's reduction: 32 threads per row, one float4 vector each, then the shuffle-down tree. ``[1]`` fp32."""
    return shuffle_down_sum(seq_sum4_last(tl.reshape(x * x, (32, 4))), 32, 5)


@triton.jit
def rms_norm_128(x, norm_ptr, eps):
    """``reference.rms_norm`` of a 128-channel indexer key ``x`` (BF16-valued fp32 ``[128]``): BF16-valued fp32."""
    return bf16_round(tl.load(norm_ptr + tl.arange(0, 128)) * (x * rsqrtf(sum_sq_128(x) * (1.0 / 128) + eps)))
