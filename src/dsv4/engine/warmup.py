"""Ahead-of-time kernel compilation: every Triton / Gluon specialisation a run will launch, compiled in parallel
before its first step, into Triton's on-disk cache.

A kernel compiles on the first launch of each *specialisation*: its constexprs (``ops.plan.StepPlan``'s decisions,
which depend only on a step's fixed-shape geometry) and the integer arguments Triton specialises on (divisible by
16, equal to 1). Both follow from a step's shape — the requests' new-token counts and the block-table width — so
``warm_up``:

1. ``plan_step_shapes``: replays the run's scheduling on the host against a cache on the ``meta`` device (no
   memory, no layers run) and collects every distinct eager step shape (prefill chunks, mixed steps) and the decode
   batch sizes the CUDA graphs will serve;
2. *compiles* them (``engine.compile_workers``): worker processes (one per CPU core) first take a census of the
   specialisations each shape launches through one layer of each kind on a small synthetic cache
   (``engine.shape_run``; nothing compiles or runs), then compile each distinct specialisation once, side by side,
   into the on-disk cache (``TRITON_CACHE_DIR``, default ``~/.triton/cache``);
3. *loads* them: this process loads each specialisation from disk (``kernels.census.compile_spec``: milliseconds
   each). The run's steps then meet no compile and no load (its JIT clock stays at zero).

Step 1's result is stored in the same cache directory (``stored_step_shapes``, ``dsv4.engine.shape_store``; keyed by
everything the replay depends on, the package's sources included): a second run of the same workload skips it.

A manifest in the cache directory names what a warm-up compiled (keyed by the kernels' sources, the versions, the
device, the model and the shapes) and lists the specialisations: a second run on the same machine skips step 2 and
loads those. It only saves time — a specialisation missing from the disk cache compiles in step 3 all the same,
and one the manifest does not name compiles in the step that launches it (the run's JIT clock reports it). Without
the census's list (it failed), step 3 runs every shape once more in this process instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..kernels.census import KernelSpec
from .compile_workers import WorkerStats, compile_in_workers
from .load_misses import explain_load_compiles
from .shape_run import kind_layers, run_shape
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
        compile: what the compile workers did (``compile_workers.WorkerStats``: workers, tasks, specialisations,
            census and compile times; all zero on a warm start or where nothing compiles).
        load_s: wall time of loading every kernel into this process.
        seconds: the whole warm-up, host replay of the schedule included.
        kernels_loaded: kernels this process loaded (or compiled, if a worker missed one) while warming.
        slowest_loads: the load pass's slowest kernels, ``[(name, seconds)]`` (at most 5 of ≥ 0.5 s): a load
            from the disk cache takes milliseconds, so these were compiled here.
        load_compiles: why each of those (at most 12) compiled here (``engine.load_misses``): a specialisation no
            worker launched (the differing arguments named), or one a worker did launch that the disk cache missed.
        load_errors: specialisations (of the census or the manifest) that failed to load, skipped: a step that
            launches one compiles it then.
        warm_start: whether the manifest showed everything compiled already.
        error: why the workers' pass failed, if it did (the load pass then compiles what it needs, serially).
        cache_dir: Triton's on-disk cache the kernels went into.
    """

    eager_shapes: int = 0
    graph_buckets: list[int] = field(default_factory=list)
    shapes_stored: bool = False
    shapes_s: float = 0.0
    compile: WorkerStats = field(default_factory=WorkerStats)
    load_s: float = 0.0
    seconds: float = 0.0
    kernels_loaded: int = 0
    slowest_loads: list[tuple[str, float]] = field(default_factory=list)
    load_compiles: list[str] = field(default_factory=list)
    load_errors: list[str] = field(default_factory=list)
    warm_start: bool = False
    error: str = ""
    cache_dir: str = ""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "WarmupReport":
        """The report ``as_dict`` gave (e.g. from a run's JSON)."""
        return cls(**{**d, "compile": WorkerStats(**d.get("compile", {}))})

    def describe(self) -> str:
        """One line for the CLI (more lines where the load pass compiled)."""
        c = self.compile
        if self.warm_start:
            done = "all compiled already (manifest)"
        elif not c.workers:
            done = "nothing to compile (no Triton kernels on this device and backend)"
        elif self.error:
            done = f"the compile workers failed ({self.error}): compiled serially while loading"
        elif c.census_error:
            done = (f"the census failed ({c.census_error}): {c.workers} workers ran {c.tasks} shape x layer-kind "
                    f"tasks in {c.seconds:.1f} s, the slowest {c.slowest_compile_s:.1f} s")
        else:
            memory = f", {c.concurrent_tasks} at once for device memory" if 0 < c.concurrent_tasks < c.workers else ""
            done = (f"{c.specialisations} specialisations compiled by {c.workers} workers in {c.seconds:.1f} s "
                    f"(census of {c.tasks} shapes {c.census_s:.1f} s{memory}; the slowest compile "
                    f"{c.slowest_compile_s:.1f} s, {c.slowest_kernel})")
        shapes = "stored" if self.shapes_stored else "replayed"
        return (f"warm-up {self.seconds:.1f} s: {self.eager_shapes} eager step shapes + graph buckets "
                f"{self.graph_buckets} ({shapes} in {self.shapes_s:.2f} s); {done}; {self.kernels_loaded} kernels "
                f"loaded in {self.load_s:.1f} s — Triton cache {self.cache_dir}{self._compiled_here()}")

    def _compiled_here(self) -> str:
        if self.load_errors:
            return "; failed to load (compiled when launched):\n" + "\n".join(f"  {e}" for e in self.load_errors)
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


