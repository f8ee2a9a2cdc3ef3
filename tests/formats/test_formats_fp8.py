"""dsv4.formats.fp8 against an independent scalar model (exact rationals, no torch casts)."""

from __future__ import annotations

import math
from fractions import Fraction as Fr

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.formats import fp8 as F8

# --------------------------------------------------------------------------------------------------------------------
# Independent scalar model
# --------------------------------------------------------------------------------------------------------------------


from support.rounding import FLT_MAX, ceil_log2, floor_log2, fp32, neg, rne, to_float32  # noqa: E402,F401


def ref_e4m3(v: Fr) -> Fr:
    r = rne(v, 3, -6)
    assert abs(r) <= 448
    return r


def ref_e4m3_code(r: Fr, negative: bool) -> int:
    """Bit pattern of an on-grid E4M3 value r (sign taken from ``negative``)."""
    a = abs(r)
    if a < Fr(1, 64):
        exp, man = 0, a / Fr(1, 512)
    else:
        e = floor_log2(a)
        exp, man = e + 7, (a / Fr(2) ** e - 1) * 8
    assert man.denominator == 1 and 0 <= man < 8 and 0 <= exp < 16
    return (int(negative) << 7) | (exp << 3) | int(man)


def ref_e4m3_value(code: int) -> float:
    s, exp, man = code >> 7, (code >> 3) & 15, code & 7
    if exp == 15 and man == 7:
        return math.nan
    mag = man * 2.0 ** -9 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
    return -mag if s else mag


def ref_pow2_exponent(amax: float, qmax: float, floor: float) -> int:
    """ceil(log2(fp32(max(amax, fp32(floor)) * fp32(1/qmax)))) -- the kernel's fast_round_scale rule."""
    a = max(Fr(amax), fp32(Fr(floor)))
    return ceil_log2(fp32(a * fp32(1 / Fr(qmax))))


def ref_fp8_block(row: list[float], block: int = 64) -> tuple[list[int], list[int], list[float]]:
    """Official block FP8 of one row: (codes, exponent bytes, dequantized values)."""
    codes, exps, deq = [], [], []
    for i in range(0, len(row), block):
        blk = row[i:i + block]
        k = ref_pow2_exponent(max(abs(v) for v in blk), 448, 1e-4)
        exps.append(k + 127)
        s = Fr(2) ** k
        for v in blk:
            q = min(max(Fr(v) / s, Fr(-448)), Fr(448))
            r = ref_e4m3(q)
            codes.append(ref_e4m3_code(r, neg(v)))
            deq.append(to_float32(r * s))
    return codes, exps, deq


def ref_fp8_per_token(row: list[float], floor: float) -> tuple[list[int], float, list[float]]:
    a = max(Fr(max(abs(v) for v in row)), fp32(Fr(floor)))
    scale = fp32(a / 448)
    codes, deq = [], []
    for v in row:
        q = min(max(fp32(Fr(v) / scale), Fr(-448)), Fr(448))
        r = ref_e4m3(q)
        codes.append(ref_e4m3_code(r, neg(v)))
        deq.append(to_float32(r * scale))
    return codes, float(scale), deq


# --------------------------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------------------------

E4M3_POS = sorted({Fr(ref_e4m3_value(c)) for c in range(0x7F)})  # 0 .. 448, 127 values


def tie_block(gen: torch.Generator, k: int, block: int = 64) -> list[float]:
    """A block whose amax is exactly 448 * 2**k (so s = 2**k) filled with exact midpoints between adjacent E4M3
    values (incl. subnormal ones) times 2**k, with random signs."""
    s = Fr(2) ** k
    idx = torch.randint(0, len(E4M3_POS) - 1, (block - 1,), generator=gen).tolist()
    sign = torch.randint(0, 2, (block - 1,), generator=gen).tolist()
    vals = [float((E4M3_POS[i] + E4M3_POS[i + 1]) / 2 * s * (1 - 2 * sg)) for i, sg in zip(idx, sign)]
    vals[:4] = [float(Fr(1, 1024) * s), float(-Fr(3, 1024) * s), float(Fr(5, 1024) * s), float(Fr(15, 128) * s)]
    return [float(448 * s)] + vals


def per_token_tie_row(g: torch.Generator, amax: float) -> list[float]:
    """amax followed by fp32 values nearest to (E4M3 midpoint) * scale and their fp32 neighbours, scale being the
    per-token scale fp32(amax / 448): v / scale then lands on or next to a rounding boundary."""
    amax = float(fp32(Fr(amax)))
    scale = fp32(Fr(amax) / 448)
    idx = torch.randint(0, len(E4M3_POS) - 1, (43,), generator=g).tolist()
    mids = torch.tensor([float(fp32((E4M3_POS[i] + E4M3_POS[i + 1]) / 2 * scale)) for i in idx])
    vals = torch.cat([mids, torch.nextafter(mids, mids * 2), -torch.nextafter(mids, mids * 0)])[:127]
    return [amax] + vals.tolist()


