"""The GPU's FP8 projections (``kernels.project``): the activation quantization kernel bit for bit against
``formats.block_fp8`` (Triton interpreter on the CPU; the GPU), and every GEMM way (cuBLAS BF16, ``_scaled_mm``,
the Triton block GEMM) against the reference FP8 GEMM on random inputs (the interpreter on small shapes; the GPU,
M = 1, 7, 64, 256, 8192)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from support.interpreter import run_interpreted

_SCRIPT = r"""
import torch
from dsv4.formats.block_fp8 import quantize_activations as reference
from dsv4.kernels.project.fp8_gemm import quantize_activations
g = torch.Generator().manual_seed(2)
for M, K in ((3, 128), (5, 200), (2, 640)):
    x = (torch.randn(M, K, generator=g) * torch.exp(3 * torch.randn(M, 1, generator=g))).bfloat16()
    q, s = quantize_activations(x)
    codes, exps = reference(x)
    assert torch.equal(q.view(torch.uint8), codes), (M, K)
    assert torch.equal(s, torch.ldexp(torch.ones_like(exps, dtype=torch.float32), exps.int() - 127)), (M, K)
    v, s2 = quantize_activations(x, values=True)
    assert torch.equal(s2, s) and v.dtype == torch.bfloat16
    qp, sp = quantize_activations(x, pad_rows=3)  # the rows torch._scaled_mm needs: zero codes, zero scales
    assert torch.equal(qp[:M], q) and torch.equal(sp[:M], s) and sp.stride() == (1, M + 3), (M, K)
    assert not qp[M:].view(torch.uint8).any() and not sp[M:].any()

# the Triton block GEMM: FP32 sums of the same exact products (codes bit-cast, never float-cast to FP8, so the
# interpreter's FP8 conversion is not involved); ragged K, several row / column tiles, split K; the TMA kernel
# one program per tile, split, and on a persistent grid whose last round runs past the last tile (also in 64-row
# tiles holding 19 rows, as the rule's persistent launches run); weight rows of different magnitudes, so that a
# wrong scale row shows
from dsv4.formats.block_fp8 import BlockFp8Weight, fp8_linear as reference_linear
from dsv4.kernels.project.block_gemm import GemmConfig, block_fp8_linear
for M, N, K, bm, bn, split, tma, programs in (
        (3, 256, 512, 16, 64, 1, False, 0), (17, 128, 384, 32, 32, 2, False, 0), (1, 64, 200, 16, 64, 2, False, 0),
        (5, 192, 640, 16, 64, 3, True, 0), (21, 192, 640, 32, 128, 1, True, 0), (9, 320, 384, 16, 64, 1, True, 2),
        (19, 384, 256, 64, 128, 1, True, 2)):
    # rows of different magnitudes: the 128-row blocks get different scales (a wrong scale row shows)
    magnitudes = torch.exp(2 * torch.randn(N, 1, generator=g))
    w = BlockFp8Weight.quantize(torch.randn(N, K, generator=g) * K**-0.5 * magnitudes)
    x = (torch.randn(M, K, generator=g) * torch.exp(torch.randn(M, 1, generator=g))).bfloat16()
    config = GemmConfig(bm=bm, bn=bn, split=split, tma=tma, programs=programs)
    got = block_fp8_linear(x, w, torch.float32, config)
    want = reference_linear(x, w, torch.float32)
    assert ((got - want).norm() / want.norm()).item() < 1e-6, (M, N, K, config)
    if tma:  # codes made by the launch before (a norm's): the same result
        assert torch.equal(block_fp8_linear(x, w, torch.float32, config, codes=quantize_activations(x)), got)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_activation_quantization_kernel_in_interpreter() -> None:
    run_interpreted(_SCRIPT)


@pytest.mark.gpu
@pytest.mark.parametrize("gemm", ["scaled_mm", "bf16", "triton", "triton-pointer", "triton-tma"])
@pytest.mark.parametrize("M", [1, 7, 33, 64, 256, 8192])
def test_gpu_fp8_projection_matches_reference(gemm: str, M: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from dsv4.formats.block_fp8 import BlockFp8Weight, fp8_linear as reference_fp8_linear, quantize_activations
    from dsv4.kernels.device import sm_count
    from dsv4.kernels.project import block_gemm, fp8_gemm

    if gemm == "scaled_mm" and not fp8_gemm.scaled_mm_works(torch.device("cuda")):
        pytest.skip("torch._scaled_mm does not take the blockwise recipe here (the plan runs 'bf16')")
    g = torch.Generator(device="cuda").manual_seed(M)
    N, K = 1024, 4096
    w = BlockFp8Weight.quantize(torch.randn(N, K, generator=g, device="cuda") * K**-0.5)
    x = (torch.randn(M, K, generator=g, device="cuda") * torch.exp(torch.randn(M, 1, generator=g, device="cuda")))
    x = x.bfloat16()
    q, s = fp8_gemm.quantize_activations(x)
    codes, exps = quantize_activations(x)
    assert torch.equal(q.view(torch.uint8), codes)
    if gemm.startswith("triton"):
        config = block_gemm.gemm_config(M, N, K, sm_count("cuda"))
        if gemm == "triton-pointer":
            config = block_gemm.GemmConfig(bm=config.bm, bn=128, split=config.split)
        elif gemm == "triton-tma":
            if M > 64:
                pytest.skip("the TMA kernel takes one row tile (at most 64 rows)")
            config = block_gemm.GemmConfig(bm=config.bm, bn=config.bn, split=config.split, num_stages=6, tma=True,
                                           programs=config.programs)
        got = block_gemm.block_fp8_linear(x, w, torch.bfloat16, config)
        again = block_gemm.block_fp8_linear(x, w, torch.bfloat16, config)
        assert torch.equal(got, again)  # split partials summed in split order, the tile counters back at zero
        got = got.float()
    else:
        got = fp8_gemm.fp8_linear(x, w, torch.bfloat16, gemm).float()
    want = reference_fp8_linear(x, w, torch.float32)  # FP32 sums of the same products
    rel = ((got - want).norm() / want.norm()).item()
    assert torch.isfinite(got).all() and rel < 4e-3, rel  # BF16 output rounding and summation order only


def test_gemm_rule_gives_persistent_launches_64_row_tiles() -> None:
    """Whatever the row count, a persistent TMA launch takes 64-row tiles (one warpgroup's tensor-core rows); a
    split launch keeps the smallest tile that holds the rows."""
    from dsv4.kernels.project.block_gemm import gemm_config

    for M in (17, 32, 64):
        persistent = gemm_config(M, 32768, 1024, 132)
        assert persistent.tma and persistent.programs == 132 and persistent.bm == 64, (M, persistent)
        split = gemm_config(M, 4096, 8192, 132)
        assert split.tma and split.split > 1 and split.bm == min(64, 1 << (M - 1).bit_length()), (M, split)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [17, 32])
