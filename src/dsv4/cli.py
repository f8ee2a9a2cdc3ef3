"""Command line: ``dsv4 run`` (the main job), ``dsv4 plan``, ``dsv4 bench``, ``dsv4 check``.

* ``dsv4 run`` — the engine: a stack of attention layers (every main layer of a preset by default) over the
  paged hybrid cache, many requests through a continuous-batching scheduler (chunked prefill + decode). Prints
  prefill / decode throughput, step-latency percentiles, cache memory against a dense BF16 cache, and a spot
  check of a few requests against ``dsv4.reference`` (PASS/FAIL; exit code 1 on FAIL). Defaults: the tiny
  preset on the CPU (about a minute on a laptop), a V4-Flash workload on a GPU.
* ``dsv4 plan`` — the memory planner: bytes per token and per request by layer kind and storage format, what
  fits a memory budget; ``--plot`` draws memory against context length.
* ``dsv4 bench`` — kernel benchmarks (``benchmarks/bench_*.py``) and the end-to-end decode benchmark, as a table
  and JSON with roofline fractions.
* ``dsv4 check`` — every layer of a preset through the reference (both numerics) and through the cache, one
  sequence, checked against the reference (the former ``dsv4 run``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import __version__
from .cache import HybridCache
from .config import LayerKind, ModelConfig
from .layer import Attention
from .reference import forward, topk_differences
from .weights import AttentionWeights

_T_COMMAND = time.perf_counter()  # when main() began (reset there): the run reports its first step from it


def _pick_device(name: str) -> torch.device:
    """``--device``: ``auto`` (CUDA when available) or a device that exists here (one-line error otherwise)."""
    from .engine.runner import pick_device

    try:
        return pick_device(name, arg="--device")
    except (TypeError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None


# ---------------------------------------------------------------- argument types (argparse: one-line errors, exit 2)
def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer (want an integer >= {minimum})") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is below the minimum: want an integer >= {minimum}")
        return v

    parse.__name__ = f"integer >= {minimum}"
    return parse


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


def _byte_size(text: str) -> int:
    from .planner import parse_bytes

    try:
        return parse_bytes(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _device_arg(text: str) -> str:
    if text == "auto" or re.fullmatch(r"cpu|cuda(:\d+)?", text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a device: use auto, cpu, cuda or cuda:N")


def _output_file(option: str, path: str | None) -> None:
    """Fail before the work (one line) when ``path`` (a file the command writes at its end) cannot be written:
    its folder is missing, or it names a folder."""
    if path in (None, "", "-"):
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise SystemExit(f"error: {option} {path!r} is a folder; give a file path")
    if not os.path.isdir(folder):
        raise SystemExit(f"error: {option} {path!r}: folder {folder!r} does not exist (create it first)")
    if not os.access(folder, os.W_OK):
        raise SystemExit(f"error: {option} {path!r}: folder {folder!r} is not writable")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` only where there is a default to show and the help text does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text or "%(default)" in text:
            return text
        return super()._get_help_string(action)


def _load_config(args: argparse.Namespace, default_preset: str) -> ModelConfig:
    """``--config`` (a config.json or its directory), else ``--checkpoint``'s config.json, else ``--preset``."""
    path = getattr(args, "config", None)
    if path and not os.path.exists(path):
        raise SystemExit(f"error: --config {path!r} does not exist")
    try:
        if getattr(args, "config", None):
            return ModelConfig.from_hf(args.config)
        if getattr(args, "checkpoint", None) and not getattr(args, "preset", None):
            from .checkpoint import config_from_checkpoint

            return config_from_checkpoint(args.checkpoint)
        return ModelConfig.preset(args.preset or default_preset)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"error: cannot load the model configuration: {e}") from None


