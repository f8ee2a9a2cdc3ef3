"""The warm-up's compile workers (``engine.warmup``, step 2): a run's kernel specialisations compiled across the
machine's cores, each by exactly one worker.

1. *Census*: the workers run each step shape once through one layer of each kind inside a
   ``kernels.census.LaunchCensus`` — the host's work only: no kernel compiles or runs — and return the
   specialisations it launches. The shapes share most of their kernels (the acceptance workload: 81 distinct
   specialisations over 72 shapes).
2. *Compile*: each distinct specialisation is one task, the costliest first (``census.compile_cost``); a worker
   compiles it into Triton's on-disk cache (``census.compile_spec``). No kernel is compiled twice, and a large
   shape's kernels compile side by side instead of one after another inside its task.

If the census or a compile task fails (e.g. a worker process dies), ``compile_in_workers`` falls back to running every (shape, kind)
task for real in a fresh pool, which compiles each task's kernels as it launches them.

Workers are forked from a ``forkserver`` that imported the kernels once; each makes its own CUDA context
(``start_worker``).
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernels.census import KernelSpec, LaunchCensus, compile_cost, compile_spec
from .jit_clock import JitClock
from .shape_run import run_shape
from .shape_store import StepShape

__all__ = ["WorkerPass", "census_task", "compile_in_workers", "compile_task", "shape_task", "start_worker"]


@dataclass
class WorkerPass:
    """What the workers did.

    Attributes:
        specs: the distinct specialisations the census found (empty after the fallback).
        launched: every specialisation the workers compiled or loaded, as ``JitClock.specs`` names them.
        tasks: census tasks (one per shape, every layer kind), or the fallback's (shape, layer kind) runs.
        census_s: wall time of the census, the pool's start included.
        census_cpu_s: the census tasks' seconds, summed (``census_s`` less this over ``n``: the pool's start).
        census_slowest_s: the longest census task (a worker's first builds its layers and asks the device).
        query_s: the longest time a census task spent compiling for device queries (``census.device_query``).
        compile_cpu_s: the compile tasks' seconds, summed (over ``n`` workers: the compile phase's floor).
        launcher_cpu_s: the part of those spent building the kernels' launchers and loading them.
        slowest_s: the longest single compile task (the fallback: the longest (shape, kind) task).
        slowest_kernel: the kernel of that compile task (empty after the fallback).
        census_error: why the census or a compile task failed, if one did (the workers then ran every task for
            real).
    """

    specs: list[KernelSpec] = field(default_factory=list)
    launched: set[str] = field(default_factory=set)
    tasks: int = 0
    census_s: float = 0.0
    census_cpu_s: float = 0.0
    census_slowest_s: float = 0.0
    query_s: float = 0.0
    compile_cpu_s: float = 0.0
    launcher_cpu_s: float = 0.0
    slowest_s: float = 0.0
    slowest_kernel: str = ""
    census_error: str = ""


def start_worker(device: str, environ: dict[str, str] | None = None) -> None:
    """Pool initializer: take the engine's environment ``environ`` (``TRITON_CACHE_DIR`` above all: the fork server
    keeps the one it started with), import the kernels (their cache keys made canonical) and make ``device``
    current (a CUDA context per worker)."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    import dsv4.ops.triton_ops  # noqa: F401 - imports every kernel module

    dev = torch.device(device)
    if dev.index is not None:  # "cuda" alone: the default device
        torch.cuda.set_device(dev)
    torch.empty(1, device=dev)


def census_task(*run_args: Any) -> tuple[float, float, list[KernelSpec]]:
    """``run_shape(*run_args)`` inside a census: its seconds, the seconds of the device queries' compiles among
    them (``census.device_query``) and the specialisations it launches (nothing compiles or runs)."""
    with JitClock() as clock, LaunchCensus() as census:  # the census passes device queries on to the clock
        seconds = run_shape(*run_args)
    return seconds, clock.seconds, census.specs


def compile_task(spec: KernelSpec) -> tuple[float, float, list[str]]:
    """Compile ``spec`` (or find it on disk) and its launcher: the seconds of both, those of the kernel's compile
    alone, and ``JitClock``'s name for it."""
    with JitClock() as clock:
        t0 = time.perf_counter()
        compile_spec(spec)
        seconds = time.perf_counter() - t0
    return seconds, clock.seconds, clock.specs


