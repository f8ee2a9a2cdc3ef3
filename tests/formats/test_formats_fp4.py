"""dsv4.formats.fp4 (E2M1, MXFP4, NVFP4) against an independent scalar model, and dsv4.formats.hadamard."""

from __future__ import annotations

import math
from fractions import Fraction as Fr

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.formats import fp4 as F4
from dsv4.formats import hadamard as H

# --------------------------------------------------------------------------------------------------------------------
# Independent scalar model (exact rationals)
# --------------------------------------------------------------------------------------------------------------------


from support.rounding import FLT_MAX, ceil_log2, floor_log2, fp32, neg, rne, to_float32  # noqa: E402,F401


E2M1_GRID = [Fr(0), Fr(1, 2), Fr(1), Fr(3, 2), Fr(2), Fr(3), Fr(4), Fr(6)]


def ref_e2m1(v: Fr) -> Fr:
    r = rne(v, 1, 0)
    assert abs(r) <= 6
    return r


def ref_e2m1_code(r: Fr, negative: bool) -> int:
    return (int(negative) << 3) | E2M1_GRID.index(abs(r))


def ref_e4m3_code(r: Fr) -> int:
    a = abs(r)
    if a < Fr(1, 64):
        exp, man = 0, a * 512
    else:
        e = floor_log2(a)
        exp, man = e + 7, (a / Fr(2) ** e - 1) * 8
    assert man.denominator == 1
    return (exp << 3) | int(man)


def ref_mxfp4(row: list[float], block: int = 32) -> tuple[list[int], list[int], list[float]]:
    """Official FP4: s = 2**ceil(log2(fp32(max(amax, 6*2**-126) * fp32(1/6)))), codes = e2m1(clamp(v/s))."""
    codes, exps, deq = [], [], []
    for i in range(0, len(row), block):
        blk = row[i:i + block]
        p = fp32(max(Fr(max(abs(v) for v in blk)), 6 * Fr(2) ** -126) * fp32(Fr(1, 6)))
        k = floor_log2(p)
        k = k if Fr(2) ** k == p else k + 1
        exps.append(k + 127)
        s = Fr(2) ** k
        for v in blk:
            r = ref_e2m1(min(max(Fr(v) / s, Fr(-6)), Fr(6)))
            codes.append(ref_e2m1_code(r, neg(v)))
            deq.append(to_float32(r * s))
    return codes, exps, deq


def ref_nvfp4(row: list[float], block: int = 16) -> tuple[list[int], list[int], list[float]]:
    """NVFP4: scale = e4m3(clamp(fp32(amax/6), 2**-9, 448)); codes = e2m1(clamp(fp32(v/scale), -6, 6))."""
    codes, scodes, deq = [], [], []
    for i in range(0, len(row), block):
        blk = row[i:i + block]
        t = min(max(fp32(Fr(max(abs(v) for v in blk)) / 6), Fr(1, 512)), Fr(448))
        sv = rne(t, 3, -6)
        scodes.append(ref_e4m3_code(sv))
        for v in blk:
            r = ref_e2m1(min(max(fp32(Fr(v) / sv), Fr(-6)), Fr(6)))
            codes.append(ref_e2m1_code(r, neg(v)))
            deq.append(to_float32(r * sv))
    return codes, scodes, deq


def pack(codes: list[int]) -> list[int]:
    return [codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)]


# --------------------------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------------------------


def tie_block(g: torch.Generator, k: int, block: int = 32) -> list[float]:
    """amax exactly 6 * 2**k (so s = 2**k), other values exact midpoints between adjacent E2M1 values times 2**k."""
    s = Fr(2) ** k
    idx = torch.randint(0, 7, (block - 1,), generator=g).tolist()
    sign = torch.randint(0, 2, (block - 1,), generator=g).tolist()
    return [float(6 * s)] + [float((E2M1_GRID[i] + E2M1_GRID[i + 1]) / 2 * s * (1 - 2 * sg))
                             for i, sg in zip(idx, sign)]


