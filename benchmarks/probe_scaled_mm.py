"""Probe: ``torch._scaled_mm``'s blockwise FP8 recipe (the FP8 projections of SPEC §1.3) on this device and torch.

1. Accumulation: FP32 outputs (no BF16 rounding) of ``_scaled_mm``, the BF16 way and the Triton block GEMM
   against FP64 sums of the same products (the reference's FP32 sums too): FP8 tensor cores sum each 128-wide K
   block with a relative error of about 1e-4 (``kernels.project.plan``'s rule keeps the projections whose outputs
   are quantized again off them on prefill rows).
2. The layer's real projection shapes at prefill row counts (rows that are and are not multiples of 4): error
   against the reference and eager time against the BF16 way.
3. K/128 not a multiple of 4 (the weight scales as given, and with their K blocks padded to 4).

Items 2-3 are what ``fp8_gemm.scaled_mm_fits`` and the row padding of ``fp8_gemm.fp8_linear`` rest on.

    python benchmarks/probe_scaled_mm.py [--accumulation-only]
"""

from __future__ import annotations

import sys

import torch

import dsv4
from dsv4.bench.roofline import time_cuda
from dsv4.formats.block_fp8 import BlockFp8Weight, fp8_linear as reference_fp8_linear, qdq_activations
from dsv4.kernels.device import sm_count
from dsv4.kernels.project import block_gemm, fp8_gemm

from bench_fp8_projections import fp8_projections


def accumulation(weights) -> None:
    """FP32 outputs (no BF16 rounding) against FP64 sums of the same products: the GEMMs' own accumulation error."""
    g = torch.Generator(device="cuda").manual_seed(2)
    for name in ("wq_b", "wo_b", "wq_a+wkv"):
        w = weights[name]
        N, K = w.shape
        wd = w.dequantize(torch.float64)
        for M in (64, 8192):
            x = torch.randn(M, K, generator=g, device="cuda").bfloat16()
            exact = qdq_activations(x).double() @ wd.T
            ref32 = reference_fp8_linear(x, w, torch.float32).double()
            row = f"{name:<10} M={M:<5} reference fp32 {((ref32 - exact).norm() / exact.norm()).item():.1e}"
            q, s = fp8_gemm.quantize_activations(x)
            try:
                y = torch._scaled_mm(q, w.data.t(), scale_a=s, scale_b=w.scale.t(), out_dtype=torch.float32).double()
                row += f"  scaled_mm fp32 {((y - exact).norm() / exact.norm()).item():.1e}"
            except Exception as e:  # noqa: BLE001
                row += f"  scaled_mm fp32: {type(e).__name__} {str(e)[:60]}"
            bf = fp8_gemm.fp8_linear(x, w, torch.float32, "bf16").double()
            row += f"  bf16-way fp32 {((bf - exact).norm() / exact.norm()).item():.1e}"
            if M <= 64:
                t = block_gemm.block_fp8_linear(x, w, torch.float32, block_gemm.gemm_config(M, N, K, sm_count("cuda")))
                row += f"  triton fp32 {((t.double() - exact).norm() / exact.norm()).item():.1e}"
            print(row, flush=True)


def main() -> None:
    cfg = dsv4.ModelConfig.preset("v4-flash")
    weights = fp8_projections(cfg)
    g = torch.Generator(device="cuda").manual_seed(1)
    print(torch.cuda.get_device_name(), torch.__version__)
    accumulation(weights)
    if "--accumulation-only" in sys.argv:
        return
    for name, w in weights.items():
        N, K = w.shape
        for M in (65, 128, 129, 1000, 4096, 8191, 8192):
            x = (torch.randn(M, K, generator=g, device="cuda") * torch.exp(torch.randn(M, 1, generator=g,
                                                                                        device="cuda"))).bfloat16()
            want = reference_fp8_linear(x, w, torch.float32)
            row = f"{name:<20}{N:>6}x{K:<6}M={M:<6}"
            for way in ("scaled_mm", "bf16"):
                try:
                    got = fp8_gemm.fp8_linear(x, w, torch.bfloat16, way).float()
                    rel = ((got - want).norm() / want.norm()).item()
                    t = time_cuda(lambda: fp8_gemm.fp8_linear(x, w, torch.bfloat16, way), warmup=3, iters=20,
                                  graph=False) * 1e6 if M >= 1000 else float("nan")
                    row += f"  {way} {t:8.1f} us rel {rel:.1e}"
                except Exception as e:  # noqa: BLE001
                    row += f"  {way} {type(e).__name__}: {str(e).splitlines()[0][:60]}"
            print(row, flush=True)
    # K/128 = 2 (not a multiple of 4): the scales as given, then with the K-block dimension padded to 4
    for K, N in ((256, 256), (384, 256), (512, 256), (640, 384)):
        w = BlockFp8Weight.quantize(torch.randn(N, K, generator=g, device="cuda") * 0.05)
        for M in (1, 16, 32, 128, 130):
            x = torch.randn(M, K, generator=g, device="cuda").bfloat16()
            want = reference_fp8_linear(x, w, torch.float32)
            q, s = fp8_gemm.quantize_activations(x)
            kb = w.scale.shape[1]
            padded = torch.zeros(w.scale.shape[0], -(-kb // 4) * 4, device="cuda")
            padded[:, :kb] = w.scale
            row = f"K={K} N={N} M={M}:"
            for label, sb in (("plain", w.scale.t()), ("padded", padded[:, :kb].t())):
                try:
                    y = torch._scaled_mm(q, w.data.t(), scale_a=s, scale_b=sb, out_dtype=torch.bfloat16).float()
                    row += f"  {label} rel {((y - want).norm() / want.norm()).item():.1e}"
                except Exception as e:  # noqa: BLE001
                    row += f"  {label} {type(e).__name__}: {str(e).splitlines()[0][:50]}"
            print(row, flush=True)


if __name__ == "__main__":
    main()
