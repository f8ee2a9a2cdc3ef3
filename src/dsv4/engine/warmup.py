"""Ahead-of-time kernel compilation: every Triton / Gluon specialisation a run will launch, compiled in parallel
before its first step, into Triton's on-disk cache.

A kernel compiles on the first launch of each *specialisation*: its constexprs (``ops.plan.StepPlan``'s decisions,
which depend only on a step's fixed-shape geometry) and the integer arguments Triton specialises on (divisible by
16, equal to 1). Both follow from a step's shape — the requests' new-token counts and the block-table width — so
``warm_up``:

1. ``plan_step_shapes``: replays the run's scheduling on the host against a cache on the ``meta`` device (no
   memory, no layers run) and collects every distinct eager step shape (prefill chunks, mixed steps) and the decode
   batch sizes the CUDA graphs will serve;
2. *compiles* them: worker processes (``spawn``, one per CPU core) run each (shape, layer kind) once on a small
   synthetic cache of the shape's geometry; every kernel the run will launch compiles there, side by side, into
   the on-disk cache (``TRITON_CACHE_DIR``, default ``~/.triton/cache``);
3. *loads* them: this process runs each shape once more, which reads the kernels from disk (milliseconds each). The
   run's steps then meet no compile and no load (its JIT clock stays at zero).

Step 1's result is stored in the same cache directory (``stored_step_shapes``, ``dsv4.engine.shape_store``; keyed by
everything the replay depends on, the package's sources included): a second run of the same workload skips it.

A manifest in the cache directory names what a warm-up compiled (keyed by the kernels' sources, the versions, the
device, the model and the shapes): a second run on the same machine skips step 2. It only saves time — a kernel
missing from the cache is compiled in step 3 all the same.

Layers of one kind launch the same kernels (the weights are arguments), so one layer per kind suffices.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import importlib
import json
import multiprocessing
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..config import LayerKind, ModelConfig
from .load_misses import explain_load_compiles
from .residual import residual_step
from .shape_store import StepShape, entry_path, load_step_shapes, step_shapes_key, store_step_shapes

__all__ = ["StepShape", "WarmupReport", "graph_shapes", "graph_sizes", "plan_step_shapes", "stored_step_shapes",
           "triton_cache_dir", "warm_up"]


@dataclass
class WarmupReport:
    """What ``warm_up`` did (``Engine.run`` records it in ``RunStats.warmup``).

    Attributes:
        eager_shapes: distinct eager step shapes of the run (prefill chunks, mixed steps, unbucketed decodes).
        graph_buckets: decode batch sizes the run's decode steps use (the CUDA graphs worth capturing).
        shapes_stored: whether the step shapes came from a stored replay (``dsv4.engine.shape_store``) rather than
            a replay of the run's scheduling.
        shapes_s: seconds to get the step shapes (the replay, or reading its stored result).
        workers: worker processes that compiled (0: the manifest said all was compiled already).
        tasks: (shape, layer kind) runs the workers made.
        compile_s: wall time of the workers' pass, their start included (0 on a warm start).
        slowest_task_s: the longest single task (a lower bound of ``compile_s`` however many workers).
        load_s: wall time of loading every kernel into this process (one real run of each shape).
        seconds: the whole warm-up, host replay of the schedule included.
        kernels_loaded: kernels this process loaded (or compiled, if a worker missed one) while warming.
        slowest_loads: the load pass's slowest kernels, ``[(name, seconds)]`` (at most 5 of ≥ 0.5 s): a load
            from the disk cache takes milliseconds, so these were compiled here.
        load_compiles: why each of those (at most 12) compiled here (``engine.load_misses``): a specialisation no
            worker launched (the differing arguments named), or one a worker did launch that the disk cache missed.
        warm_start: whether the manifest showed everything compiled already.
        error: why the workers' pass failed, if it did (the load pass then compiles what it needs, serially).
        cache_dir: Triton's on-disk cache the kernels went into.
    """

    eager_shapes: int = 0
    graph_buckets: list[int] = field(default_factory=list)
    shapes_stored: bool = False
    shapes_s: float = 0.0
    workers: int = 0
    tasks: int = 0
    compile_s: float = 0.0
    slowest_task_s: float = 0.0
    load_s: float = 0.0
    seconds: float = 0.0
    kernels_loaded: int = 0
    slowest_loads: list[tuple[str, float]] = field(default_factory=list)
    load_compiles: list[str] = field(default_factory=list)
    warm_start: bool = False
    error: str = ""
    cache_dir: str = ""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line for the CLI."""
        if self.warm_start:
            done = "all compiled already (manifest)"
        elif not self.workers:
            done = "nothing to compile (no Triton kernels on this device and backend)"
        elif self.error:
            done = f"the compile workers failed ({self.error}): compiled serially while loading"
        else:
            done = (f"compiled by {self.workers} workers in {self.compile_s:.1f} s ({self.tasks} shape x layer-kind "
                    f"runs, the slowest {self.slowest_task_s:.1f} s)")
        shapes = "stored" if self.shapes_stored else "replayed"
        return (f"warm-up {self.seconds:.1f} s: {self.eager_shapes} eager step shapes + graph buckets "
                f"{self.graph_buckets} ({shapes} in {self.shapes_s:.2f} s); {done}; {self.kernels_loaded} kernels "
                f"loaded in {self.load_s:.1f} s — Triton cache {self.cache_dir}{self._compiled_here()}")

    def _compiled_here(self) -> str:
        if self.load_compiles:
            return "; compiled while loading:\n" + "\n".join(f"  {line}" for line in self.load_compiles)
        if not self.slowest_loads:
            return ""
        return " (compiled while loading: " + ", ".join(f"{n} {s:.1f} s" for n, s in self.slowest_loads) + ")"


