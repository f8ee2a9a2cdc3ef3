"""Benchmark: the lightning indexer's MXFP4 queries (``kernels/indexer/queries.py``: RoPE, the 128-point Hadamard
butterflies, MXFP4 and the FP8 operand bytes, one launch) next to its roofline.

V4-Flash's indexer (64 heads × 128 dims, BF16 projection in) at ``--tokens`` tokens: a decode step (64) and a
prefill chunk (8,192). Timed as CUDA-graph replays (``dsv4.bench.roofline.time_cuda``, median); the large shape
also eagerly with L2 flushed. Roofline: the bytes read (the BF16 projection) and written (the operand bytes and
per-head scales) at the copy bandwidth measured in the same run.

    python benchmarks/bench_mxfp4_queries.py [--tokens 64 8192] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from dsv4.bench.roofline import environment, measure_copy_bandwidth, roofline_row, time_cuda
from dsv4.kernels.indexer import queries as kernel
from dsv4.kernels.indexer.queries import mxfp4_queries

REQUIRES_CUDA = True  # dsv4 bench skips this script on other devices (dsv4.bench.suite)

HEADS, HEAD_DIM = 64, 128  # V4-Flash's and V4-Pro's indexer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 8192], help="query rows")
    ap.add_argument("--iters", type=int, default=50, help="timed calls per figure (median)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mxfp4_queries.py needs a CUDA device")
    dev = torch.device("cuda")
    env = environment(dev)
    bw = measure_copy_bandwidth(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    inv_freq = (10000.0 ** (-torch.arange(32, device=dev) / 32)).float()
    launch = f"{getattr(kernel, 'HEADS_PER_PROGRAM', 16)} heads x {getattr(kernel, 'WARPS', 4)} warps"  # older trees
    print(f"{env['device']}  MXFP4 index queries, {HEADS} heads x {HEAD_DIM}, {launch} per program; copy bandwidth "
          f"{bw / 1e12:.2f} TB/s")
    print(f"{'tokens':>7} {'timing':<18}{'us':>9}{'roofline us':>13}{'% roofline':>12}")
    rows = []
    for T in args.tokens:
        q = (torch.randn(T, HEADS * HEAD_DIM, device=dev, generator=g) * 3).bfloat16()
        pos = torch.randint(0, 1 << 16, (T,), device=dev, generator=g)
        q8, qs = mxfp4_queries(q, pos, inv_freq, HEADS, HEADS)
        nbytes = q.numel() * q.element_size() + q8.numel() + qs.numel() * qs.element_size()
        timings = [("graph replay", dict(graph=True))]
        if T >= 1024:
            timings.append(("eager, L2 flushed", dict(flush_l2="read")))
        for label, how in timings:
            s = time_cuda(lambda: mxfp4_queries(q, pos, inv_freq, HEADS, HEADS), iters=args.iters, device=dev, **how)
            row = roofline_row(f"mxfp4_queries T={T} {label}", s, bytes=nbytes, flops=0, copy_bw=bw, mm_rate=0,
                               tokens=T, timing=label)
            rows.append(row)
            print(f"{T:>7} {label:<18}{row['us']:>9.1f}{row['roofline_us']:>13.1f}{100 * row['roofline_frac']:>11.0f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "copy_bw": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
