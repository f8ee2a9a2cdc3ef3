"""Diagnostic (GPU): the same steps through the torch and the Triton backend on two caches, layer by layer.

For each step prints the output's relative difference (Triton vs torch), the LSE difference, and which cache
tensors' bytes differ (``HybridCache.differences`` of the Triton cache against a snapshot of the torch one), so a
discrepancy can be pinned on the write path or on attention.
Usage: PYTHONPATH=src python3 tools/diag_backends.py [--preset v4-flash] [--layers 2 3]
"""

from __future__ import annotations

import argparse

import torch

import dsv4
from dsv4.cache import HybridCache


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="v4-flash")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=8)
    a = ap.parse_args()
    cfg = dsv4.ModelConfig.preset(a.preset)
    dev = torch.device("cuda")
    for li in a.layers:
        w = dsv4.AttentionWeights.random(cfg, li, seed=li)
        caches = [HybridCache(cfg, layers=[li], max_requests=a.requests, num_blocks=64 * a.requests, device=dev)
                  for _ in range(2)]
        layers = [dsv4.Attention(w, cfg, li, backend=b) for b in ("torch", "triton")]
        ids = [f"r{i}" for i in range(a.requests)]
        for c in caches:
            for r in ids:
                c.add_request(r)
        plans = [{r: a.prompt for r in ids}] + [{r: 1 for r in ids}] * a.decode
        g = torch.Generator(device="cpu").manual_seed(li)
        for s, plan in enumerate(plans):
            x = torch.randn(sum(plan.values()), cfg.hidden_size, generator=g).to(dev, torch.bfloat16)
            outs = []
            for c, layer in zip(caches, layers):
                outs.append(layer.forward_with_aux(x, c.prepare_forward(plan), c))
            (a_out, b_out) = outs
            rel = ((b_out.y.float() - a_out.y.float()).norm() / a_out.y.float().norm()).item()
            row_rel = ((b_out.y.float() - a_out.y.float()).norm(dim=-1) / a_out.y.float().norm(dim=-1)).max().item()
            dlse = (b_out.lse - a_out.lse).abs().max().item()
            diff = caches[1].differences(caches[0].snapshot())
            print(f"layer {li} {cfg.layer_kind(li).name} step {s} T={x.shape[0]}: y rel {rel:.2e} (worst row {row_rel:.2e})"
                  f" lse max|d| {dlse:.2e}; cache differs: {diff}", flush=True)


if __name__ == "__main__":
    main()
