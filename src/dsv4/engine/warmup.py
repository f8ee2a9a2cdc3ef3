"""Ahead-of-time kernel compilation: every Triton / Gluon specialisation a run will launch, compiled in parallel
before the first timed step, into Triton's on-disk cache.

A kernel compiles on the first launch of each *specialisation*: its constexprs (``ops.plan.StepPlan``'s decisions,
which depend only on a step's fixed-shape geometry) and the integer arguments Triton specialises on (divisible by
16, equal to 1). Both follow from a step's shape — the requests' new-token counts and the block-table width — so:

1. ``plan_step_shapes`` replays the run's scheduling on the host against a cache on the ``meta`` device (no memory,
   no layers run: seconds for thousands of steps) and collects every distinct step shape: the eager steps
   (prefill chunks, mixed steps) and the decode batch sizes the CUDA graphs will be captured for;
2. ``compile_step_shapes`` runs one layer of each kind over each shape in worker processes (``spawn``, one per
   CPU core up to the number of shapes), on small synthetic caches of the same geometry: every kernel the run will
   launch compiles there, in parallel, into the on-disk cache (``TRITON_CACHE_DIR``; Triton's default
   ``~/.triton/cache``);
3. the run itself then loads each kernel from disk (milliseconds) — its JIT clock stays at zero inside steps — and
   a second run on the same machine finds everything compiled already.

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

__all__ = ["StepShape", "WarmupReport", "compile_step_shapes", "plan_step_shapes"]


@dataclass(frozen=True)
class StepShape:
    """One step's fixed-shape geometry: its requests' new-token counts (plan order) and its block-table width."""

    num_new: tuple[int, ...]
    width: int

    @property
    def key(self) -> tuple:
        """What the kernels' specialisations depend on: tokens, requests, most new tokens per request, the
        per-ratio emit capacities (through ``num_new``) and the block-table width."""
        return (sum(self.num_new), len(self.num_new), max(self.num_new), self.width,
                tuple(sorted(self.num_new)))


@dataclass
class WarmupReport:
    """What ``compile_step_shapes`` did.

    Attributes:
        shapes: distinct step shapes compiled (eager steps and graph buckets).
        workers: worker processes used.
        seconds: wall time of the whole compile pass.
        per_shape_s: each shape's time in its worker (compilation dominates; a shape whose kernels an earlier one
            compiled loads them from disk).
        cache_dir: Triton's on-disk cache the kernels went into.
    """

    shapes: int = 0
    workers: int = 0
    seconds: float = 0.0
    per_shape_s: list[float] = field(default_factory=list)
    cache_dir: str = ""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def plan_step_shapes(engine, requests: Sequence) -> tuple[list[StepShape], list[int]]:
    """The distinct step shapes a run of ``requests`` on ``engine`` will launch, from its scheduling replayed on a
    ``meta``-device cache: ``(eager step shapes, decode batch sizes the CUDA graphs serve)`` (no graphs: every step
    is eager). Prefix caching is not replayed (its hits shorten some prefill chunks: those may still compile in a
    step)."""
    from .graphs import default_batch_sizes
    from .scheduler import Scheduler, SchedulerConfig

    c = engine.config
    reqs = [dataclasses.replace(r, token_ids=None) for r in requests]
    for i, r in enumerate(reqs):
        if r.number < 0:
            r.number = i
    cache = engine.build_cache(reqs, device=torch.device("meta"))
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
        if graphs and plan.is_decode_only and bucket is not None:
            buckets.add(bucket)
        else:
            shape = StepShape(tuple(n for _, n in plan.plan), int(batch.block_tables.shape[1]))
            eager.setdefault(shape.key, shape)
        cache.claim_step(batch)
        sched.commit(plan)
    return list(eager.values()), sorted(buckets)


def _kinds(cfg: ModelConfig, layers: Sequence[int]) -> list[int]:
    """One layer of each kind among ``layers``."""
    first: dict[LayerKind, int] = {}
    for li in layers:
        first.setdefault(cfg.layer_kind(li), li)
    return sorted(first.values())


def _compile_worker(cfg: ModelConfig, layers: list[int], numerics: str, backend: str, block_size: int,
                    shapes: list[StepShape], device: str) -> list[float]:
    """Run each shape once through one layer of each kind (eagerly): its kernels compile into the disk cache."""
    import dsv4
    from dsv4.cache import HybridCache

    torch.cuda.set_device(torch.device(device))
    weights = {li: dsv4.AttentionWeights.random(cfg, li, seed=0, device=device) for li in layers}
    attn = {li: dsv4.Attention(weights[li], cfg, li, backend=backend, check_inputs=False, nan_policy="off")
            for li in layers}
    times = []
    for shape in shapes:
        t0 = time.perf_counter()
        B = len(shape.num_new)
        cache = HybridCache(cfg, layers=layers, max_requests=B, num_blocks=B * shape.width + 1, block_size=block_size,
                            device=device, numerics=numerics)
        for b in range(B):
            cache.add_request(f"r{b}")
        batch = cache.prepare_forward({f"r{b}": n for b, n in enumerate(shape.num_new)}, max_blocks=shape.width)
        x = torch.randn(batch.num_tokens, cfg.hidden_size, device=device).to(cache.numerics.act_dtype)
        plan = attn[layers[0]].plan_step(batch, cache)
        for li in layers:
            attn[li](x, batch, cache, plan)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def compile_step_shapes(engine, shapes: Sequence[StepShape], workers: int | None = None) -> WarmupReport:
    """Compile every kernel ``shapes`` launch, in ``workers`` processes (default: one per CPU core, at most one per
    shape), into Triton's on-disk cache. Returns what it did."""
    shapes = list(shapes)
    report = WarmupReport(cache_dir=os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache")))
    if not shapes or engine.device.type != "cuda":
        return report
    # the biggest shapes first: they compile the most; round-robin spreads them over the workers
    shapes.sort(key=lambda s: -sum(s.num_new))
    n = max(1, min(workers or os.cpu_count() or 1, len(shapes)))
    parts = [shapes[i::n] for i in range(n)]
    layers = _kinds(engine.cfg, engine.layer_ids)
    numerics = engine.numerics.name if engine.numerics.name in ("official", "exact") else "official"
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=n, mp_context=ctx) as pool:
        futures = [pool.submit(_compile_worker, engine.cfg, layers, numerics, engine.backend,
                               engine.config.block_size, part, str(engine.device)) for part in parts if part]
        for f in futures:
            report.per_shape_s.extend(f.result())
    report.seconds = time.perf_counter() - t0
    report.shapes = len(shapes)
    report.workers = n
    return report