def graph_shapes(engine, requests: Sequence, buckets: Sequence[int]) -> list[StepShape]:
    """The padded decode steps ``engine.graphs`` captures for ``buckets`` (``capacity`` rows of
    ``decode_tokens`` tokens, the run's block-table width; see ``engine.graphs``)."""
    from .graphs import decode_table_width

    ratios = [engine.cfg.ratio(li) for li in engine.layer_ids if engine.cfg.ratio(li)]
    width = decode_table_width(max(r.total_len for r in requests), min(ratios, default=0), engine.config.block_size)
    return [StepShape((engine.config.decode_tokens,) * c, width) for c in buckets]


def _manifest_path(engine, shapes: Sequence[StepShape]) -> str:
    """Where the manifest of a warm-up of ``shapes`` on ``engine`` lives: named by a digest of everything the
    kernels' binaries depend on (their sources and plans, triton / torch versions, the device, the model, the
    shapes)."""
    import triton

    from .source_digest import source_digest

    h = hashlib.sha256(source_digest("kernels", "ops"))  # the kernels and the plans that pick their constexprs
    ratios = sorted({engine.cfg.ratio(li) for li in engine.layer_ids if engine.cfg.ratio(li)})
    h.update(repr((triton.__version__, torch.__version__, torch.cuda.get_device_name(engine.device),
                   dataclasses.astuple(engine.cfg), kind_layers(engine.cfg, engine.layer_ids), engine.numerics.name,
                   engine.backend, engine.config.block_size, sorted(s.key(ratios) for s in shapes))).encode())
    return os.path.join(triton_cache_dir(), "dsv4-warmup", h.hexdigest()[:32] + ".json")


def _write_manifest(path: str, report: WarmupReport, specs: Sequence[KernelSpec]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"report": report.as_dict(), "specs": [s.data for s in specs]}, f)
    os.replace(tmp, path)  # a reader never sees half a manifest