def _parse_layers(spec: Sequence[str] | None, cfg: ModelConfig, default: str = "main") -> list[int]:
    """``main`` (0 … num_layers−1), ``all`` (MTP included), ``kinds`` (the first layer of each kind), or
    indices / ranges (``0 2 5-9``)."""
    spec = list(spec) if spec else [default]
    if len(spec) == 1 and spec[0] in ("main", "all", "kinds"):
        if spec[0] == "main":
            return list(range(cfg.num_layers))
        if spec[0] == "all":
            return list(range(cfg.num_attention_layers))
        seen: dict[LayerKind, int] = {}
        for i in range(cfg.num_layers):
            seen.setdefault(cfg.layer_kind(i), i)
        return sorted(seen.values())
    out: list[int] = []
    for tok in spec:
        for part in str(tok).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                if "-" in part[1:]:
                    a, b = part.split("-", 1)
                    out.extend(range(int(a), int(b) + 1))
                else:
                    out.append(int(part))
            except ValueError:
                raise SystemExit(f"error: bad layer spec {part!r} (use main, all, kinds, or indices like 0 2 5-9)") from None
    for i in out:
        if not 0 <= i < cfg.num_attention_layers:
            raise SystemExit(f"error: layer {i} out of range for {cfg.name} (0..{cfg.num_attention_layers - 1})")
    if len(set(out)) != len(out):
        raise SystemExit(f"error: repeated layers in {out}")
    return out


def _kinds_summary(cfg: ModelConfig, layers: Sequence[int]) -> str:
    counts = {k: sum(1 for i in layers if cfg.layer_kind(i) is k) for k in LayerKind}
    parts = [f"{n} {k.name}" for k, n in counts.items() if n]
    if layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 2:
        rng = f"{layers[0]}-{layers[-1]}"
    else:
        rng = ",".join(map(str, layers))
    return f"layers {rng} ({', '.join(parts)})"


def _mib(n: float) -> str:
    from .planner import human_bytes

    return human_bytes(n)


def _emit_json(obj: Any, target: str | None) -> None:
    text = json.dumps(obj, indent=2, default=_json_default)
    if target in (None, "-"):
        print(text)
    else:
        with open(target, "w") as f:
            f.write(text + "\n")


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, (torch.device, torch.dtype)):
        return str(o)
    return str(o)


def _clean(o: Any) -> Any:
    """NaN/Inf → None, recursively (strict JSON)."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


# ==================================================================================================== dsv4 run
_CPU_DEFAULTS = {"preset": "tiny", "requests": 16, "prompt_len": "uniform:64:384", "gen_len": "32", "max_running": 8,
                 "max_batched_tokens": 512}
_GPU_DEFAULTS = {"preset": "v4-flash", "requests": 64, "prompt_len": "8192", "gen_len": "256", "max_running": 64,
                 "max_batched_tokens": 8192}


def _start_parallel(args: argparse.Namespace) -> tuple[Any, torch.device | None]:
    """``--tp`` / ``--cp`` beyond one process: this rank's ``Parallel`` and device from ``torchrun``'s environment
    (``(None, None)`` for one process)."""
    if args.tp * args.cp == 1:
        return None, None
    from .distributed import init_from_env

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
    from .engine import Engine, EngineConfig, LengthSpec, make_requests, spot_check
    from .engine.runner import weights_bytes

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
        from .cache import layer_schemas

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
            warmup={"auto": None, "on": True, "off": False}[args.warmup],
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
    first_step = time.perf_counter() - stats.wall_s - _T_COMMAND
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
        from .engine.warmup import WarmupReport

        say(WarmupReport(**s["warmup"]).describe())
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
        say(f"  {'request':<10}{'layer':>6} {'kind':<5}{'tokens':>8}{'rel err':>11}{'tol':>9}{'ties':>6}  result")
        for r in rows:
            say(f"  {r.request_id:<10}{r.layer:>6} {r.kind:<5}{r.tokens:>8}{r.rel_err:>11.2e}{r.tol:>9.0e}"
                f"{r.tie_rows:>6}  {'PASS' if r.passed else 'FAIL'}"
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
            "parallel": {"tp": args.tp, "cp": args.cp},
            "workload": {"requests": n_req, "prompt_len": str(p_spec), "gen_len": str(g_spec), "prompt_tokens": tot_p,
                         "gen_tokens": tot_g, "max_running": max_running, "max_batched_tokens": budget,
                         "decode_tokens": args.decode_tokens, "block_size": block_size,
                         "shared_prefix": args.shared_prefix, "prefix_groups": args.prefix_groups,
                         "prefix_caching": args.prefix_caching},
            "summary": s, "spot_check": check_rows, "check": verdict if n_check else None,
            "step_plans": {label: plan.describe() for label, plan in engine.plans_seen.items()},
        }
        from .bench.roofline import git_commit

        out["commit"] = git_commit()
        out["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        _emit_json(_clean(out), args.json)
    return 1 if failures else 0


def _warmup_only(args: argparse.Namespace, engine: Any, requests: list, say: Callable[..., None]) -> int:
    """``dsv4 warmup``: compile the workload's kernels into the on-disk cache, run nothing else."""
    from .engine.warmup import warm_up

    if engine.device.type != "cuda" or engine.backend != "triton":
        say(f"warm-up: nothing to compile (backend {engine.backend} on {engine.device}: no Triton kernels)")
    report = warm_up(engine, requests, progress=not args.no_progress and args.json != "-")
    say(report.describe())
    if args.json:
        from .bench.roofline import git_commit

        _emit_json(_clean({"version": __version__, "command": "warmup", "device": str(engine.device),
                           "warmup": report.as_dict(), "commit": git_commit(),
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}), args.json)
    return 0


