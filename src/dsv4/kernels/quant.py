"""Triton device helpers for the cache's number formats (SPEC §2.3–2.4), bit-exact with ``dsv4.formats``.

Every helper is a ``@triton.jit`` function on fp32 register tensors of any shape; none touches memory. They are
written with integer bit arithmetic and IEEE round-to-nearest operations only, so the results are the same on
the GPU and in the Triton interpreter (whose float→float8 cast is unreliable) — except ``e4m3_round``, which on the
GPU is the hardware's E4M3 conversion, checked equal to the bit arithmetic on every fp32:

* ``ue8m0_exponent`` / ``exp2i``         — the power-of-two ("ue8m0") scale rule: ``ceil(log2 x)`` from the fp32
  bits, and ``2**e`` built from bits;
* ``fp8_block_qdq``                      — official FP8: per block ``s = 2**ceil(log2(max(amax, 1e-4)·fp32(1/448)))``,
  E4M3 codes of ``clamp(v / s, ±448)`` (RNE, subnormals), their values times ``s``, the UE8M0 byte;
* ``e4m3_round``                         — E4M3 code + value of an fp32 clamped to ``[-448, 448]``: the hardware
  conversion on the GPU (``e4m3_round_cvt``), integer arithmetic in the interpreter (``e4m3_round_bits``);
* ``mxfp4_block_qdq`` / ``e2m1_round`` / ``e2m1_magnitude`` — official MXFP4 (block 32, ``s = 2**ceil(log2(max(amax, 6·2⁻¹²⁶)·fp32(1/6)))``);
* ``hadamard128``                        — the normalized 128-point Sylvester Walsh–Hadamard transform as the same
  7 add/subtract butterfly stages as ``formats.hadamard_transform`` (so the fp32 rounding is identical);
* ``pack_nibbles``                       — two E2M1 codes per byte (even element in the low nibble).

Bit-exactness notes: divisions use ``tl.math.div_rn`` or its own operations (``divide_rn``; Triton's ``/`` is an
approximate fp32 division), divisions by a power-of-two scale multiply by its exact reciprocal, and the
kernels that use these helpers are compiled with ``enable_fp_fusion=False`` so that no ``a*b + c`` is contracted
into an FMA that torch would round twice.
"""

from __future__ import annotations

import os
import struct

import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = [
    "expf", "logf", "cosf", "sinf", "rsqrtf", "divide_rn", "reciprocal_rn", "divide_by_reciprocal", "bf16_round",
    "bf16_pairs", "bf16_pair_words", "with_sign_of",
    "ue8m0_exponent", "exp2i", "e4m3_round", "e4m3_round_bits", "e4m3_round_cvt", "fp8_block_qdq",
    "e2m1_magnitude", "e2m1_round", "mxfp4_block_qdq", "hadamard128",
    "pack_nibbles", "split_halves", "seq_sum4_last", "shuffle_down_sum",
]


def _fp32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


# The CUDA math library's expf / logf / cosf / sinf / rsqrtf (libdevice), which torch's CUDA kernels call; Triton's own
# tl.exp / tl.cos lower to faster approximations that round differently. The interpreter has no libdevice, so
# there the numpy-backed tl functions stand in (CPU tests check logic, the GPU tests check bits).
if os.environ.get("TRITON_INTERPRET") == "1":

    @triton.jit
    def expf(x):
        return tl.exp(x)

    @triton.jit
    def logf(x):
        return tl.log(x)

    @triton.jit
    def cosf(x):
        return tl.cos(x)

    @triton.jit
    def sinf(x):
        return tl.sin(x)

    @triton.jit
    def rsqrtf(x):
        return tl.rsqrt(x)

else:
    expf, logf, cosf, sinf, rsqrtf = libdevice.exp, libdevice.log, libdevice.cos, libdevice.sin, libdevice.rsqrt

# ------------------------------------------------------------------------------------------- IEEE division
#: Below this a dividend leaves ``divide_rn``'s fast path (a subset of the range where the hardware's ``FCHK``
#: accepts the division; see ``divide_rn``).
DIV_FAST_MIN: tl.constexpr = tl.constexpr(2.0**-64)
DIV_FAST_MIN_BITS: tl.constexpr = tl.constexpr((127 - 64) << 23)
#: Divisors in ``[1, DIV_FAST_DEN_MAX]`` keep the fast path (a softmax denominator over at most 256 slots): with a
#: dividend in ``[2⁻⁶⁴, 1]`` every operand and quotient is a normal far from the subnormal and overflow ranges.
DIV_FAST_DEN_MAX: tl.constexpr = tl.constexpr(256.0)

