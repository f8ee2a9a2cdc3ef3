"""The stream-K Gluon GEMM of decode rows (``kernels.project.block_gemm_sm90``): its ranges and workspace on the
CPU (against brute-force enumeration), and on a Hopper GPU its output against the reference FP8 GEMM and the
Triton TMA kernel on random inputs — split and unsplit tiles, ragged N and K, 1 … 64 rows."""

from __future__ import annotations

import pytest
import torch

from dsv4.kernels.project.block_gemm_sm90 import StreamKConfig, stream_k_config, stream_k_slots


def _shares(tiles: int, nkb: int, programs: int) -> list[list[int]]:
    """Each program's iterations by brute force: whole tiles dealt out in turn while every program gets one more,
    then the iterations of the tiles left over cut into equal contiguous ranges."""
    shares: list[list[int]] = [[] for _ in range(programs)]
    rounds = tiles // programs
    for p in range(programs):
        for t in range(p * rounds, (p + 1) * rounds):
            shares[p] += range(t * nkb, (t + 1) * nkb)
    base = rounds * programs * nkb
    rem = tiles * nkb - base
    for p in range(programs):
        shares[p] += range(base + p * rem // programs, base + (p + 1) * rem // programs)
    return shares


@pytest.mark.parametrize("N,K", [(1536, 4096), (4096, 8192), (32768, 1024), (40960, 1024), (320, 1040), (64, 128)])
@pytest.mark.parametrize("programs", [1, 7, 64, 132, 1000])
def test_slots_cover_every_tile_sharing(N: int, K: int, programs: int) -> None:
    """Every tile's programs (by enumerating every program's share) fit the workspace slots, and the owner
    formula the kernel uses for a stream-K iteration names the program whose range holds it."""
    for slice_cols in (64, 128):
        config = StreamKConfig(programs=programs, slice=slice_cols)
        nkb = -(-K // 128)
        total = -(-N // config.tile_cols) * nkb
        P = min(programs, total)
        shares = _shares(total // nkb, nkb, P)
        owner = {g: p for p, share in enumerate(shares) for g in share}
        assert sorted(owner) == list(range(total)) and sum(map(len, shares)) == total  # a partition
        base = (total // nkb) // P * P * nkb
        rem = total - base
        # the kernel's owner of a stream-K iteration
        assert all(((g - base + 1) * P - 1) // rem == p for g, p in owner.items() if g >= base)
        most = max(len({owner[g] for g in range(t * nkb, (t + 1) * nkb)}) for t in range(total // nkb))
        assert most <= stream_k_slots(N, K, config), (N, K, programs, slice_cols)


def test_config_fills_the_device_and_the_ring() -> None:
    big = stream_k_config(32768, 1024, 132)
    assert big.programs == 132 and big.stages * big.stage_bytes <= 200 * 1024 and big.stages >= 4
    small = stream_k_config(256, 256, 132)  # 1 tile x 2 K blocks: one program
    assert small.programs == 1
    with pytest.raises(ValueError, match="slice"):
        StreamKConfig(programs=4, slice=96)
    with pytest.raises(ValueError, match="exceed"):
        StreamKConfig(programs=4, slice=128, stages=8)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 17, 64])
def test_gpu_stream_k_matches_reference(M: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU")
    from dsv4.formats.block_fp8 import BlockFp8Weight, fp8_linear as reference_fp8_linear
    from dsv4.kernels.project import block_gemm
    from dsv4.kernels.project.block_gemm_sm90 import stream_k_linear
    from dsv4.kernels.project.fp8_gemm import quantize_activations

    g = torch.Generator(device="cuda").manual_seed(M)
    counters = torch.zeros(4096, dtype=torch.int32, device="cuda")
    for N, K, programs in ((1536, 4096, 96), (4096, 8192, 132), (320, 1040, 5), (2048, 1024, 3), (1024, 512, 40)):
        magnitudes = torch.exp(2 * torch.randn(N, 1, generator=g, device="cuda"))  # a wrong scale row shows
        w = BlockFp8Weight.quantize(torch.randn(N, K, generator=g, device="cuda") * K**-0.5 * magnitudes)
        x = (torch.randn(M, K, generator=g, device="cuda") * torch.exp(torch.randn(M, 1, generator=g,
                                                                                   device="cuda"))).bfloat16()
        codes, scales = quantize_activations(x)
        want = reference_fp8_linear(x, w, torch.float32)  # FP32 sums of the same products
        tma = block_gemm.block_fp8_linear(x, w, torch.float32, block_gemm.GemmConfig(
            bm=64, bn=128, num_stages=4, tma=True), codes=(codes, scales)) if K % 16 == 0 else None
        for slice_cols in (64, 128):
            config = StreamKConfig(programs=programs, slice=slice_cols, stages=4)
            partials = torch.full((stream_k_slots(N, K, config) * M * N,), float("nan"), device="cuda")
            out = torch.full((M, N), float("nan"), device="cuda")
            got = stream_k_linear(codes, scales, w, out, config, partials, counters)
            assert not counters.any(), "a tile counter was left non-zero"
            rel = ((got - want).norm() / want.norm()).item()
            assert torch.isfinite(got).all() and rel < 1e-3, (N, K, config, rel)
            # the same block sums as the Triton kernel's, added in another grouping only where tiles are split
            assert ((got - tma).norm() / tma.norm()).item() < 1e-6, (N, K, config)
            again = stream_k_linear(codes, scales, w, torch.empty_like(out), config, partials, counters)
            assert torch.equal(again, got)  # partials summed in rank order: no dependence on arrival order
            bf16 = stream_k_linear(codes, scales, w, torch.empty(M, N, dtype=torch.bfloat16, device="cuda"), config,
                                   partials, counters)
            assert torch.equal(bf16, got.bfloat16())


@pytest.mark.gpu
def test_gpu_stream_k_refuses_what_does_not_fit() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU")
    from dsv4.formats.block_fp8 import BlockFp8Weight
    from dsv4.kernels.project.block_gemm_sm90 import stream_k_linear
    from dsv4.kernels.project.fp8_gemm import quantize_activations

    w = BlockFp8Weight.quantize(torch.randn(256, 512, device="cuda"))
    codes, scales = quantize_activations(torch.randn(65, 512, device="cuda").bfloat16())
    config = StreamKConfig(programs=4, slice=64, stages=4)
    counters = torch.zeros(64, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="M ≤ 64"):
        stream_k_linear(codes, scales, w, torch.empty(65, 256, device="cuda"), config,
                        torch.empty(10**6, device="cuda"), counters)
    with pytest.raises(ValueError, match="partials"):
        stream_k_linear(codes[:8], scales[:8], w, torch.empty(8, 256, device="cuda"), config,
                        torch.empty(8, device="cuda"), counters)