def fp8_cases(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for scale in (1e-6, 1e-3, 1.0, 37.0, 1e4):
        rows.append((torch.randn(128, generator=g) * scale).tolist())
    for k in (-20, -3, 0, 1, 7, 60):
        rows.append(tie_block(g, k) + tie_block(g, -k))
    rows.append([0.0] * 64 + [-0.0] * 64)  # all-zero blocks
    rows.append([1e30, -1e30] * 32 + [-3e38] + [1.0] * 63)  # huge
    rows.append([1e-40 * (i - 32) for i in range(64)] + [2e-38 * (i - 32) for i in range(64)])  # fp32 subnormals
    rows.append([448.0] + (torch.rand(63, generator=g) * 2 ** -5 - 2 ** -6).tolist()
                + [-(2.0 ** 9)] + (torch.rand(63, generator=g) * 2 ** -4).tolist())  # e4m3-subnormal range
    rows.append([((-1) ** i) * (i + 0.5) for i in range(128)])  # mixed sign
    for amax in (300.7, 1.234e-3, 5e3):
        rows.append(per_token_tie_row(g, amax))
    return torch.tensor(rows, dtype=torch.float32)


# --------------------------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------------------------


def test_all_e4m3_codes_round_trip():
    codes = torch.arange(256, dtype=torch.uint8)
    vals = F8.e4m3_decode(codes)
    for c in range(256):
        want = ref_e4m3_value(c)
        if math.isnan(want):
            assert c in (0x7F, 0xFF) and math.isnan(vals[c].item())
        else:
            assert vals[c].item() == want and math.copysign(1, vals[c].item()) == math.copysign(1, want), c
    ok = ~torch.isnan(vals)
    assert ok.sum() == 254
    assert torch.equal(F8.e4m3_encode(vals[ok]), codes[ok])


def test_e4m3_encode_midpoints_and_neighbours():
    mids = [(a + b) / 2 for a, b in zip(E4M3_POS, E4M3_POS[1:])]
    xs = torch.tensor([float(m) for m in mids], dtype=torch.float32)
    up, down = torch.nextafter(xs, torch.full_like(xs, 1e9)), torch.nextafter(xs, torch.zeros_like(xs))
    x = torch.cat([xs, up, down, -xs, -up, -down])
    want = [ref_e4m3_code(ref_e4m3(Fr(v)), neg(v)) for v in x.tolist()]
    assert F8.e4m3_encode(x).tolist() == want


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=-448, max_value=448, width=32))
def test_e4m3_encode_matches_scalar(v):
    assert F8.e4m3_encode(torch.tensor([v])).item() == ref_e4m3_code(ref_e4m3(Fr(v)), neg(v))


def test_ue8m0_exponent_and_pow2_scale():
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.rand(500, generator=g) * 10.0 ** torch.randint(-30, 30, (500,), generator=g),
                   2.0 ** torch.arange(-126, 127, dtype=torch.float32)])
    x = torch.cat([x, torch.nextafter(x, torch.zeros_like(x)), torch.nextafter(x, torch.full_like(x, 3e38))])
    x = x[x >= 2 ** -126]
    e = F8.ue8m0_exponent(x)
    assert e.dtype == torch.int32
    assert e.tolist() == [ceil_log2(Fr(v)) for v in x.tolist()]
    for qmax, floor in ((448.0, 1e-4), (6.0, 6 * 2.0 ** -126)):
        s = F8.pow2_scale(x, qmax, floor)
        assert s.dtype == torch.float32
        assert s.tolist() == [2.0 ** ref_pow2_exponent(v, qmax, floor) for v in x.tolist()]
        assert (x.clamp_min(floor) / s <= qmax).all()


def test_pow2_scale_uses_fp32_reciprocal():
    # amax = 448 * 2**k exactly gives s = 2**k; the value just above gives 2**(k+1).
    k = torch.arange(-10, 10, dtype=torch.float32)
    a = 448 * 2.0 ** k
    assert torch.equal(F8.pow2_scale(a, 448.0, 1e-4), 2.0 ** k)
    assert torch.equal(F8.pow2_scale(torch.nextafter(a, a * 2), 448.0, 1e-4), 2.0 ** (k + 1))
    assert torch.equal(F8.pow2_scale(torch.zeros(3), 448.0, 1e-4), torch.full((3,), 2.0 ** -22))


@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_block_matches_scalar(seed):
    x = fp8_cases(seed)
    codes, exps = F8.quantize_fp8_block(x)
    assert codes.dtype == exps.dtype == torch.uint8 and codes.shape == x.shape and exps.shape == (x.shape[0], 2)
    deq = F8.dequantize_fp8_block(codes, exps)
    for i, row in enumerate(x.tolist()):
        c, e, d = ref_fp8_block(row)
        assert codes[i].tolist() == c, i
        assert exps[i].tolist() == e, i
        assert deq[i].tolist() == d, i
    assert torch.equal(F8.qdq_fp8_block(x), deq)