def triton_cache_dir() -> str:
    """Where Triton keeps compiled kernels (``TRITON_CACHE_DIR``, else ``~/.triton/cache``)."""
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")


def graph_sizes(engine) -> list[int]:
    """The decode batch sizes ``engine`` can capture as CUDA graphs, ascending (``EngineConfig.graph_batch_sizes``,
    else ``dsv4.engine.graphs.default_batch_sizes``)."""
    from .graphs import default_batch_sizes

    c = engine.config
    return sorted(c.graph_batch_sizes or default_batch_sizes(c.max_running))


def plan_step_shapes(engine, requests: Sequence) -> tuple[list[StepShape], list[int]]:
    """The distinct step shapes a run of ``requests`` on ``engine`` will launch, from its scheduling replayed on a
    ``meta``-device cache (no memory, no layers run): ``(eager step shapes, decode batch sizes the CUDA graphs
    serve)`` (without graphs every step is eager). Prefix caching is not replayed (its hits shorten some prefill
    chunks: those may still compile inside a step)."""
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
    sizes = graph_sizes(engine)
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


def stored_step_shapes(engine, requests: Sequence, directory: str | None = None
                       ) -> tuple[list[StepShape], list[int], bool]:
    """``plan_step_shapes(engine, requests)`` as ``(eager step shapes, graph buckets, stored)``: from the stored
    replay (``dsv4.engine.shape_store``) when a valid entry exists (``stored`` True), else replayed and stored.
    ``directory``: the cache directory (default ``triton_cache_dir()``)."""
    key = step_shapes_key(engine, requests)
    path = entry_path(key, directory or triton_cache_dir())
    found = load_step_shapes(path, key, engine, requests, graph_sizes(engine) if engine._want_graphs() else [])
    if found is not None:
        return found[0], found[1], True
    eager, buckets = plan_step_shapes(engine, requests)
    store_step_shapes(path, key, eager, buckets)
    return eager, buckets, False


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
    if dev.type == "cuda" and dev.index is not None:
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
        # the engine's glue between layers (``dsv4.engine.residual``) runs too: every variant of it compiles
        glue = residual_step(backend, dev, cache.numerics.act_dtype, cfg.norm_eps)
        h, x = glue(torch.randn(batch.num_tokens, cfg.hidden_size, device=dev), None)
        plan = attn[layers[0]].plan_step(batch, cache)
        for li in layers:
            y = attn[li](x, batch, cache, plan)
        h, _ = glue(h, y)
        glue(h, y, norm=False, in_place=True)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


def _run_shape_recorded(*args) -> tuple[float, list[str]]:
    """A compile worker's task: ``_run_shape(*args)``, and the specialisations it launched first in this process
    (``JitClock.specs``: compiled, or loaded from disk)."""
    from .jit_clock import JitClock

    with JitClock() as clock:
        seconds = _run_shape(*args)
    return seconds, clock.specs


def graph_shapes(engine, requests: Sequence, buckets: Sequence[int]) -> list[StepShape]:
    """The padded decode steps ``engine.graphs`` captures for ``buckets`` (``capacity + 1`` rows of
    ``decode_tokens`` tokens, the run's block-table width; see ``engine.graphs``)."""
    from .graphs import decode_table_width

    ratios = [engine.cfg.ratio(li) for li in engine.layer_ids if engine.cfg.ratio(li)]
    width = decode_table_width(max(r.total_len for r in requests), min(ratios, default=0), engine.config.block_size)
    return [StepShape((engine.config.decode_tokens,) * (c + 1), width) for c in buckets]


def _start_worker(device: str) -> None:
    """Pool initializer: import the kernels and make ``device`` current (a CUDA context per worker)."""
    import dsv4.ops.triton_ops  # noqa: F401 - imports every kernel module

    dev = torch.device(device)
    if dev.index is not None:  # "cuda" alone: the default device
        torch.cuda.set_device(dev)
    torch.empty(1, device=dev)


