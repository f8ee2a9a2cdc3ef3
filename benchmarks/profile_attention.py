"""Resources and (under ``ncu``) hardware counters of the sparse-attention kernels at one shape.

Runs ``--calls`` launches of the step's plan (``--variant``: requests such as ``{"impl": "triton"}``) for a
profiler to pick up, then prints each compiled kernel's registers per thread, spilled bytes and shared memory
(from Triton's compiled kernels), e.g.::

    ncu --clock-control none -k regex:_sparse_attention_kernel --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section Occupancy \\
        python3 benchmarks/profile_attention.py --shape flash_csa --batch 64
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention import DECODE, PREFILL, build  # noqa: E402


def kernel_resources(jit_fn) -> list[dict]:
    """Registers, spills and shared memory of every kernel ``jit_fn`` (a ``@triton.jit`` function) compiled so far."""
    rows = []
    for caches in jit_fn.device_caches.values():
        for kernel in caches[0].values():
            meta = kernel.metadata
            rows.append(dict(regs=getattr(kernel, "n_regs", None), spills=getattr(kernel, "n_spills", None),
                             shared=getattr(meta, "shared", None), num_warps=getattr(meta, "num_warps", None),
                             num_stages=getattr(meta, "num_stages", None)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="flash_csa", choices=[*DECODE, *PREFILL])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--variant", default="{}", help="JSON requests of sparse_attention_fwd (impl, keys, combine, ...)")
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args()
    from dsv4.kernels.attention import launch, sm90_pipelined, sm90_serial, sm90_ws, triton_kernel

    prefill = a.shape in PREFILL
    heads, ratio, topk, context = (PREFILL if prefill else DECODE)[a.shape]
    args = build(heads, ratio, topk, context, 1 if prefill else a.batch, 4096 if prefill else 1)
    call = {k: v for k, v in args.items() if not k.startswith("_")}
    var = json.loads(a.variant)
    for _ in range(a.calls):
        launch.sparse_attention_fwd(**call, **var)
    torch.cuda.synchronize()
    for jit_fn in (triton_kernel._sparse_attention_kernel, sm90_serial._sparse_attention_sm90_kernel,
                   sm90_ws._sparse_attention_ws_kernel, sm90_pipelined._pipelined_kernel):
        if jit_fn.device_caches:
            print(f"{a.shape} B={a.batch} {var} {jit_fn.__name__}: {kernel_resources(jit_fn)}", flush=True)


if __name__ == "__main__":
    main()
