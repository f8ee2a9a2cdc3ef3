"""Indexer queries as the official numerics round them, in one kernel (SPEC §5): RoPE on the last 64 dims (FP32,
rounded once to BF16), the normalized 128-point Hadamard butterfly in FP32, MXFP4 (E2M1, one UE8M0 power-of-two
scale per 32 values, the "ceil" rule) — written as the FP8 E4M3 operand bytes the scores kernels read
(``fp8_operands``: the block scales folded into the bytes, one scale per head)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..quant import cosf, e2m1_magnitude, sinf
from .fp8_operands import e4m3_from_e2m1, pow2_from_byte

__all__ = ["mxfp4_queries"]

#: one program's heads of one token, and its warps: the fastest of 16 / 32 / 64 heads × 2–8 warps on the H200
#: (8,192 tokens × 64 heads: 193 µs; 4 warps 206, 32 heads × 4 warps 212, 64 × 8 210;
#: ``docs/perf/2026-11-29-mxfp4-queries.md``)
HEADS_PER_PROGRAM = 16
WARPS = 2


@triton.jit
def _butterfly(y, R: tl.constexpr, h: tl.constexpr):
    """One Walsh–Hadamard stage on fp32 ``[R, 128]``: pairs ``(a, b)`` at distance ``h`` become ``(a + b, a − b)``.

    Written as two sums over the pair's axis — ``a + b`` and ``a + (−b)``, the same IEEE results — put back in
    place by a select, rather than split / join / permute: the same bits, 14–21% faster over the whole kernel on the
    H200 (``docs/perf/2026-11-29-mxfp4-queries.md``)."""
    pairs = tl.reshape(y, (R, 64 // h, 2, h))
    first = tl.arange(0, 2)[None, None, :, None] == 0
    total = tl.expand_dims(tl.sum(pairs, axis=2), 2)
    diff = tl.expand_dims(tl.sum(tl.where(first, pairs, -pairs), axis=2), 2)
    return tl.reshape(tl.where(first, total, diff), (R, 128))


@triton.jit
def _mxfp4_queries_kernel(
    q_ptr, q_stride,            # bf16 [T, H * 128]: W_Iq c^Q, head-major, rows q_stride apart
    pos_ptr, inv_freq_ptr,      # int64 [T] positions p; fp32 [32] ω_i (rotation angles p · ω_i)
    q8_ptr,                     # uint8 [T, 2, HP, 64] out: E4M3 operand bytes (channel order of unpack_keys_asm)
    qs_ptr,                     # fp32 [T, HP] out: 2**(e_max − 133) per head (0 for padded heads)
    H, HP,
    HB: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * HB
    heads = h0 + tl.arange(0, HB)
    ch = tl.arange(0, 128)
    live = heads < H
    x = tl.load(q_ptr + t * q_stride + heads[:, None] * 128 + ch[None, :], mask=live[:, None], other=0.0)
    x = x.to(tl.float32)

    # RoPE on pairs 32…63 (channels 64…127), FP32, then one rounding to BF16: the angles as the torch ops make
    # them (fp32 position × ω, libdevice cosf / sinf), once per program for its block of heads.
    re, im = tl.split(tl.reshape(x, (HB, 64, 2)))
    pair = tl.arange(0, 64)
    rot = pair >= 32
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + (pair - 32), mask=rot, other=0.0)
    c = cosf(angle)[None, :]
    s = sinf(angle)[None, :]
    re2 = tl.where(rot[None, :], re * c - im * s, re)
    im2 = tl.where(rot[None, :], re * s + im * c, im)
    y = tl.reshape(tl.join(re2, im2), (HB, 128))
    if ROUND_BF16:  # RNE to BF16 by bit arithmetic (exact on the GPU and in the interpreter alike)
        yi = y.to(tl.int32, bitcast=True)
        y = ((yi + 0x7FFF + ((yi >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)

    # Normalized Walsh–Hadamard: 7 butterfly stages (a, b) → (a + b, a − b) at distance h, as the reference.
    y = _butterfly(y, HB, 1)
    y = _butterfly(y, HB, 2)
    y = _butterfly(y, HB, 4)
    y = _butterfly(y, HB, 8)
    y = _butterfly(y, HB, 16)
    y = _butterfly(y, HB, 32)
    y = _butterfly(y, HB, 64)
    y = y * 0.08838834764831845  # fp32(1/sqrt(128)), as fast_hadamard_transform's scale

    # MXFP4: per 32-value block s = 2**ceil(log2(max(amax, 6·2**-126) · fp32(1/6))) from the fp32 bits.
    yb = tl.reshape(y, (HB, 4, 32))
    amax = tl.max(tl.abs(yb), axis=2)
    a6 = tl.maximum(amax, 6.0 * 1.1754943508222875e-38) * 0.1666666716337204
    bits = a6.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # UE8M0 byte, [HB, 4]
    inv_s = ((254 - e) << 23).to(tl.float32, bitcast=True)  # 2**(127 − e), exact
    v = yb * inv_s[:, :, None]
    mag = e2m1_magnitude(tl.minimum(tl.abs(v), 6.0))  # of v clamped to ±6
    sign = (tl.maximum(v, -6.0).to(tl.int32, bitcast=True) >> 31) & 1  # the clamped sign (a NaN's: clamped to −6)

    e_max = tl.max(e, axis=1)  # [HB]
    d = e - e_max[:, None] + 11  # [HB, 4]
    byte = e4m3_from_e2m1(mag, d[:, :, None]) | (sign << 7)
    # the keys' operand order (unpack_keys_asm): of channels 8k … 8k + 7, the first four to q8[t, 0], the rest to
    # q8[t, 1], both at 4k … 4k + 3
    first, last = tl.split(tl.permute(tl.reshape(byte, (HB, 16, 2, 4)), (0, 1, 3, 2)))
    half = tl.arange(0, 64)
    out = q8_ptr + t * 2 * HP * 64 + heads[:, None] * 64 + half[None, :]
    pad = heads < HP
    tl.store(out, tl.reshape(first, (HB, 64)).to(tl.uint8), mask=pad[:, None])
    tl.store(out + HP * 64, tl.reshape(last, (HB, 64)).to(tl.uint8), mask=pad[:, None])
    qs = tl.where(live, pow2_from_byte(e_max - 6), 0.0)
    tl.store(qs_ptr + t * HP + heads, qs, mask=pad)


def mxfp4_queries(q: Tensor, positions: Tensor, inv_freq: Tensor, num_heads: int,
                  head_pad: int) -> tuple[Tensor, Tensor]:
    """Fused RoPE → Hadamard → MXFP4 of the indexer queries, as FP8 operand bytes.

    Args:
        q: ``[T, H * 128]`` act dtype, ``W_Iq c^Q`` head-major (the rotated values are rounded back to this dtype
            when it is BF16, as the reference's RoPE does); channels contiguous, rows any stride apart (a column
            block of a wider GEMM output is read in place).
        positions: int64 ``[T]``; inv_freq: float32 ``[32]`` (the layer's compressed RoPE table).
        num_heads: ``H``; head_pad: ``HP`` ≥ H, a power of two ≥ 16 (MMA width).
    Returns:
        ``q8`` uint8 ``[T, 2, HP, 64]``: E4M3 bytes of ``e2m1 · 2**(e_j − e_max + 6)`` per head, ``q8[:, 0, h,
        4k + r]`` = channel ``8k + r`` and ``q8[:, 1, h, 4k + r]`` = channel ``8k + 4 + r`` (zeros for padded
        heads); ``qscale`` float32 ``[T, HP]``: ``2**(e_max − 133)`` so that ``q = qscale · q8`` (0 for padded
        heads).
    """
    T = q.shape[0]
    if q.stride(1) != 1:
        q = q.contiguous()
    inv_freq = inv_freq.to(device=q.device, dtype=torch.float32).contiguous()
    positions = positions.contiguous()
    q8 = torch.empty((T, 2, head_pad, 64), dtype=torch.uint8, device=q.device)
    qscale = torch.empty((T, head_pad), dtype=torch.float32, device=q.device)
    if T == 0:
        return q8, qscale
    grid = (T, triton.cdiv(head_pad, HEADS_PER_PROGRAM))
    _mxfp4_queries_kernel[grid](q, q.stride(0), positions, inv_freq, q8, qscale, num_heads, head_pad,
                                HB=HEADS_PER_PROGRAM, ROUND_BF16=q.dtype == torch.bfloat16,
                                num_warps=WARPS, enable_fp_fusion=False)
    return q8, qscale