def _manifest_specs(path: str) -> list[KernelSpec]:
    """The specialisations a manifest lists (empty if it lists none or cannot be read: the load pass then runs the
    shapes instead). Each names a JIT function of this package or ``census.compile_spec`` refuses it."""
    try:
        with open(path) as f:
            return [KernelSpec.from_data(d) for d in json.load(f)["specs"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _load(report: WarmupReport, specs: Sequence[KernelSpec], shape_runs: Sequence[tuple], bar) -> "JitClock":
    """Step 3: every specialisation of ``specs`` loaded into this process (compiled if the disk cache lacks it; one
    that fails is named in ``report.load_errors`` and skipped); without specs, every one of ``shape_runs``
    (``run_shape``'s arguments) run once: what it launches compiles or loads. Returns the pass's ``JitClock``."""
    from ..kernels.census import compile_spec
    from .jit_clock import JitClock

    if bar is not None:
        bar.reset(total=len(specs) or len(shape_runs))
        bar.set_description("warm-up: load")
    with JitClock() as clock:
        for spec in specs:
            try:
                compile_spec(spec)
            except Exception as e:  # noqa: BLE001 - a bad entry costs a compile in a step, never a wrong kernel
                report.load_errors.append(f"{spec.name}: {type(e).__name__}: {e}"[:300])
            if bar is not None:
                bar.update()
        if not specs:
            for args in shape_runs:
                run_shape(*args)
                if bar is not None:
                    bar.update()
    return clock


def _ask_device(device: torch.device) -> None:
    """This process's device facts for the plans, asked now (the attention kernel's resident clusters compile a
    probe kernel): while the workers start, so that theirs load it from disk."""
    from ..kernels.attention.cluster_launch import MAX_CLUSTER
    from ..kernels.device_facts import facts

    clusters = facts(device).resident_clusters
    if clusters is not None:
        for size in range(2, MAX_CLUSTER + 1):
            clusters(size)


def warm_up(engine, requests: Sequence, workers: int | None = None, progress: bool = False) -> WarmupReport:
    """Compile every kernel a run of ``requests`` on ``engine`` launches before its first step (see the module
    docstring for the three steps). ``workers``: compile processes (default: one per CPU core). Returns the
    ``WarmupReport``. On a device other than CUDA, a backend without kernels, or under TP / CP
    (``Engine(parallel=...)``) it only plans."""
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
    layers = kind_layers(engine.cfg, engine.layer_ids)
    numerics = engine.numerics.name if engine.numerics.name in ("official", "exact") else "official"
    device = str(engine.device)

    def run_args(shape: StepShape, kinds: list[int]) -> tuple:  # run_shape's arguments
        return engine.cfg, kinds, numerics, engine.backend, engine.config.block_size, shape, device

    manifest = _manifest_path(engine, shapes)
    report.warm_start = os.path.exists(manifest)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(unit="kernel", desc="warm-up", leave=False, dynamic_ncols=True)
    specs: list[KernelSpec] = _manifest_specs(manifest) if report.warm_start else []
    launched: set[str] = set()
    if not report.warm_start:
        n = max(1, min(workers or os.cpu_count() or 1, len(shapes) * len(layers)))
        t0 = time.perf_counter()
        try:
            done = compile_in_workers(n, run_args, shapes, layers, device, bar,
                                      meanwhile=lambda: _ask_device(engine.device))
            specs, launched, report.compile = done.specs, done.launched, done.stats
        except Exception as e:  # noqa: BLE001 - a failed worker costs time, never correctness: step 3 compiles
            report.error = f"{type(e).__name__}: {e}"[:300]
            report.compile = WorkerStats(workers=n, seconds=time.perf_counter() - t0)
    t0 = time.perf_counter()
    clock = _load(report, specs, [run_args(s, layers) for s in shapes], bar)
    report.load_s = time.perf_counter() - t0
    report.kernels_loaded = clock.kernels
    report.slowest_loads = sorted(((n, round(s, 2)) for n, s in clock.records if s >= 0.5), key=lambda r: -r[1])[:5]
    if report.compile.workers and not report.error:
        report.load_compiles = explain_load_compiles(clock.records, clock.specs, launched)
    if bar is not None:
        bar.close()
    report.seconds = time.perf_counter() - t_all
    if not report.warm_start and not report.error:
        _write_manifest(manifest, report, specs)
    return report
