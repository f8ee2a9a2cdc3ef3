"""Benchmark: prefix caching on a shared system prompt — the same workload with and without it.

64 requests (``--requests``) whose prompts are a 4,096-token system prompt shared by all (``--shared-prefix``,
``--groups`` distinct ones) plus 1,024 tokens of their own (``--unique``), then ``--gen`` decode steps; V4-Flash,
every main layer, Triton backend on a GPU (torch on the CPU). Both runs use the same engine (weights, layers,
budget); all requests arrive at once. Per run: prefill tokens computed, time to first token p50 / p90 (from the
start of the run), throughput (prompt + generated tokens served per second of the run, and requests per second),
the hit rate and the memory the prefix cache held. With prefix caching the first request of a group computes the
prefix, ending a step where it ends; the others wait for it and start from it (``dsv4.engine.prefix_plan``).

Per step (JSON ``steps``; the printout sums up the steps with prefill tokens): requests, prefill and decode tokens,
wall / GPU / host milliseconds, the host's milliseconds before the layers' first launch (scheduling, admissions,
``prepare_forward``) and, on a GPU, the host-device synchronisations the step made (``torch.cuda.set_sync_debug_mode``;
JSON ``sync_sites``: the lines that made them). A prefill step is eager, so a synchronisation inside it stalls the
host's launches until the device has drained its queue.

On a GPU each mode first runs the whole workload once untimed, so no Triton compile lands in the timed run
(``--no-warmup`` to skip). ``--check`` (default on) spot-checks the prefix run against ``dsv4.reference``: a
group's first request and a request that hit, over their whole sequences, one layer of each kind.

    python benchmarks/bench_prefix_cache.py --out prefix.json                       # GPU: V4-Flash, Triton
    python benchmarks/bench_prefix_cache.py --preset tiny --requests 8 --shared-prefix 256 --unique 64 \\
        --gen 4 --block-size 64 --max-batched-tokens 512                              # CPU smoke run

Acceptance (issue 37, on an H200): prefill tokens computed with prefix caching <= 25% of the cold run's, and time
to first token p50 at least 3x better.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import platform
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

import dsv4
from dsv4.engine import Engine, EngineConfig, make_requests, spot_check
from dsv4.engine.runner import pick_device
from dsv4.engine.stats import StepRecord, percentiles


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default="v4-flash", choices=dsv4.ModelConfig.presets())
    p.add_argument("--device", default="auto")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"))
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--shared-prefix", type=int, default=4096, help="tokens of the system prompt")
    p.add_argument("--groups", type=int, default=1, help="distinct system prompts (request i uses i %% groups)")
    p.add_argument("--unique", type=int, default=1024, help="tokens of each request's own")
    p.add_argument("--gen", type=int, default=32, help="generated tokens per request")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--weights", default="random", choices=("random", "shared"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="run each mode once untimed first (default: on a GPU)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="spot-check the prefix run against the reference (one layer per kind)")
    p.add_argument("--threads", type=int, help="CPU threads for torch")
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args(argv)


def workload(args: argparse.Namespace, cfg: dsv4.ModelConfig) -> list[dsv4.engine.Request]:
    return make_requests(args.requests, args.unique, args.gen, seed=args.seed, max_total=cfg.max_position,
                         shared_prefix=args.shared_prefix, prefix_groups=args.groups)


class SyncCounter:
    """While active (``with``) on CUDA, counts host-device synchronisations by the line that made them
    (``torch.cuda.set_sync_debug_mode("warn")``); as ``Engine.run``'s ``on_step`` callback, notes the running count
    at each step's end (``at_step``). Elsewhere it counts nothing (``at_step`` stays empty)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.sites: collections.Counter[str] = collections.Counter()
        self.at_step: list[int] = []
        self._caught: list[warnings.WarningMessage] = []

    def __enter__(self) -> SyncCounter:
        if self.cuda:
            self._warnings = warnings.catch_warnings(record=True)
            self._caught = self._warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
            self._drain()
            self._warnings.__exit__(*exc)

    def _drain(self) -> None:
        self.sites.update(f"{w.filename}:{w.lineno}" for w in self._caught if "synchroniz" in str(w.message))
        self._caught.clear()

    def __call__(self, rec: StepRecord) -> None:
        if self.cuda:
            self._drain()
            self.at_step.append(sum(self.sites.values()))