def fp4_cases(seed: int, block: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = 64
    rows = [(torch.randn(n, generator=g) * sc).tolist() for sc in (1e-6, 1e-2, 1.0, 300.0, 1e4)]
    for k in (-100, -5, 0, 3, 40):
        rows.append((tie_block(g, k) + tie_block(g, -k))[:n])
    rows.append([0.0] * 32 + [-0.0] * 32)
    rows.append([1e30, -1e30] * 16 + [-3e38] + [1.0] * 31)
    rows.append([1e-40 * (i - 16) for i in range(32)] + [1e-30 * (i - 16) for i in range(32)])
    rows.append([((-1) ** i) * (i + 0.25) for i in range(n)])
    rows.append((-torch.rand(n, generator=g) * 3).tolist())  # all negative
    return torch.tensor(rows, dtype=torch.float32)


# --------------------------------------------------------------------------------------------------------------------
# E2M1
# --------------------------------------------------------------------------------------------------------------------


def test_e2m1_values_and_round_trip():
    assert F4.E2M1_MAX == 6.0
    want = [float(v) for v in E2M1_GRID] + [-float(v) for v in E2M1_GRID]
    assert F4.E2M1_VALUES.tolist() == want
    codes = torch.arange(16, dtype=torch.uint8)
    vals = F4.e2m1_decode(codes)
    assert vals.tolist() == want
    assert torch.signbit(vals[8])  # code 8 is -0.0
    assert torch.equal(F4.e2m1_encode(vals), codes)


def test_e2m1_ties_to_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    expect = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    assert torch.equal(F4.e2m1_decode(F4.e2m1_encode(x)), expect)
    assert torch.equal(F4.e2m1_decode(F4.e2m1_encode(-x)), -expect)
    up = torch.nextafter(x, torch.full_like(x, 10))
    assert F4.e2m1_decode(F4.e2m1_encode(up)).tolist() == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_e2m1_negative_zero_is_code_8():
    assert F4.e2m1_encode(torch.tensor([-0.0, -0.1, 0.0, 0.1])).tolist() == [8, 8, 0, 0]


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=-6, max_value=6, width=32))
def test_e2m1_encode_matches_scalar(v):
    assert F4.e2m1_encode(torch.tensor([v])).item() == ref_e2m1_code(ref_e2m1(Fr(v)), neg(v))


def test_pack_unpack_nibbles():
    codes = torch.tensor([[1, 2, 15, 0, 7, 8]], dtype=torch.uint8)
    packed = F4.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x0F, 0x87]]
    assert torch.equal(F4.unpack_nibbles(packed), codes)
    g = torch.Generator().manual_seed(0)
    c = torch.randint(0, 16, (5, 64), generator=g, dtype=torch.uint8)
    assert torch.equal(F4.unpack_nibbles(F4.pack_nibbles(c)), c)
    assert F4.pack_nibbles(c).tolist() == [pack(r) for r in c.tolist()]
    with pytest.raises(ValueError, match="multiple of 2"):
        F4.pack_nibbles(c[:, :3])


# --------------------------------------------------------------------------------------------------------------------
# MXFP4 / NVFP4
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_mxfp4_matches_scalar(seed):
    x = fp4_cases(seed, 32)
    packed, exps = F4.quantize_mxfp4(x)
    assert packed.dtype == exps.dtype == torch.uint8
    assert packed.shape == (x.shape[0], 32) and exps.shape == (x.shape[0], 2)
    deq = F4.dequantize_mxfp4(packed, exps)
    for i, row in enumerate(x.tolist()):
        c, e, d = ref_mxfp4(row)
        assert packed[i].tolist() == pack(c), i
        assert exps[i].tolist() == e, i
        assert deq[i].tolist() == d, i
    assert torch.equal(F4.qdq_mxfp4(x), deq)


def test_mxfp4_bf16_input_is_bf16_exact():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 128, generator=g).bfloat16()
    packed, exps = F4.quantize_mxfp4(x)
    for i, row in enumerate(x.float().tolist()):
        c, e, _ = ref_mxfp4(row)
        assert packed[i].tolist() == pack(c) and exps[i].tolist() == e
    y = F4.qdq_mxfp4(x)
    assert torch.equal(y.bfloat16().float(), y)


@pytest.mark.parametrize("seed", [0, 1])
def test_nvfp4_matches_scalar(seed):
    x = fp4_cases(seed, 16)
    packed, scodes = F4.quantize_nvfp4(x)
    assert packed.shape == (x.shape[0], 32) and scodes.shape == (x.shape[0], 4)
    deq = F4.dequantize_nvfp4(packed, scodes)
    for i, row in enumerate(x.tolist()):
        c, s, d = ref_nvfp4(row)
        assert packed[i].tolist() == pack(c), i
        assert scodes[i].tolist() == s, i
        assert deq[i].tolist() == d, i
    assert torch.equal(F4.qdq_nvfp4(x), deq)


