"""``dsv4 run``: the engine over many requests (``--tp`` / ``--cp`` under torchrun), its report and spot check."""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

from .. import __version__
from . import common
from .common import _pick_device, _output_file, _load_config, _parse_layers, _kinds_summary, _mib, _emit_json, _clean


_CPU_DEFAULTS = {"preset": "tiny", "requests": 16, "prompt_len": "uniform:64:384", "gen_len": "32", "max_running": 8,
                 "max_batched_tokens": 512}
_GPU_DEFAULTS = {"preset": "v4-flash", "requests": 64, "prompt_len": "8192", "gen_len": "256", "max_running": 64,
                 "max_batched_tokens": 8192}


def _start_parallel(args: argparse.Namespace) -> tuple[Any, torch.device | None]:
    """``--tp`` / ``--cp`` beyond one process: this rank's ``Parallel`` and device from ``torchrun``'s environment
    (``(None, None)`` for one process)."""
    if args.tp * args.cp == 1:
        return None, None
    from ..distributed import init_from_env

    world = os.environ.get("WORLD_SIZE")
    if world is not None and int(world) != args.tp * args.cp:
        raise SystemExit(f"error: --tp {args.tp} --cp {args.cp} needs exactly {args.tp * args.cp} processes, torchrun "
                         f"started {world} (--nproc-per-node)")
    try:
        return init_from_env(args.tp, args.cp, args.device)
    except (RuntimeError, ValueError) as e:
        raise SystemExit(f"error: --tp {args.tp} --cp {args.cp}: {e}") from None


def cmd_run(args: argparse.Namespace) -> int:
    """``dsv4 run``: the engine over a workload, figures, and a spot check against the reference. With ``--tp`` /
    ``--cp`` under ``torchrun``: every rank runs the engine on its share, rank 0 prints (and spot-checks)."""
    parallel, device = _start_parallel(args)
    try:
        return _run(args, parallel, device)
    finally:
        if parallel is not None:
            import torch.distributed as dist

            dist.destroy_process_group()


