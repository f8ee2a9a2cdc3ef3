"""A/B of the indexer scores kernel: this tree's against a baseline copy, same inputs, same run, same device.

The baseline is a directory holding an older ``dsv4/kernels/indexer.py`` and the ``ptx.py`` (and
``indexer_sm90.py``) it imports (e.g. ``git show REV:src/dsv4/kernels/indexer.py > DIR/indexer.py``, same for the
others); it is loaded as a package of its own next to ``dsv4``. Both kernels read the same random MXFP4 pool; each
gets the same query channels in its own operand order (``--baseline-order``: ``even-odd`` for kernels before the
nibble-order conversion, ``natural`` for this tree's ``mxfp4_operand_channels``). Launches per shape: the baseline
(if given), this tree's kernel with each of ``--variants``' launch options (default: the Triton kernel,
``GLUON=False``) and this tree's default (the Gluon kernel for single-token decode on sm_90). Scores are compared
(largest difference relative to the row's largest score: they differ only in the MMA's accumulation order) and
timed as CUDA-graph replays with L2 flushed (decode, 1-4 tokens) or eagerly (prefill chunks).

Usage: ``python benchmarks/ab_scores.py [--baseline DIR] [--baseline-order even-odd] [--variants JSON]
[--decode-only] [--json out.json]`` (``--variants '{"uncapped": {"maxnreg": 0}}'``: this tree's kernel with other
launch options); ``--profile-calls N`` only calls this tree's kernel at B=64 × 128K (``gpu_profile.sh``'s
``scores`` target).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch

from bench_indexer import EPP, BLOCK, M, _setup
from dsv4.bench.roofline import environment, measure_copy_bandwidth, time_cuda

#: (label, batch, context, query tokens per request)
SHAPES = [("decode 128K B=64", 64, 131072, 1), ("decode 128K B=8", 8, 131072, 1),
          ("decode 128K B=128", 128, 131072, 1), ("decode 32K B=64", 64, 32768, 1),
          ("decode 1M B=8", 8, 1048576, 1), ("prefill 4K @32K B=1", 1, 32768, 4096),
          ("prefill 4K @128K B=1", 1, 131072, 4096), ("decode 2 tokens 32K B=64", 64, 32768, 2)]

#: launch options of this tree's default kernel timed by ``--sweep``
SWEEP = [*({"PROGRAMS_PER_SM": p} for p in (8, 16, 32)), *({"MIN_TILES_PER_PROGRAM": m} for m in (1, 8, 16))]


def load_baseline(path: str):
    """The baseline's ``indexer`` module, imported as ``dsv4_ab_baseline.indexer`` (its ``from . import ptx``
    finds the baseline's ``ptx.py``)."""
    name = "dsv4_ab_baseline"
    spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[name] = pkg
    if not os.path.exists(os.path.join(path, "__init__.py")):
        open(os.path.join(path, "__init__.py"), "w").close()
    spec.loader.exec_module(pkg)
    return importlib.import_module(f"{name}.indexer")


def operand(q_channels: torch.Tensor, order: str) -> torch.Tensor:
    """``[T, HP, 128]`` E4M3 bytes per channel → the ``[T, 2, HP, 64]`` operand of a kernel with ``order``."""
    from dsv4.ops.triton_indexer import mxfp4_operand_channels

    if order == "even-odd":
        return torch.stack([q_channels[..., 0::2], q_channels[..., 1::2]], dim=1).contiguous()
    ch = mxfp4_operand_channels(q_channels.device)
    return torch.stack([q_channels[..., ch[0]], q_channels[..., ch[1]]], dim=1).contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="directory with the baseline's indexer.py and ptx.py")
    ap.add_argument("--profile-calls", type=int, default=0,
                    help="only call this tree's kernel N times at the first shape (for ncu), no timing")
    ap.add_argument("--baseline-order", default="even-odd", choices=["even-odd", "natural"])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sweep", action="store_true",
                    help="also time this tree's default with the launch options SWEEP (B=64 and B=8, 128K decode)")
    ap.add_argument("--variants", default='{"triton": {"GLUON": false}}',
                    help="JSON {tag: config}: this tree's index_scores with these configs, timed beside the baseline "
                         "(if any) and the default")
    ap.add_argument("--decode-only", action="store_true", help="skip the prefill shape (e.g. variants with maxnreg)")
    ap.add_argument("--json")
    a = ap.parse_args()
    from dsv4.kernels.indexer import scores as new

    if a.profile_calls:
        label, batch, context, tokens = SHAPES[0]
        s = _setup(batch, context, tokens, "mxfp4")
        q = operand(torch.cat([s["q"][:, 0], s["q"][:, 1]], dim=-1), "natural")
        for _ in range(a.profile_calls):
            new.index_scores(s["pages"], s["block_tables"], s["cu"], s["visible"], q, s["w"], s["scores"],
                             fmt=new.FMT_MXFP4, m=M, block_size=BLOCK, entries_per_page=EPP, num_requests=batch,
                             max_new=tokens, max_entries=s["entries"])
        torch.cuda.synchronize()
        print(f"profiled {label}: {a.profile_calls} calls")
        return
    bw = measure_copy_bandwidth()
    env = environment()
    print(f"{env['device']}: copy {bw / 1e12:.2f} TB/s")
    variants = [(tag, new, "natural", config) for tag, config in json.loads(a.variants).items()]
    if a.baseline:
        variants.insert(0, ("baseline", load_baseline(a.baseline), a.baseline_order, None))
    variants.append(("default", new, "natural", None))
    first = variants[0][0]
    print("| shape | " + " | ".join(f"{v[0]} µs" for v in variants) + f" | speedup default/{first} | key MB | "
          "% copy bw (default) | max diff / row max |")
    print("|---" * (len(variants) + 5) + "|")
    rows = []
    for label, batch, context, tokens in SHAPES:
        if a.decode_only and tokens > 1:
            continue
        s = _setup(batch, context, tokens, "mxfp4")
        chans = torch.cat([s["q"][:, 0], s["q"][:, 1]], dim=-1)  # [T, HP, 128]: any channel order will do
        outs, times = {}, {}
        for tag, mod, order, config in variants:
            q = operand(chans, order)
            out = torch.full_like(s["scores"], float("nan"))

            def fn(mod=mod, q=q, out=out, config=config):
                mod.index_scores(s["pages"], s["block_tables"], s["cu"], s["visible"], q, s["w"], out,
                                 fmt=mod.FMT_MXFP4, m=M, block_size=BLOCK, entries_per_page=EPP,
                                 num_requests=batch, max_new=tokens, max_entries=s["entries"], config=config)
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
            q = operand(torch.cat([s["q"][:, 0], s["q"][:, 1]], dim=-1), "natural")
            for config in SWEEP:
                def fn(config=config):
                    new.index_scores(s["pages"], s["block_tables"], s["cu"], s["visible"], q, s["w"], s["scores"],
                                     fmt=new.FMT_MXFP4, m=M, block_size=BLOCK, entries_per_page=EPP,
                                     num_requests=batch, max_new=tokens, max_entries=s["entries"], config=config)
                us = time_cuda(fn, warmup=10, iters=a.iters, graph=True) * 1e6
                print(f"{label} {config}: {us:.1f} µs", flush=True)
                rows.append(dict(shape=label, config=config, default_us=us, device=env["device"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(environment=env, copy_bandwidth=bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