def shape_task(*run_args: Any) -> tuple[float, list[str]]:
    """The fallback's task: ``run_shape(*run_args)`` for real, and the specialisations it compiled or loaded."""
    with JitClock() as clock:
        seconds = run_shape(*run_args)
    return seconds, clock.specs


def _pool(n: int, device: str) -> concurrent.futures.ProcessPoolExecutor:
    """``n`` workers forked from one ``forkserver`` process that imported torch and the kernels once (a spawned
    worker imports them itself: seconds each, sixteen at once). The server never touches CUDA, so its forks may
    create their own contexts."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["dsv4.ops.triton_ops"])
    return concurrent.futures.ProcessPoolExecutor(max_workers=n, mp_context=ctx, initializer=start_worker,
                                                  initargs=(device, dict(os.environ)))


def _each(futures: Iterable[concurrent.futures.Future], bar: Any, total: int, what: str) -> Iterable[Any]:
    """The futures' results as they complete, advancing ``bar`` (a tqdm bar or ``None``)."""
    futures = list(futures)
    if bar is not None:
        bar.reset(total=total)
        bar.set_description(f"warm-up: {what}")
    for f in concurrent.futures.as_completed(futures):
        yield f, f.result()
        if bar is not None:
            bar.update()


def compile_in_workers(n: int, run_args: Callable[[StepShape, list[int]], tuple], shapes: list[StepShape],
                       layers: list[int], device: str, bar: Any = None,
                       meanwhile: Callable[[], None] | None = None) -> WorkerPass:
    """Steps 1 and 2 of the module docstring in a pool of ``n`` workers.

    Args:
        n: worker processes.
        run_args: ``(shape, [layer]) -> run_shape``'s arguments for one task.
        shapes: the step shapes; ``layers``: one layer of each kind (``shape_run.kind_layers``).
        device: the CUDA device the workers compile for.
        bar: a tqdm progress bar to drive, or ``None``.
        meanwhile: work for this process while the workers start and take the census.
    """
    order = sorted(shapes, key=lambda s: -sum(s.num_new))  # largest first: the longest tasks start first
    out = WorkerPass()
    t0 = time.perf_counter()
    try:
        with _pool(n, device) as pool:
            seen: dict[tuple[str, str], KernelSpec] = {}
            tasks = [run_args(shape, layers) for shape in order]  # no compiles: one task per shape, every kind
            out.tasks = len(tasks)
            futures = [pool.submit(census_task, *a) for a in tasks]
            if meanwhile is not None:
                meanwhile()
            for _, (seconds, query_s, specs) in _each(futures, bar, len(tasks), "census"):
                out.census_slowest_s = max(out.census_slowest_s, seconds)
                out.census_cpu_s += seconds
                out.query_s = max(out.query_s, query_s)
                for spec in specs:
                    seen.setdefault((spec.name, spec.key), spec)
            out.census_s = time.perf_counter() - t0
            cost = {name: compile_cost(name) for name, _ in seen}
            out.specs = sorted(seen.values(), key=lambda s: (-cost[s.name], s.name, s.key))
            futures = {pool.submit(compile_task, spec): spec for spec in out.specs}
            for f, (seconds, kernel_s, launched) in _each(futures, bar, len(futures), "compile"):
                out.compile_cpu_s += seconds
                out.launcher_cpu_s += seconds - kernel_s
                out.launched.update(launched)
                if seconds > out.slowest_s:
                    out.slowest_s, out.slowest_kernel = seconds, futures[f].name.rsplit(".", 1)[-1]
        return out
    except Exception as e:  # noqa: BLE001 - the census only saves time: the fallback compiles the same kernels
        out.census_error = f"{type(e).__name__}: {e}"[:300]
    out.specs, out.slowest_s = [], 0.0
    tasks = [run_args(shape, [li]) for shape in order for li in layers]  # each kind's compiles in its own task
    out.tasks = len(tasks)
    with _pool(n, device) as pool:
        for _, (seconds, launched) in _each((pool.submit(shape_task, *a) for a in tasks), bar, len(tasks),
                                            "compile"):
            out.slowest_s = max(out.slowest_s, seconds)
            out.launched.update(launched)
    return out