def _manifest_path(engine, shapes: Sequence[StepShape]) -> str:
    """Where the manifest of a warm-up of ``shapes`` on ``engine`` lives: named by a digest of everything the
    kernels' binaries depend on (their sources and plans, triton / torch versions, the device, the model, the
    shapes)."""
    import triton

    from .source_digest import source_digest

    h = hashlib.sha256(source_digest("kernels", "ops"))  # the kernels and the plans that pick their constexprs
    ratios = sorted({engine.cfg.ratio(li) for li in engine.layer_ids if engine.cfg.ratio(li)})
    h.update(repr((triton.__version__, torch.__version__, torch.cuda.get_device_name(engine.device),
                   dataclasses.astuple(engine.cfg), _kinds(engine.cfg, engine.layer_ids), engine.numerics.name,
                   engine.backend, engine.config.block_size, sorted(s.key(ratios) for s in shapes))).encode())
    return os.path.join(triton_cache_dir(), "dsv4-warmup", h.hexdigest()[:32] + ".json")


def _compile_in_workers(report: WarmupReport, n: int, args: tuple, shapes: list[StepShape], device: str,
                        bar) -> set[str]:
    """Step 2: each (shape, layer kind) once in a pool of ``n`` workers. Tasks go out shape by shape, largest
    first, each shape's layer kinds side by side: the first wave compiles the kinds' different kernels at once.
    Returns every specialisation the workers launched (``JitClock.specs``)."""
    cfg, layers, *rest = args
    order = sorted(shapes, key=lambda s: -sum(s.num_new))
    tasks = [(shape, [li]) for shape in order for li in layers]
    report.tasks = len(tasks)
    if bar is not None:
        bar.reset(total=len(tasks))
        bar.set_description("warm-up: compile")
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=n, mp_context=ctx, initializer=_start_worker,
                                                initargs=(device,)) as pool:
        futures = [pool.submit(_run_shape_recorded, cfg, layer, *rest, shape, device) for shape, layer in tasks]
        launched: set[str] = set()
        for f in concurrent.futures.as_completed(futures):
            seconds, specs = f.result()
            report.slowest_task_s = max(report.slowest_task_s, seconds)
            launched.update(specs)
            if bar is not None:
                bar.update()
    return launched


def warm_up(engine, requests: Sequence, workers: int | None = None, progress: bool = False) -> WarmupReport:
    """Compile every kernel a run of ``requests`` on ``engine`` launches before its first step (see the module
    docstring for the three steps). ``workers``: compile processes (default: one per CPU core). Returns the
    ``WarmupReport``. On a device other than CUDA, a backend without kernels, or under TP / CP
    (``Engine(parallel=...)``) it only plans."""
    from .jit_clock import JitClock

    t_all = time.perf_counter()
    report = WarmupReport(cache_dir=triton_cache_dir())
    eager, buckets, report.shapes_stored = stored_step_shapes(engine, requests)
    report.shapes_s = time.perf_counter() - t_all
    report.eager_shapes, report.graph_buckets = len(eager), buckets
    if engine.device.type != "cuda" or engine.backend != "triton" or getattr(engine, "parallel", None) is not None:
        # nothing to compile; under TP / CP the workers' single-process layers would compile other head counts
        report.seconds = time.perf_counter() - t_all
        return report
    shapes = eager + graph_shapes(engine, requests, buckets)
    layers = _kinds(engine.cfg, engine.layer_ids)
    numerics = engine.numerics.name if engine.numerics.name in ("official", "exact") else "official"
    args = (engine.cfg, layers, numerics, engine.backend, engine.config.block_size)
    device = str(engine.device)
    manifest = _manifest_path(engine, shapes)
    report.warm_start = os.path.exists(manifest)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(unit="run", desc="warm-up", leave=False, dynamic_ncols=True)
    worker_specs: set[str] = set()
    if not report.warm_start:
        n = max(1, min(workers or os.cpu_count() or 1, len(shapes) * len(layers)))
        t0 = time.perf_counter()
        try:
            worker_specs = _compile_in_workers(report, n, args, shapes, device, bar)
        except Exception as e:  # noqa: BLE001 - a failed worker costs time, never correctness: step 3 compiles
            report.error = f"{type(e).__name__}: {e}"[:300]
        report.workers = n
        report.compile_s = time.perf_counter() - t0
    if bar is not None:
        bar.reset(total=len(shapes))
        bar.set_description("warm-up: load")
    t0 = time.perf_counter()
    with JitClock() as clock:
        for s in shapes:
            _run_shape(*args, s, device)
            if bar is not None:
                bar.update()
    report.load_s = time.perf_counter() - t0
    report.kernels_loaded = clock.kernels
    report.slowest_loads = sorted(((n, round(s, 2)) for n, s in clock.records if s >= 0.5), key=lambda r: -r[1])[:5]
    if report.workers and not report.error:
        report.load_compiles = explain_load_compiles(clock.records, clock.specs, worker_specs)
    if bar is not None:
        bar.close()
    report.seconds = time.perf_counter() - t_all
    if not report.warm_start and not report.error:
        os.makedirs(os.path.dirname(manifest), exist_ok=True)
        with open(manifest, "w") as f:
            json.dump(report.as_dict(), f)
    return report