if os.environ.get("TRITON_INTERPRET") == "1":

    @triton.jit
    def reciprocal_rn(den):
        return den

    @triton.jit
    def divide_by_reciprocal(e, den, y):
        return tl.math.div_rn(e, den)

else:

    @triton.jit
    def reciprocal_rn(den):
        """``div.rn.f32``'s reciprocal of ``den``: ``MUFU.RCP`` refined by one Newton step (for
        ``divide_by_reciprocal``; computed once per divisor)."""
        y0 = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [den], dtype=tl.float32, is_pure=True,
                                       pack=1)
        return tl.fma(y0, tl.fma(-den, y0, 1.0), y0)

    @triton.jit
    def divide_by_reciprocal(e, den, y):
        """``e / den`` by ``div.rn.f32``'s fast path given ``y = reciprocal_rn(den)``: a quotient refined by one
        residual step (three FMAs). Bit-equal to ``tl.math.div_rn`` where the hardware's ``FCHK`` takes the fast
        path — e.g. a dividend in ``[2⁻⁶⁴, 1]`` or +0 and a divisor in ``[1, DIV_FAST_DEN_MAX]``; the caller
        guarantees it (``e = +0`` gives +0)."""
        q0 = tl.fma(e, y, 0.0)
        return tl.fma(y, tl.fma(-den, q0, e), q0)


@triton.jit
def divide_rn(e, den):
    """``e / den`` rounded as IEEE division (bit-equal to ``tl.math.div_rn``) for ``e`` ≥ 0 and a divisor that
    is the same across ``e``'s first axis (``den`` broadcast from ``[1, C]``; a softmax's denominator).

    ``div.rn.f32`` compiles to a reciprocal (``MUFU.RCP`` refined by one Newton step), a quotient refined by
    one residual step (three FMAs), and an ``FCHK`` test that sends divisions outside its safe range through
    a slow-path subroutine. Here the reciprocal is computed once per divisor (``reciprocal_rn``) and the same
    FMAs run per element (``divide_by_reciprocal``) — the same operations, so the same bits wherever ``FCHK``
    takes the fast path, which it does for a normal dividend ≥ 2⁻⁶⁴ and a divisor in [1, ``DIV_FAST_DEN_MAX``]
    (quotients far from the subnormal and overflow ranges). A zero dividend gives +0 (what the division returns
    for a positive divisor). Anything else (tiny dividends, a divisor outside that range, NaN) is divided by
    ``tl.math.div_rn``, in a branch taken only by programs that hold such an element. (The interpreter runs
    ``div_rn`` throughout.)
    """
    q = divide_by_reciprocal(e, den, reciprocal_rn(den))
    den_ok = (den >= 1.0) & (den <= DIV_FAST_DEN_MAX)  # NaN fails
    # e's bits − 1 as unsigned is below bits(2⁻⁶⁴) − 1 exactly when 0 < e < 2⁻⁶⁴: one min over the tile
    tiny = tl.min((e.to(tl.int32, bitcast=True) - 1).to(tl.uint32, bitcast=True)) < DIV_FAST_MIN_BITS - 1
    if tiny | (tl.min(den_ok.to(tl.int32)) == 0):
        slow = ((e > 0.0) & (e < DIV_FAST_MIN)) | ~den_ok
        q = tl.where(slow, tl.math.div_rn(e, den), q)
    return q


INV_448: tl.constexpr = tl.constexpr(_fp32(1.0 / 448.0))
INV_6: tl.constexpr = tl.constexpr(_fp32(1.0 / 6.0))
FP8_AMAX_FLOOR: tl.constexpr = tl.constexpr(_fp32(1e-4))
MXFP4_AMAX_FLOOR: tl.constexpr = tl.constexpr(6.0 * 2.0**-126)
INV_SQRT_128: tl.constexpr = tl.constexpr(_fp32(1.0 / 128**0.5))


# ------------------------------------------------------------------------------------------- BF16
@triton.jit
def bf16_round(x):
    """Round fp32 ``x`` to the nearest BF16 value, ties to even; returns fp32 (exactly representable in BF16, so a
    following ``.to(tl.bfloat16)`` is exact). Same as the GPU's ``cvt.rn.bf16.f32`` on finite values; spelled out
    because the interpreter's cast truncates."""
    bits = x.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # clear the low 16 bits (0xFFFF0000)
    return r.to(tl.float32, bitcast=True)


