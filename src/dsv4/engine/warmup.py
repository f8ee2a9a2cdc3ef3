"""Ahead-of-time kernel compilation: every Triton / Gluon specialisation a run will launch, compiled in parallel
before its first step, into Triton's on-disk cache.

A kernel compiles on the first launch of each *specialisation*: its constexprs (``ops.plan.StepPlan``'s decisions,
which depend only on a step's fixed-shape geometry) and the integer arguments Triton specialises on (divisible by
16, equal to 1). Both follow from a step's shape — the requests' new-token counts and the block-table width — so
``warm_up``:

1. ``plan_step_shapes``: replays the run's scheduling on the host against a cache on the ``meta`` device (no
   memory, no layers run: seconds for thousands of steps) and collects every distinct eager step shape (prefill
   chunks, mixed steps) and the decode batch sizes the CUDA graphs will serve;
2. runs one layer of each kind over each shape in worker processes (``spawn``, one per CPU core), on small
   synthetic caches of the same geometry: every kernel the run will launch compiles there, in parallel, into the
   on-disk cache (``TRITON_CACHE_DIR``, default ``~/.triton/cache``);
3. runs each shape once more in this process, which loads the kernels from disk (milliseconds each): the run's
   steps then meet no compile and no load (its JIT clock stays at zero), and a second run on the same machine
   finds everything compiled already (step 2 only loads).

Layers of one kind launch the same kernels (the weights are arguments), so one layer per kind suffices.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..config import LayerKind, ModelConfig

__all__ = ["StepShape", "WarmupReport", "graph_shapes", "plan_step_shapes", "triton_cache_dir", "warm_up"]


@dataclass(frozen=True)
class StepShape:
    """One step's fixed-shape geometry: its requests' new-token counts (plan order) and its block-table width."""

    num_new: tuple[int, ...]
    width: int

    def key(self, ratios: Sequence[int]) -> tuple:
        """What the kernels' specialisations depend on (``ops.plan.StepPlan``'s inputs and the integers Triton
        specialises on): tokens, requests, most new tokens per request, block-table width and, per compression
        ratio ``m``, the emit capacity ``Σ_b ⌈num_new[b] / m⌉``."""
        return (sum(self.num_new), len(self.num_new), max(self.num_new), self.width,
                tuple(sum(-(-n // m) for n in self.num_new) for m in ratios))


@dataclass
class WarmupReport:
    """What ``warm_up`` did (``Engine.run`` records it in ``RunStats.warmup``).

    Attributes:
        eager_shapes: distinct eager step shapes of the run (prefill chunks, mixed steps, unbucketed decodes).
        graph_buckets: decode batch sizes the run's decode steps use (the CUDA graphs worth capturing).
        workers: worker processes that compiled.
        compile_s: wall time of the parallel compile pass (0 when everything was in the disk cache already
            — the pass still runs, loading).
        load_s: wall time of loading every compiled kernel into this process (one run of each shape).
        seconds: ``compile_s + load_s`` plus the host replay of the schedule.
        kernels_compiled: kernels this process compiled or loaded while warming (``JitClock``).
        cache_dir: Triton's on-disk cache the kernels went into.
    """

    eager_shapes: int = 0
    graph_buckets: list[int] = field(default_factory=list)
    workers: int = 0
    compile_s: float = 0.0
    load_s: float = 0.0
    seconds: float = 0.0
    kernels_compiled: int = 0
    cache_dir: str = ""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line for the CLI."""
        return (f"warm-up: {self.eager_shapes} eager step shapes + graph buckets {self.graph_buckets} compiled by "
                f"{self.workers} workers in {self.compile_s:.1f} s, loaded in {self.load_s:.1f} s "
                f"({self.kernels_compiled} kernels) — Triton cache {self.cache_dir}")


def triton_cache_dir() -> str:
    """Where Triton keeps compiled kernels (``TRITON_CACHE_DIR``, else ``~/.triton/cache``)."""
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")


def plan_step_shapes(engine, requests: Sequence) -> tuple[list[StepShape], list[int]]:
    """The distinct step shapes a run of ``requests`` on ``engine`` will launch, from its scheduling replayed on a
    ``meta``-device cache (no memory, no layers run): ``(eager step shapes, decode batch sizes the CUDA graphs
    serve)`` (without graphs every step is eager). Prefix caching is not replayed (its hits shorten some prefill
    chunks: those may still compile inside a step)."""
    from .graphs import default_batch_sizes
    from .scheduler import Scheduler, SchedulerConfig

    c = engine.config
    reqs = [dataclasses.replace(r, token_ids=None) for r in requests]
    for i, r in enumerate(reqs):
        if r.number < 0:
            r.number = i
    cache = engine.build_cache(reqs, device=torch.device("meta"))
    ratios = sorted({m for m in cache.ratios if m})
    sched = Scheduler(cache, SchedulerConfig(max_batched_tokens=c.max_batched_tokens, max_running=c.max_running,
                                             decode_tokens=c.decode_tokens, max_prefill_chunk=c.max_prefill_chunk))
    for r in reqs:
        sched.add(r)
    graphs = engine._want_graphs()
    sizes = sorted(c.graph_batch_sizes or default_batch_sizes(c.max_running))
    eager: dict[tuple, StepShape] = {}
    buckets: set[int] = set()
    while sched.has_work:
        plan = sched.schedule()
        if plan is None:
            sched.skip_step()
            continue
        batch = cache.prepare_forward(plan.plan)
        bucket = next((s for s in sizes if s >= len(plan.plan)), None)
        decode = plan.is_decode_only and all(n == c.decode_tokens for _, n in plan.plan)
        if graphs and decode and bucket is not None:
            buckets.add(bucket)
        else:
            shape = StepShape(tuple(n for _, n in plan.plan), int(batch.block_tables.shape[1]))
            eager.setdefault(shape.key(ratios), shape)
        cache.claim_step(batch)
        sched.commit(plan)
    return list(eager.values()), sorted(buckets)


