"""How many clusters of each size the serial Gluon attention kernel fits on this GPU at once (driver's answer),
and where a split decode step's time goes with either merge of its partials.

A split step runs its tokens' splits as clusters (``merge="cluster"`` plans, ``sparse_attention_fwd(combine=
"auto")``) only when every cluster of the step is resident at once; this prints the kernel's resident clusters of
sizes 2-16 (``sm90_serial.resident_clusters``: ``cuOccupancyMaxActiveClusters``), the plan a batch of ``--batch``
tokens gets for each split count, then each kernel's mean duration (torch profiler, L2 flushed before every call)
with ``combine="kernel"`` and ``"auto"``::

    PYTHONPATH=src:benchmarks python benchmarks/cluster_occupancy.py --batch 8 --shape flash_csa
"""

from __future__ import annotations

import argparse

import torch

from bench_attention import DECODE as SHAPES, build
from dsv4.kernels.attention import cluster_launch, launch, sm90_serial


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--shape", default="flash_csa", choices=list(SHAPES))
    a = ap.parse_args()
    heads, ratio, topk, context = SHAPES[a.shape]
    args = build(heads, ratio, topk, context, a.batch, 1)
    fwd_args = {k: v for k, v in args.items() if not k.startswith("_")}
    clusters = a.batch * -(-heads // 64)
    device = torch.cuda.current_device()
    print(f"# {torch.cuda.get_device_name()}, {a.shape} B={a.batch} ({clusters} clusters a step)")
    for size in range(2, cluster_launch.MAX_CLUSTER + 1):
        fit = sm90_serial.resident_clusters(device, size)
        plan = launch.plan_for(fwd_args["q"], fwd_args["kv_new"], fwd_args["block_tables"], **{
            k: fwd_args[k] for k in ("window", "ratio", "block_size", "entry_idx", "visible", "max_entries",
                                     "max_visible") if k in fwd_args}, impl="gluon", num_splits=size)
        print(f"cluster of {size:2d}: {fit:3d} resident at once -> {plan.describe()}")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for combine in ("kernel", "auto"):
        for _ in range(3):
            launch.sparse_attention_fwd(**fwd_args, combine=combine)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                flush.zero_()
                launch.sparse_attention_fwd(**fwd_args, combine=combine)
            torch.cuda.synchronize()
        times: dict[str, list[float]] = {}
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA and ("attention" in ev.name or "combine" in ev.name):
                times.setdefault(ev.name, []).append(ev.device_time)
        print(f"combine={combine}: " + ", ".join(f"{name[:40]} {sum(v) / len(v):.1f} us x{len(v)}"
                                               for name, v in times.items()))


if __name__ == "__main__":
    main()
