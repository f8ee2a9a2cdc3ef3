"""Where a whole prefill step's time goes: the engine's step (every layer, the residual glue, the hidden-state
source, the host) against the sum of its kernels.

The engine runs ``--requests`` prompts of ``--prompt-len`` tokens with ``--gen-len`` tokens each, as ``dsv4 run``
does (warm-up, then the run): steps of one ``--max-batched-tokens`` budget, whose later prefill steps also carry the
decode rows of the requests already prefilled (as in the acceptance workload). Three times:

1. unprofiled, for each step's wall time (interval between step completions on the device) and GPU time (CUDA
   events around the step's launches);
2. under the torch profiler from the second prefill step to the last, for the kernels: time per kernel name per
   step, the sum of all kernels, and the time the GPU ran at least one of them (their union);
3. under the profiler with the host's side: the GPU's idle gaps (between which kernels), the host's runtime calls,
   and where the host synchronised with the device (Python frames);

and once more under ``torch.cuda.set_sync_debug_mode``, for the Python frames of torch's synchronising calls, and
once under cProfile, for the host's own work per prefill step.

``wall − kernel union`` is the time the GPU sat idle during the steps (host-bound launches, synchronisations);
the kernel table says which kernels outside the layers (hidden states, residual glue) cost what.

    python benchmarks/profile_step.py [--preset v4-flash] [--requests 5] [--prompt-len 8192] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics

import torch

import dsv4
from dsv4.bench.roofline import environment
from dsv4.engine import Engine, EngineConfig, make_requests

REQUIRES_CUDA = True


def _short(name: str) -> str:
    """A kernel's name without template arguments and launch-config noise."""
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"\(.*", "", name)
    return name.split("::")[-1][:70]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals (µs)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + ((cur_e - cur_s) if cur_e is not None else 0.0)


def _device_events(prof) -> list:
    """The profiler's device events (kernels, copies, memsets), user annotations left out."""
    return [e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time_total > 0
            and not getattr(e, "is_user_annotation", False)]


def _sync_sites(prof) -> collections.Counter:
    """Where the host waited for the device: the innermost dsv4 frames above each ``cuda*Synchronize`` call."""
    sites: collections.Counter = collections.Counter()
    for e in prof.events():
        if "Synchronize" not in e.name:
            continue
        op = e
        while op is not None and not op.stack:
            op = op.cpu_parent
        frames = [f for f in (op.stack if op is not None else []) if "dsv4" in f or "benchmarks" in f][:4]
        sites[" <- ".join(f.split("/")[-1] for f in frames) or "(no stack)"] += 1
    return sites


