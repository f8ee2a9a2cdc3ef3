"""Lightning-indexer kernels (SPEC §5): fused query prep and paged index scores on the tensor cores.

Two kernels:

* ``_mxfp4_queries_kernel`` — indexer queries as the official numerics round them: RoPE on the last 64 dims
  (FP32, rounded once to BF16), the normalized 128-point Hadamard butterfly in FP32, MXFP4 (E2M1, one UE8M0
  power-of-two scale per 32 values, the "ceil" rule). The result is written as FP8 E4M3 *operand bytes* (below).
* ``_scores_kernel`` — ``I[t, s] = Σ_h w[t, h] · relu(q[t, h] · K[s])`` for every query of a request against that
  request's keys in the paged pool (through its block table), rounded once to the score dtype. Keys are the tile's
  rows (MMA ``M``), the heads of ``QT`` queries its columns (``N = QT · HP``), the 128 channels the reduction.

MXFP4 keys on sm_90 — the indexer's hot path, decode steps and prefill chunks — run a Gluon kernel instead
(``indexer_sm90``: same numerics, the key bytes converted straight into the MMA's register operand, no shared
memory per tile; a decode tile's MMA overlapping the previous one's head sum, a prefill tile converted once for
four queries); ``index_scores`` chooses. This module's kernel serves the other formats, and the Triton interpreter.

A transposed layout — heads as MMA rows, keys as columns — measured slower on the H200 (154 µs vs 129 µs at B=64, 128K
decode, before the changes below) and was removed.

MXFP4 on FP8 tensor cores. An E2M1 value times a power of two is an E4M3 value (one mantissa bit fits into three),
so every key is turned into E4M3 bytes *exactly* in registers and one FP8 MMA (K = 128) does the 64 heads. The four
block scales of a key are folded into its bytes relative to the key's largest block: block ``j`` holds
``e2m1 · 2**(e_j − e_max + 6)`` (largest magnitude 6 · 64 = 384 ≤ 448) and the key keeps one scale
``2**(e_max − 127 − 6)`` applied after the head reduction (``relu(c·x) = c·relu(x)`` for ``c > 0``). Queries are
folded the same way per head, their scale multiplying the head weight. This is exact whenever a vector's four
block exponents span at most 11 binades (always, in practice: the Hadamard rotation evens the blocks out); a block
more than 2**11 below its vector's largest is flushed to zero (its contribution is below 2**-11 of the largest
block's). The E2M1 → E4M3 conversion of the packed key bytes is one inline-PTX function (``UNPACK_KEYS_PTX``): each
block's shift is added once to an 8-entry table of E4M3 bytes (``_block_tables``), and ``prmt`` looks four
magnitudes up at a time (9 instructions per four packed bytes, ``ptx.UNPACK_KEYS``); under the Triton interpreter
the same bytes come from plain integer arithmetic, and ``tests/test_indexer_ptx.py`` executes the PTX itself on the
CPU. The relu and head weight run as ``(x + |x|) · w/2`` (``_head_sum``): the same bits, on the FMA pipe.

Memory pipeline. Where pages hold a multiple of the 64-key tile (block size 256: one page per tile), a program
reads its split's block-table entries once, before its loop, and takes each tile's page from registers: no load
feeds the address of a key tile, so Triton's pipeliner copies the tile's codes two tiles ahead (``NUM_STAGES=3``),
and the tile's scales (2 bytes per thread, too small for an asynchronous copy) are loaded into registers one tile
ahead (``PAGE_VECTOR``; H200, B=64 × 128K decode: 114 → 88 µs). Smaller pages take a per-row block-table gather.

Channel order. Packed E2M1 nibbles put channel ``2i`` in the low and ``2i + 1`` in the high nibble of byte ``i``;
four packed bytes are eight consecutive channels. The conversion turns each four bytes into two E4M3 words, the
first four channels and the last four (a ``prmt`` selector nibble is an E2M1 code: no nibble shuffling), so a
key's operands ``ka`` / ``kb`` hold channels ``8k + r`` / ``8k + 4 + r`` at ``4k + r``; the sum over channels does
not care about their order, and the query operand is stored in the same one (``q8[t, 0]`` / ``q8[t, 1]``,
``triton_indexer.mxfp4_operand_channels``), so nothing is interleaved at run time.

Other key formats share the scores kernel (``FORMAT``):

* ``FMT_FP8`` (vLLM's 132-B key: 128 E4M3 codes + an fp32 scale): codes go to the MMA as they are; ``q8[t, 0]`` /
  ``q8[t, 1]`` are the first / last 64 channels; the per-key and per-query fp32 scales are applied like the folded
  MXFP4 scales.
* ``FMT_FP32`` (exact numerics, 512-B keys): an IEEE fp32 ``tl.dot`` (no TF32), ``qf[t, 0]`` / ``qf[t, 1]`` = first /
  last 64 channels.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import ptx
from . import scores_sm90

__all__ = [
    "FMT_MXFP4", "FMT_FP8", "FMT_FP32",
    "mxfp4_queries", "index_scores", "interpreting", "pick_scores_config",
]

FMT_MXFP4 = 0
FMT_FP8 = 1
FMT_FP32 = 2

#: fp32 bits of 1/sqrt(128) and of fp32(1/6), the constants the reference multiplies by.
_INV_SQRT128 = float(torch.tensor(1.0 / math.sqrt(128), dtype=torch.float32))
_INV6 = float(torch.tensor(1.0 / 6.0, dtype=torch.float32))
_MXFP4_AMAX_FLOOR = 6.0 * 2.0**-126


def interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (``TRITON_INTERPRET=1``): no inline PTX there."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ------------------------------------------------------------------------------------------------ device helpers
@triton.jit
def _e4m3_from_e2m1(mag, d):
    """E4M3 byte (no sign) of ``e2m1(mag) · 2**(d − 5)``; 0 when ``mag == 0`` or ``d < 0`` (flushed block).

    ``mag``: int32 E2M1 magnitude code 0…7; ``d``: int32 shift 0…11 (or negative = flush).
    The table ``e2m1 · 2**-5`` in E4M3 is 0x00, 0x08, 0x10, 0x14, 0x18, 0x1C, 0x20, 0x24; adding ``d`` to the
    exponent field (``+ 8·d``) stays a normal number up to 0x7C = 384.
    """
    base = tl.where(mag == 1, 8, (mag + 2) * 4)
    return tl.where((mag == 0) | (d < 0), 0, base + d * 8)


#: The key conversion's lookup table at shift 0 (see ``dsv4.kernels.ptx``).
_E4M3_LO: tl.constexpr = tl.constexpr(ptx.E4M3_TABLE_LO)
_E4M3_HI: tl.constexpr = tl.constexpr(ptx.E4M3_TABLE_HI)


@triton.jit
def _block_tables(e, e_max):
    """Per-block lookup tables of the key conversion: the E4M3 bytes of ``e2m1 · 2**(e − e_max + 6)``.

    ``e``: int32 ``[..., 4]`` UE8M0 block exponents of a key; ``e_max``: int32 ``[...]`` their maximum. Returns
    int32 ``(lo, hi)``, ``[..., 4]``: byte ``j`` of ``lo`` / ``hi`` is the E4M3 byte of magnitude code ``j`` /
    ``j + 4``. The block's shift ``d = e − e_max + 11`` (0…11) is added to every nonzero entry's exponent field
    (``+ 8·d`` per byte; the largest, 0x24 + 88 = 0x7C = 384, stays normal); a block more than 11 binades below the
    key's largest (``d < 0``) gets all-zero tables (flushed).
    """
    d = e - e_max[:, None] + 11
    lo = tl.where(d < 0, 0, _E4M3_LO + (d * 8) * 0x01010100)  # byte 0 (magnitude 0) stays 0
    hi = tl.where(d < 0, 0, _E4M3_HI + (d * 8) * 0x01010101)
    return lo, hi


@triton.jit
def _e4m3_from_table(c, lo, hi):
    """E4M3 byte of the E2M1 code ``c`` (int32 0…15, sign in bit 3) by the block's tables ``lo`` / ``hi`` (the sign
    kept on zeros: −0 for a negative code, as the PTX gives it)."""
    mag = c & 7
    table = tl.where(mag < 4, lo, hi)
    byte = (table >> ((mag & 3) * 8)) & 0xFF
    return (byte | ((c & 8) << 4)).to(tl.uint8)


@triton.jit
def _unpack_keys_int(x, lo, hi, BLOCK_N: tl.constexpr):
    """Plain-integer twin of ``_unpack_keys_asm`` (interpreter path): same arguments, same bytes.

    ``x``: uint8 ``[BLOCK_N, 4, 16]``. Bytes ``4k … 4k + 3`` of a block hold its channels ``8k … 8k + 7`` (two per
    byte, low nibble first); the first four become bytes ``4k … 4k + 3`` of the first result, the last four those of
    the second.
    """
    xi = x.to(tl.int32)
    nibbles = tl.join(_e4m3_from_table(xi & 15, lo, hi), _e4m3_from_table(xi >> 4, lo, hi))  # [BLOCK_N, 4, 16, 2]
    groups = tl.reshape(nibbles, (BLOCK_N, 4, 4, 2, 4))  # [key, block, k, half, r]: channel 8k + 4·half + r
    first, last = tl.split(tl.permute(groups, (0, 1, 2, 4, 3)))
    return tl.reshape(first, (BLOCK_N, 4, 16)), tl.reshape(last, (BLOCK_N, 4, 16))


#: PTX of ``_unpack_keys_asm`` (``dsv4.kernels.ptx.UNPACK_KEYS``, a triton-free module so that
#: ``tests/test_indexer_ptx.py`` can execute it on any CPU install).
UNPACK_KEYS_PTX: tl.constexpr = tl.constexpr(ptx.UNPACK_KEYS)


@triton.jit
def _unpack_keys_asm(x, lo, hi):
    """Packed E2M1 bytes → two E4M3 byte tensors, the block's shift applied, signs kept.

    Args:
        x: uint8 packed E2M1 bytes (channel ``2i`` in the low, ``2i + 1`` in the high nibble of byte ``i``).
        lo, hi: int32, the block's lookup tables (``_block_tables``), broadcast over its bytes.
    Returns:
        ``(first, last)`` uint8: of every four packed bytes (eight channels), byte ``r`` of ``first`` is channel
        ``r`` and byte ``r`` of ``last`` channel ``4 + r`` (``ptx.UNPACK_KEYS``: 9 instructions per four bytes;
        a zero keeps its code's sign).
        The query operand is stored in the same channel order (``q8[t, 0]`` / ``q8[t, 1]``).
    """
    return tl.inline_asm_elementwise(
        asm=UNPACK_KEYS_PTX,
        constraints="=r,=r,r,r,r,r,r,r,r,r,r",
        args=[x, lo, hi],
        dtype=(tl.uint8, tl.uint8),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _pow2_from_byte(e):
    """fp32 ``2**(e − 127)`` of an int32 biased exponent ``e`` (0 below the normal range)."""
    return tl.where(e >= 1, (tl.maximum(e, 1) << 23).to(tl.float32, bitcast=True), 0.0)


# ------------------------------------------------------------------------------------------------ query prep
@triton.jit
def _butterfly(y, R: tl.constexpr, h: tl.constexpr):
    """One Walsh–Hadamard stage on fp32 ``[R, 128]``: pairs ``(a, b)`` at distance ``h`` become ``(a + b, a − b)``."""
    a, b = tl.split(tl.permute(tl.reshape(y, (R, 64 // h, 2, h)), (0, 1, 3, 2)))
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (R, 128))


@triton.jit
def _mxfp4_queries_kernel(
    q_ptr, q_stride,            # bf16 [T, H * 128]: W_Iq c^Q, head-major
    cos_ptr, sin_ptr,           # fp32 [T, 32]: cos / sin of p · ω_i
    q8_ptr,                     # uint8 [T, 2, HP, 64] out: E4M3 operand bytes (channel order of _unpack_keys_asm)
    qs_ptr,                     # fp32 [T, HP] out: 2**(e_max − 133) per head (0 for padded heads)
    H, HP,
    HB: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    t = tl.program_id(0)
    h0 = tl.program_id(1) * HB
    heads = h0 + tl.arange(0, HB)
    ch = tl.arange(0, 128)
    live = heads < H
    x = tl.load(q_ptr + t * q_stride + heads[:, None] * 128 + ch[None, :], mask=live[:, None], other=0.0)
    x = x.to(tl.float32)

    # RoPE on pairs 32…63 (channels 64…127), FP32, then one rounding to BF16.
    re, im = tl.split(tl.reshape(x, (HB, 64, 2)))
    pair = tl.arange(0, 64)
    rot = pair >= 32
    c = tl.load(cos_ptr + t * 32 + (pair - 32), mask=rot, other=1.0)[None, :]
    s = tl.load(sin_ptr + t * 32 + (pair - 32), mask=rot, other=0.0)[None, :]
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
    v = tl.minimum(tl.maximum(yb * inv_s[:, :, None], -6.0), 6.0)
    m = tl.abs(v)
    mag = ((m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
           + (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32) + (m > 5.0).to(tl.int32))
    sign = (v.to(tl.int32, bitcast=True) >> 31) & 1

    e_max = tl.max(e, axis=1)  # [HB]
    d = e - e_max[:, None] + 11  # [HB, 4]
    byte = _e4m3_from_e2m1(mag, d[:, :, None]) | (sign << 7)
    # the keys' operand order (_unpack_keys_asm): of channels 8k … 8k + 7, the first four to q8[t, 0], the rest to
    # q8[t, 1], both at 4k … 4k + 3
    first, last = tl.split(tl.permute(tl.reshape(byte, (HB, 16, 2, 4)), (0, 1, 3, 2)))
    half = tl.arange(0, 64)
    out = q8_ptr + t * 2 * HP * 64 + heads[:, None] * 64 + half[None, :]
    pad = heads < HP
    tl.store(out, tl.reshape(first, (HB, 64)).to(tl.uint8), mask=pad[:, None])
    tl.store(out + HP * 64, tl.reshape(last, (HB, 64)).to(tl.uint8), mask=pad[:, None])
    qs = tl.where(live, _pow2_from_byte(e_max - 6), 0.0)
    tl.store(qs_ptr + t * HP + heads, qs, mask=pad)


def mxfp4_queries(q: Tensor, positions: Tensor, inv_freq: Tensor, num_heads: int, head_pad: int) -> tuple[Tensor, Tensor]:
    """Fused RoPE → Hadamard → MXFP4 of the indexer queries, as FP8 operand bytes.

    Args:
        q: ``[T, H * 128]`` act dtype, ``W_Iq c^Q`` head-major (the rotated values are rounded back to this dtype
            when it is BF16, as the reference's RoPE does).
        positions: int64 ``[T]``; inv_freq: float32 ``[32]`` (the layer's compressed RoPE table).
        num_heads: ``H``; head_pad: ``HP`` ≥ H, a power of two ≥ 16 (MMA width).
    Returns:
        ``q8`` uint8 ``[T, 2, HP, 64]``: E4M3 bytes of ``e2m1 · 2**(e_j − e_max + 6)`` per head, ``q8[:, 0, h,
        4k + r]`` = channel ``8k + r`` and ``q8[:, 1, h, 4k + r]`` = channel ``8k + 4 + r`` (zeros for padded heads); ``qscale`` float32 ``[T, HP]``:
        ``2**(e_max − 133)`` so that ``q = qscale · q8`` (0 for padded heads).
    """
    T = q.shape[0]
    q = q.contiguous()
    angle = positions.to(torch.float32)[:, None] * inv_freq.to(device=q.device, dtype=torch.float32)[None, :]
    cos, sin = angle.cos().contiguous(), angle.sin().contiguous()
    q8 = torch.empty((T, 2, head_pad, 64), dtype=torch.uint8, device=q.device)
    qscale = torch.empty((T, head_pad), dtype=torch.float32, device=q.device)
    if T == 0:
        return q8, qscale
    HB = 16
    grid = (T, triton.cdiv(head_pad, HB))
    _mxfp4_queries_kernel[grid](q, q.stride(0), cos, sin, q8, qscale, num_heads, head_pad, HB=HB,
                                ROUND_BF16=q.dtype == torch.bfloat16,
                                num_warps=4, enable_fp_fusion=False)
    return q8, qscale


# ------------------------------------------------------------------------------------------------ scores
@triton.jit
def _head_sum(ka, kb, qa, qb, w_half, BLOCK_N: tl.constexpr, QT: tl.constexpr, HP: tl.constexpr,
              IEEE: tl.constexpr):
    """``Σ_h w_h · relu(q_h · k)`` of a key tile (``ka`` / ``kb``: ``[BLOCK_N, 64]``) against the queries (``qa`` /
    ``qb``: ``[64, QT · HP]``): ``[BLOCK_N, QT]`` fp32. ``w_half``: ``[QT · HP]`` half the head weights.

    ``relu(x) · w`` is computed as ``(x + |x|) · (w / 2)``: the same bits (``x + |x|`` is ``2x`` or ``+0`` exactly,
    halving ``w`` is exact), but an add with an operand modifier on the FMA pipe instead of a max on the
    integer/logic pipe that the key conversion keeps busy."""
    if IEEE:
        acc = tl.dot(ka, qa, input_precision="ieee")
        acc = tl.dot(kb, qb, acc, input_precision="ieee")
    else:
        acc = tl.dot(ka, qa)
        acc = tl.dot(kb, qb, acc)
    p = (acc + tl.abs(acc)) * w_half[None, :]
    return tl.sum(tl.reshape(p, (BLOCK_N, QT, HP)), axis=2)


#: ``_store_scores``' store of one element (``SIZE`` bytes, ``BITS`` bits) at ``$1 + SIZE · $2`` where ``$4`` is
#: nonzero
_STORE_SCORE_PTX = """{ .reg .pred p; .reg .b64 a;
    setp.ne.b32 p, $4, 0;
    mad.lo.s64 a, $2, SIZE, $1;
    @p st.global.bBITS [a], $3;
    mov.b32 $0, 0; }"""
_STORE_B16_PTX: tl.constexpr = tl.constexpr(_STORE_SCORE_PTX.replace("SIZE", "2").replace("BITS", "16"))
_STORE_B32_PTX: tl.constexpr = tl.constexpr(_STORE_SCORE_PTX.replace("SIZE", "4").replace("BITS", "32"))


@triton.jit
def _store_scores(out_ptr, offsets, scores, mask):
    """``out_ptr[offsets] = scores`` (rounded to the buffer's dtype) where ``mask``, as inline PTX in the scores'
    own register layout: ``tl.store`` would first move the tile through shared memory (two barriers) into a
    coalesced layout. The MMA layout holds each score in four lanes; each stores the same value."""
    base = out_ptr.to(tl.int64, bitcast=True) + tl.zeros_like(offsets)
    if out_ptr.dtype.element_ty == tl.bfloat16:
        bits = scores.to(tl.bfloat16).to(tl.int16, bitcast=True)
        asm: tl.constexpr = _STORE_B16_PTX
        constraints: tl.constexpr = "=r,l,l,h,r"
    else:
        bits = scores.to(tl.float32).to(tl.int32, bitcast=True)
        asm: tl.constexpr = _STORE_B32_PTX
        constraints: tl.constexpr = "=r,l,l,r,r"
    tl.inline_asm_elementwise(asm=asm, constraints=constraints, args=[base, offsets, bits, mask.to(tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _mxfp4_scales(page, slot, live, ENTRIES: tl.constexpr):
    """int32 ``[BLOCK_N, 4]`` biased UE8M0 block exponents of MXFP4 keys: ``page`` ``[BLOCK_N]`` pointers to each
    row's page (``ENTRIES × 64`` packed E2M1 bytes, then ``ENTRIES × 4`` scale bytes), ``slot`` ``[BLOCK_N]`` the
    rows' entry slots, ``live`` ``[BLOCK_N]`` rows to read (the others read as 1)."""
    e = tl.load(page[:, None] + ENTRIES * 64 + slot[:, None] * 4 + tl.arange(0, 4)[None, :], mask=live[:, None],
                other=1)
    return e.to(tl.int32)


@triton.jit
def _scores_kernel(
    pages_ptr,                  # uint8 [num_blocks, PAGE_BYTES]: the layer's indexer key pages
    bt_ptr, bt_stride,          # int32 [B, max_blocks]: block tables
    cu_ptr,                     # int32 [B + 1]: token offsets of each request
    vis_ptr,                    # int64 [T]: entries visible to each token, (pos + 1) // m
    q_ptr,                      # [T, 2, HP, 64] query operand (uint8 E4M3 bytes, or fp32 for FMT_FP32)
    w_ptr,                      # fp32 [T, HP]: head weight · query scale (0 for padded heads)
    out_ptr, out_stride,        # [T, out_stride] scores (score dtype); only s < visible[t] are written
    PAGE_BYTES, TILES_PER_SPLIT,
    M_RATIO: tl.constexpr, BLOCK_SIZE: tl.constexpr, ENTRIES: tl.constexpr,
    HP: tl.constexpr, QT: tl.constexpr, BLOCK_N: tl.constexpr,
    FORMAT: tl.constexpr, USE_ASM: tl.constexpr, NUM_STAGES: tl.constexpr,
    PAGE_VECTOR: tl.constexpr, MAX_TPS: tl.constexpr,
    HOST_BOUND: tl.constexpr,
    TPS_HINT: tl.constexpr,  # interpreter: tiles per split as a loop bound (no data-dependent loops there)
):
    split = tl.program_id(0)
    chunk = tl.program_id(1)
    b = tl.program_id(2)
    tok0 = tl.load(cu_ptr + b)
    n_tok = tl.load(cu_ptr + b + 1) - tok0
    t0 = tok0 + chunk * QT
    nq = tl.minimum(n_tok - chunk * QT, QT)
    if nq <= 0:
        return
    # The chunk's last query sees the most entries (positions increase within a request).
    n_keys = tl.load(vis_ptr + t0 + nq - 1).to(tl.int32)
    tile_lo = split * TILES_PER_SPLIT
    tile_hi = tl.minimum(tile_lo + TILES_PER_SPLIT, tl.cdiv(n_keys, BLOCK_N))
    if tile_lo >= tile_hi:
        return

    NQ: tl.constexpr = QT * HP
    col = tl.arange(0, NQ)
    qi = col // HP  # query of each column
    hh = col % HP
    qrow = t0 + qi
    qlive = qi < nq
    half = tl.arange(0, 64)
    q_off = qrow[:, None] * (2 * HP * 64) + hh[:, None] * 64 + half[None, :]
    if FORMAT == 2:
        qa = tl.trans(tl.load(q_ptr + q_off, mask=qlive[:, None], other=0.0))  # [64, NQ] fp32
        qb = tl.trans(tl.load(q_ptr + q_off + HP * 64, mask=qlive[:, None], other=0.0))
    else:
        qa = tl.trans(tl.load(q_ptr + q_off, mask=qlive[:, None], other=0).to(tl.float8e4nv, bitcast=True))
        qb = tl.trans(tl.load(q_ptr + q_off + HP * 64, mask=qlive[:, None], other=0).to(tl.float8e4nv, bitcast=True))
    w_half = tl.load(w_ptr + qrow * HP + hh, mask=qlive, other=0.0) * 0.5  # [NQ], see _head_sum
    # visible count per query, for the causal mask of the stores
    vis_q = tl.load(vis_ptr + t0 + tl.arange(0, QT), mask=tl.arange(0, QT) < nq, other=0).to(tl.int32)

    rows = tl.arange(0, BLOCK_N)
    zero_rows = tl.zeros([BLOCK_N], dtype=tl.int64)  # a tile's page pointer broadcast over its rows
    bt_row = bt_ptr + b * bt_stride
    if PAGE_VECTOR:
        # Every tile lies in one page (pages hold a multiple of BLOCK_N entries): the split's block-table entries are
        # read once, before the loop, and a tile's page is picked from registers — no load feeds the address of the
        # tile's keys, so the pipeliner can issue them NUM_STAGES − 1 tiles ahead. MXFP4 scales (2 bytes per thread,
        # too small for an asynchronous copy) are loaded into registers a tile ahead.
        tiles = tl.arange(0, MAX_TPS)
        tile_pages = tl.load(bt_row + ((tile_lo + tiles) * BLOCK_N) // ENTRIES, mask=tile_lo + tiles < tile_hi,
                             other=0)
        if FORMAT == 0:
            blk0 = tl.sum(tl.where(tiles == 0, tile_pages, 0)).to(tl.int64)
            e_next = _mxfp4_scales(pages_ptr + blk0 * PAGE_BYTES + zero_rows, (tile_lo * BLOCK_N) % ENTRIES + rows,
                                   tile_lo * BLOCK_N + rows < n_keys, ENTRIES)
    for it in tl.range(0, TPS_HINT if HOST_BOUND else tile_hi - tile_lo, num_stages=NUM_STAGES):
        tile = tile_lo + it
        idx = tile * BLOCK_N + rows
        kl = idx < n_keys
        if PAGE_VECTOR:
            blk = tl.sum(tl.where(tiles == it, tile_pages, 0)).to(tl.int64)
            slot = (tile * BLOCK_N) % ENTRIES + rows
            page = pages_ptr + blk * PAGE_BYTES + zero_rows
        else:
            pos = idx * M_RATIO
            blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=kl, other=0).to(tl.int64)
            slot = (pos % BLOCK_SIZE) // M_RATIO
            page = pages_ptr + blk * PAGE_BYTES
        if FORMAT == 0:
            xb = tl.load(page[:, None, None] + (slot * 64)[:, None, None] + (tl.arange(0, 4) * 16)[None, :, None]
                         + tl.arange(0, 16)[None, None, :], mask=kl[:, None, None], other=0)  # [BLOCK_N, 4, 16]
            if PAGE_VECTOR:
                e = e_next
                nt = tile + 1
                blk_n = tl.sum(tl.where(tiles == it + 1, tile_pages, 0)).to(tl.int64)
                e_next = _mxfp4_scales(pages_ptr + blk_n * PAGE_BYTES + zero_rows, (nt * BLOCK_N) % ENTRIES + rows,
                                       (nt * BLOCK_N + rows < n_keys) & (nt < tile_hi), ENTRIES)
            else:
                e = _mxfp4_scales(page, slot, kl, ENTRIES)
            e_max = tl.max(e, axis=1)
            t_lo, t_hi = _block_tables(e, e_max)
            if USE_ASM:
                klo, khi = _unpack_keys_asm(xb, t_lo[:, :, None], t_hi[:, :, None])
            else:
                klo, khi = _unpack_keys_int(xb, t_lo[:, :, None], t_hi[:, :, None], BLOCK_N)
            ka = tl.reshape(klo, (BLOCK_N, 64)).to(tl.float8e4nv, bitcast=True)
            kb = tl.reshape(khi, (BLOCK_N, 64)).to(tl.float8e4nv, bitcast=True)
            ks = _pow2_from_byte(e_max - 6)
            sc = _head_sum(ka, kb, qa, qb, w_half, BLOCK_N, QT, HP, False)
        elif FORMAT == 1:
            # values: ENTRIES * 128 E4M3 bytes, then ENTRIES fp32 scales
            krow = page[:, None] + slot[:, None] * 128 + half[None, :]
            ka = tl.load(krow, mask=kl[:, None], other=0).to(tl.float8e4nv, bitcast=True)
            kb = tl.load(krow + 64, mask=kl[:, None], other=0).to(tl.float8e4nv, bitcast=True)
            ks = tl.load((page + ENTRIES * 128 + slot * 4).to(tl.pointer_type(tl.float32)), mask=kl, other=0.0)
            sc = _head_sum(ka, kb, qa, qb, w_half, BLOCK_N, QT, HP, False)
        else:
            krow = (page + slot * 512).to(tl.pointer_type(tl.float32))[:, None] + half[None, :]
            ka = tl.load(krow, mask=kl[:, None], other=0.0)
            kb = tl.load(krow + 64, mask=kl[:, None], other=0.0)
            ks = tl.full((BLOCK_N,), 1.0, tl.float32)
            sc = _head_sum(ka, kb, qa, qb, w_half, BLOCK_N, QT, HP, True)
        # relu, head weights (query scale folded in) and the head sum are done; the key scale
        sc = sc * ks[:, None]  # [BLOCK_N, QT]
        dst = (t0 + tl.arange(0, QT))[None, :].to(tl.int64) * out_stride + idx[:, None]
        if USE_ASM:
            _store_scores(out_ptr, dst, sc, idx[:, None] < vis_q[None, :])
        else:
            tl.store(out_ptr + dst, sc.to(out_ptr.dtype.element_ty), mask=idx[:, None] < vis_q[None, :])


#: Most key tiles one program of the scores kernel takes when its pages are held in registers (``PAGE_VECTOR``).
MAX_TILES_PER_SPLIT = 32


def pick_scores_config(fmt: int, head_pad: int, max_new: int) -> dict:
    """Launch parameters of the scores kernel: ``QT`` queries per program (keys read once for all of them),
    ``BLOCK_N`` keys per tile, warps and pipeline depth."""
    qt = 1
    while qt < max_new and qt * 2 * head_pad <= 256:
        qt *= 2
    if fmt == FMT_FP32:
        return dict(QT=max(1, min(qt, 128 // head_pad)), BLOCK_N=64, num_warps=4, NUM_STAGES=2)
    if qt * head_pad >= 256:
        return dict(QT=qt, BLOCK_N=128, num_warps=8, NUM_STAGES=3)
    # 3 stages: a tile's keys are read two tiles ahead (with 2 the copy is issued after a tile's compute and
    # awaited before the next one's, with nothing in between)
    return dict(QT=qt, BLOCK_N=64, num_warps=4, NUM_STAGES=3)


def index_scores(
    pages: Tensor,
    block_tables: Tensor,
    cu_seqlens: Tensor,
    visible: Tensor,
    q: Tensor,
    w: Tensor,
    out: Tensor,
    *,
    fmt: int,
    m: int,
    block_size: int,
    entries_per_page: int,
    num_requests: int,
    max_new: int,
    max_entries: int,
    num_sms: int | None = None,
    config: dict | None = None,
) -> Tensor:
    """Index scores of every query against its request's visible keys, read from the paged pool.

    Args:
        pages: uint8 ``[num_blocks, page_bytes]`` indexer key pages (format ``fmt``).
        block_tables: int32 ``[B, max_blocks]``; cu_seqlens: int32 ``[B + 1]``; visible: int64 ``[T]``.
        q: ``[T, 2, HP, 64]`` query operand (uint8 E4M3 bytes for MXFP4 / FP8, float32 for FP32).
        w: float32 ``[T, HP]`` head weights times the query scales (0 on padded heads).
        out: ``[T, >= max_entries]`` score buffer (BF16 or FP32); row ``t`` is written for ``s < visible[t]``
            only, other elements are left as they were.
        m, block_size, entries_per_page: the layer's ratio and pool geometry.
        num_requests, max_new, max_entries: host facts of the step (grid sizing; no device sync).
        num_sms: multiprocessors to fill (default: the current device's).
        config: override of ``pick_scores_config`` (keys ``QT``, ``BLOCK_N``, ``num_warps``, ``NUM_STAGES``,
            ``PROGRAMS_PER_SM``, ``USE_ASM``, ``PAGE_VECTOR``: a split's block-table entries held in registers, the
            default where tiles lie within a page; ``maxnreg``: a register cap per thread (the Gluon kernel's
            default ``scores_sm90.register_cap``, 0 for none); ``GLUON``: ``False`` keeps the Triton kernel
            where the Gluon one (``indexer_sm90``) would serve: MXFP4 keys on sm_90; ``GLUON_QT``: its queries per
            program for multi-token steps, default ``scores_sm90.CHUNK_QUERIES``; ``MIN_TILES_PER_PROGRAM``: its
            shortest split, default 8).
    Returns:
        ``out``.
    """
    T = q.shape[0]
    if T == 0 or max_entries == 0 or num_requests == 0:
        return out
    HP = q.shape[2]
    cfg = dict(pick_scores_config(fmt, HP, max_new))
    if config:
        cfg.update(config)
    use_gluon = (fmt == FMT_MXFP4 and cfg.get("GLUON", True) and not interpreting()
                 and scores_sm90.applies(HP, entries_per_page) and scores_sm90.available(q.device))
    if use_gluon:
        QT, BLOCK_N = scores_sm90.queries_per_program(max_new, HP, cfg.get("GLUON_QT")), scores_sm90.BLOCK_N
    else:
        QT, BLOCK_N = cfg["QT"], cfg["BLOCK_N"]
    page_vector = cfg.get("PAGE_VECTOR", entries_per_page % BLOCK_N == 0)
    if page_vector and entries_per_page % BLOCK_N:
        raise ValueError(f"PAGE_VECTOR needs tiles within a page: BLOCK_N={BLOCK_N} must divide the "
                         f"{entries_per_page} entries per page")
    chunks = triton.cdiv(max_new, QT)
    tiles = triton.cdiv(max_entries, BLOCK_N)
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
    # many short programs: the last wave's tail stays small
    splits = max(1, min(tiles, triton.cdiv(cfg.get("PROGRAMS_PER_SM", 16) * num_sms, num_requests * chunks)))
    if use_gluon:  # but not so short that the pipeline's fill dominates (small batches)
        splits = min(splits, triton.cdiv(tiles, cfg.get("MIN_TILES_PER_PROGRAM", scores_sm90.MIN_TILES_PER_PROGRAM)))
    per_split = triton.cdiv(tiles, splits)
    if page_vector and not use_gluon:  # a split's pages are held in registers: at most MAX_TILES_PER_SPLIT
        per_split = min(per_split, MAX_TILES_PER_SPLIT)
    splits = triton.cdiv(tiles, per_split)
    if use_gluon:
        scores_sm90.launch(pages, block_tables, cu_seqlens, visible, q, w, out, entries_per_page=entries_per_page,
                            num_requests=num_requests, queries=QT, chunks=chunks, tiles_per_split=per_split,
                            splits=splits, maxnreg=cfg.get("maxnreg"))
        return out
    grid = (splits, chunks, num_requests)
    _scores_kernel[grid](
        pages, block_tables, block_tables.stride(0), cu_seqlens, visible, q, w, out, out.stride(0),
        pages.stride(0), per_split,
        M_RATIO=m, BLOCK_SIZE=block_size, ENTRIES=entries_per_page, HP=HP, QT=QT, BLOCK_N=BLOCK_N,
        FORMAT=fmt, USE_ASM=cfg.get("USE_ASM", not interpreting()), NUM_STAGES=cfg["NUM_STAGES"],
        PAGE_VECTOR=page_vector, MAX_TPS=MAX_TILES_PER_SPLIT,
        HOST_BOUND=interpreting(),
        TPS_HINT=per_split if interpreting() else 0,
        num_warps=cfg["num_warps"],
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
    )
    return out
