"""Benchmark: the host work of the engine's steady decode steps (issue 38, "no host gap"), without the layers.

The acceptance workload by default: V4-Flash, every main layer (43), 64 requests of 8,192 prompt + 256 generated
tokens, 64 running, an 8,192-token step budget, block size 256, 1 token per decode step (``dsv4 run``'s GPU
defaults). The run goes through ``Engine.step`` unchanged — ``Scheduler.schedule``, the step's token ids,
``HybridCache.prepare_forward`` (validation, block allocation, ``build_step_batch``, the step ledger), the decode
graph's ``DecodeGraphs.run`` (``pad_step_batch``, ``claim_step`` for every layer, ``StepBatch.copy_`` into the
captured batch, the token ids into the captured input), ``Scheduler.commit`` and the ``StepRecord`` — with the
layers replaced by a stand-in:

* the layer stack (``Engine.forward_layers``) claims the step for every layer and returns its input (prefill and
  mixed steps, and the graphs' capture);
* the hidden-state source returns a constant row broadcast to the step's tokens (``TokenHidden`` is device work);
  like ``TokenHidden`` it is graph-safe, so a decode graph step does not call it (its graph would);
* on the CPU (no CUDA graphs here) the decode graphs are ``DecodeGraphs`` whose ``capture`` builds the captured
  batch and inputs on the CPU and whose ``replay`` does nothing; on CUDA they are real CUDA graphs of the stand-in.

Reported: per decode step replayed as a graph, the host time (``StepRecord.host_seconds``) — p50 / p90 / mean —
and a cProfile of those steps (top functions by cumulative and by own time). On the CPU this is CPU time of the
host path (a CPU tensor op costs less than a CUDA launch, and ``to_device`` does not pin: name the figures as
CPU figures); with ``--device cuda`` it is the host path against a real device whose work is trivial, so the host
never waits for it.

    python benchmarks/bench_decode_host.py                     # the acceptance workload, on this CPU
    python benchmarks/bench_decode_host.py --profile 25        # + cProfile, 25 rows per table
    python benchmarks/bench_decode_host.py --device cuda       # on a GPU (host path + pinned copies + replays)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

import dsv4
from host_workload import add_workload_args
from dsv4.cache.batch import StepBatch
from dsv4.cache.schema import resolve_layers
from dsv4.engine import Engine, EngineConfig, LengthSpec, make_requests
from dsv4.engine.graphs import DecodeGraphs, _Captured
from dsv4.engine.stats import percentiles
from dsv4.numerics import resolve_numerics


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_workload_args(p)
    p.add_argument("--decode-tokens", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (real CUDA graphs of the stand-in)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: less noise on a busy machine)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="cProfile the decode graph steps; print N rows by cumulative and by own time")
    p.add_argument("--count", action="store_true",
                   help="count, per steady decode step, the torch ops and the host-to-device transfers (to_device "
                        "calls) — a proxy for the host cost of a CUDA step (each a launch there); slows the steps")
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args(argv)


class _NoGraph:
    """The CPU stand-in of a ``torch.cuda.CUDAGraph``: replaying it does nothing."""

    def replay(self) -> None:
        pass


class CpuDecodeGraphs(DecodeGraphs):
    """``DecodeGraphs`` on the CPU: the same padding, claiming and copies per step, no graph (``replay`` is a
    no-op). Only ``__init__``'s CUDA check and ``capture`` differ."""

    def __init__(self, engine: Engine, max_len: int) -> None:
        dev = engine.device
        engine.device = torch.device("cuda")  # past the base class's CUDA check; nothing is put on it
        try:
            super().__init__(engine, max_len)
        finally:
            engine.device = dev

    def capture(self, keep: Any = None) -> None:
        eng = self.engine
        for c in sorted(self.sizes, reverse=True):
            batch = self._static(c)
            T = batch.num_tokens
            ids = torch.zeros(T, dtype=torch.int64, device=eng.device)
            h_in = torch.zeros(T, eng.cfg.hidden_size, dtype=torch.float32, device=eng.device)
            self.captured[c] = _Captured(c, _NoGraph(), batch, h_in, ids, h_in.clone(), {})  # type: ignore[arg-type]


class OpCounter(TorchDispatchMode):
    """Counts the torch (aten) ops dispatched while active, and the ``to_device`` calls of the modules that move
    host-built tensors to the step's device."""

    MODULES = ("dsv4.cache.batch", "dsv4.cache.packed", "dsv4.cache.capture_index", "dsv4.engine.runner")

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.transfers = 0
        self._saved: dict[str, Any] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> "OpCounter":
        for name in self.MODULES:
            mod = sys.modules.get(name)
            if mod is None or not hasattr(mod, "to_device"):
                continue
            orig = self._saved[name] = mod.to_device

            def counted(t: Tensor, device: torch.device, _orig: Any = orig) -> Tensor:
                self.transfers += 1
                return _orig(t, device)

            mod.to_device = counted
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for name, orig in self._saved.items():
            sys.modules[name].to_device = orig
        return super().__exit__(*exc)


