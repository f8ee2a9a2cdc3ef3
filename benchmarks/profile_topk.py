"""Profile target for the radix top-k at the indexer's acceptance shape (B=64 × 128K decode, k=512): builds the
scores with the scores kernel (as ``bench_indexer.py``), prints how the scores are distributed and how many
candidates the ``"filter"`` bound keeps per row, then runs one top-k variant ``--calls`` times (for ncu / nsys).

Usage: ``python benchmarks/profile_topk.py [--variant filter4] [--calls 3] [--batch 64] [--context 131072]
[--tokens 1]`` (``--tokens 4096``: the rows of a 4K-token prefill chunk per request).
"""

from __future__ import annotations

import argparse

import torch
import triton

from bench_indexer import K_TOP, _scores_fn, _setup
from dsv4.kernels.indexer.topk import VARIANTS, _bound_group, filter_header_shape, radix_topk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="filter4", choices=list(VARIANTS))
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
    C = _bound_group(n, K_TOP, triton.next_power_of_2(n))  # the launcher's group width at this shape
    g_max = f[:, : n // C * C].view(sc.shape[0], -1, C).amax(dim=2)
    bound = g_max.masked_fill(g_max == float("-inf"), float("inf")).amin(dim=1)  # over the nonempty groups
    cand = (f >= bound[:, None]).sum(dim=1).float()
    print(f"scores: {tuple(sc.shape)}, zeros {(f == 0).float().mean().item():.3f}, distinct in row 0 "
          f"{torch.unique(f[0]).numel()}, candidates under the group bound: min {cand.min().item():.0f} "
          f"median {cand.median().item():.0f} max {cand.max().item():.0f}")
    opts = dict(VARIANTS[a.variant])
    if opts["algorithm"] == "filter":
        opts.update(header=torch.zeros(filter_header_shape(sc.shape[0]), dtype=torch.int32, device=sc.device),
                    candidates=torch.empty(sc.shape, dtype=torch.int32, device=sc.device))
    ws = torch.empty(sc.shape[0] * 1024, dtype=torch.int32, device=sc.device)
    out = torch.empty((sc.shape[0], K_TOP), dtype=torch.int64, device=sc.device)
    for _ in range(a.calls):
        radix_topk(sc, vis, K_TOP, out=out, workspace=ws, **opts)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
