"""``engine.compile_workers``: the warm-up hands each distinct specialisation to exactly one compile task, the
costliest first, and falls back to running every (shape, layer kind) for real when the census fails.

The pool runs in threads here and the tasks are stand-ins (the census of a task is a made-up list of
specialisations; a compile records what it was given), so the bookkeeping is checked on the CPU; the real tasks
run on the GPU in ``tests/kernels/test_census.py`` and ``tests/engine/test_warmup.py``.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import threading
import time

import pytest
import torch

from dsv4.engine import compile_workers
from dsv4.engine.shape_store import StepShape
from dsv4.kernels.census import KernelSpec

KERNELS = {  # name -> compile cost
    "dsv4.kernels.attention.sm90_serial._sparse_attention_sm90_kernel": 300,
    "dsv4.kernels.project.block_gemm._block_fp8_gemm_kernel": 200,
    "dsv4.kernels.write.window.window_entries_kernel": 100,
}


def _spec(name: str, key: str) -> KernelSpec:
    return KernelSpec.from_data(json.dumps({"name": name, "key": key}))


@pytest.fixture
def fake_pool(monkeypatch: pytest.MonkeyPatch):
    """Threads instead of processes; census = a random subset of a fixed spec universe per task."""
    rng = random.Random(0)
    universe = [_spec(n, f"k{i}") for n in KERNELS for i in range(3)]
    calls = {"census": [], "compile": [], "shape": [], "in_flight": 0, "most_in_flight": 0}
    lock = threading.Lock()

    def census_task(*args):
        with lock:
            calls["census"].append(args)
            calls["in_flight"] += 1
            calls["most_in_flight"] = max(calls["most_in_flight"], calls["in_flight"])
        time.sleep(0.01)
        with lock:
            calls["in_flight"] -= 1
        return 3 << 30, 0.2, 0.1, rng.sample(universe, 4)

    def compile_task(spec):
        with lock:
            calls["compile"].append(spec)
        return 0.01 * KERNELS[spec.name], 0.005 * KERNELS[spec.name], [f"{spec.name}[{spec.key}]"]

    def shape_task(*args):
        with lock:
            calls["shape"].append(args)
        return 3 << 30, 0.5, [f"shape{args[-2]}"]

    monkeypatch.setattr(compile_workers, "_pool", lambda n, device: concurrent.futures.ThreadPoolExecutor(n))
    monkeypatch.setattr(compile_workers, "census_task", census_task)
    monkeypatch.setattr(compile_workers, "compile_task", compile_task)
    monkeypatch.setattr(compile_workers, "shape_task", shape_task)
    monkeypatch.setattr(compile_workers, "compile_cost", lambda name: KERNELS[name])
    return calls


SHAPES = [StepShape((1,) * 3, 4), StepShape((64, 1), 8), StepShape((7,), 2)]


SHAPES += [StepShape((2,) * k, 4) for k in range(1, 9)]


def _run(n: int = 4) -> compile_workers.WorkerPass:
    return compile_workers.compile_in_workers(n, lambda shape, kind: ("cfg", kind, shape, "cuda"), SHAPES, [0, 2],
                                              "cuda")


def test_each_specialisation_compiles_once_costliest_first(fake_pool) -> None:
    done = _run()
    assert done.stats.tasks == len(fake_pool["census"]) == len(SHAPES) and not done.stats.census_error
    assert [a[1] for a in fake_pool["census"]] == [[0, 2]] * len(SHAPES)  # one census per shape, every kind
    assert fake_pool["census"][0][2] == max(SHAPES, key=lambda s: sum(s.num_new))  # the largest shape first
    assert done.stats.concurrent_tasks == 4 and fake_pool["most_in_flight"] > 1  # memory to spare: all at once
    assert done.stats.task_gib == 3.0
    compiled = [(s.name, s.key) for s in fake_pool["compile"]]
    assert len(compiled) == len(set(compiled)) == len(done.specs)  # each distinct spec exactly once
    assert {(s.name, s.key) for s in done.specs} == set(compiled)
    costs = [KERNELS[s.name] for s in done.specs]  # the order they are handed out in
    assert costs == sorted(costs, reverse=True)
    assert done.launched == {f"{n}[{k}]" for n, k in compiled}
    assert done.stats.slowest_compile_s == max(costs) * 0.01
    assert done.stats.slowest_kernel == "_sparse_attention_sm90_kernel"
    assert done.stats.compile_cpu_s == pytest.approx(0.01 * sum(costs))
    assert done.stats.launcher_cpu_s == pytest.approx(0.005 * sum(costs))
    assert fake_pool["shape"] == [] and (done.stats.census_slowest_s, done.stats.census_query_s) == (0.2, 0.1)


def test_a_failed_census_falls_back_to_running_every_task(fake_pool, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args):
        raise RuntimeError("worker died")

    monkeypatch.setattr(compile_workers, "census_task", broken)
    done = _run()
    assert "worker died" in done.stats.census_error
    assert done.specs == [] and fake_pool["compile"] == []
    assert len(fake_pool["shape"]) == len(SHAPES) * 2  # one task per shape and kind
    assert done.stats.slowest_compile_s == 0.5
    assert {a[1][0] for a in fake_pool["shape"]} == {0, 2}
    assert done.launched == {f"shape{s}" for s in SHAPES}


def _worker_view(name: str) -> tuple[str | None, bool]:
    import sys

    return os.environ.get(name), "dsv4.ops.triton_ops" in sys.modules


def test_workers_take_the_engine_s_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fork server keeps the environment it started with; each pool's workers get the engine's current one
    (a run's ``--triton-cache``), with the kernels imported."""
    for value in ("first", "second"):
        monkeypatch.setenv("DSV4_TEST_WORKER_ENV", value)
        with compile_workers._pool(1, "cpu") as pool:
            assert pool.submit(_worker_view, "DSV4_TEST_WORKER_ENV").result(timeout=300) == (value, True)


def test_a_task_out_of_device_memory_runs_again_with_fewer_at_once(fake_pool, monkeypatch) -> None:
    """Tasks beside the engine's weights may not all fit: one that runs out of memory goes back in the queue and
    halves the tasks at once; every shape is still taken exactly once."""
    real = compile_workers.census_task
    fits = 2
    failed = []
    lock = threading.Lock()
    held = [0]

    def census(*args):
        with lock:
            held[0] += 1
            crowded = held[0] > fits
        try:
            if crowded:
                failed.append(args[2])
                raise torch.OutOfMemoryError("CUDA out of memory (test)")
            time.sleep(0.02)  # held while the next ones start
            return real(*args)
        finally:
            with lock:
                held[0] -= 1

    monkeypatch.setattr(compile_workers, "census_task", census)
    done = _run(n=8)
    assert failed and done.stats.concurrent_tasks <= fits and not done.stats.census_error
    assert sorted(map(str, (a[2] for a in fake_pool["census"]))) == sorted(map(str, SHAPES))  # each once


def test_out_of_memory_with_one_task_at_once_is_an_error(fake_pool, monkeypatch) -> None:
    def census(*args):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(compile_workers, "census_task", census)
    done = _run(n=4)  # the census gives up; the fallback runs every (shape, kind) for real
    assert "OutOfMemoryError" in done.stats.census_error and len(fake_pool["shape"]) == len(SHAPES) * 2
