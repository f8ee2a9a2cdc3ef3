"""The warm-up's compile workers (``engine.warmup``, step 2): a run's kernel specialisations compiled across the
machine's cores, each by exactly one worker.

1. *Census*: the workers run each step shape once through one layer of each kind inside a
   ``kernels.census.LaunchCensus`` — the host's work only: no kernel compiles or runs — and return the
   specialisations it launches. The shapes share most of their kernels (the acceptance workload: 81 distinct
   specialisations over 72 shapes).
2. *Compile*: each distinct specialisation is one task, the costliest first (``census.compile_cost``); a worker
   compiles it into Triton's on-disk cache (``census.compile_spec``). No kernel is compiled twice, and a large
   shape's kernels compile side by side instead of one after another inside its task.

Each task builds a layer of each kind and a cache of its shape beside the engine's process, which already holds the
model's weights: a task that runs out of device memory is run again later with half as many at once (``_run_all``).

If the census or a compile task fails (e.g. a worker process dies), ``compile_in_workers`` falls back to running
every (shape, kind) task for real in a fresh pool, which compiles each task's kernels as it launches them.

Workers are forked from a ``forkserver`` that imported the kernels once; each makes its own CUDA context
(``start_worker``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernels.census import KernelSpec, LaunchCensus, compile_cost, compile_spec
from .jit_clock import JitClock
from .shape_run import run_shape
from .shape_store import StepShape

__all__ = ["WorkerPass", "WorkerStats", "census_task", "compile_in_workers", "compile_task", "shape_task",
           "start_worker"]


@dataclass
class WorkerStats:
    """What the compile workers did, in figures (``WarmupReport.compile``; all zero where none ran).

    Attributes:
        workers: worker processes.
        tasks: census tasks (one per shape, every layer kind), or the fallback's (shape, layer kind) runs.
        concurrent_tasks: how many of them ran at once in the end (the workers, or fewer after a task ran out of
            device memory beside the engine's weights).
        task_gib: the most device memory one task held (GiB, torch's allocator, besides its CUDA context).
        specialisations: the distinct kernel specialisations the census found, each compiled by one worker.
        seconds: wall time of the workers' whole pass (their start, the census, the compiles).
        census_s: wall time of the census, the workers' start included.
        census_cpu_s: the census tasks' seconds summed over the workers (the rest of ``census_s`` is their start).
        census_slowest_s: the longest census task (a worker's first builds its layers).
        census_query_s: the longest time a census task spent compiling for device queries (``census.device_query``:
            the attention kernel's occupancy probe, which the engine's process compiles meanwhile).
        compile_cpu_s: the compile tasks' seconds summed over the workers; ``launcher_cpu_s`` the part of them spent
            building the kernels' launchers (C modules) and loading them.
        slowest_compile_s: the longest single compile (after the fallback: the longest (shape, kind) run) — a lower
            bound of the compile phase however many workers.
        slowest_kernel: the kernel of that compile (empty after the fallback).
        census_error: why the census or a compile task failed, if one did (the workers then ran every (shape, kind)
            for real).
    """

    workers: int = 0
    tasks: int = 0
    concurrent_tasks: int = 0
    task_gib: float = 0.0
    specialisations: int = 0
    seconds: float = 0.0
    census_s: float = 0.0
    census_cpu_s: float = 0.0
    census_slowest_s: float = 0.0
    census_query_s: float = 0.0
    compile_cpu_s: float = 0.0
    launcher_cpu_s: float = 0.0
    slowest_compile_s: float = 0.0
    slowest_kernel: str = ""
    census_error: str = ""


@dataclass
class WorkerPass:
    """What ``compile_in_workers`` returns.

    Attributes:
        stats: its figures.
        specs: the distinct specialisations the census found (empty after the fallback).
        launched: every specialisation the workers compiled or loaded, as ``JitClock.specs`` names them.
    """

    stats: WorkerStats
    specs: list[KernelSpec] = field(default_factory=list)
    launched: set[str] = field(default_factory=set)


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


def census_task(*run_args: Any) -> tuple[int, float, float, list[KernelSpec]]:
    """``run_shape(*run_args)`` inside a census: the device memory it held at most (bytes, torch's allocator),
    its seconds, the seconds of the device queries' compiles among them
    (``census.device_query``) and the specialisations it launches (nothing compiles or runs). Its memory is handed
    back after."""
    with _peak_memory(run_args[-1]) as peak, JitClock() as clock, LaunchCensus() as census:
        seconds = run_shape(*run_args)  # the census passes device queries on to the clock
    return peak[0], seconds, clock.seconds, census.specs


def compile_task(spec: KernelSpec) -> tuple[float, float, list[str]]:
    """Compile ``spec`` (or find it on disk) and its launcher: the seconds of both, those of the kernel's compile
    alone, and ``JitClock``'s name for it."""
    with JitClock() as clock:
        t0 = time.perf_counter()
        compile_spec(spec)
        seconds = time.perf_counter() - t0
    return seconds, clock.seconds, clock.specs


def shape_task(*run_args: Any) -> tuple[int, float, list[str]]:
    """The fallback's task: ``run_shape(*run_args)`` for real: the device memory it held at most, its seconds and
    the specialisations it compiled or loaded."""
    with _peak_memory(run_args[-1]) as peak, JitClock() as clock:
        seconds = run_shape(*run_args)
    return peak[0], seconds, clock.specs


@contextmanager
def _peak_memory(device: str) -> Iterator[list[int]]:
    """Measures the torch allocator's peak on ``device`` inside (``[bytes]``; ``[0]`` off CUDA) and returns the
    cached blocks to the device after: a worker holds only its layers between tasks."""
    dev = torch.device(device)
    out = [0]
    if dev.type != "cuda":
        yield out
        return
    torch.cuda.reset_peak_memory_stats(dev)
    try:
        yield out
    finally:
        out[0] = torch.cuda.max_memory_reserved(dev)
        torch.cuda.empty_cache()


def _pool(n: int, device: str) -> concurrent.futures.ProcessPoolExecutor:
    """``n`` workers forked from one ``forkserver`` process that imported torch and the kernels once (a spawned
    worker imports them itself: seconds each, sixteen at once). The server never touches CUDA, so its forks may
    create their own contexts."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["dsv4.ops.triton_ops"])
    return concurrent.futures.ProcessPoolExecutor(max_workers=n, mp_context=ctx, initializer=start_worker,
                                                  initargs=(device, dict(os.environ)))


def _run_all(pool: concurrent.futures.Executor, fn: Callable, tasks: list[tuple], limit: int, bar: Any,
             what: str, meanwhile: Callable[[], None] | None = None) -> Iterator[tuple[tuple, Any, int]]:
    """``(arguments, fn(*arguments), tasks at once)`` of every task as it completes, at most ``limit`` in flight,
    advancing ``bar`` (a tqdm bar or ``None``); ``meanwhile`` runs here once the first tasks are out.

    A task that ran out of device memory goes back in the queue and halves the tasks at once (the engine's process
    already holds the model's weights: V4-Pro's 30 GiB leave room for about ten of its largest shapes' tasks, not
    sixteen); out of memory with one task at once, it raises."""
    if bar is not None:
        bar.reset(total=len(tasks))
        bar.set_description(f"warm-up: {what}")
    queue = collections.deque(tasks)
    pending: dict[concurrent.futures.Future, tuple] = {}
    while queue or pending:
        while queue and len(pending) < limit:
            args = queue.popleft()
            pending[pool.submit(fn, *args)] = args
        if meanwhile is not None:
            meanwhile()
            meanwhile = None
        done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
        for f in done:
            args = pending.pop(f)
            try:
                result = f.result()
            except torch.OutOfMemoryError:
                if limit == 1 and not pending:
                    raise
                limit = max(1, (len(pending) + 1) // 2)
                queue.appendleft(args)
                continue
            if bar is not None:
                bar.update()
            yield args, result, limit


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
    st = WorkerStats(workers=n)
    out = WorkerPass(st)
    t0 = time.perf_counter()
    try:
        with _pool(n, device) as pool:
            tasks = [run_args(shape, layers) for shape in order]  # no compiles: one task per shape, every kind
            st.tasks = len(tasks)
            seen: dict[tuple[str, str], KernelSpec] = {}
            for _, (peak, seconds, query_s, specs), st.concurrent_tasks in _run_all(pool, census_task, tasks, n, bar,
                                                                                     "census", meanwhile):
                st.task_gib = max(st.task_gib, round(peak / 2**30, 2))
                st.census_slowest_s = max(st.census_slowest_s, seconds)
                st.census_cpu_s += seconds
                st.census_query_s = max(st.census_query_s, query_s)
                for spec in specs:
                    seen.setdefault((spec.name, spec.key), spec)
            st.census_s = time.perf_counter() - t0
            cost = {name: compile_cost(name) for name, _ in seen}
            out.specs = sorted(seen.values(), key=lambda s: (-cost[s.name], s.name, s.key))
            st.specialisations = len(out.specs)
            for (spec,), (seconds, kernel_s, launched), _ in _run_all(pool, compile_task, [(s,) for s in out.specs],
                                                                      n, bar, "compile"):
                st.compile_cpu_s += seconds
                st.launcher_cpu_s += seconds - kernel_s
                out.launched.update(launched)
                if seconds > st.slowest_compile_s:
                    st.slowest_compile_s, st.slowest_kernel = seconds, spec.name.rsplit(".", 1)[-1]
        st.seconds = time.perf_counter() - t0
        return out
    except Exception as e:  # noqa: BLE001 - the census only saves time: the fallback compiles the same kernels
        st.census_error = f"{type(e).__name__}: {e}"[:300]
    out.specs, st.specialisations, st.slowest_compile_s, st.slowest_kernel = [], 0, 0.0, ""
    tasks = [run_args(shape, [li]) for shape in order for li in layers]  # each kind's compiles in its own task
    st.tasks = len(tasks)
    with _pool(n, device) as pool:
        for _, (peak, seconds, launched), st.concurrent_tasks in _run_all(pool, shape_task, tasks, n, bar, "compile"):
            st.task_gib = max(st.task_gib, round(peak / 2**30, 2))
            st.slowest_compile_s = max(st.slowest_compile_s, seconds)
            out.launched.update(launched)
    st.seconds = time.perf_counter() - t0
    return out
