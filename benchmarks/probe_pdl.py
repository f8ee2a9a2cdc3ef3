"""Probe: what programmatic dependent launch (PDL) saves at a kernel boundary, in a CUDA graph and eagerly.

A chain of ``--layers`` × (a small norm-like kernel → a kernel streaming an FP8 weight → a small kernel), each
kernel reading the one before's output, launched three ways:

* ``off``: ordinary launches;
* ``pdl``: every kernel launched with ``launch_pdl=True`` and starting with ``griddepcontrol.wait`` then
  ``griddepcontrol.launch_dependents`` (Triton's ``gdc_wait`` / ``gdc_launch_dependents``);
* ``pdl+prefetch``: the same, the streaming kernel loading its first weight block before the wait (the weight is no
  kernel's output).

Each way is captured as one CUDA graph (replays timed with CUDA events, median of 20) and timed once eagerly; the
outputs must equal the ordinary launches' bit for bit. The dsv4 kernels do not take part in PDL: in the acceptance
run it gave no gain (``benchmarks/archive/RESULTS-2026-11.md``, "Programmatic dependent launch …").

    PYTHONPATH=src python benchmarks/probe_pdl.py [--layers 100]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _small_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """``y = x / rms(x)`` over blocks of ``BLOCK`` (bf16)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    s = tl.sum(x * x, axis=0) / BLOCK
    tl.store(y_ptr + offs, (x * tl.rsqrt(s + 1e-6)).to(tl.bfloat16), mask=m)


@triton.jit
def _stream_kernel(w_ptr, x_ptr, y_ptr, K, ROWS: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
                   PREFETCH: tl.constexpr):
    """``y[rows] = w[rows] @ x`` for e4m3 ``w`` ``[N, K]``, ``ROWS`` rows per program."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ks = tl.arange(0, BK)
    if PDL and not PREFETCH:
        gdc_wait()
        gdc_launch_dependents()
    w0 = tl.load(w_ptr + rows[:, None] * K + ks[None, :])
    if PDL and PREFETCH:
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.sum(w0.to(tl.float32) * tl.load(x_ptr + ks).to(tl.float32)[None, :], axis=1)
    for k in range(BK, K, BK):
        w = tl.load(w_ptr + rows[:, None] * K + k + ks[None, :])
        acc += tl.sum(w.to(tl.float32) * tl.load(x_ptr + k + ks).to(tl.float32)[None, :], axis=1)
    tl.store(y_ptr + rows, acc.to(tl.bfloat16))


def _chain(x, h, weights, outs, layers: int, pdl: bool, prefetch: bool):
    n = x.numel()
    cur = x
    for i in range(layers):
        _small_kernel[(n // 1024,)](cur, h, n, BLOCK=1024, PDL=pdl, launch_pdl=pdl)
        w = weights[i % len(weights)]
        _stream_kernel[(w.shape[0] // 16,)](w, h, outs[i % 2], w.shape[1], ROWS=16, BK=512, PDL=pdl,
                                            PREFETCH=prefetch, launch_pdl=pdl)
        _small_kernel[(n // 1024,)](outs[i % 2], outs[(i + 1) % 2], n, BLOCK=1024, PDL=pdl, launch_pdl=pdl)
        cur = outs[(i + 1) % 2]
    return cur


def _median_us(fn, reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=100)
    args = ap.parse_args()
    torch.manual_seed(0)
    K = N = 4096
    x = torch.randn(K, device="cuda").bfloat16()
    h = torch.empty_like(x)
    weights = [(torch.randn(N, K, device="cuda") * 0.1).to(torch.float8_e4m3fn) for _ in range(8)]
    outs = [torch.empty(N, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    launches = 3 * args.layers
    print(f"{torch.cuda.get_device_name()}: {launches} launches per chain")
    want = None
    for name, pdl, prefetch in (("off", False, False), ("pdl", True, False), ("pdl+prefetch", True, True)):
        run = lambda: _chain(x, h, weights, outs, args.layers, pdl, prefetch)  # noqa: E731
        eager_out = run().clone()
        eager = _median_us(run, reps=5)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        replay = _median_us(graph.replay)
        want = eager_out if want is None else want
        same = torch.equal(eager_out, want) and torch.equal(out, want)
        print(f"  {name:13s} graph {replay:8.1f} us ({replay / launches:.2f} per launch)   eager {eager:8.1f} us"
              f"   equal to ordinary launches: {same}")


if __name__ == "__main__":
    main()