def test_gpu_persistent_tma_launch_matches_reference(M: int) -> None:
    """The rule's persistent launch (more 128-column tiles than SMs, ragged N) at few rows in 64-row tiles."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU (TMA)")
    from dsv4.formats.block_fp8 import BlockFp8Weight, fp8_linear as reference_fp8_linear
    from dsv4.kernels.device import sm_count
    from dsv4.kernels.project import block_gemm

    g = torch.Generator(device="cuda").manual_seed(M)
    N, K = 128 * sm_count("cuda") + 64, 1024
    w = BlockFp8Weight.quantize(torch.randn(N, K, generator=g, device="cuda") * K**-0.5
                                * torch.exp(2 * torch.randn(N, 1, generator=g, device="cuda")))
    x = (torch.randn(M, K, generator=g, device="cuda") * torch.exp(torch.randn(M, 1, generator=g, device="cuda")))
    x = x.bfloat16()
    config = block_gemm.gemm_config(M, N, K, sm_count("cuda"))
    assert config.programs and config.bm == 64
    got = block_gemm.block_fp8_linear(x, w, torch.float32, config)
    want = reference_fp8_linear(x, w, torch.float32)
    assert ((got - want).norm() / want.norm()).item() < 1e-3  # the tensor cores' block sums (~14 bits) only
    assert torch.equal(block_gemm.block_fp8_linear(x, w, torch.float32, config), got)


def test_scaled_mm_fits_every_v4_projection() -> None:
    """Every FP8 projection of both presets (and of a tensor-parallel rank's share) has the shape
    ``torch._scaled_mm``'s blockwise recipe computes right, so prefill steps take it where the device does."""
    from dsv4.config import ModelConfig
    from dsv4.kernels.project.fp8_gemm import scaled_mm_fits
    from dsv4.kernels.project.plan import fp8_projection_shapes

    for preset in ("v4-flash", "v4-pro"):
        cfg = ModelConfig.preset(preset)
        for heads in (cfg.num_heads, cfg.num_heads // 2, cfg.num_heads // 8):
            for name, (n, k) in fp8_projection_shapes(cfg, heads).items():
                assert scaled_mm_fits(n, k), (preset, heads, name, n, k)
    assert not scaled_mm_fits(256, 256) and not scaled_mm_fits(384, 640) and not scaled_mm_fits(200, 512)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 6, 130])
def test_gpu_scaled_mm_way_is_right_where_cublas_would_not_be(M: int) -> None:
    """K/128 = 5 (cuBLASLt's blockwise recipe returned wrong values for it): the "scaled_mm" way takes the BF16
    GEMM there and matches the reference; K/128 = 4 with rows that are no multiple of 4 (padded)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from dsv4.formats.block_fp8 import BlockFp8Weight, fp8_linear as reference_fp8_linear
    from dsv4.kernels.project import fp8_gemm

    g = torch.Generator(device="cuda").manual_seed(M)
    for N, K in ((384, 640), (256, 512)):
        w = BlockFp8Weight.quantize(torch.randn(N, K, generator=g, device="cuda") * K**-0.5)
        x = torch.randn(M, K, generator=g, device="cuda").bfloat16()
        got = fp8_gemm.fp8_linear(x, w, torch.bfloat16, "scaled_mm").float()
        want = reference_fp8_linear(x, w, torch.float32)
        assert got.shape == (M, N)
        assert ((got - want).norm() / want.norm()).item() < 4e-3, (N, K)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_block_gemm_refuses_codes_of_another_input() -> None:
    """Codes made for another input shape are refused before any launch (a TMA launch would read them as given)."""
    from dsv4.formats.block_fp8 import BlockFp8Weight
    from dsv4.kernels.project.block_gemm import GemmConfig, block_fp8_linear

    w = BlockFp8Weight.quantize(torch.randn(64, 256))
    x = torch.randn(20, 256).bfloat16()
    config = GemmConfig(bm=32, bn=64, tma=True)
    for codes in ((torch.zeros(20, 128, dtype=torch.float8_e4m3fn), torch.zeros(20, 1)),
                  (torch.zeros(20, 256, dtype=torch.float8_e4m3fn), torch.zeros(19, 2))):
        with pytest.raises(ValueError, match="not those of a \\[20, 256\\] input"):
            block_fp8_linear(x, w, torch.float32, config, codes=codes)