# ==================================================================================================== dsv4 plan
def cmd_plan(args: argparse.Namespace) -> int:
    """``dsv4 plan``: bytes per token / per request by layer kind and format, what fits a memory budget."""
    from .planner import FORMATS, human_bytes, plan_formats, plot_memory

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
            from .planner import plan_parallel

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
        from .planner import plan_prefix_sharing

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


# ==================================================================================================== dsv4 bench
def cmd_bench(args: argparse.Namespace) -> int:
    """``dsv4 bench``: kernel benchmark scripts + the end-to-end decode benchmark → table + JSON."""
    import tempfile

    from .bench.suite import format_table, run_suite, write_results

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


# ==================================================================================================== dsv4 check
def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _chunks(S: int) -> list[int]:
    """A prefill chunk, a few more chunks, then decode steps of 1–4 tokens (speculative decoding)."""
    out, left = [], S
    for n in (S // 3, S // 5, S // 7):
        if left and n:
            out.append(min(n, left))
            left -= out[-1]
    step = 0
    while left:
        out.append(min(1 + step % 4, left))
        left -= out[-1]
        step += 1
    return out


def _through_cache(
    w: AttentionWeights, cfg: ModelConfig, li: int, x: torch.Tensor, numerics: str
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Run ``x`` through a HybridCache in ``_chunks`` steps.

    Returns outputs ``[S, d]``, attended compressed entries ``[S, K]`` (−1 padded), steps, cache bytes in use."""
    chunks = _chunks(x.shape[0])
    cache = HybridCache(cfg, layers=[li], max_requests=1, memory_bytes=64 << 20, block_size=256 if cfg.window >= 128 else 64,
                        device=x.device, numerics=numerics)
    layer = Attention(w, cfg, li)
    cache.add_request("seq")
    outs, idx, at = [], [], 0
    for n in chunks:
        res = layer.forward_with_aux(x[at : at + n], cache.prepare_forward({"seq": n}), cache)
        outs.append(res.y)
        idx.append(res.attended_entries())
        at += n
    in_use = cache.memory_in_use()
    cache.release("seq")
    cache.check_invariants()
    width = max(i.shape[1] for i in idx)
    idx = [torch.nn.functional.pad(i, (0, width - i.shape[1]), value=-1) for i in idx]
    return torch.cat(outs), torch.cat(idx), len(chunks), in_use


def cmd_check(args: argparse.Namespace) -> int:
    """``dsv4 check``: every layer of a preset through the reference (both numerics) and through the cache."""
    cfg = _load_config(args, "tiny")
    device = _pick_device(args.device)
    layers = list(range(cfg.num_attention_layers)) if args.layers is None else args.layers
    for li in layers:
        if not 0 <= li < cfg.num_attention_layers:
            raise SystemExit(f"error: --layers {li} out of range for {cfg.name} (0..{cfg.num_attention_layers - 1})")
    S = args.seq_len
    say = (lambda *a, **k: None) if args.json else print
    say(f"dsv4 {__version__} check — reference forward on {device} ({platform.processor() or platform.machine()})")
    say(cfg.describe())
    say(f"sequence: {S} tokens at positions 0..{S - 1}; layers {layers}; seed {args.seed}\n")
    say(f"{'layer':>5} {'kind':>4} {'entries':>7} {'keys/query':>10} {'exact ms':>9} {'official ms':>11} "
        f"{'official vs exact':>17} {'cache vs ref':>12} {'cache ms':>9} {'check':>5}")
    failures = 0

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
        # The same sequence through the paged cache in prefill chunks + decode steps, checked against the reference.
        t0 = time.perf_counter()
        y_cache, idx_cache, steps, in_use = _through_cache(w, cfg, li, x, "official")
        row["cache_ms"] = (time.perf_counter() - t0) * 1e3
        row["cache_steps"], row["cache_bytes_in_use"] = steps, in_use
        # CSA: torch.topk breaks exact score ties arbitrarily; rows whose selection differs only by a tie are
        # excluded from the output comparison (any other difference fails the check).
        scores = of.index_scores if of.index_scores is not None else torch.zeros(S, 1)
        differs, ties = topk_differences(scores.cpu(), of.entry_idx.cpu(), idx_cache.cpu())
        keep = ~differs.to(y_cache.device)
        row["cache_tie_rows"] = int(ties.sum())
        row["cache_vs_reference_rel_err"] = _rel_err(y_cache[keep].float(), of.y[keep].float())
        # 0 where the ops are the same; BF16 GEMMs over other row blocks may round differently.
        ok = torch.equal(differs, ties) and row["cache_vs_reference_rel_err"] <= 1e-3
        row["check"] = "PASS" if ok else "FAIL"
        failures += row["check"] == "FAIL"
        rows.append(row)
        say(f"{li:>5} {kind.name:>4} {row['compressed_entries']:>7} {keys_last:>10} {timings['exact']:>9.1f} "
            f"{timings['official']:>11.1f} {row['official_vs_exact_rel_err']:>17.2e} "
            f"{row['cache_vs_reference_rel_err']:>12.2e} {row['cache_ms']:>9.1f} {row['check']:>5}")
    total = time.perf_counter() - t_all
    say(f"\n{len(layers)} layers x {S} tokens x 2 numerics in {total:.2f} s "
        f"({2 * len(layers) * S / total:,.0f} token-layers/s). The official numerics store window and compressed "
        f"entries as 584-B FP8 entries and indexer keys as 68-B MXFP4; 'official vs exact' is their effect on the output.\n"
        f"'cache vs ref': the same tokens through HybridCache + dsv4.Attention in {rows[0]['cache_steps'] if rows else 0} "
        f"steps (prefill chunks, then 1-4 token decodes) against the reference, on tokens whose top-k had no exact tie "
        f"({sum(r['cache_tie_rows'] for r in rows)} tie rows): {'PASS' if not failures else 'FAIL'}.")
    if args.json:
        print(json.dumps({"version": __version__, "device": str(device), "config": cfg.name, "seq_len": S,
                          "seed": args.seed, "total_s": total, "layers": rows, "check": "FAIL" if failures else "PASS"},
                         indent=2))
    return 1 if failures else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4", description="DeepSeek-V4 hybrid attention: reference, cache, kernels, runner")
    p.add_argument("--version", action="version", version=f"dsv4 {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    fmt = _HelpFormatter

    def model_args(q: argparse.ArgumentParser, preset_help: str) -> None:
        q.add_argument("--preset", default=None, choices=ModelConfig.presets(), help=preset_help)
        q.add_argument("--config", help="HF / official config.json (or its directory) instead of a preset")

    def json_arg(q: argparse.ArgumentParser) -> None:
        q.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                       help="machine-readable JSON: to stdout alone (no PATH), or written to PATH next to the text "
                            "(its folder must exist)")

    def run_args(r: argparse.ArgumentParser) -> None:
        model_args(r, "model preset (default: tiny on the CPU, v4-flash on a GPU)")
        r.add_argument("--layers", nargs="+", help="main (default) | all (MTP included) | kinds | indices, e.g. 0 2 5-9")
        r.add_argument("--requests", type=_positive_int, help="number of requests (default: 16 CPU / 64 GPU)")
        r.add_argument("--prompt-len", help="prompt length: N, uniform:LO:HI, normal:MEAN:STD, lognormal:MEDIAN:SIGMA, "
                                            "choice:A,B (default: uniform:64:384 CPU / 8192 GPU); prompt + generated "
                                            "tokens must fit the model's max_position")
        r.add_argument("--gen-len", help="generated tokens, same syntax (default: 32 CPU / 256 GPU)")
        r.add_argument("--arrival-every", type=_nonneg_int, default=0, metavar="STEPS",
                       help="request i arrives at step i*STEPS (0: all at the start)")
        r.add_argument("--max-running", type=_positive_int, help="requests running at once (default: 8 CPU / 64 GPU)")
        r.add_argument("--max-batched-tokens", type=_positive_int,
                       help="token budget per step (default: 512 CPU / 8192 GPU)")
        r.add_argument("--max-prefill-chunk", type=_positive_int,
                       help="largest prefill chunk per request per step (default: the token budget)")
        r.add_argument("--decode-tokens", type=int, default=1, choices=(1, 2, 3, 4),
                       help="tokens per decode step per request (2-4: speculative / MTP decoding)")
        r.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"),
                       help="attention backend (auto: triton on a CUDA GPU, else torch)")
        r.add_argument("--device", type=_device_arg, default="auto", help="auto | cpu | cuda | cuda:N")
        r.add_argument("--numerics", default="official", choices=("official", "exact"),
                       help="official: FP8 / MXFP4 cache and BF16 activations as DeepSeek; exact: FP32 everywhere")
        r.add_argument("--block-size", type=_positive_int,
                       help="tokens per pool block, a multiple of every compression ratio (default 256; 64 for windows "
                            "under 128, e.g. the tiny preset)")
        r.add_argument("--cache-memory", type=_byte_size, metavar="BYTES",
                       help="cache budget, e.g. 20GiB or 4e9 (default: enough for --max-running requests of the longest "
                            "length; smaller budgets make requests wait)")
        r.add_argument("--cuda-graphs", default="auto", choices=("auto", "on", "off"),
                       help="decode steps as CUDA graph replays (auto: when the backend is graph-safe)")
        r.add_argument("--weights", default="random", choices=("random", "shared"),
                       help="random per layer, or one random set per layer kind shared by its layers")
        r.add_argument("--checkpoint", help="HF-format safetensors checkpoint directory (official or transformers names)")
        r.add_argument("--prefix-caching", action="store_true",
                       help="reuse cached prompt prefixes: shared whole blocks + the state snapshot at their end")
        r.add_argument("--shared-prefix", type=_nonneg_int, default=0, metavar="N",
                       help="every prompt starts with N tokens shared by its prefix group, then --prompt-len of its own")
        r.add_argument("--prefix-groups", type=_positive_int, default=1, metavar="G",
                       help="request i belongs to prefix group i %% G (with --shared-prefix)")
        r.add_argument("--prefix-states", type=_positive_int, metavar="N",
                       help="state snapshots the prefix cache keeps (default: 2 x --max-running)")
        r.add_argument("--seed", type=_nonneg_int, default=0, help="seed of the weights, lengths and hidden states")
        r.add_argument("--tp", type=_positive_int, default=1,
                       help="tensor-parallel ranks (query heads split; run under torchrun with tp x cp processes)")
        r.add_argument("--cp", type=_positive_int, default=1,
                       help="context-parallel ranks (every request's compressed pool split; torch backend; under torchrun)")
        r.add_argument("--check-requests", type=_nonneg_int, default=2,
                       help="requests spot-checked against the reference (0: none)")
        r.add_argument("--check-layers", nargs="+", help="layers spot-checked (default: all if <= 8 layers, else kinds)")
        r.add_argument("--threads", type=_positive_int, help="CPU threads for torch (default: torch's; 1 helps on a busy machine)")
        r.add_argument("--no-progress", action="store_true", help="no progress bars")
        r.add_argument("--explain", action="store_true",
                       help="print the launch plan of the first prefill, decode and mixed step (kernels, splits, grids)")
        json_arg(r)
        r.add_argument("--warmup", default="auto", choices=("auto", "on", "off"),
                       help="compile every kernel the run launches before its first step, in parallel over the CPU "
                            "cores (auto: with the triton backend)")
        r.add_argument("--triton-cache", metavar="DIR",
                       help="Triton's on-disk kernel cache (default: $TRITON_CACHE_DIR, else ~/.triton/cache)")

    r = sub.add_parser("run", help="the main job: the engine over many requests, figures, spot check vs the reference",
                       formatter_class=fmt)
    run_args(r)
    r.set_defaults(func=cmd_run, warmup_only=False)
    w = sub.add_parser("warmup", help="compile a workload's kernels into the on-disk cache (for deployment images); "
                                      "takes run's arguments", formatter_class=fmt)
    run_args(w)
    w.set_defaults(func=cmd_run, warmup_only=True)

    pl = sub.add_parser("plan", help="memory planner: bytes per token / request, capacity of a memory budget",
                        formatter_class=fmt)
    model_args(pl, "model preset (default: v4-flash)")
    pl.add_argument("--context", type=_positive_int, help="tokens per request (default: 1M, or the preset's max_position)")
    pl.add_argument("--memory", type=_byte_size, default="80GiB", help="cache memory budget (e.g. 80GiB, 141GB)")
    pl.add_argument("--layers", nargs="+", help="main (default) | all | kinds | indices")
    pl.add_argument("--block-size", type=_positive_int, default=256, help="tokens per pool block")
    pl.add_argument("--formats", nargs="+", help="official hopper exact prototype dense-bf16 "
                                                 "(default: official hopper exact dense-bf16)")
    pl.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                    help="with prefix caching: the first N tokens of every request are shared within its group")
    pl.add_argument("--prefix-groups", type=int, default=1, metavar="G", help="groups sharing a prefix")
    pl.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel GPUs (heads split; cache replicated)")
    pl.add_argument("--cp", type=_positive_int, default=1,
                    help="context-parallel GPUs (every request's compressed pool split): the tables are per GPU")
    pl.add_argument("--plot", metavar="PNG", help="draw per-request memory against context length (needs matplotlib)")
    pl.add_argument("--plot-max-context", type=_positive_int, help="right end of the plot (default: max_position)")
    json_arg(pl)
    pl.set_defaults(func=cmd_plan)

    b = sub.add_parser("bench", help="kernel + end-to-end benchmarks with roofline fractions (table + JSON); kernel "
                                     "benchmarks need a CUDA GPU", formatter_class=fmt)
    b.add_argument("--device", type=_device_arg, default="auto",
                   help="auto | cpu | cuda | cuda:N (on the CPU only the end-to-end benchmark runs)")
    b.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"), help="end-to-end backend")
    b.add_argument("--quick", action="store_true", help="small shapes (smoke run)")
    b.add_argument("--dir", help="directory of bench_*.py scripts (default: the checkout's benchmarks/)")
    b.add_argument("--only", nargs="+", help="run only benchmarks whose name contains one of these (e2e: the engine)")
    b.add_argument("--no-e2e", action="store_true", help="skip the end-to-end benchmark")
    b.add_argument("--e2e-preset", choices=ModelConfig.presets(),
                   help="preset of the end-to-end stack (default: v4-flash on a GPU, tiny on the CPU)")
    b.add_argument("--e2e-layers", nargs="+", help="layers of the end-to-end stack (default: main)")
    b.add_argument("--e2e-batch", type=_positive_int, nargs="+", help="decode batch sizes (default 1 8 64 GPU / 1 4 CPU)")
    b.add_argument("--e2e-context", type=_positive_int, nargs="+", help="context lengths (default 4096 GPU / 128 CPU)")
    b.add_argument("--e2e-gen", type=_positive_int, help="decode steps per request (default: 32, 8 with --quick)")
    b.add_argument("--out", default=None,
                   help="directory for bench-<date>.json / .md (default: a new temporary directory; '' = none)")
    json_arg(b)
    b.set_defaults(func=cmd_bench)

    c = sub.add_parser("check", help="every layer of a preset through the reference and the cache, one sequence",
                       formatter_class=fmt)
    c.add_argument("--preset", default=None, choices=ModelConfig.presets(), help="model preset (default: tiny)")
    c.add_argument("--config", help="HF config.json (or its directory) instead of a preset")
    c.add_argument("--seq-len", type=_positive_int, default=300, help="tokens per sequence")
    c.add_argument("--layers", type=_nonneg_int, nargs="+", help="layer indices (default: all, MTP block included)")
    c.add_argument("--device", type=_device_arg, default="auto", help="auto | cpu | cuda | cuda:N")
    c.add_argument("--seed", type=_nonneg_int, default=0, help="seed of the weights and inputs")
    c.add_argument("--json", action="store_true", help="print machine-readable JSON only")
    c.set_defaults(func=cmd_check)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Bad input ends in one line naming the value and what is allowed (``SystemExit``: exit
    status 2 for argument errors, 1 otherwise), never a traceback."""
    from .cache import CacheFullError
    from .checkpoint import CheckpointError

    global _T_COMMAND
    _T_COMMAND = time.perf_counter()
    args = build_parser().parse_args(argv)
    if getattr(args, "triton_cache", None):  # before any kernel compiles; Triton reads it at each lookup
        os.makedirs(args.triton_cache, exist_ok=True)
        os.environ["TRITON_CACHE_DIR"] = os.path.abspath(args.triton_cache)
    try:
        return args.func(args)
    except (CheckpointError, CacheFullError, ValueError, TypeError, OSError) as e:
        raise SystemExit(f"error: {type(e).__name__}: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
