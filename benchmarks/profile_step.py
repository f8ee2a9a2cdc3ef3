"""Where a whole prefill step's time goes: the engine's step (every layer, the residual glue, the hidden states,
the host) against the sum of its kernels.

The engine runs ``--requests`` prompts of ``--prompt-len`` tokens with ``--gen-len`` tokens each, as ``dsv4 run``
does (warm-up, then the run): steps of one ``--max-batched-tokens`` budget, whose later prefill steps also carry the
decode rows of the requests already prefilled (as in the acceptance workload). The same workload runs six times:

1. twice unprofiled — the first run after the warm-up, then a second one — for each prefill step's wall time (the
   interval between step completions on the device), its GPU time (CUDA events around its launches), its host
   time (waiting on a full launch queue included) and the caching allocator's device allocations during the run;
2. under the torch profiler (device side), from the second prefill step to the last: time per kernel name per
   step, the sum of all kernels, and the time the GPU ran at least one of them (their union);
3. under the profiler with the host's side: the GPU's idle gaps longer than ``--gap-us`` (between which kernels)
   and the host's CUDA runtime calls (the host runs slower under tracing: the gaps are larger than unprofiled,
   their places are what counts);
4. under ``torch.cuda.set_sync_debug_mode``: where torch made the host wait for the GPU (Python frames);
5. under cProfile: the host's own work per prefill step.

``wall − kernel sum`` is the time the GPU sat idle during a step (host-bound stretches, synchronisations, the
allocator); the kernel table says which kernels — the layers', the residual glue's, the hidden states' — cost what.

    python benchmarks/profile_step.py [--preset v4-flash] [--requests 6] [--prompt-len 8192] [--side-stream on|off]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import statistics
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

import dsv4
from dsv4.bench.kernel_profile import (device_events, kernel_totals, short_kernel_name, torch_sync_sites,
                                      union_us)
from dsv4.bench.roofline import environment
from dsv4.engine import Engine, EngineConfig, make_requests

REQUIRES_CUDA = True
_ALLOCATOR_STATS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def cuda_engine(script: str, preset: str, requests: int, max_batched_tokens: int, weights: str = "random",
                side_stream: bool = True) -> tuple[dsv4.ModelConfig, Engine]:
    """The engine of ``dsv4 run``'s Triton CUDA path over every layer of ``preset``, at most ``requests`` running
    and ``max_batched_tokens`` per step (its warm-up done; ``side_stream``: ``EngineConfig.side_stream``);
    ``script`` names the caller when there is no CUDA."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA device")
    cfg = dsv4.ModelConfig.preset(preset)
    return cfg, Engine(cfg, list(range(cfg.num_layers)), EngineConfig(
        backend="triton", device="cuda", max_running=requests, max_batched_tokens=max_batched_tokens,
        weights=weights, side_stream=side_stream))


def timed_run(engine: Engine, requests: Callable[[], list]) -> dict:
    """One unprofiled run: means over its prefill steps after the first (whose wall includes the pipeline's fill)
    of tokens, wall, GPU and host ms, and the caching allocator's device allocations during the whole run."""
    before = torch.cuda.memory_stats()
    stats = engine.run(requests())
    after = torch.cuda.memory_stats()
    steps = [s for s in stats.steps if s.prefill_tokens][1:]
    out = {"stats": stats, "steps": len(steps),
           "tokens": statistics.mean(s.prefill_tokens + s.decode_tokens for s in steps)}
    for key, attr in (("wall_ms", "seconds"), ("gpu_ms", "gpu_seconds"), ("host_ms", "host_seconds")):
        out[key] = statistics.mean(getattr(s, attr) for s in steps) * 1e3
    return out | {k: after.get(k, 0) - before.get(k, 0) for k in _ALLOCATOR_STATS}


def profiled_run(engine: Engine, requests: Callable[[], list], window: tuple[int, int],
                 activities: list) -> profile:
    """One run with the torch profiler on from the end of step ``window[0]`` to the end of step ``window[1]``
    (0-based; the GPU drained at both ends)."""
    prof = profile(activities=activities)
    seen = [0]

    def on_step(_rec) -> None:
        if seen[0] in window:
            torch.cuda.synchronize()
            prof.start() if seen[0] == window[0] else prof.stop()
        seen[0] += 1

    engine.run(requests(), on_step=on_step)
    return prof


