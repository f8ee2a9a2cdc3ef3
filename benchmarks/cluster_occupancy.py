"""How many clusters of each size the serial Gluon attention kernel fits on this GPU at once (driver's answer),
and where a split decode step's time goes with either merge of its partials.

A split step runs its tokens' splits as clusters (``sparse_attention_fwd(combine="auto")``) only when every
cluster of the step is resident at once; this prints ``cuOccupancyMaxActiveClusters`` for cluster sizes 2-16 of
the kernel as the chosen decode shape compiles it, and which sizes a batch of ``--batch`` tokens can use; then each
kernel's mean duration (torch profiler, L2 flushed before every call) with ``combine="kernel"`` and ``"auto"``::

    PYTHONPATH=src:benchmarks python benchmarks/cluster_occupancy.py --batch 8 --shape flash_csa
"""

from __future__ import annotations

import argparse

import torch

from bench_attention import DECODE as SHAPES, build
from dsv4.kernels.attention import cluster_launch as cluster, triton_kernel as sparse_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--shape", default="flash_csa", choices=list(SHAPES))
    a = ap.parse_args()
    heads, ratio, topk, context = SHAPES[a.shape]
    args = build(heads, ratio, topk, context, a.batch, 1)
    seen: dict[int, int] = {}
    real = cluster.max_active_clusters

    def spy(compiled, size):
        seen[size] = real(compiled, size)
        return seen[size]

    cluster.max_active_clusters = spy
    fwd_args = {k: v for k, v in args.items() if not k.startswith("_")}
    for size in range(2, cluster.MAX_CLUSTER + 1):
        try:
            sparse_attention.sparse_attention_fwd(**fwd_args, num_splits=size, impl="gluon", combine="auto")
        except ValueError as err:
            print(f"splits {size}: {err}")
    torch.cuda.synchronize()
    clusters = a.batch * -(-heads // 64)
    print(f"# {torch.cuda.get_device_name()}, {a.shape} B={a.batch} ({clusters} clusters a step)")
    for size, fit in sorted(seen.items()):
        print(f"cluster of {size:2d}: {fit:3d} resident at once -> "
              f"{'clusters' if fit >= clusters else 'combine kernel'}")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for combine in ("kernel", "auto"):
        for _ in range(3):
            sparse_attention.sparse_attention_fwd(**fwd_args, combine=combine)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                flush.zero_()
                sparse_attention.sparse_attention_fwd(**fwd_args, combine=combine)
            torch.cuda.synchronize()
        times: dict[str, list[float]] = {}
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA and ("attention" in ev.name or "combine" in ev.name):
                times.setdefault(ev.name, []).append(ev.device_time)
        print(f"combine={combine}: " + ", ".join(f"{name[:40]} {sum(v) / len(v):.1f} us x{len(v)}"
                                               for name, v in times.items()))


if __name__ == "__main__":
    main()