def _torch_sync_sites(run) -> collections.Counter:
    """Where torch synchronised the host with the device during ``run()`` (``torch.cuda.set_sync_debug_mode``:
    ``.item()``, pageable copies, ``nonzero`` …), as the innermost dsv4 frames of each call."""
    import traceback
    import warnings

    sites: collections.Counter = collections.Counter()
    shown = warnings.showwarning

    def note(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        frames = [f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()
                  if "/dsv4/" in f.filename][-4:]
        sites[" <- ".join(reversed(frames)) or "(outside dsv4)"] += 1

    warnings.showwarning = note
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = note
            run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = shown
    return sites


def _host_profile(engine: Engine, requests, steps: range, top: int) -> str:
    """cProfile of the host's work in the steps numbered ``steps`` (0-based, counting steps that ran) of one more
    run: the ``top`` functions by own time, then by cumulative time."""
    import cProfile
    import io
    import pstats

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
    st.stats = {k: (cc, nc, tt / len(steps), ct / len(steps), callers) for k, (cc, nc, tt, ct, callers) in st.stats.items()}
    st.total_tt /= len(steps)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="v4-flash", help="model preset")
    ap.add_argument("--requests", type=int, default=6, help="prompts (about one prefill step each at the defaults)")
    ap.add_argument("--prompt-len", type=int, default=8192, help="tokens per prompt")
    ap.add_argument("--gen-len", type=int, default=32,
                    help="tokens generated per request (their decode rows ride in the later prefill steps, as in "
                         "the acceptance workload)")
    ap.add_argument("--max-batched-tokens", type=int, default=8192, help="the step's token budget")
    ap.add_argument("--weights", default="random", help="'random' or 'shared' (one random set per layer kind)")
    ap.add_argument("--top", type=int, default=25, help="kernel names to list")
    ap.add_argument("--gap-us", type=float, default=20.0, help="GPU idle gaps longer than this are listed")
    ap.add_argument("--host-top", type=int, default=25, help="host functions to list (cProfile, per prefill step)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_step.py needs a CUDA device")

    cfg = dsv4.ModelConfig.preset(args.preset)
    layers = list(range(cfg.num_layers))
    econf = EngineConfig(backend="triton", device="cuda", max_running=args.requests,
                         max_batched_tokens=args.max_batched_tokens, weights=args.weights)
    engine = Engine(cfg, layers, econf)

    def requests() -> list:
        return make_requests(args.requests, args.prompt_len, args.gen_len, seed=0)

    def timed_run() -> dict:
        """One unprofiled run: its prefill steps after the first (whose wall includes the pipeline's fill) and the
        caching allocator's device allocations during the run."""
        before = torch.cuda.memory_stats()
        stats = engine.run(requests())
        after = torch.cuda.memory_stats()
        steps = [s for s in stats.steps if s.prefill_tokens][1:]
        return {"stats": stats, "steps": len(steps),
                "tokens": statistics.mean(s.prefill_tokens + s.decode_tokens for s in steps),
                **{f"{k}_ms": statistics.mean(getattr(s, a) for s in steps) * 1e3
                   for k, a in (("wall", "seconds"), ("gpu", "gpu_seconds"), ("host", "host_seconds"))},
                **{k: after.get(k, 0) - before.get(k, 0) for k in ("num_device_alloc", "num_device_free",
                                                                    "num_alloc_retries")}}

    runs = [timed_run(), timed_run()]  # the first after the warm-up (compiles), the second steady
    stats = runs[0]["stats"]

    from torch.profiler import ProfilerActivity, profile

    pre_at = [i for i, s in enumerate(stats.steps) if s.prefill_tokens]  # the schedule repeats in every run
    between = sum(1 for s in stats.steps[pre_at[0] + 1 : pre_at[-1] + 1] if not s.prefill_tokens)

    def profiled(activities: list, stacks: bool = False) -> tuple[profile, int]:
        """Run the workload again, profiling its prefill steps from the second on."""
        prof = profile(activities=activities, with_stack=stacks)
        seen = []

        def on_step(rec) -> None:
            seen.append(rec)
            if len(seen) - 1 in (pre_at[0], pre_at[-1]):  # from after the first prefill step to the last one
                torch.cuda.synchronize()
                prof.start() if len(seen) - 1 == pre_at[0] else prof.stop()

        engine.run(requests(), on_step=on_step)
        return prof, len(pre_at) - 1

    prof, n_prof = profiled([ProfilerActivity.CUDA])
    per_name: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    spans = []
    for e in _device_events(prof):
        t = per_name[_short(e.name)]
        t[0] += 1
        t[1] += e.device_time_total
        spans.append((e.time_range.start, e.time_range.end))
    kernel_sum = sum(us for _, us in per_name.values()) / n_prof / 1e3
    union = _union_us(spans) / n_prof / 1e3
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) / n_prof / 1e3
    launches = sum(n for n, _ in per_name.values()) / n_prof

    # Again with the host's side: runtime calls and where the GPU waited (the host slows down under CPU tracing,
    # so the gaps are larger than in the unprofiled run; their places are what this shows)
    prof_cpu, _ = profiled([ProfilerActivity.CPU, ProfilerActivity.CUDA], stacks=True)
    syncs = _sync_sites(prof_cpu)
    dev = sorted(_device_events(prof_cpu), key=lambda e: e.time_range.start)
    gaps: dict[tuple[str, str], list] = collections.defaultdict(lambda: [0, 0.0])
    for a, b in zip(dev, dev[1:]):
        g = b.time_range.start - a.time_range.end
        if g > args.gap_us:
            t = gaps[(_short(a.name)[:34], _short(b.name)[:34])]
            t[0] += 1
            t[1] += g
    runtime = sorted(((e.key, e.count / n_prof, e.self_cpu_time_total / n_prof / 1e3)
                      for e in prof_cpu.key_averages() if e.key.startswith(("cuda", "cu"))), key=lambda r: -r[2])

    torch_syncs = _torch_sync_sites(lambda: engine.run(requests()))
    host_top = _host_profile(engine, requests, range(pre_at[0] + 1, pre_at[-1] + 1), args.host_top)
    env = environment()
    print(f"{env['device']}  {args.preset}, {len(layers)} layers: {args.requests} x {args.prompt_len} "
          f"tokens, gen {args.gen_len}, budget {args.max_batched_tokens}")
    for label, r in zip(("first run", "second run"), runs):
        print(f"{label}, unprofiled (mean of {r['steps']} prefill steps): {r['tokens']:,.0f} tokens, wall "
              f"{r['wall_ms']:.1f} ms ({r['tokens'] / r['wall_ms'] * 1e3:,.0f} tok/s), GPU events {r['gpu_ms']:.1f} ms, "
              f"host {r['host_ms']:.1f} ms; device allocations {r['num_device_alloc']}, frees "
              f"{r['num_device_free']}, retries {r['num_alloc_retries']}")
    print(f"profiled ({n_prof} prefill steps{f' and {between} decode steps among them' if between else ''}), per step: kernels {kernel_sum:.1f} ms summed, {union:.1f} ms busy (union), "
          f"span {span:.1f} ms, {launches:.0f} launches")
    print(f"{'kernel':<72}{'calls/step':>11}{'ms/step':>9}{'%':>6}")
    rows = sorted(((k, n / n_prof, us / n_prof / 1e3) for k, (n, us) in per_name.items()), key=lambda r: -r[2])
    for k, n, ms in rows[: args.top]:
        print(f"{k:<72}{n:>11.1f}{ms:>9.2f}{100 * ms / kernel_sum:>6.1f}")
    print(f"GPU idle gaps > {args.gap_us:.0f} us under CPU tracing, per step (after -> before):")
    for (a, b), (n, us) in sorted(gaps.items(), key=lambda kv: -kv[1][1])[:15]:
        print(f"  {a:<35}-> {b:<35}{n / n_prof:>7.1f} x {us / max(n, 1):>7.0f} us = {us / n_prof / 1e3:6.2f} ms")
    print("host runtime calls per step (self CPU ms, under tracing):")
    for k, n, ms in runtime[:8]:
        print(f"  {k:<40}{n:>8.0f} calls {ms:>8.2f} ms")
    print("host synchronisations (innermost dsv4 frames):")
    for site, n in syncs.most_common(8):
        print(f"  {n / n_prof:5.1f}/step  {site}")
    print("torch's synchronising calls in one whole run (torch.cuda.set_sync_debug_mode), innermost dsv4 frames first:")
    for site, n in torch_syncs.most_common(10):
        print(f"  {n:5d}  {site}")
    print(f"host work per prefill step (cProfile; times per step, calls over all {n_prof} steps):")
    print(host_top)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "preset": args.preset, "requests": args.requests, "prompt_len": args.prompt_len,
                       "gen_len": args.gen_len, "runs": [{k: v for k, v in r.items() if k != "stats"} for r in runs],
                       "kernel_sum_ms": kernel_sum, "kernel_union_ms": union, "span_ms": span,
                       "launches": launches,
                       "gaps": [{"after": a, "before": b, "count": n, "us": us} for (a, b), (n, us) in gaps.items()],
                       "runtime_calls": [{"name": k, "calls": n, "ms": ms} for k, n, ms in runtime], "kernels": [{"name": k, "calls": n, "ms": ms} for k, n, ms in rows]},
                      f, indent=1)


if __name__ == "__main__":
    main()
