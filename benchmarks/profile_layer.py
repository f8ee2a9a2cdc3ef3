"""Where one layer's decode step spends its GPU time: every kernel of ``dsv4.Attention.forward`` under the torch
profiler, summed by kernel name, per layer kind.

One V4-Flash (or ``--preset``) layer of each kind, a cache with ``--batch`` requests advanced to ``--context``
tokens (positions only: the pool holds garbage, which does not change the kernels' work), then one decode step
(one token per request) profiled eagerly after a warm-up step. Kernel times are the GPU's; a CUDA-graph replay
runs the same kernels without the host gaps.

    python benchmarks/profile_layer.py [--preset v4-flash] [--batch 64] [--context 2048] [--backend triton]
    python benchmarks/profile_layer.py --batch 1 --context 8192 --prefill 8192   # one 8K prefill chunk
"""

from __future__ import annotations

import argparse
import collections
import re

import torch

import dsv4
from dsv4.cache import HybridCache


def _short(name: str) -> str:
    """A kernel's name without template arguments and launch-config noise."""
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"\(.*", "", name)
    return name.split("::")[-1][:60]


def profile_kind(cfg: dsv4.ModelConfig, li: int, batch: int, context: int, backend: str,
                 prefill: int = 0) -> list[tuple[str, int, float]]:
    """``(kernel, calls, µs)`` of one decode step of layer ``li`` (``prefill``: instead one chunk of that many tokens
    per request), largest first."""
    w = dsv4.AttentionWeights.random(cfg, li, seed=0, device="cuda")
    layer = dsv4.Attention(w, cfg, li, backend=backend)
    blocks = batch * ((context + 3 * max(prefill, 1)) // 256 + 4) + 8
    cache = HybridCache(cfg, layers=[li], max_requests=batch, num_blocks=blocks, block_size=256, device="cuda")
    for r in range(batch):
        cache.add_request(f"r{r}")
    if context:
        # positions only: claim_step records the step as run (its data stays empty), so the layer accepts the requests
        cache.claim_step(cache.prepare_forward({f"r{r}": context for r in range(batch)}))
    new = max(prefill, 1)
    x = torch.randn(batch * new, cfg.hidden_size, device="cuda").bfloat16()
    for _ in range(2):  # compile and warm up
        layer.forward(x, cache.prepare_forward({f"r{r}": new for r in range(batch)}), cache)
    torch.cuda.synchronize()
    step = cache.prepare_forward({f"r{r}": new for r in range(batch)})
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        layer.forward(x, step, cache)
        torch.cuda.synchronize()
    total: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            t = total[_short(e.name)]
            t[0] += 1
            t[1] += e.device_time_total
    return sorted(((k, n, us) for k, (n, us) in total.items()), key=lambda r: -r[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="v4-flash")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--backend", default="triton", choices=["triton", "torch"])
    ap.add_argument("--top", type=int, default=25, help="kernels listed per layer kind")
    ap.add_argument("--prefill", type=int, default=0, help="profile a prefill chunk of this many tokens per request")
    a = ap.parse_args()
    cfg = dsv4.ModelConfig.preset(a.preset)
    kinds = {}
    for li in range(cfg.num_layers):
        kinds.setdefault(cfg.layer_kind(li), li)
    what = f"prefill chunk of {a.prefill} tokens" if a.prefill else "decode step"
    print(f"{torch.cuda.get_device_name()}  {a.preset} {what}, B={a.batch}, context {a.context}, {a.backend}")
    for kind, li in kinds.items():
        rows = profile_kind(cfg, li, a.batch, a.context, a.backend, a.prefill)
        print(f"\n== layer {li} ({kind.name}): {sum(r[2] for r in rows):.1f} us in {sum(r[1] for r in rows)} kernels")
        for name, n, us in rows[: a.top]:
            print(f"  {us:8.1f} us  {n:3d}x  {name}")


if __name__ == "__main__":
    main()
