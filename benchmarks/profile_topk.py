"""Profile target for the radix top-k at the indexer's acceptance shape (B=64 × 128K decode, k=512): builds the
scores with the scores kernel (as ``bench_indexer.py``), prints how the scores are distributed and how many
candidates the ``"filter"`` bound keeps per row, then runs the top-k ``--calls`` times (for ncu / nsys): the step's
plan, or the plan of ``--algorithm`` (``bisect_triton``: the Triton "bisect" where the Gluon one would run).

Usage: ``python benchmarks/profile_topk.py [--algorithm filter] [--calls 3] [--batch 64] [--context 131072]
[--tokens 1]`` (``--tokens 4096``: the rows of a 4K-token prefill chunk per request).
"""

from __future__ import annotations

import argparse

import torch

from bench_indexer import K_TOP, _scores_fn, _setup, topk_plan
from dsv4.kernels.indexer.topk import radix_topk
from dsv4.kernels.indexer.topk_plan import bound_group, next_power_of_2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algorithm", choices=["split", "filter", "bisect", "bisect_triton"],
                    help="instead of the step's plan's")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--tokens", type=int, default=1, help="query tokens per request (4096: a prefill chunk)")
    a = ap.parse_args()
    s = _setup(a.batch, a.context, a.tokens, "mxfp4")
    _scores_fn(s, a.batch, a.tokens)()
    sc, vis = s["scores"], s["visible"]
    n = sc.shape[1]
    f = sc.float().masked_fill(torch.arange(n, device=sc.device)[None, :] >= vis[:, None], float("-inf"))
    plan = topk_plan(sc, a.algorithm and a.algorithm.removesuffix("_triton"), gluon=a.algorithm != "bisect_triton")
    print(plan.describe())
    C = bound_group(n, K_TOP, next_power_of_2(n))  # the bound's group width over a whole row in registers
    g_max = f[:, : n // C * C].view(sc.shape[0], -1, C).amax(dim=2)
    bound = g_max.masked_fill(g_max == float("-inf"), float("inf")).amin(dim=1)  # over the nonempty groups
    cand = (f >= bound[:, None]).sum(dim=1).float()
    print(f"scores: {tuple(sc.shape)}, zeros {(f == 0).float().mean().item():.3f}, distinct in row 0 "
          f"{torch.unique(f[0]).numel()}, candidates under the group bound: min {cand.min().item():.0f} "
          f"median {cand.median().item():.0f} max {cand.max().item():.0f}")
    scratch = {name: torch.zeros(shape, dtype=torch.int32, device=sc.device)
               for name, (shape, _) in plan.scratch().items()}
    out = torch.empty((sc.shape[0], K_TOP), dtype=torch.int64, device=sc.device)
    for _ in range(a.calls):
        radix_topk(sc, vis, plan, out=out, **scratch)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
