"""Block-scaled FP8 projections (``formats.block_fp8``): the official quantization points against independent
computations — the activation quantizer against a scalar model of ``act_quant``, ``fp8_linear`` against FP64 sums
of the same quantized operands — and the weights' round trip."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.formats.block_fp8 import (BlockFp8Weight, dequantize_activations, fp8_linear, qdq_activations,
                                    quantize_activations)


def _scalar_act_quant(row: list[float]) -> list[float]:
    """One row through the official act_quant with UE8M0 scales, value by value in Python: per block of 128
    ``s = 2^ceil(log2(max(amax, 1e-4) / 448))``, the value rounded to the nearest E4M3 (ties to even) times ``s``."""
    e4m3 = sorted({float(v) for v in torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
                   if math.isfinite(v)})
    out = []
    for b0 in range(0, len(row), 128):
        block = row[b0:b0 + 128]
        a = max(max(abs(v) for v in block), 1e-4)
        ratio = torch.tensor(a, dtype=torch.float32) / torch.tensor(448.0)  # the fp32 division the kernels do
        s = 2.0 ** math.ceil(math.log2(float(ratio)))
        for v in block:
            y = max(-448.0, min(448.0, float(torch.tensor(v, dtype=torch.float32) / torch.tensor(s))))
            best = min(e4m3, key=lambda c: (abs(c - y), abs(torch.tensor(c).to(torch.float8_e4m3fn).view(
                torch.uint8).item() & 1)))
            out.append(best * s)
    return out


@pytest.mark.parametrize("K", [128, 200, 384])
def test_activation_quantizer_matches_a_scalar_model(K: int) -> None:
    g = torch.Generator().manual_seed(K)
    x = torch.randn(3, K, generator=g) * torch.exp(3 * torch.randn(3, 1, generator=g))
    x[0, :5] = torch.tensor([0.0, -0.0, 1e-6, 448.0, -1e-30])
    got = qdq_activations(x)
    for r in range(3):
        want = torch.tensor(_scalar_act_quant(x[r].tolist()))
        assert torch.equal(got[r], want), (r, (got[r] - want).abs().max())
    codes, exps = quantize_activations(x)
    assert codes.dtype == torch.uint8 and exps.shape == (3, -(-K // 128))
    assert torch.equal(dequantize_activations(codes, exps), got)


@pytest.mark.parametrize("M,N,K", [(1, 256, 384), (7, 130, 200), (64, 64, 128)])
def test_fp8_linear_equals_fp64_sums_of_the_same_operands(M: int, N: int, K: int) -> None:
    """The reference FP8 GEMM forms the official products exactly and sums them in FP32: against the FP64 sum of
    the same quantized operands it differs only by FP32 summation error (and the final rounding)."""
    g = torch.Generator().manual_seed(M * 1000 + N)
    w = BlockFp8Weight.quantize(torch.randn(N, K, generator=g) * K**-0.5)
    x = torch.randn(M, K, generator=g)
    got = fp8_linear(x, w, torch.float32)
    want = qdq_activations(x).double() @ w.dequantize().double().T
    rel = ((got.double() - want).norm() / want.norm()).item()
    assert rel < 1e-6, rel
    assert not torch.equal(qdq_activations(x), x)  # the activations really were quantized


def test_block_fp8_weight_round_trip_and_errors() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * 0.02
    q = BlockFp8Weight.quantize(w)
    assert q.scale.shape == (3, 2) and q.data.dtype == torch.float8_e4m3fn
    s = q.scale
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))  # powers of two
    per_elem = s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    # E4M3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value (normals), 2^-10 of the scale (subnormals)
    assert ((q.dequantize() - w).abs() <= w.abs() * 2.0**-4 + per_elem * 2.0**-10).all()
    assert torch.equal(BlockFp8Weight.quantize(q.dequantize()).data.view(torch.uint8), q.data.view(torch.uint8))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        BlockFp8Weight(w, q.scale)
    with pytest.raises(TypeError, match="scale must be float32"):
        BlockFp8Weight(q.data, q.scale[:1])