def step_figures(steps: Sequence[StepRecord], syncs_at_step: Sequence[int]) -> list[dict[str, Any]]:
    """One dict per step: requests, tokens, wall / GPU / host / before-launch ms, and host syncs (``None`` when not
    counted; the first step's count includes the run's setup)."""
    out, prev = [], 0
    for i, r in enumerate(steps):
        syncs = None
        if i < len(syncs_at_step):
            syncs, prev = syncs_at_step[i] - prev, syncs_at_step[i]
        out.append({"step": r.step, "kind": r.kind, "requests": r.num_requests, "prefill_tokens": r.prefill_tokens,
                    "decode_tokens": r.decode_tokens, "wall_ms": r.seconds * 1e3, "gpu_ms": r.gpu_seconds * 1e3,
                    "host_ms": r.host_seconds * 1e3, "prepare_ms": r.prepare_seconds * 1e3, "syncs": syncs})
    return out


def prefill_summary(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Medians over the steps with prefill tokens (``step_figures`` rows), and their most host syncs."""
    pre = [r for r in rows if r["prefill_tokens"]]
    p50 = lambda key: percentiles([r[key] for r in pre])["p50"]  # noqa: E731
    syncs = [r["syncs"] for r in pre[1:] if r["syncs"] is not None]  # the first step's count includes the setup
    return {"steps": len(pre), "requests_p50": p50("requests"), "prefill_tokens_p50": p50("prefill_tokens"),
            "wall_ms_p50": p50("wall_ms"), "gpu_ms_p50": p50("gpu_ms"), "host_ms_p50": p50("host_ms"),
            "prepare_ms_p50": p50("prepare_ms"), "syncs_max": max(syncs) if syncs else math.nan}


def run_mode(engine: Engine, args: argparse.Namespace, prefix: bool, warmup: bool, check: bool) -> dict[str, Any]:
    """One timed run of the workload (after an untimed one if ``warmup``); returns its figures."""
    engine.config = dataclasses.replace(engine.config, prefix_caching=prefix)  # same engine, other mode
    if warmup:
        engine.run(workload(args, engine.cfg))
    requests = workload(args, engine.cfg)
    kinds = sorted({next(i for i in engine.layer_ids if engine.cfg.layer_kind(i) is k)
                    for k in {engine.cfg.layer_kind(i) for i in engine.layer_ids}})
    group0 = [r.request_id for r in requests if r.number % args.groups == 0]
    engine.trace([group0[0], group0[-1]] if check else [], kinds)
    with SyncCounter(engine.device) as syncs:
        stats = engine.run(requests, on_step=syncs)
    s = stats.summary()
    steps = step_figures(stats.steps, syncs.at_step)
    served = s["prompt_tokens"] + s["decode_tokens"]
    out = {
        "prefix_caching": prefix,
        "prefill_tokens_computed": s["prefill_tokens"],
        "prompt_tokens": s["prompt_tokens"],
        "decode_tokens": s["decode_tokens"],
        "ttft_p50_s": s["ttft_s"]["p50"],
        "ttft_p90_s": s["ttft_s"]["p90"],
        "wall_s": s["wall_s"],
        "throughput_tok_s": served / s["wall_s"],
        "requests_per_s": s["requests_finished"] / s["wall_s"],
        "prefill_compute_tok_s": s["prefill_tok_s"],
        "decode_tok_s": s["decode_tok_s"],
        "jit_s": s["jit_s"],
        "prefix_hit_rate": s["prefix_hit_rate"],
        "prefix_requests_hit": s["prefix_requests_hit"],
        "prefix_cache_bytes_peak": s["prefix_cache_bytes_peak"],
        "cache_bytes_peak": s["cache_bytes_peak"],
        "steps": s["steps"],
        "prefill_steps": prefill_summary(steps),
        "step_figures": steps,
        "sync_sites": dict(syncs.sites.most_common(8)),
    }
    if check:
        engine.graphs = None
        rows = spot_check(engine)
        out["spot_check"] = [r.as_dict() for r in rows]
        out["check"] = "PASS" if all(r.passed for r in rows) else "FAIL"
        out["checked_hit_request"] = any(tr.prefix_from is not None for tr in engine.traces.values())
    engine.trace([], [])
    return out


def snapshot_cost(engine: Engine, repeats: int = 20) -> dict[str, float]:
    """Bytes of one prefix state snapshot and the seconds to restore one into a state slot (device copies,
    synchronised), against recomputing the state instead: the last ``window · layers`` tokens (each layer's
    window depends on the previous layers' outputs over the previous window) at the run's prefill rate."""
    cache = engine.cache
    assert cache is not None and cache.prefix.states.num_rows and cache.num_free_slots
    slot = cache.state.allocate_slot()
    sync = torch.cuda.synchronize if cache.device.type == "cuda" else (lambda: None)
    cache.prefix.states.restore(cache.state, 0, slot)  # warm-up
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        cache.prefix.states.restore(cache.state, 0, slot)
    sync()
    seconds = (time.perf_counter() - t0) / repeats
    cache.state.free_slot(slot)
    return {"snapshot_bytes": cache.prefix_state_bytes, "restore_s": seconds,
            "block_bytes": cache.pool.bytes_per_block,
            "recompute_tokens": engine.cfg.window * len(engine.layer_ids)}


def measure(args: argparse.Namespace) -> tuple[dict[str, Any], torch.device]:
    """Both runs and the snapshot cost; prints progress lines."""
    device = pick_device(args.device)
    cfg = dsv4.ModelConfig.preset(args.preset)
    warmup = device.type == "cuda" if args.warmup is None else args.warmup
    conf = EngineConfig(backend=args.backend, device=str(device), block_size=args.block_size,
                        max_running=min(args.max_running, args.requests), max_batched_tokens=args.max_batched_tokens,
                        weights=args.weights, seed=args.seed)
    t0 = time.perf_counter()
    engine = Engine(cfg, config=conf)
    print(f"# {cfg.name}: {len(engine.layer_ids)} layers, backend {engine.backend} on {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else f" ({platform.machine()})")
          + f"; built in {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"# {args.requests} requests: {args.shared_prefix:,}-token shared prefix ({args.groups} group(s)) + "
          f"{args.unique:,} own tokens, {args.gen} generated; {conf.max_running} running, "
          f"{args.max_batched_tokens}-token steps, {args.block_size}-token blocks; warm-up {'on' if warmup else 'off'}",
          flush=True)
    results = {}
    for prefix in (False, True):
        results["prefix" if prefix else "cold"] = run_mode(engine, args, prefix, warmup, args.check and prefix)
        print(f"# {'prefix caching' if prefix else 'cold'}: {results['prefix' if prefix else 'cold']['wall_s']:.2f} s",
              flush=True)
    cost = snapshot_cost(engine)
    cost["recompute_s"] = cost["recompute_tokens"] / results["prefix"]["prefill_compute_tok_s"]
    results["snapshot"] = cost
    results["config"] = cfg.name
    return results, device


def run(device: torch.device | str = "auto", quick: bool = False) -> list[dict[str, Any]]:
    """``dsv4 bench`` entry: the two runs as rows (µs = time to first token p50, tok/s = tokens served per second).
    ``quick`` or a CPU: the tiny preset at small sizes; else the V4-Flash workload of the module docstring."""
    small = quick or torch.device(device).type == "cpu" or (device == "auto" and not torch.cuda.is_available())
    argv = ["--device", str(device), "--no-check"]
    if small:
        argv += ["--preset", "tiny", "--requests", "8", "--shared-prefix", "256", "--unique", "64", "--gen", "4",
                 "--block-size", "64", "--max-batched-tokens", "512"]
    results, _ = measure(parse_args(argv))
    rows = []
    for mode in ("cold", "prefix"):
        r = results[mode]
        rows.append(dict(r, name=f"prefix cache {'on' if mode == 'prefix' else 'off'} ({results['config']}): time to first "
                         "token p50", us=r["ttft_p50_s"] * 1e6, tokens_per_s=r["throughput_tok_s"]))
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results, device = measure(args)
    cfg = dsv4.ModelConfig.preset(args.preset)
    cost = results["snapshot"]
    cold, pc = results["cold"], results["prefix"]
    rows = [
        ("prefill tokens computed", f"{cold['prefill_tokens_computed']:,}", f"{pc['prefill_tokens_computed']:,}",
         f"{pc['prefill_tokens_computed'] / cold['prefill_tokens_computed']:.1%} of cold"),
        ("time to first token p50 (s)", f"{cold['ttft_p50_s']:.3f}", f"{pc['ttft_p50_s']:.3f}",
         f"{cold['ttft_p50_s'] / pc['ttft_p50_s']:.2f}x better"),
        ("time to first token p90 (s)", f"{cold['ttft_p90_s']:.3f}", f"{pc['ttft_p90_s']:.3f}",
         f"{cold['ttft_p90_s'] / pc['ttft_p90_s']:.2f}x better"),
        ("throughput (tokens served/s)", f"{cold['throughput_tok_s']:,.0f}", f"{pc['throughput_tok_s']:,.0f}",
         f"{pc['throughput_tok_s'] / cold['throughput_tok_s']:.2f}x"),
        ("requests/s", f"{cold['requests_per_s']:.2f}", f"{pc['requests_per_s']:.2f}",
         f"{pc['requests_per_s'] / cold['requests_per_s']:.2f}x"),
        ("wall (s)", f"{cold['wall_s']:.2f}", f"{pc['wall_s']:.2f}", ""),
        ("prefix hit rate", "-", f"{pc['prefix_hit_rate']:.1%}", f"{pc['prefix_requests_hit']} requests hit"),
        ("prefix cache memory at peak", "-", f"{pc['prefix_cache_bytes_peak'] / 2**20:.1f} MiB", ""),
        ("Triton JIT inside timed steps (s)", f"{cold['jit_s']:.1f}", f"{pc['jit_s']:.1f}", ""),
    ]
    cs, ps = cold["prefill_steps"], pc["prefill_steps"]
    rows += [
        ("steps with prefill tokens", f"{cs['steps']}", f"{ps['steps']}", "medians below"),
        ("  requests / step", f"{cs['requests_p50']}", f"{ps['requests_p50']}", ""),
        ("  prefill tokens / step", f"{cs['prefill_tokens_p50']:,}", f"{ps['prefill_tokens_p50']:,}", ""),
    ] + [
        (f"  {label} ms / step", f"{cs[key]:.1f}", f"{ps[key]:.1f}", note)
        for label, key, note in (("wall", "wall_ms_p50", ""), ("GPU", "gpu_ms_p50", "events around the launches"),
                                 ("host", "host_ms_p50", ""), ("host before launch", "prepare_ms_p50",
                                                               "schedule, admissions, prepare_forward"))
    ] + [("  host syncs / step (most)", f"{cs['syncs_max']}", f"{ps['syncs_max']}", "GPU only; JSON sync_sites")]
    w = max(len(r[0]) for r in rows)
    print(f"\n{'':<{w}}  {'cold':>14}  {'prefix cache':>14}")
    for name, a, b, note in rows:
        print(f"{name:<{w}}  {a:>14}  {b:>14}  {note}")
    acc = {
        "prefill_le_25pct": pc["prefill_tokens_computed"] <= 0.25 * cold["prefill_tokens_computed"],
        "ttft_p50_ge_3x": cold["ttft_p50_s"] >= 3 * pc["ttft_p50_s"],
    }
    print(f"\nacceptance: prefill computed <= 25% of cold: {'PASS' if acc['prefill_le_25pct'] else 'FAIL'}; "
          f"time to first token p50 >= 3x better: {'PASS' if acc['ttft_p50_ge_3x'] else 'FAIL'}")
    print(f"state snapshot at a block boundary: {cost['snapshot_bytes'] / 2**20:.2f} MiB "
          f"({cost['snapshot_bytes'] / cost['block_bytes']:.1f} blocks' worth), restored in "
          f"{cost['restore_s'] * 1e6:.0f} us; recomputing it instead means {cost['recompute_tokens']:,} tokens "
          f"(window x layers), about {cost['recompute_s'] * 1e3:.0f} ms at this run's prefill rate")
    if "check" in pc:
        print(f"spot check of the prefix run (a group's first request + one that hit, one layer per kind): {pc['check']}"
              + ("" if pc["checked_hit_request"] else " (no traced request hit)"))
    if args.out:
        from dsv4.bench.roofline import environment, git_commit

        with open(args.out, "w") as f:
            json.dump({"benchmark": "prefix_cache", "args": vars(args), "config": cfg.name, "device": str(device),
                       "environment": environment(device), "commit": git_commit(),
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": results,
                       "acceptance": acc}, f, indent=2, default=str)
        print(f"wrote {args.out}")
    return 0 if pc.get("check", "PASS") == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