@triton.jit
def bf16_pairs(words):
    """Pairs of BF16 values packed in int32 ``words`` (first value in the low half, little endian) → ``(re, im)``
    fp32, each widened exactly by a shift."""
    return (words << 16).to(tl.float32, bitcast=True), (words & -65536).to(tl.float32, bitcast=True)


@triton.jit
def bf16_pair_words(re, im):
    """``bf16_pairs``' inverse for BF16-valued fp32 ``re`` / ``im`` (e.g. ``bf16_round``'s results): int32 words."""
    return ((re.to(tl.int32, bitcast=True) >> 16) & 0xFFFF) | (im.to(tl.int32, bitcast=True) & -65536)


# ------------------------------------------------------------------------------------------- power-of-two scales
@triton.jit
def ue8m0_exponent(x):
    """``ceil(log2(x))`` of positive normal fp32 ``x`` from its bits (exponent field, +1 if any mantissa bit).

    Args: ``x`` fp32, any shape, > 0 and normal. Returns int32, same shape.
    """
    bits = x.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def exp2i(e):
    """``2.0**e`` as fp32 for int32 ``e`` in ``[-126, 127]`` (built from the exponent bits, exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


# ------------------------------------------------------------------------------------------- E4M3
@triton.jit
def with_sign_of(mag, bits):
    """``mag`` (fp32 ≥ +0) with the sign bit of int32 ``bits`` — ``-0.0`` kept (Triton's ``-x`` is ``0 − x``)."""
    return (mag.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_round_bits(y):
    """Round fp32 ``y`` clamped to ``[-448, 448]`` to E4M3, round-to-nearest-even, subnormals down to ``2**-9``, in
    integer and fp32 arithmetic (what ``e4m3_round`` runs in the interpreter).

    Returns ``(code, value)``: int32 bit patterns in ``[0, 256)`` (sign bit kept: ``-0.0`` → 0x80) and the fp32
    value of the code. Same shape as ``y``.
    """
    bits = tl.minimum(tl.maximum(y, -448.0), 448.0).to(tl.int32, bitcast=True)
    neg = bits < 0
    ab = bits & 0x7FFFFFFF
    ay = ab.to(tl.float32, bitcast=True)
    # |y| < 2**-6: E4M3 subnormals, multiples of 2**-9. ay * 512 is exact; adding and removing 2**23 rounds it to
    # the nearest integer, ties to even (fp32 RNE).
    q = (ay * 512.0 + 8388608.0) - 8388608.0
    sub_code = q.to(tl.int32)
    sub_val = q * 0.001953125
    # Normal range: round the 23-bit mantissa to 3 bits (RNE); a carry moves into the exponent as it should.
    r = (ab + 0x7FFFF + ((ab >> 20) & 1)) & -1048576  # clear the low 20 bits (0xFFF00000)
    norm_code = ((((r >> 23) & 0xFF) - 120) << 3) | ((r >> 20) & 7)
    norm_val = r.to(tl.float32, bitcast=True)
    is_sub = ab < 0x3C800000  # 2**-6
    code = tl.where(is_sub, sub_code, norm_code) | tl.where(neg, 0x80, 0)
    val = tl.where(is_sub, sub_val, norm_val)
    return code, with_sign_of(val, bits)


@triton.jit
def e4m3_round_cvt(y):
    """``e4m3_round_bits`` by the hardware conversion (``cvt.rn.satfinite.e4m3x2.f32``, whose saturation is the
    clamp, then the exact E4M3 → fp32 widening): the same codes and values for every fp32 but NaN (a NaN stays NaN,
    0x7F / 0xFF, where the clamp would make it ±448; checked on every fp32 by
    ``tests/kernels/write/test_write_path_gpu.py::test_e4m3_conversion_is_the_bit_arithmetic``), in ~3 instructions per
    element instead of ~17."""
    f8 = y.to(tl.float8e4nv)
    return f8.to(tl.uint8, bitcast=True).to(tl.int32), f8.to(tl.float32)


# The interpreter's float → float8 cast is unreliable: there the bit arithmetic runs (the GPU tests check that both
# give the same bits on every input in range).
e4m3_round = e4m3_round_bits if os.environ.get("TRITON_INTERPRET") == "1" else e4m3_round_cvt


@triton.jit
def fp8_block_qdq(v, AXIS: tl.constexpr, BITS: tl.constexpr = False):
    """Official FP8 block quantization of ``v`` (fp32), one block along ``AXIS`` (the last axis, length 64).

    Per block ``a = max(max|v|, 1e-4)``, ``s = 2**ceil(log2(a·fp32(1/448)))``, ``code = e4m3(clamp(v / s, ±448))``
    (the clamp matters only where ``a·fp32(1/448)`` rounded down onto ``s``). ``BITS``: round by
    ``e4m3_round_bits`` on the GPU too, the same bits — the compressor's entry encoder uses it, because there the
    hardware conversion costs registers (V4-Flash CSA decode launch: 128 → 168 per thread, 4 → 3 programs per SM).

    Returns ``(code int32 like v, value fp32 like v = e4m3(code)·s, exponent byte int32 [...] = log2(s) + 127)``.
    """
    amax = tl.max(tl.abs(v), axis=AXIS)
    e = ue8m0_exponent(tl.maximum(amax, FP8_AMAX_FLOOR) * INV_448)
    s = tl.expand_dims(exp2i(e), AXIS)
    # v / s == v · 2⁻ᵉ exactly (both are the exact value rounded once; e ∈ [−22, 120], so 2⁻ᵉ is a normal fp32)
    y = v * tl.expand_dims(exp2i(-e), AXIS)
    if BITS:
        code, val = e4m3_round_bits(y)
    else:
        code, val = e4m3_round(y)
    return code, val * s, e + 127


# ------------------------------------------------------------------------------------------- E2M1 / MXFP4
@triton.jit
def e2m1_magnitude(m):
    """The E2M1 magnitude code (int32 0…7) of fp32 ``m`` in ``[0, 6]``, rounded to nearest, ties to even — the
    7 thresholds of ``formats.fp4.e2m1_encode`` (0.25 <, 0.75 ≤, 1.25 <, 1.75 ≤, 2.5 <, 3.5 ≤, 5 <) from the fp32
    bits in a few integer operations instead of seven comparisons:

    * below 1 the codes 0, 1, 2 are the multiples of 0.5: ``2m`` rounded to an integer (adding ``1.5·2²³`` rounds
      it, RNE, into the low significand bits);
    * from 1 up a code is the exponent and one significand bit: the fp32 bits rounded to their top 10 bits (RNE),
      less the bits of 1.0's code (``127·2 − 2``).

    Equal to the thresholds on every fp32 in ``[0, 6]`` (checked exhaustively on the GPU,
    ``tests/kernels/test_e2m1_magnitude.py``)."""
    b = m.to(tl.int32, bitcast=True)
    below_one = (m * 2.0 + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000
    from_one = ((b + 0x1FFFFF + ((b >> 22) & 1)) >> 22) - 252
    return tl.where(m < 1.0, below_one, from_one)


@triton.jit
def e2m1_round(y):
    """Round fp32 ``y`` (``|y| <= 6``) to E2M1 as ``formats.fp4.e2m1_encode`` (7 RNE thresholds, sign bit kept).

    Returns ``(code int32 in [0, 16), value fp32)``, same shape as ``y``.
    """
    c = e2m1_magnitude(tl.abs(y))
    ex = c >> 1
    frac = (c & 1).to(tl.float32)
    mag = tl.where(ex == 0, 0.5 * frac, (1.0 + 0.5 * frac) * exp2i(ex - 1))
    bits = y.to(tl.int32, bitcast=True)
    return c | tl.where(bits < 0, 8, 0), with_sign_of(mag, bits)


@triton.jit
def mxfp4_block_qdq(v, AXIS: tl.constexpr):
    """Official MXFP4 block quantization of ``v`` (fp32), one block along ``AXIS`` (the last axis, length 32).

    Returns ``(code int32 like v in [0, 16), value fp32 like v, exponent byte int32 [...])``.
    """
    amax = tl.max(tl.abs(v), axis=AXIS)
    e = ue8m0_exponent(tl.maximum(amax, MXFP4_AMAX_FLOOR) * INV_6)
    s = tl.expand_dims(exp2i(e), AXIS)
    # v / s == v · 2⁻ᵉ exactly (e ∈ [−126, 126]: 2⁻ᵉ is a normal fp32)
    y = tl.minimum(tl.maximum(v * tl.expand_dims(exp2i(-e), AXIS), -6.0), 6.0)
    code, val = e2m1_round(y)
    return code, val * s, e + 127


@triton.jit
def pack_nibbles(code, N: tl.constexpr):
    """``[N]`` int32 codes in ``[0, 16)`` → ``[N // 2]`` int32 bytes ``code[2i] | code[2i+1] << 4``."""
    lo, hi = tl.split(tl.reshape(code, (N // 2, 2)))
    return lo | (hi << 4)


# ------------------------------------------------------------------------------------------- data movement + sums
@triton.jit
def split_halves(x, N: tl.constexpr):
    """``[N]`` → ``(x[:N//2], x[N//2:])`` (pure data movement, no arithmetic)."""
    return tl.split(tl.trans(tl.reshape(x, (2, N // 2))))


@triton.jit
def columns4(t):
    """``(t[..., 0], t[..., 1], t[..., 2], t[..., 3])`` of a last axis of length 4 (pure data movement)."""
    ev, od = tl.split(tl.reshape(t, t.shape[:-1] + [2, 2]))  # ev = t[..., 0::2], od = t[..., 1::2]
    t0, t2 = tl.split(ev)
    t1, t3 = tl.split(od)
    return t0, t1, t2, t3


@triton.jit
def seq_sum4_last(t):
    """``((t[..., 0] + t[..., 1]) + t[..., 2]) + t[..., 3]`` over a last axis of length 4, in exactly that order."""
    t0, t1, t2, t3 = columns4(t)
    return ((t0 + t1) + t2) + t3


@triton.jit
def halves_last(t):
    """``[R, N]`` → ``(t[:, :N//2], t[:, N//2:])`` (pure data movement)."""
    R: tl.constexpr = t.shape[0]
    N: tl.constexpr = t.shape[1]
    return tl.split(tl.permute(tl.reshape(t, (R, 2, N // 2)), (0, 2, 1)))


@triton.jit
def seq_add4_last(acc, t):
    """``(((acc + t[:, 0]) + t[:, 1]) + t[:, 2]) + t[:, 3]`` for ``t`` ``[R, 4]``, ``acc`` ``[R]``."""
    t0, t1, t2, t3 = columns4(t)
    return (((acc + t0) + t1) + t2) + t3


@triton.jit
def seq_accumulate_rows(acc, t, N: tl.constexpr):
    """``acc + t[0] + t[1] + … + t[N−1]``, one row at a time in that order (``t`` ``[N, C]``, ``acc`` ``[C]``,
    N = 4, 8 or 16): a running sum over a tile of rows with the order of a row-by-row loop, without a loop
    iteration (and its address arithmetic) per row."""
    tt = tl.trans(t)  # [C, N]
    if N == 4:
        acc = seq_add4_last(acc, tt)
    else:
        a, b = halves_last(tt)
        if N == 8:
            acc = seq_add4_last(seq_add4_last(acc, a), b)
        else:
            a0, a1 = halves_last(a)
            b0, b1 = halves_last(b)
            acc = seq_add4_last(seq_add4_last(seq_add4_last(seq_add4_last(acc, a0), a1), b0), b1)
    return acc


@triton.jit
def shuffle_down_sum(t, N: tl.constexpr, LOG2N: tl.constexpr):
    """Sum of a 1-D ``[N]`` (N a power of two ≥ 2) in the order of a CUDA warp's shuffle-down reduction with
    offsets N/2, …, 2, 1 (torch's ``block_x_reduce``): each level adds the upper half onto the lower half, and lane
    0 ends with ``(…((t0 + t16) + (t8 + t24)) + …)``. Returns a ``[1]`` tensor."""
    for lvl in tl.static_range(LOG2N):
        lo, hi = split_halves(t, N >> lvl)
        t = lo + hi
    return t


# ------------------------------------------------------------------------------------------- Hadamard
@triton.jit
def hadamard128(x):
    """Normalized Walsh–Hadamard transform of ``x`` fp32 ``[128]``: the butterfly stages h = 1, 2, …, 64 of
    ``formats.hadamard_transform`` (pairs at distance h become ``(a + b, a − b)``), then ``· fp32(128**-0.5)``."""
    for lvl in tl.static_range(7):
        # stage h = 2**lvl: view x as [64 / h, 2, h]; (a, b) = the two rows of each [2, h] pair
        y = tl.permute(tl.reshape(x, (64 >> lvl, 2, 1 << lvl)), (0, 2, 1))
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (128,))
    return x * INV_SQRT_128
