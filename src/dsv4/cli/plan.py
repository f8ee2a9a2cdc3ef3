"""``dsv4 plan``: the memory planner's tables (per GPU of a ``--tp`` / ``--cp`` split), JSON and plot."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from .. import __version__
from .common import _output_file, _load_config, _parse_layers, _kinds_summary, _emit_json, _clean


def cmd_plan(args: argparse.Namespace) -> int:
    """``dsv4 plan``: bytes per token / per request by layer kind and format, what fits a memory budget."""
    from ..planner import FORMATS, human_bytes, plan_formats, plot_memory

    _output_file("--json", args.json)
    _output_file("--plot", args.plot)
    cfg = _load_config(args, "v4-flash")
    layers = _parse_layers(args.layers, cfg)
    memory = args.memory
    context = args.context if args.context is not None else min(1 << 20, cfg.max_position)
    if not 1 <= context <= cfg.max_position:
        raise SystemExit(f"error: --context must be in 1..{cfg.max_position} (max_position of {cfg.name})")
    formats = args.formats or ["official", "hopper", "exact", "dense-bf16"]
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise SystemExit(f"error: unknown format(s) {bad}; choose from {sorted(FORMATS)}")
    parallel = None
    try:
        plans = plan_formats(cfg, context, memory, layers, formats, args.block_size, args.cp)
        if args.tp * args.cp > 1:
            from ..planner import plan_parallel

            parallel = plan_parallel(cfg, context, memory, layers, args.tp, args.cp, "official", args.block_size)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    say: Callable[..., None] = (lambda *a, **k: None) if args.json == "-" else print
    say(f"dsv4 {__version__} plan — {cfg.describe()}")
    say(f"counted: {_kinds_summary(cfg, layers)}"
        + (" (the MTP block excluded; add it with --layers all)" if cfg.num_mtp_layers and len(layers) == cfg.num_layers
           and layers == list(range(cfg.num_layers)) else ""))
    say(f"assumptions: cache only (no weights, activations or kernel workspace); {args.block_size}-token pool blocks, "
        f"block rounding and page padding as HybridCache allocates; no prefix sharing; per-request fixed state = "
        f"the {cfg.window}-token SWA ring of every layer (+ int32 positions) and the CSA/HCA compressor tails in FP32; "
        f"the dense baseline keeps every token of every layer as one 512-dim BF16 KV entry (K = V) and no state.")
    say("")
    official = next((p for p in plans if p.kinds), None)
    if official is not None:
        say(f"per layer kind ({official.format} format):")
        say(f"  {'kind':<5}{'layers':>7}{'ratio':>6}{'KV B':>7}{'index B':>8}{'B/token':>9}{'state/request':>15}"
            f"{'pool/block':>12}")
        for k in official.kinds:
            say(f"  {k.kind:<5}{k.layers:>7}{k.ratio:>6}{k.kv_entry_bytes:>7}{k.index_entry_bytes:>8}"
                f"{k.bytes_per_token:>9.2f}{human_bytes(k.state_bytes):>15}{human_bytes(k.pool_bytes_per_block):>12}")
        say("")
    per_gpu = f" per GPU (one of {args.cp} context-parallel GPUs: its share of the pool)" if args.cp > 1 else ""
    say(f"context {context:,} tokens, memory budget {human_bytes(memory)}{per_gpu}:")
    say(f"  {'format':<11}{'B/token':>9}{'fixed/request':>15}{'per request':>13}{'B/token x ctx':>15}"
        f"{'requests':>10}{'max context':>13}")
    for p in plans:
        say(f"  {p.format:<11}{p.bytes_per_token:>9,.0f}{human_bytes(p.fixed_bytes_per_request):>15}"
            f"{human_bytes(p.bytes_per_request):>13}{human_bytes(p.spec_estimate):>15}{p.max_requests:>10,}"
            f"{p.max_context:>13,}")
    for p in plans:
        say(f"  {p.format}: {p.description}")
    if official is not None:
        sp = official.bytes_per_token
        say(f"\nSPEC §7.3 (docs/spec.md): {official.format} grows {sp:,.2f} B/token"
            f"{f' per GPU (1/{args.cp} of the whole)' if args.cp > 1 else ''} over these layers "
            f"({' + '.join(f'{k.layers} {k.kind} x {k.bytes_per_token:.2f}' for k in official.kinds if k.bytes_per_token)}); "
            f"x {context:,} tokens = {human_bytes(sp * context)}; with the fixed state "
            f"({human_bytes(official.fixed_bytes_per_request)}) and block rounding/page padding one request holds "
            f"{human_bytes(official.bytes_per_request)}.")
    if parallel is not None:
        pp = parallel
        say(f"\nparallel: tp {pp.tp} x cp {pp.cp} = {pp.tp * pp.cp} GPUs ({pp.format} format; tensor parallelism splits the "
            f"heads and replicates the cache, context parallelism splits every request's compressed pool):")
        say(f"  {'per GPU':<34}{f'tp {pp.tp} x cp {pp.cp}':>16}{'one GPU':>16}")
        rows = [("attention weights", human_bytes(pp.weights_per_gpu), human_bytes(pp.weights_one_gpu)),
                (f"cache of one {context:,}-token request", human_bytes(pp.request_per_gpu), human_bytes(pp.request_one_gpu)),
                (f"requests that fit {human_bytes(memory)} of cache", f"{pp.max_requests_per_gpu:,}", f"{pp.max_requests_one_gpu:,}"),
                ("longest context that fits", f"{pp.max_context_per_gpu:,}", f"{pp.max_context_one_gpu:,}")]
        for label, a, b in rows:
            say(f"  {label:<34}{a:>16}{b:>16}")
        say(f"  (the longest context is capped at {cfg.name}'s max_position {cfg.max_position:,})")
    prefix = None
    if args.shared_prefix:
        from ..planner import plan_prefix_sharing

        if not 0 < args.shared_prefix <= context or args.prefix_groups < 1:
            raise SystemExit("error: --shared-prefix must be in 1..--context and --prefix-groups >= 1")
        prefix = plan_prefix_sharing(cfg, memory, context, args.shared_prefix, args.prefix_groups, None, layers,
                                     FORMATS["official"].numerics, args.block_size)
        say(f"\nprefix caching (official format): {args.prefix_groups} group(s) sharing the first "
            f"{args.shared_prefix:,} tokens of each {context:,}-token request; a hit takes {prefix.shared_blocks} whole "
            f"blocks ({prefix.shared_tokens:,} tokens) and the state snapshot at their end "
            f"({human_bytes(prefix.snapshot_bytes)}: every layer's SWA ring + CSA previous-window halves; the "
            f"compressor tails are empty at a block boundary)")
        say(f"  one cached prefix holds {human_bytes(prefix.bytes_per_prefix)}; a request then holds "
            f"{human_bytes(prefix.private_bytes_per_request)} of its own; requests that fit {human_bytes(memory)}: "
            f"{prefix.max_requests_shared:,} sharing vs {prefix.max_requests_private:,} without "
            f"({prefix.max_requests_shared / max(prefix.max_requests_private, 1):.2f}x); prefill computed "
            f"{100 * prefix.prefill_fraction:.1f}% of the prompt tokens")
    if args.plot:
        try:
            plot_memory(cfg, args.plot, formats, layers, args.block_size, memory, args.plot_max_context or cfg.max_position)
        except ImportError as e:
            raise SystemExit(f"error: {e}") from None
        say(f"plot written to {args.plot}")
    if args.json:
        _emit_json(_clean({
            "version": __version__, "command": "plan", "config": cfg.name, "layers": layers, "context": context,
            "memory_bytes": memory, "block_size": args.block_size,
            "plans": [dict(p.__dict__, kinds=[k.__dict__ for k in p.kinds]) for p in plans],
            "prefix": None if prefix is None else prefix.__dict__,
            "parallel": None if parallel is None else parallel.__dict__,
        }), args.json)
    return 0
