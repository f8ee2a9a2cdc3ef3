"""Benchmark: the engine's glue between layers over one step — the residual add and the next layer's input norm of
every layer — in torch (``TorchResidualStep``: about eight kernels per layer) and as one Triton launch per layer
(``TritonResidualStep``, ``kernels/project/residual_norm``).

Each step is what ``Engine.forward_layers`` runs besides the layers, for ``--layers`` layers (default 43,
V4-Flash's): the first layer's norm, then per layer ``h ← h + y`` and the next norm (add only after the last). Rows
``T``: a decode bucket of 64 requests (65 rows with the pad row) and a prefill chunk (8,192); widths: V4-Flash
(4,096) and V4-Pro (7,168); BF16 activations. Timed as CUDA-graph replays (the GPU time, as in a decode graph;
``dsv4.bench.roofline.time_cuda``), median of ``--iters``. Also reported: the share of ``x`` values that equal the
torch glue's, and that the sums are equal bit for bit.

    python benchmarks/bench_residual_norm.py [--layers 43] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from dsv4.bench.roofline import environment, time_cuda
from dsv4.engine.residual import TorchResidualStep, TritonResidualStep

REQUIRES_CUDA = True  # dsv4 bench skips this script on other devices (dsv4.bench.suite)

SHAPES = [(65, 4096), (65, 7168), (8192, 4096), (8192, 7168)]  # (rows T, hidden d)
EPS = 1e-6
DISTINCT_Y = 4  # layer outputs cycled through the layers (a decode step's y is fresh in L2 anyway)


def glue_step(step, h_in: torch.Tensor, ys: list[torch.Tensor], layers: int) -> tuple[torch.Tensor, list]:
    """One step's glue as ``Engine.forward_layers`` runs it: ``(h after the last layer, every layer's x)``."""
    _, x = step(h_in, None)
    xs, h = [x], h_in
    for i in range(layers):
        h, x = step(h, ys[i % len(ys)], norm=i < layers - 1, in_place=i > 0)
        if x is not None:
            xs.append(x)
    return h, xs


def run(layers: int, iters: int, json_path: str | None) -> list[dict]:
    dev = torch.device("cuda")
    torch_step, triton_step = TorchResidualStep(torch.bfloat16, EPS), TritonResidualStep(torch.bfloat16, EPS)
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    print(f"{'T':>6} {'d':>6} {'torch us/step':>14} {'triton us/step':>15} {'speed-up':>9} {'x equal':>8} "
          f"{'h equal':>8}   ({layers} layers, CUDA-graph replays)")
    for T, d in SHAPES:
        h_in = torch.randn(T, d, generator=g, device=dev)
        ys = [torch.randn(T, d, generator=g, device=dev).bfloat16() for _ in range(DISTINCT_Y)]
        times = {name: time_cuda(lambda s=s: glue_step(s, h_in, ys, layers), iters=iters, graph=True, device=dev)
                 for name, s in (("torch", torch_step), ("triton", triton_step))}
        h_t, xs_t = glue_step(torch_step, h_in, ys, layers)
        h_k, xs_k = glue_step(triton_step, h_in, ys, layers)
        x_equal = float(sum((a == b).sum() for a, b in zip(xs_t, xs_k)) / sum(a.numel() for a in xs_t))
        h_equal = bool(torch.equal(h_t.view(torch.int32), h_k.view(torch.int32)))
        row = dict(T=T, d=d, layers=layers, torch_us=times["torch"] * 1e6, triton_us=times["triton"] * 1e6,
                   x_equal=x_equal, h_equal=h_equal)
        rows.append(row)
        print(f"{T:>6} {d:>6} {row['torch_us']:>14.1f} {row['triton_us']:>15.1f} "
              f"{row['torch_us'] / row['triton_us']:>8.2f}x {x_equal:>8.4f} {str(h_equal):>8}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"environment": environment(dev), "rows": rows}, f, indent=1)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", help="write the rows (and the environment) here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    run(args.layers, args.iters, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