def kernel_table(prof: profile, steps: int) -> dict:
    """Per kernel name: calls and ms per step; the kernels' sum, union and span per step; launches per step."""
    events = device_events(prof)
    spans = [(e.time_range.start, e.time_range.end) for e in events]
    rows = [(k, n / steps, us / steps / 1e3) for k, n, us in kernel_totals(events, 70)]
    return {"kernels": [{"name": k, "calls": n, "ms": ms} for k, n, ms in rows],
            "kernel_sum_ms": sum(ms for _, _, ms in rows), "kernel_union_ms": union_us(spans) / steps / 1e3,
            "span_ms": (max(e for _, e in spans) - min(s for s, _ in spans)) / steps / 1e3,
            "launches": sum(n for _, n, _ in rows)}


def idle_gaps(prof: profile, steps: int, gap_us: float) -> tuple[list, list]:
    """The GPU's idle gaps longer than ``gap_us`` grouped by the kernels around them (count and ms per step,
    largest first), and the host's CUDA runtime calls (calls and self ms per step, largest first)."""
    dev = sorted(device_events(prof), key=lambda e: e.time_range.start)
    gaps: dict[tuple[str, str], list] = collections.defaultdict(lambda: [0, 0.0])
    for a, b in zip(dev, dev[1:]):
        g = b.time_range.start - a.time_range.end
        if g > gap_us:
            row = gaps[(short_kernel_name(a.name, 34), short_kernel_name(b.name, 34))]
            row[0] += 1
            row[1] += g
    gap_rows = sorted(({"after": a, "before": b, "per_step": n / steps, "ms": us / steps / 1e3}
                       for (a, b), (n, us) in gaps.items()), key=lambda r: -r["ms"])
    runtime = sorted(({"name": e.key, "calls": e.count / steps, "ms": e.self_cpu_time_total / steps / 1e3}
                      for e in prof.key_averages() if e.key.startswith("cu")), key=lambda r: -r["ms"])
    return gap_rows, runtime


