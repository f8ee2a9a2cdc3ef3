"""The indexer scores at the shapes of benchmarks/RESULTS.md's scores table: the step's plan against plan variants,
same inputs, same run, same device.

Launches per shape: each of ``--variants`` (default: the Triton kernel's plan) and the step's own plan ("default":
the Gluon kernel for MXFP4 keys on sm_90), all on the same random MXFP4 pool and queries. Scores are compared
(largest difference relative to the row's largest score: they differ only in the MMA's accumulation order) and timed
as CUDA-graph replays with L2 flushed (decode, 1-4 tokens) or eagerly (prefill chunks). To compare two trees, run
this script in each.

Usage: ``python benchmarks/ab_scores.py [--variants JSON] [--decode-only] [--sweep] [--json out.json]``
(``--variants '{"uncapped": {"max_registers": 0}}'``: the default plan with these fields replaced; ``{"kernel":
"triton"}`` plans for the Triton kernel); ``--profile-calls N`` only calls the default plan at B=64 × 128K.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from bench_indexer import _scores_fn, _setup, scaled_tiles, scores_plan
from dsv4.bench.roofline import environment, measure_copy_bandwidth, time_cuda

#: (label, batch, context, query tokens per request)
SHAPES = [("decode 128K B=64", 64, 131072, 1), ("decode 128K B=8", 8, 131072, 1),
          ("decode 128K B=128", 128, 131072, 1), ("decode 32K B=64", 64, 32768, 1),
          ("decode 1M B=8", 8, 1048576, 1), ("prefill 4K @32K B=1", 1, 32768, 4096),
          ("prefill 4K @128K B=1", 1, 131072, 4096), ("decode 2 tokens 32K B=64", 64, 32768, 2)]

#: ``--sweep``: the default plan's key tiles per program scaled by these factors (B=64 and B=8, 128K decode)
SWEEP = (0.25, 0.5, 2.0, 4.0)


def variant_plan(fields: dict, s, batch: int, tokens: int):
    """The plan of a ``--variants`` entry: the default plan (``{"kernel": "triton"}``: the Triton kernel's) with
    the other ``fields`` replaced."""
    fields = dict(fields)
    triton = fields.pop("kernel", None) == "triton"
    return dataclasses.replace(scores_plan(s, batch, tokens, sm90=False if triton else None), **fields)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile-calls", type=int, default=0,
                    help="only call the default plan N times at the first shape (for ncu), no timing")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sweep", action="store_true",
                    help="also time the default plan with its tiles per program scaled by SWEEP (B=64 and B=8, "
                         "128K decode)")
    ap.add_argument("--variants", default='{"triton": {"kernel": "triton"}}',
                    help="JSON {tag: plan fields}: the default plan with these fields replaced, timed beside it")
    ap.add_argument("--decode-only", action="store_true", help="skip the prefill shape (e.g. variants with maxnreg)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.profile_calls:
        label, batch, context, tokens = SHAPES[0]
        s = _setup(batch, context, tokens, "mxfp4")
        fn = _scores_fn(s, batch, tokens)
        for _ in range(a.profile_calls):
            fn()
        torch.cuda.synchronize()
        print(f"profiled {label}: {a.profile_calls} calls")
        return
    bw = measure_copy_bandwidth()
    env = environment()
    print(f"{env['device']}: copy {bw / 1e12:.2f} TB/s")
    variants = [*json.loads(a.variants).items(), ("default", {})]
    first = variants[0][0]
    print("| shape | " + " | ".join(f"{v[0]} µs" for v in variants) + f" | speedup default/{first} | key MB | "
          "% copy bw (default) | max diff / row max |")
    print("|---" * (len(variants) + 5) + "|")
    rows = []
    for label, batch, context, tokens in SHAPES:
        if a.decode_only and tokens > 1:
            continue
        s = _setup(batch, context, tokens, "mxfp4")
        outs, times = {}, {}
        for tag, fields in variants:
            out = torch.full_like(s["scores"], float("nan"))
            fn = _scores_fn(dict(s, scores=out), batch, tokens, variant_plan(fields, s, batch, tokens))
            fn()
            torch.cuda.synchronize()
            outs[tag] = out.clone()
            times[tag] = time_cuda(fn, warmup=10, iters=a.iters, graph=tokens <= 4) * 1e6
        vis = s["visible"]
        live = torch.arange(s["entries"], device=vis.device)[None, :] < vis[:, None]
        o = outs[first].float()
        row_max = torch.where(live, o.abs(), 0).amax(dim=1, keepdim=True).clamp_min(1e-30)
        worst, unwritten = 0.0, 0
        for tag in outs:
            n = outs[tag].float()
            unwritten += int(torch.isnan(n[live]).sum())
            worst = max(worst, float(((o - n).abs() / row_max)[live].nan_to_num(0).max()))
        key_bytes = batch * s["entries"] * 68
        row = dict(shape=label, batch=batch, context=context, tokens=tokens, key_mb=key_bytes / 1e6,
                   **{f"{t}_us": v for t, v in times.items()},
                   pct_copy_default=100 * key_bytes / bw / (times["default"] / 1e6),
                   max_diff_rel_row_max=worst, unwritten=unwritten, device=env["device"])
        rows.append(row)
        print(f"| {label} | " + " | ".join(f"{times[v[0]]:.1f}" for v in variants)
              + f" | {times[first] / times['default']:.2f}x | {key_bytes / 1e6:.1f} | "
              f"{row['pct_copy_default']:.0f} | {worst:.1e}{' UNWRITTEN ' + str(unwritten) if unwritten else ''} |",
              flush=True)
        del s, outs
    if a.sweep:
        for label, batch, context, tokens in SHAPES[:2]:
            s = _setup(batch, context, tokens, "mxfp4")
            default = scores_plan(s, batch, tokens)
            for factor in SWEEP:
                plan = scaled_tiles(default, factor)
                us = time_cuda(_scores_fn(s, batch, tokens, plan), warmup=10, iters=a.iters, graph=True) * 1e6
                print(f"{label} {plan.tiles_per_split} tiles per program: {us:.1f} µs", flush=True)
                rows.append(dict(shape=label, plan=plan.describe(), default_us=us, device=env["device"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(environment=env, copy_bandwidth=bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