def test_nvfp4_keeps_negatives():
    """The seed clamped v/scale to [0, 6], so every negative value decoded to 0."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 64, generator=g)
    y = F4.qdq_nvfp4(x)
    big_neg = x < -0.3 * x.abs().amax(-1, keepdim=True)
    assert big_neg.any()
    assert (y[big_neg] < 0).all()
    assert torch.equal(torch.sign(y[y != 0]), torch.sign(x[y != 0]))
    assert torch.equal(F4.qdq_nvfp4(-x), -y)
    assert (y - x).abs().max() < 0.3 * x.abs().max()


def test_nvfp4_zero_group_uses_floor_scale():
    packed, scodes = F4.quantize_nvfp4(torch.zeros(2, 16))
    assert scodes.tolist() == [[1], [1]]  # 2**-9, the smallest E4M3 subnormal
    assert torch.equal(F4.dequantize_nvfp4(packed, scodes), torch.zeros(2, 16))


QUANTIZERS = [F4.quantize_mxfp4, F4.qdq_mxfp4, F4.quantize_nvfp4, F4.qdq_nvfp4, F4.e2m1_encode]


@pytest.mark.parametrize("q", QUANTIZERS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_rejected(q, bad):
    x = torch.randn(3, 64) * 0.1
    x[2, 5] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        q(x)


def test_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match="quantize_mxfp4.*multiple"):
        F4.quantize_mxfp4(torch.randn(2, 48))
    with pytest.raises(ValueError, match="quantize_nvfp4.*multiple"):
        F4.quantize_nvfp4(torch.randn(2, 24))
    with pytest.raises(ValueError, match="floating"):
        F4.quantize_mxfp4(torch.ones(2, 32, dtype=torch.int64))
    with pytest.raises(ValueError, match="6"):
        F4.e2m1_encode(torch.tensor([6.5]))
    packed, exps = F4.quantize_mxfp4(torch.randn(2, 64))
    with pytest.raises(ValueError, match="uint8"):
        F4.dequantize_mxfp4(packed.to(torch.int32), exps)
    with pytest.raises(ValueError, match="does not match"):
        F4.dequantize_mxfp4(packed, exps[:, :1])
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        F4.e2m1_decode(torch.tensor([16], dtype=torch.uint8))


# --------------------------------------------------------------------------------------------------------------------
# Hadamard
# --------------------------------------------------------------------------------------------------------------------


def butterfly(x: torch.Tensor) -> torch.Tensor:
    """Recursive unnormalized transform x @ H_n: [x1, x2] @ [[H, H], [H, -H]] = [(x1 + x2) @ H, (x1 - x2) @ H]."""
    n = x.shape[-1]
    if n == 1:
        return x
    a, b = x[..., : n // 2], x[..., n // 2:]
    return torch.cat((butterfly(a + b), butterfly(a - b)), dim=-1)


@pytest.mark.parametrize("n", [1, 2, 4, 8, 64, 128, 256])
def test_hadamard_matrix(n):
    h = H.hadamard_matrix(n)
    assert h.shape == (n, n) and h.dtype == torch.float32
    assert set(h.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(h @ h.T, n * torch.eye(n))
    assert torch.equal(h, h.T)
    assert torch.equal(butterfly(torch.eye(n, dtype=torch.float64)), h.double())
    if n >= 2:
        assert torch.equal(h[: n // 2, : n // 2], H.hadamard_matrix(n // 2))
        assert torch.equal(h[n // 2:, n // 2:], -H.hadamard_matrix(n // 2))
    assert H.hadamard_matrix(n, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_hadamard_transform_orthonormal():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(16, 128, generator=g)
    k = torch.randn(16, 128, generator=g)
    hq, hk = H.hadamard_transform(q), H.hadamard_transform(k)
    assert hq.dtype == torch.float32 and hq.shape == q.shape
    expect = (butterfly(q.double()) / math.sqrt(128)).float()
    torch.testing.assert_close(hq, expect, rtol=0, atol=1e-5)
    torch.testing.assert_close(hq, q @ H.hadamard_matrix(128) / math.sqrt(128), rtol=0, atol=1e-5)
    torch.testing.assert_close(hq.norm(dim=-1), q.norm(dim=-1), rtol=1e-5, atol=0)
    torch.testing.assert_close((hq * hk).sum(-1), (q * k).sum(-1), rtol=0, atol=1e-4)
    # involution: Had(Had(x)) = x
    torch.testing.assert_close(H.hadamard_transform(hq), q, rtol=0, atol=1e-5)
    assert H.hadamard_transform(q.bfloat16()).dtype == torch.float32


def test_hadamard_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        H.hadamard_matrix(96)
    with pytest.raises(ValueError, match="power of two"):
        H.hadamard_transform(torch.randn(3, 12))