def host_profile(engine: Engine, requests: Callable[[], list], steps: range, top: int) -> str:
    """cProfile of the host's work in the steps numbered ``steps`` (0-based, counting steps that ran) of one more
    run: the ``top`` functions by own time, then by cumulative time, times per step."""
    prof, ran = cProfile.Profile(), [0]
    step = engine.step

    def profiled_step(*a, **k):
        on = ran[0] in steps
        if on:
            prof.enable()
        try:
            rec = step(*a, **k)
        finally:
            if on:
                prof.disable()
        ran[0] += rec is not None
        return rec

    engine.step = profiled_step
    try:
        engine.run(requests())
    finally:
        del engine.step
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    n = len(steps)
    st.stats = {k: (cc, nc, tt / n, ct / n, callers) for k, (cc, nc, tt, ct, callers) in st.stats.items()}
    st.total_tt /= n
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="v4-flash", help="model preset")
    ap.add_argument("--requests", type=int, default=6, help="prompts (about one prefill step each at the defaults)")
    ap.add_argument("--prompt-len", type=int, default=8192, help="tokens per prompt")
    ap.add_argument("--gen-len", type=int, default=32,
                    help="tokens generated per request (their decode rows ride in the later prefill steps)")
    ap.add_argument("--max-batched-tokens", type=int, default=8192, help="the step's token budget")
    ap.add_argument("--weights", default="random", help="'random' or 'shared' (one random set per layer kind)")
    ap.add_argument("--top", type=int, default=25, help="kernel names to list")
    ap.add_argument("--gap-us", type=float, default=20.0, help="GPU idle gaps longer than this are listed")
    ap.add_argument("--host-top", type=int, default=25, help="host functions to list (cProfile, per prefill step)")
    ap.add_argument("--side-stream", default="on", choices=("on", "off"),
                    help="each layer's writes and ring commit on a second CUDA stream (the default) or not")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    cfg, engine = cuda_engine("profile_step.py", args.preset, args.requests, args.max_batched_tokens, args.weights,
                              args.side_stream == "on")

    def requests() -> list:
        return make_requests(args.requests, args.prompt_len, args.gen_len, seed=0)

    runs = [timed_run(engine, requests), timed_run(engine, requests)]  # after the warm-up, then steady
    pre_at = [i for i, s in enumerate(runs[0]["stats"].steps) if s.prefill_tokens]  # every run schedules alike
    if len(pre_at) < 2:
        raise SystemExit("the workload has fewer than two prefill steps: raise --requests or --prompt-len")
    window, n = (pre_at[0], pre_at[-1]), len(pre_at) - 1
    between = sum(1 for s in runs[0]["stats"].steps[pre_at[0] + 1 : pre_at[-1] + 1] if not s.prefill_tokens)
    table = kernel_table(profiled_run(engine, requests, window, [ProfilerActivity.CUDA]), n)
    gaps, runtime = idle_gaps(profiled_run(engine, requests, window, [ProfilerActivity.CPU, ProfilerActivity.CUDA]),
                              n, args.gap_us)
    syncs = torch_sync_sites(lambda: engine.run(requests()))
    host = host_profile(engine, requests, range(pre_at[0] + 1, pre_at[-1] + 1), args.host_top)

    env = environment()
    print(f"{env['device']}  {args.preset}, {cfg.num_layers} layers: {args.requests} x {args.prompt_len} tokens, "
          f"gen {args.gen_len}, budget {args.max_batched_tokens}")
    for label, r in zip(("first run", "second run"), runs):
        print(f"{label}, unprofiled (mean of {r['steps']} prefill steps): {r['tokens']:,.0f} tokens, wall "
              f"{r['wall_ms']:.1f} ms ({r['tokens'] / r['wall_ms'] * 1e3:,.0f} tok/s), GPU events "
              f"{r['gpu_ms']:.1f} ms, host {r['host_ms']:.1f} ms; device allocations {r['num_device_alloc']}, "
              f"frees {r['num_device_free']}, retries {r['num_alloc_retries']}")
    among = f" and {between} decode steps among them" if between else ""
    print(f"profiled ({n} prefill steps{among}), per step: kernels {table['kernel_sum_ms']:.1f} ms summed, "
          f"{table['kernel_union_ms']:.1f} ms busy (union), span {table['span_ms']:.1f} ms, "
          f"{table['launches']:.0f} launches")
    print(f"{'kernel':<72}{'calls/step':>11}{'ms/step':>9}{'%':>6}")
    for k in table["kernels"][: args.top]:
        print(f"{k['name']:<72}{k['calls']:>11.1f}{k['ms']:>9.2f}{100 * k['ms'] / table['kernel_sum_ms']:>6.1f}")
    print(f"GPU idle gaps > {args.gap_us:.0f} us under CPU tracing, per step (after -> before):")
    for g in gaps[:15]:
        print(f"  {g['after']:<35}-> {g['before']:<35}{g['per_step']:>7.1f} x = {g['ms']:6.2f} ms")
    print("host CUDA runtime calls per step (self CPU ms, under tracing):")
    for r in runtime[:8]:
        print(f"  {r['name']:<40}{r['calls']:>8.0f} calls {r['ms']:>8.2f} ms")
    print("where torch made the host wait for the GPU in one whole run (innermost dsv4 frames first):")
    for site, count in syncs.most_common(10):
        print(f"  {count:5d}  {site}")
    print(f"host work per prefill step (cProfile; times per step, calls over all {n} steps):")
    print(host)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "preset": args.preset, "requests": args.requests, "prompt_len": args.prompt_len,
                       "gen_len": args.gen_len, "runs": [{k: v for k, v in r.items() if k != "stats"} for r in runs],
                       **table, "gaps": gaps, "runtime_calls": runtime, "syncs": dict(syncs)}, f, indent=1)


if __name__ == "__main__":
    main()