def test_fp8_block_bf16_input_and_block_sizes():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 256, generator=g) * 5).bfloat16()
    codes, exps = F8.quantize_fp8_block(x, block=128)
    for i, row in enumerate(x.float().tolist()):
        c, e, _ = ref_fp8_block(row, 128)
        assert codes[i].tolist() == c and exps[i].tolist() == e
    # values are exactly representable in bf16 (SPEC §2.4)
    y = F8.qdq_fp8_block(x)
    assert torch.equal(y.bfloat16().float(), y)


def test_fp8_block_never_clips_and_is_close():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 448, generator=g) * 3
    y = F8.qdq_fp8_block(x)
    assert (y - x).abs().max() <= x.abs().max() / 8
    assert not torch.equal(y, x)  # quantization actually happened


@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_per_token_matches_scalar(seed):
    x = fp8_cases(seed)
    codes, scale = F8.quantize_fp8_per_token(x)
    assert scale.dtype == torch.float32 and scale.shape == (x.shape[0],)
    deq = F8.dequantize_fp8_per_token(codes, scale)
    for i, row in enumerate(x.tolist()):
        c, s, d = ref_fp8_per_token(row, F8.FP8_PER_TOKEN_AMAX_FLOOR)
        assert codes[i].tolist() == c, i
        assert scale[i].item() == s, i
        assert deq[i].tolist() == d, i
    assert torch.equal(F8.qdq_fp8_per_token(x), deq)


def test_fp8_per_token_zeros_give_zeros():
    y = F8.qdq_fp8_per_token(torch.zeros(3, 64))
    assert torch.equal(y, torch.zeros(3, 64))
    _, scale = F8.quantize_fp8_per_token(torch.zeros(2, 8))
    assert (scale > 0).all() and torch.isfinite(scale).all()


def test_fp8_key_matches_scalar():
    g = torch.Generator().manual_seed(5)
    x = torch.cat([torch.randn(3, 128, generator=g) * 10.0 ** torch.tensor([[-6.0], [0.0], [3.0]]),
                   torch.zeros(1, 128)])
    codes, scale = F8.quantize_fp8_key(x)
    for i, row in enumerate(x.tolist()):
        c, s, d = ref_fp8_per_token(row, 1e-4)
        assert codes[i].tolist() == c and scale[i].item() == s
        assert F8.qdq_fp8_key(x)[i].tolist() == d
    with pytest.raises(ValueError, match="128"):
        F8.quantize_fp8_key(torch.randn(2, 64))


QUANTIZERS = [
    lambda x: F8.quantize_fp8_block(x),
    lambda x: F8.qdq_fp8_block(x),
    lambda x: F8.quantize_fp8_per_token(x),
    lambda x: F8.qdq_fp8_per_token(x),
    lambda x: F8.quantize_fp8_key(x),
    lambda x: F8.e4m3_encode(x),
]


@pytest.mark.parametrize("q", QUANTIZERS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_rejected(q, bad):
    x = torch.randn(2, 128)
    x[1, 77] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        q(x)


def test_check_false_skips_nan_check():
    x = torch.randn(2, 64)
    x[0, 0] = math.nan
    F8.quantize_fp8_block(x, check=False)  # no exception


def test_fp64_overflowing_fp32_rejected():
    with pytest.raises(ValueError, match="NaN or Inf"):
        F8.quantize_fp8_block(torch.full((64,), 1e300, dtype=torch.float64))


def test_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match="quantize_fp8_block.*multiple"):
        F8.quantize_fp8_block(torch.randn(2, 100))
    with pytest.raises(ValueError, match="floating"):
        F8.quantize_fp8_block(torch.ones(64, dtype=torch.int32))
    with pytest.raises(ValueError, match="floating"):
        F8.quantize_fp8_per_token(torch.ones(64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="448"):
        F8.e4m3_encode(torch.tensor([449.0]))
    codes, exps = F8.quantize_fp8_block(torch.randn(2, 128))
    with pytest.raises(ValueError, match="uint8"):
        F8.dequantize_fp8_block(codes.float(), exps)
    with pytest.raises(ValueError, match="uint8"):
        F8.e4m3_decode(codes.to(torch.int8))
    with pytest.raises(ValueError, match="does not match"):
        F8.dequantize_fp8_block(codes, exps[:, :1])
    with pytest.raises(ValueError, match="multiple"):
        F8.dequantize_fp8_block(codes[:, :100], exps)
    c2, s2 = F8.quantize_fp8_per_token(torch.randn(2, 16))
    with pytest.raises(ValueError, match="shape"):
        F8.dequantize_fp8_per_token(c2, s2[:1])


def test_ue8m0_decode_special_bytes():
    b = torch.tensor([0, 1, 127, 128, 254, 255], dtype=torch.uint8)
    v = F8.ue8m0_decode(b)
    assert v[:5].tolist() == [2.0 ** -127, 2.0 ** -126, 1.0, 2.0, 2.0 ** 127]
    assert math.isnan(v[5].item())
    s = 2.0 ** torch.arange(-126, 128, dtype=torch.float32)
    assert torch.equal(F8.ue8m0_decode(F8.ue8m0_encode(s)), s)