def _kinds(cfg: ModelConfig, layers: Sequence[int]) -> list[int]:
    """One layer of each kind among ``layers``."""
    first: dict[LayerKind, int] = {}
    for li in layers:
        first.setdefault(cfg.layer_kind(li), li)
    return sorted(first.values())


_WORKER_LAYERS: dict[tuple, dict] = {}  # per process: (cfg, layers, backend, device) -> {layer: Attention}


def _run_shape(cfg: ModelConfig, layers: list[int], numerics: str, backend: str, block_size: int,
               shape: StepShape, device: str) -> float:
    """Run ``shape`` once, eagerly, through one layer of each kind on a small synthetic cache of its geometry:
    every kernel the shape launches compiles (or loads from the disk cache). Returns its seconds."""
    import dsv4
    from dsv4.cache import HybridCache

    t0 = time.perf_counter()
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    key = (cfg, tuple(layers), backend, device)
    if key not in _WORKER_LAYERS:
        _WORKER_LAYERS[key] = {
            li: dsv4.Attention(dsv4.AttentionWeights.random(cfg, li, seed=0, device=dev), cfg, li, backend=backend,
                               check_inputs=False, nan_policy="off")
            for li in layers
        }
    attn = _WORKER_LAYERS[key]
    B = len(shape.num_new)
    cache = HybridCache(cfg, layers=layers, max_requests=B, num_blocks=B * shape.width + 1, block_size=block_size,
                        device=dev, numerics=numerics)
    for b in range(B):
        cache.add_request(f"r{b}")
    with torch.no_grad():
        batch = cache.prepare_forward({f"r{b}": n for b, n in enumerate(shape.num_new)}, max_blocks=shape.width)
        x = torch.randn(batch.num_tokens, cfg.hidden_size, device=dev).to(cache.numerics.act_dtype)
        plan = attn[layers[0]].plan_step(batch, cache)
        for li in layers:
            attn[li](x, batch, cache, plan)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


def graph_shapes(engine, requests: Sequence, buckets: Sequence[int]) -> list[StepShape]:
    """The padded decode steps ``engine.graphs`` captures for ``buckets`` (``capacity + 1`` rows of
    ``decode_tokens`` tokens, the run's block-table width; see ``engine.graphs``)."""
    from .graphs import decode_table_width

    ratios = [engine.cfg.ratio(li) for li in engine.layer_ids if engine.cfg.ratio(li)]
    width = decode_table_width(max(r.total_len for r in requests), min(ratios, default=0), engine.config.block_size)
    return [StepShape((engine.config.decode_tokens,) * (c + 1), width) for c in buckets]


def warm_up(engine, requests: Sequence, workers: int | None = None, progress: bool = False) -> WarmupReport:
    """Compile every kernel a run of ``requests`` on ``engine`` launches before its first step.

    1. ``plan_step_shapes`` lists the run's step shapes (host, ``meta`` device);
    2. ``workers`` processes (``spawn``; default one per CPU core, at most one per shape) run each shape once,
       compiling in parallel into Triton's on-disk cache (``triton_cache_dir()``);
    3. this process runs each shape once too, loading every kernel from the disk cache into memory, so that no
       timed step meets a compile (or a load).

    Returns the ``WarmupReport``. On a device other than CUDA, or a backend without kernels, it only plans.
    """
    from .jit_clock import JitClock

    t_all = time.perf_counter()
    report = WarmupReport(cache_dir=triton_cache_dir())
    eager, buckets = plan_step_shapes(engine, requests)
    report.eager_shapes, report.graph_buckets = len(eager), buckets
    if engine.device.type != "cuda" or engine.backend != "triton":
        report.seconds = time.perf_counter() - t_all
        return report
    shapes = sorted(eager, key=lambda s: -sum(s.num_new)) + graph_shapes(engine, requests, buckets)
    layers = _kinds(engine.cfg, engine.layer_ids)
    numerics = engine.numerics.name if engine.numerics.name in ("official", "exact") else "official"
    args = (engine.cfg, layers, numerics, engine.backend, engine.config.block_size)
    n = max(1, min(workers or os.cpu_count() or 1, len(shapes)))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=2 * len(shapes), unit="shape", desc="compile", leave=False, dynamic_ncols=True)
    t0 = time.perf_counter()
    if n > 1:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=n, mp_context=ctx) as pool:
            futures = [pool.submit(_run_shape, *args, s, str(engine.device)) for s in shapes]
            for f in concurrent.futures.as_completed(futures):
                f.result()
                if bar is not None:
                    bar.update()
    report.workers = n if n > 1 else 0
    report.compile_s = time.perf_counter() - t0
    if bar is not None:
        bar.set_description("load")
    t0 = time.perf_counter()
    with JitClock() as clock:
        for s in shapes:
            _run_shape(*args, s, str(engine.device))
            if bar is not None:
                bar.update()
    report.load_s = time.perf_counter() - t0
    report.kernels_compiled = clock.kernels
    if bar is not None:
        bar.close()
    report.seconds = time.perf_counter() - t_all
    return report