def _run(args: argparse.Namespace, parallel: Any, device: torch.device | None) -> int:
    from ..engine import Engine, EngineConfig, LengthSpec, make_requests, spot_check
    from ..engine.runner import weights_bytes

    rank0 = parallel is None or torch.distributed.get_rank() == 0
    _output_file("--json", args.json if rank0 else None)
    if args.checkpoint and not os.path.exists(args.checkpoint):
        raise SystemExit(f"error: --checkpoint {args.checkpoint!r} does not exist")
    device = device if device is not None else _pick_device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    d = _GPU_DEFAULTS if device.type == "cuda" else _CPU_DEFAULTS
    cfg = _load_config(args, d["preset"])
    layers = _parse_layers(args.layers, cfg)
    n_req = args.requests if args.requests is not None else d["requests"]
    prompt_text = args.prompt_len if args.prompt_len is not None else d["prompt_len"]
    gen_text = args.gen_len if args.gen_len is not None else d["gen_len"]
    try:
        p_spec = LengthSpec.parse(prompt_text, 1)
        g_spec = LengthSpec.parse(gen_text, 0)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    longest = p_spec.max_value + g_spec.max_value
    if longest > cfg.max_position:
        raise SystemExit(
            f"error: --prompt-len {prompt_text} + --gen-len {gen_text} reach {longest:,} tokens but {cfg.name} allows "
            f"at most {cfg.max_position:,} (max_position); use shorter lengths"
        )
    max_running = args.max_running if args.max_running is not None else min(d["max_running"], n_req)
    budget = args.max_batched_tokens if args.max_batched_tokens is not None else d["max_batched_tokens"]
    block_size = args.block_size if args.block_size is not None else (256 if cfg.window >= 128 else 64)
    try:
        from ..cache import layer_schemas

        layer_schemas(cfg, layers, args.numerics, block_size)  # block size vs the ratios, before any output
    except ValueError as e:
        raise SystemExit(f"error: --block-size {block_size}: {e}") from None
    weights_mode = args.checkpoint or args.weights
    cache_memory = args.cache_memory
    json_only = args.json == "-"
    say: Callable[..., None] = (lambda *a, **k: None) if json_only or not rank0 else print
    if args.shared_prefix < 0 or args.prefix_groups < 1:
        raise SystemExit("error: --shared-prefix must be >= 0 and --prefix-groups >= 1")
    if args.prefix_states is not None and args.prefix_states < 1:
        raise SystemExit("error: --prefix-states must be >= 1")
    try:
        econf = EngineConfig(
            backend=args.backend, device=str(device), numerics=args.numerics, block_size=block_size,
            max_running=max_running, max_batched_tokens=budget, max_prefill_chunk=args.max_prefill_chunk,
            decode_tokens=args.decode_tokens, cache_memory=cache_memory, cuda_graphs=args.cuda_graphs,
            weights=weights_mode, seed=args.seed, prefix_caching=args.prefix_caching, prefix_states=args.prefix_states,
            warmup={"auto": None, "on": True, "off": False}[args.warmup], side_stream=args.side_stream == "on",
        )
    except (TypeError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    requests = make_requests(n_req, p_spec, g_spec, seed=args.seed, shared_prefix=args.shared_prefix,
                             prefix_groups=args.prefix_groups)
    too_long = [r for r in requests if r.total_len > cfg.max_position]
    if too_long:
        r = too_long[0]
        raise SystemExit(
            f"error: request {r.request_id} draws {r.prompt_len:,} + {r.gen_len:,} tokens, more than {cfg.name}'s "
            f"max_position {cfg.max_position:,}; narrow --prompt-len / --gen-len"
        )
    for i, r in enumerate(requests):
        r.arrival_step = i * args.arrival_every
    act_bytes = 2 if args.numerics == "official" else 4
    one_per_kind = sorted({next(i for i in layers if cfg.layer_kind(i) is k) for k in {cfg.layer_kind(i) for i in layers}})
    w_bytes = weights_bytes(cfg, one_per_kind if weights_mode == "shared" else layers, act_bytes)
    if device.type == "cuda" and weights_mode == "random":
        free, _ = torch.cuda.mem_get_info(device)
        if w_bytes > 0.7 * free:
            say(f"note: random weights of {len(layers)} layers need {_mib(w_bytes)} but {_mib(free)} is free: "
                "using --weights shared (one random set per layer kind, shared by its layers)")
            weights_mode = "shared"
            econf = dataclasses.replace(econf, weights="shared")
            w_bytes = weights_bytes(cfg, one_per_kind, act_bytes)

    say(f"dsv4 {__version__} run — {platform.processor() or platform.machine()}"
        + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "") + f", torch {torch.__version__}")
    say(cfg.describe())
    t_build = time.perf_counter()
    try:
        engine = Engine(cfg, layers, econf, progress=not args.no_progress and not json_only and rank0,
                        parallel=parallel)
    except (ValueError, TypeError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    build_s = time.perf_counter() - t_build
    say(f"stack: {_kinds_summary(cfg, layers)}; backend {engine.backend} on {device}; numerics {args.numerics}; "
        f"weights {weights_mode} ({_mib(w_bytes)}, built in {build_s:.1f} s)")
    if parallel is not None:
        import torch.distributed as dist

        say(f"parallel: tp {args.tp} x cp {args.cp} over {dist.get_world_size()} processes ({dist.get_backend()}); "
            f"each rank computes {cfg.num_heads // args.tp} of {cfg.num_heads} heads and holds 1/{args.cp} of every "
            f"request's compressed entries; rank 0 prints and spot-checks; figures are rank 0's")
    tot_p = sum(r.prompt_len for r in requests)
    tot_g = sum(r.gen_len for r in requests)
    shared = (f"a shared prefix of {args.shared_prefix:,} tokens per group ({args.prefix_groups} groups) + "
              if args.shared_prefix else "")
    say(f"workload: {n_req} requests, prompt {shared}{p_spec} ({tot_p:,} tokens), generate {g_spec} ({tot_g:,} tokens); "
        f"<= {max_running} running, {budget}-token step budget, {args.decode_tokens} token(s) per decode step"
        + (f", one arrival every {args.arrival_every} steps" if args.arrival_every else "")
        + ("; prefix caching on" if args.prefix_caching else ""))

    if args.warmup_only:
        return _warmup_only(args, engine, requests, say)

    # Spot-check requests: the longest and the shortest (distinct), plus more if asked.
    n_check = max(0, min(args.check_requests, n_req))
    check_layers: list[int] = []
    if n_check:
        by_len = sorted(requests, key=lambda r: (r.total_len, r.number))
        picks = [by_len[-1], by_len[0]] + by_len[1:-1]
        if args.shared_prefix:  # a group's first request (computes the prefix) and its last (most likely a hit)
            group = [r for r in requests if r.number % args.prefix_groups == 0]
            picks = [group[0], group[-1]] + picks
        chosen = []
        for r in picks:
            if r not in chosen:
                chosen.append(r)
        chosen = chosen[:n_check]
        check_layers = (layers if len(layers) <= 8 else _parse_layers(["kinds"], cfg)) if args.check_layers is None \
            else _parse_layers(args.check_layers, cfg)
        check_layers = [li for li in check_layers if li in layers]
        engine.trace([r.request_id for r in chosen], check_layers)

    try:
        stats = engine.run(requests, progress=not args.no_progress and not json_only and rank0)
    except Exception as e:  # the run itself failing is an error, not a FAIL of the check
        raise SystemExit(f"error: the run failed: {type(e).__name__}: {e}") from e
    first_step = time.perf_counter() - stats.wall_s - common._T_COMMAND
    s = stats.summary()
    cache = engine.cache
    assert cache is not None
    state_per_slot = cache.state.bytes_per_slot
    per_block = cache.pool.bytes_per_block

    say("")
    say(f"cache{' (rank 0)' if parallel is not None else ''}: {_mib(s['cache_bytes_allocated'])} allocated "
        f"({cache.num_blocks} blocks of {block_size} tokens x "
        f"{_mib(per_block)}, {cache.max_requests} state slots x {_mib(state_per_slot)})"
        + (f"; CUDA graphs for decode batches {list(engine.graphs.sizes)} (captured in {s['graph_capture_s']:.1f} s)"
           if engine.graphs is not None else "; CUDA graphs: off"))
    say(f"{'':<10}{'tokens':>12}{'seconds':>10}{'tokens/s':>12}")
    pre_s = sum(r.seconds for r in stats.steps if r.prefill_tokens)
    dec_steps = [r for r in stats.steps if not r.prefill_tokens]
    dec_s = sum(r.seconds for r in dec_steps)
    dec_tok = sum(r.decode_tokens for r in dec_steps)
    say(f"{'prefill':<10}{s['prefill_tokens']:>12,}{pre_s:>10.2f}{s['prefill_tok_s']:>12,.0f}   "
        f"({sum(1 for r in stats.steps if r.prefill_tokens)} steps with prefill; their decode tokens ride along)")
    say(f"{'decode':<10}{dec_tok:>12,}{dec_s:>10.2f}{s['decode_tok_s']:>12,.0f}   "
        f"({s['decode_steps']} decode-only steps, mean batch {s['decode_batch_mean']:.1f}, {s['graph_steps']} graph replays)")
    say(f"{'total':<10}{s['prefill_tokens'] + s['decode_tokens']:>12,}{s['wall_s']:>10.2f}{s['total_tok_s']:>12,.0f}")
    if s["warmup"]:
        from ..engine.warmup import WarmupReport

        say(WarmupReport.from_dict(s["warmup"]).describe())
    s["cli_to_first_step_s"] = first_step
    say(f"first step {first_step:.1f} s after the command started (weights {build_s:.1f} s, then warm-up, cache and "
        f"graph capture {s['prepare_s']:.1f} s)")
    if s["jit_kernels"] or s["warmup"]:
        say(f"Triton JIT compiles inside the timed steps: {s['jit_s']:.1f} s ({s['jit_kernels']} kernels, first use of "
            f"each specialisation); without them prefill {s['prefill_tok_s_without_jit']:,.0f} tokens/s, decode "
            f"{s['decode_tok_s_without_jit']:,.0f} tokens/s")
    say(f"{'step ms':<16}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}")
    for k in ("decode", "prefill"):
        q = s["step_ms"][k]
        label = "decode-only" if k == "decode" else "with prefill"
        say(f"  {label:<14}{q['p50']:>10.2f}{q['p90']:>10.2f}{q['p99']:>10.2f}{q['max']:>10.2f}")
    say(f"time to first token p50 {s['ttft_s']['p50']:.2f} s, p90 {s['ttft_s']['p90']:.2f} s; "
        f"request done p50 {s['e2e_s']['p50']:.2f} s")
    tok = s["tokens_cached_at_peak"]
    peak = s["cache_bytes_peak"]
    dense = s["dense_bf16_bytes_at_peak"]
    say(f"cache in use at peak: {_mib(peak)} for {tok:,} tokens ({peak / max(tok, 1):,.0f} B/token incl. windows and "
        f"compressor state); a dense BF16 cache of the same tokens needs {_mib(dense)} "
        f"({dense / max(peak, 1):.1f}x)")
    if args.prefix_caching:
        pc = s["prefix"]
        say(f"prefix cache: hit rate {100 * s['prefix_hit_rate']:.1f}% ({s['prefix_cached_tokens']:,} of "
            f"{s['prompt_tokens']:,} prompt tokens from the cache; {s['prefix_requests_hit']} of {n_req} requests hit); "
            f"prefill computed {s['prefill_tokens']:,} of {s['prompt_tokens']:,} submitted tokens; memory held by the "
            f"prefix cache alone: peak {_mib(s['prefix_cache_bytes_peak'])}, at the end {_mib(s['prefix_cache_bytes_end'])} "
            f"({pc['cached_blocks']} cached blocks, {pc['state_rows_used']} of {pc['state_rows']} state snapshots x "
            f"{_mib(pc['state_bytes_per_row'])})")

    if args.explain:
        say("")
        for label, plan in engine.plans_seen.items():
            say(f"first {label} step's {plan.describe()}")

    failures = 0
    check_rows: list[dict[str, Any]] = []
    if n_check and rank0:  # the reference runs in one process
        engine.graphs = None
        engine.cache = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        t0 = time.perf_counter()
        try:
            rows = spot_check(engine)
        except RuntimeError as e:
            raise SystemExit(f"error: spot check: {e}") from None
        check_s = time.perf_counter() - t0
        say(f"\nspot check against dsv4.reference ({len(engine.traces)} requests x {len(check_layers)} layers, "
            f"{args.numerics} numerics, {check_s:.1f} s):")
        say(f"  {'request':<10}{'layer':>6} {'kind':<5}{'tokens':>8}{'rel err':>11}{'tol':>9}{'ties':>6}"
            f"{'tie gap':>9}  result")
        for r in rows:
            say(f"  {r.request_id:<10}{r.layer:>6} {r.kind:<5}{r.tokens:>8}{r.rel_err:>11.2e}{r.tol:>9.0e}"
                f"{r.tie_rows:>6}{r.tie_worst_gap:>9.3g}  {'PASS' if r.passed else 'FAIL'}"
                + (f" ({r.topk_mismatch_rows} top-k rows differ beyond a tie: tokens {r.topk_mismatch_tokens}, "
                   f"worst gap {r.topk_worst_gap:.3g} of max|score|)" if r.topk_mismatch_rows else ""))
            failures += not r.passed
            check_rows.append(r.as_dict())
        for rid, tr in engine.traces.items():
            if tr.prefix_from is not None:
                P = next(r.cached_tokens for r in requests if r.request_id == rid)
                say(f"  {rid}: started from a cached prefix of {P:,} tokens; its rows 0-{P - 1} are {tr.prefix_from}'s, "
                    "the rest computed on the restored blocks, window and compressor state")
        say(f"spot check: {'PASS' if not failures else 'FAIL'}"
            + ("" if not any(r.tie_rows for r in rows) else
               " ('ties': CSA tokens whose top-k differs only by near-tied index scores, excluded from the error)"))
    verdict = "PASS" if not failures else "FAIL"
    if args.json and rank0:
        out = {
            "version": __version__, "command": "run", "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine()),
            "torch": torch.__version__, "config": cfg.name, "layers": layers, "backend": engine.backend,
            "numerics": args.numerics, "weights": weights_mode, "seed": args.seed,
            "parallel": {"tp": args.tp, "cp": args.cp}, "side_stream": args.side_stream == "on",
            "workload": {"requests": n_req, "prompt_len": str(p_spec), "gen_len": str(g_spec), "prompt_tokens": tot_p,
                         "gen_tokens": tot_g, "max_running": max_running, "max_batched_tokens": budget,
                         "decode_tokens": args.decode_tokens, "block_size": block_size,
                         "shared_prefix": args.shared_prefix, "prefix_groups": args.prefix_groups,
                         "prefix_caching": args.prefix_caching},
            "summary": s, "spot_check": check_rows, "check": verdict if n_check else None,
            "step_plans": {label: plan.describe() for label, plan in engine.plans_seen.items()},
        }
        from ..bench.roofline import git_commit

        out["commit"] = git_commit()
        out["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        _emit_json(_clean(out), args.json)
    return 1 if failures else 0


def _warmup_only(args: argparse.Namespace, engine: Any, requests: list, say: Callable[..., None]) -> int:
    """``dsv4 warmup``: compile the workload's kernels into the on-disk cache, run nothing else."""
    from ..engine.warmup import warm_up

    report = warm_up(engine, requests, progress=not args.no_progress and args.json != "-")
    say(report.describe())
    if args.json:
        from ..bench.roofline import git_commit

        _emit_json(_clean({"version": __version__, "command": "warmup", "device": str(engine.device),
                           "warmup": report.as_dict(), "commit": git_commit(),
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}), args.json)
    return 0
