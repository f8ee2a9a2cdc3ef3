"""Command line: ``dsv4 run`` (the main job).

Until the continuous-batching runner lands, ``dsv4 run`` runs the real reference forward of every layer of a
preset (every layer kind) on random weights and inputs, in both numerics, and reports what it computed: per
layer its kind, the keys each query saw, the compressed entries produced, how far the official (FP8/MXFP4)
numerics land from the exact FP32 ones, and the time taken.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Any, Sequence

import torch

from . import __version__
from .config import LayerKind, ModelConfig
from .reference import forward
from .weights import AttentionWeights


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda requested but no CUDA device is available")
    return dev


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def cmd_run(args: argparse.Namespace) -> int:
    cfg = ModelConfig.from_hf(args.config) if args.config else ModelConfig.preset(args.preset)
    device = _pick_device(args.device)
    layers = list(range(cfg.num_attention_layers)) if args.layers is None else args.layers
    for li in layers:
        cfg.layer_kind(li)  # range check with a clear error
    S = args.seq_len
    say = (lambda *a, **k: None) if args.json else print
    say(f"dsv4 {__version__} run — reference forward on {device} ({platform.processor() or platform.machine()})")
    say(cfg.describe())
    say(f"sequence: {S} tokens at positions 0..{S - 1}; layers {layers}; seed {args.seed}\n")
    say(f"{'layer':>5} {'kind':>4} {'entries':>7} {'keys/query':>10} {'exact ms':>9} {'official ms':>11} {'official vs exact':>17}")

    rows: list[dict[str, Any]] = []
    t_all = time.perf_counter()
    for li in layers:
        kind = cfg.layer_kind(li)
        w = AttentionWeights.random(cfg, li, seed=args.seed).to(device)
        x = torch.randn(S, cfg.hidden_size, generator=torch.Generator().manual_seed(args.seed * 7919 + li)).to(device)
        timings = {}
        results = {}
        for numerics in ("exact", "official"):
            t0 = time.perf_counter()
            results[numerics] = forward(w, cfg, li, x, numerics)
            if device.type == "cuda":
                torch.cuda.synchronize()
            timings[numerics] = (time.perf_counter() - t0) * 1e3
        ex, of = results["exact"], results["official"]
        if not (torch.isfinite(ex.y).all() and torch.isfinite(of.y).all()):
            print(f"error: non-finite output in layer {li}", file=sys.stderr)
            return 1
        keys_last = min(S, cfg.window) + int((of.entry_idx[-1] >= 0).sum()) if S else 0
        row = {
            "layer": li, "kind": kind.name, "compressed_entries": int(of.entries.shape[0]),
            "keys_last_query": keys_last, "exact_ms": timings["exact"], "official_ms": timings["official"],
            "official_vs_exact_rel_err": _rel_err(of.y.float(), ex.y),
        }
        if kind is LayerKind.CSA and ex.index_keys is not None and S >= cfg.csa_ratio:
            same = [set(a[a >= 0].tolist()) == set(b[b >= 0].tolist()) for a, b in zip(of.entry_idx, ex.entry_idx)]
            row["topk_rows_equal_exact"] = sum(same) / len(same)
        rows.append(row)
        say(f"{li:>5} {kind.name:>4} {row['compressed_entries']:>7} {keys_last:>10} {timings['exact']:>9.1f} "
            f"{timings['official']:>11.1f} {row['official_vs_exact_rel_err']:>17.2e}")
    total = time.perf_counter() - t_all
    say(f"\n{len(layers)} layers x {S} tokens x 2 numerics in {total:.2f} s "
        f"({2 * len(layers) * S / total:,.0f} token-layers/s). The official numerics store window and compressed "
        f"entries as 584-B FP8 entries and indexer keys as 68-B MXFP4; 'official vs exact' is their effect on the output.")
    if args.json:
        print(json.dumps({"version": __version__, "device": str(device), "config": cfg.name, "seq_len": S,
                          "seed": args.seed, "total_s": total, "layers": rows}, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4", description="DeepSeek-V4 hybrid attention: reference, cache and kernels")
    p.add_argument("--version", action="version", version=f"dsv4 {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the main job (reference forward of every layer kind; CPU when there is no GPU)")
    r.add_argument("--preset", default="tiny", choices=ModelConfig.presets(), help="model preset (default: tiny)")
    r.add_argument("--config", help="HF config.json (or its directory) instead of a preset")
    r.add_argument("--seq-len", type=int, default=300, help="tokens per sequence (default: 300)")
    r.add_argument("--layers", type=int, nargs="+", help="layer indices (default: all, MTP block included)")
    r.add_argument("--device", default="auto", help="auto | cpu | cuda (default: auto)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--json", action="store_true", help="print machine-readable JSON only")
    r.set_defaults(func=cmd_run)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "seq_len", 1) < 1:
        raise SystemExit("error: --seq-len must be >= 1")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
