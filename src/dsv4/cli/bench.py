"""``dsv4 bench``: the kernel benchmark scripts and the end-to-end decode benchmark, as a table and JSON."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from ..config import ModelConfig
from .common import _pick_device, _output_file, _parse_layers, _emit_json, _clean


def cmd_bench(args: argparse.Namespace) -> int:
    """``dsv4 bench``: kernel benchmark scripts + the end-to-end decode benchmark → table + JSON."""
    import tempfile

    from ..bench.suite import format_table, run_suite, write_results

    _output_file("--json", args.json)
    if args.dir is not None and not os.path.isdir(args.dir):
        raise SystemExit(f"error: --dir {args.dir!r} is not a folder")
    device = _pick_device(args.device)
    if args.backend == "triton" and device.type != "cuda":
        raise SystemExit(f"error: --backend triton needs a CUDA GPU; this run is on {device} (use auto or torch)")
    e2e_kwargs: dict[str, Any] = {"backend": args.backend}
    if args.e2e_preset:
        e2e_kwargs["preset"] = args.e2e_preset
    if args.e2e_batch:
        e2e_kwargs["batches"] = args.e2e_batch
    if args.e2e_context:
        e2e_kwargs["contexts"] = args.e2e_context
    if args.e2e_layers:
        cfg = ModelConfig.preset(args.e2e_preset or ("v4-flash" if device.type == "cuda" else "tiny"))
        e2e_kwargs["layers"] = _parse_layers(args.e2e_layers, cfg)
    if args.e2e_gen is not None:
        e2e_kwargs["gen"] = args.e2e_gen
    say = print if args.json != "-" else (lambda *a, **k: None)
    if device.type != "cuda":
        say(f"note: running on {device}: kernel benchmarks that need a CUDA GPU are skipped (listed below); "
            "the end-to-end benchmark runs with the torch backend")
    result = run_suite(device, quick=args.quick, directory=args.dir, only=args.only, e2e=not args.no_e2e,
                       e2e_kwargs=e2e_kwargs, say=say)
    table = format_table(result)
    say("")
    say(table)
    out_dir = args.out if args.out is not None else tempfile.mkdtemp(prefix="dsv4-bench-")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        jp, tp = os.path.join(out_dir, f"bench-{stamp}.json"), os.path.join(out_dir, f"bench-{stamp}.md")
        write_results(_clean(result), jp, tp)
        say(f"\nwrote {jp} and {tp}")
    if args.json:
        _emit_json(_clean(result), args.json)
    return 1 if any(sec["error"] for sec in result["sections"]) else 0