def stand_in_engine(cfg: dsv4.ModelConfig, config: EngineConfig) -> Engine:
    """An ``Engine`` without weights or layers whose ``step`` is the real one (see the module docstring)."""
    eng = Engine.__new__(Engine)
    eng.cfg, eng.config, eng.parallel = cfg, config, None
    eng.device = torch.device(config.device)
    if eng.device.type == "cuda":
        eng.device = torch.device("cuda", torch.cuda.current_device())
    eng.numerics, eng.layer_ids = resolve_numerics(config.numerics), resolve_layers(cfg, None)
    eng._want_graphs = lambda: True  # type: ignore[method-assign]
    row = torch.zeros(1, cfg.hidden_size, dtype=torch.float32, device=eng.device)

    def hidden(ids: Tensor) -> Tensor:
        return row.expand(ids.shape[0], -1)

    hidden.graph_safe = True  # type: ignore[attr-defined] - as TokenHidden: in the graphs, not called per replay
    eng.hidden = hidden
    eng.check_finite, eng.nan_policy = False, "off"
    eng.overlap_host = eng.device.type == "cuda"
    eng.traces, eng._trace_layers, eng._records, eng._events = {}, [], [], []
    eng._nonfinite = torch.zeros((), dtype=torch.bool, device=eng.device)
    eng._jit_clock, eng.graph_capture_s, eng.plans_seen = None, 0.0, {}
    eng.cache = eng.scheduler = eng.graphs = None

    def forward_layers(batch: StepBatch, h: Tensor, keep: Any = ()) -> tuple[Tensor, dict]:
        eng.cache.claim_step(batch)  # a pad (captured) batch is not accounted: claims nothing
        return h * 1.0, {}

    eng.forward_layers = forward_layers  # type: ignore[method-assign]
    return eng


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = dsv4.ModelConfig.preset(args.preset)
    config = EngineConfig(backend="torch", device=args.device, block_size=args.block_size,
                          max_running=args.max_running, max_batched_tokens=args.max_batched_tokens,
                          decode_tokens=args.decode_tokens, check_finite=False)
    reqs = make_requests(args.requests, LengthSpec.parse(args.prompt_len, 1), LengthSpec.parse(args.gen_len, 0),
                         seed=0)
    eng = stand_in_engine(cfg, config)
    eng.submit(reqs, graph_batch_sizes=[])  # the graphs are made below (the CPU has no CUDA graphs)
    max_len = max(r.total_len for r in reqs)
    eng.graphs = (CpuDecodeGraphs(eng, max_len) if eng.device.type == "cpu"
                  else DecodeGraphs(eng, max_len=max_len))
    eng.graphs.capture()
    if eng.device.type == "cuda":
        torch.cuda.synchronize()

    prof = cProfile.Profile() if args.profile else None
    counter = OpCounter() if args.count else None
    counted_steps = 0
    decode: list[float] = []
    batch_sizes: list[int] = []
    sched = eng.scheduler
    t_run = time.perf_counter()
    while sched.has_work:
        # profile only once every step left is a decode step (nothing waits, nothing is in prefill)
        steady = not sched.waiting and not any(r.in_prefill for r in sched.running.values())
        if steady and prof is not None:
            prof.enable()
        if steady and counter is not None:
            with counter:
                rec = eng.step()
            counted_steps += 1
        else:
            rec = eng.step()
        if steady and prof is not None:
            prof.disable()
        if rec is not None and rec.graph:
            decode.append(rec.host_seconds)
            batch_sizes.append(rec.num_requests)
    if eng.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t_run
    eng.cache.check_invariants()
    if not decode:
        print("no decode step replayed a graph")
        return 1

    ms = percentiles([s * 1e3 for s in decode], (50, 90))
    dev = (torch.cuda.get_device_name() if eng.device.type == "cuda"
           else f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s))")
    print(f"dsv4 {dsv4.__version__} decode-step host work — {args.preset} ({len(eng.layer_ids)} layers), "
          f"{args.requests} x {args.prompt_len} + {args.gen_len}, {args.max_running} running, budget "
          f"{args.max_batched_tokens}, torch {torch.__version__}, on {dev}; layers stood in (see --help)")
    print(f"{'decode graph steps':<28}{len(decode):>8}   mean batch {statistics.fmean(batch_sizes):.1f} "
          f"(max {max(batch_sizes)})")
    print(f"{'host ms per step p50':<28}{ms['p50']:>8.3f}")
    print(f"{'host ms per step p90':<28}{ms['p90']:>8.3f}")
    print(f"{'host ms per step mean':<28}{ms['mean']:>8.3f}")
    print(f"{'whole run (s)':<28}{wall:>8.2f}")
    counts = {}
    if counter is not None and counted_steps:
        counts = {"torch_ops_per_step": counter.ops / counted_steps,
                  "to_device_per_step": counter.transfers / counted_steps}
        print(f"{'torch ops per step':<28}{counts['torch_ops_per_step']:>8.1f}   (steady decode steps; timings "
              f"above include the counting)")
        print(f"{'to_device per step':<28}{counts['to_device_per_step']:>8.1f}")
    if prof is not None:
        for key in ("cumulative", "tottime"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).strip_dirs().sort_stats(key).print_stats(args.profile)
            print(f"\n--- cProfile of the steady decode steps, by {key} ---")
            print(s.getvalue().split("\n", 4)[-1].rstrip())
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"version": dsv4.__version__, "preset": args.preset, "device": dev,
                       "decode_steps": len(decode), "mean_batch": statistics.fmean(batch_sizes),
                       "host_ms": ms, **counts}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
