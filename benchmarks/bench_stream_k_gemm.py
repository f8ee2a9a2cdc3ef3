"""The decode FP8 projections of one ``--preset`` layer: the Triton TMA kernel's launch (``block_gemm.gemm_config``)
against the stream-K Gluon kernel (``block_gemm_sm90``) at each slice width, next to the weight-read roofline.

Both are fed the same pre-quantized activations (as a norm launch hands them over). Each timing is a CUDA graph of
calls that each read another copy of the weight (none in L2 when its GEMM starts, as in a layer), per call.
Roofline: the FP8 weight (values + scales) read once at the copy bandwidth measured in the same run. Errors:
relative L2 against the reference's FP32 sums of the same products (``formats.block_fp8.fp8_linear``).

    python benchmarks/bench_stream_k_gemm.py [--preset v4-flash] [--rows 17 32 64] [--json out]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
from bench_fp8_projections import L2_SPAN, fp8_projections

import dsv4
from dsv4.bench.roofline import environment, measure_copy_bandwidth, time_cuda
from dsv4.formats.block_fp8 import BlockFp8Weight, fp8_linear as reference_fp8_linear
from dsv4.kernels.device import sm_count
from dsv4.kernels.project import block_gemm
from dsv4.kernels.project.block_gemm_sm90 import stream_k_config, stream_k_linear, stream_k_slots
from dsv4.kernels.project.fp8_gemm import quantize_activations

REQUIRES_CUDA = True
#: the decode GEMMs (the rest run at prefill only or are BF16)
DECODE_WEIGHTS = ("wq_a+wkv", "wq_b+indexer.wq_b", "wq_b", "wo_b")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="v4-flash")
    ap.add_argument("--rows", type=int, nargs="+", default=[17, 64])
    ap.add_argument("--json")
    a = ap.parse_args()
    bw, sms = measure_copy_bandwidth("cuda"), sm_count("cuda")
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s, {sms} SMs", flush=True)
    weights = fp8_projections(dsv4.ModelConfig.preset(a.preset))
    g = torch.Generator(device="cuda").manual_seed(0)
    counters = torch.zeros(1 << 14, dtype=torch.int32, device="cuda")
    rows = []
    for name in DECODE_WEIGHTS:
        w = weights[name]
        N, K = w.shape
        copies = [w] + [BlockFp8Weight(w.data.clone(), w.scale.clone())
                        for _ in range(max(1, -(-L2_SPAN // w.nbytes)) - 1)]
        roof = w.nbytes / bw
        for M in a.rows:
            x = (torch.randn(M, K, generator=g, device="cuda") * torch.exp(torch.randn(
                M, 1, generator=g, device="cuda"))).bfloat16()
            codes = quantize_activations(x)
            want = reference_fp8_linear(x, w, torch.float32)
            config = block_gemm.gemm_config(M, N, K, sms)
            ways = {f"triton {config.describe()}": [
                lambda c=c: block_gemm.block_fp8_linear(x, c, torch.bfloat16, config, codes=codes) for c in copies]}
            for slice_cols in (64, 128):
                rule = stream_k_config(N, K, sms, slice=slice_cols)
                for sk in dict.fromkeys([rule, dataclasses.replace(rule, programs=sms)]):
                    partials = torch.empty(stream_k_slots(N, K, sk) * M * N, device="cuda")
                    out = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
                    label = sk.describe() + (" (rule)" if sk == rule else "")
                    ways[label] = [lambda c=c, sk=sk, p=partials, o=out: stream_k_linear(
                        codes[0], codes[1], c, o, sk, p, counters) for c in copies]
            for way, calls in ways.items():
                got = calls[0]().float()
                rel = ((got - want).norm() / want.norm()).item()
                t = time_cuda(lambda: [f() for f in calls], warmup=5, iters=30, graph=True) / len(calls)
                row = dict(weight=name, N=N, K=K, M=M, way=way, us=t * 1e6, roofline_us=roof * 1e6, rel_err=rel)
                rows.append(row)
                print(f"{name:18s} M={M:3d} {way:62s} {t * 1e6:7.1f} us  roofline {roof * 1e6:5.1f}  "
                      f"({roof / t:4.0%})  err {rel:.1e}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(environment=environment(), copy_bandwidth=bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
