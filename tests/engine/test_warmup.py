"""Ahead-of-time compilation (``dsv4.engine.warmup``): the step shapes it plans are the ones the run launches.

The oracle is the run itself: every ``StepBatch`` the engine prepares is recorded, and the shapes the host replay
(on a ``meta``-device cache) predicted must be exactly those. On CUDA, a warmed run compiles nothing inside its
steps.
"""

from __future__ import annotations

import pytest
import torch

import dsv4
from dsv4.cache import HybridCache
from dsv4.engine import Engine, EngineConfig, make_requests
from dsv4.engine.graphs import default_batch_sizes
from dsv4.engine.warmup import StepShape, WarmupReport, graph_shapes, plan_step_shapes, warm_up

TINY = dsv4.ModelConfig.preset("tiny")


def _record_step_shapes(monkeypatch: pytest.MonkeyPatch, ratios: list[int]) -> list[tuple[tuple, bool]]:
    """Patch ``HybridCache.prepare_forward`` to record (shape key, decode-only) of every step prepared."""
    seen: list[tuple[tuple, bool]] = []
    original = HybridCache.prepare_forward

    def recording(self, plan, **kw):
        batch = original(self, plan, **kw)
        if batch.block_tables.device.type != "meta":
            shape = StepShape(tuple(batch.num_new), int(batch.block_tables.shape[1]))
            seen.append((shape.key(ratios), all(n == 1 for n in batch.num_new) and not batch.prefix_captures))
        return batch

    monkeypatch.setattr(HybridCache, "prepare_forward", recording)
    return seen


@pytest.mark.parametrize("seed", [0, 1])
def test_planned_shapes_are_the_run_s_shapes(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    ratios = sorted({TINY.ratio(li) for li in range(TINY.num_layers) if TINY.ratio(li)})
    eng = Engine(TINY, config=EngineConfig(device="cpu", max_running=3, max_batched_tokens=96, block_size=64,
                                           seed=seed, warmup=False))
    reqs = make_requests(7, "uniform:8:200", "uniform:1:12", seed=seed)
    seen = _record_step_shapes(monkeypatch, ratios)
    eng.run(reqs)
    eager, buckets = plan_step_shapes(eng, make_requests(7, "uniform:8:200", "uniform:1:12", seed=seed))
    assert buckets == []  # no graphs on the CPU: every step is eager
    assert {s.key(ratios) for s in eager} == {key for key, _ in seen}
    assert len(eager) == len({key for key, _ in seen})

    # with graphs, each decode-only step maps to the smallest bucket that holds it; the rest stay eager
    monkeypatch.setattr(Engine, "_want_graphs", lambda self: True)
    eager_g, buckets_g = plan_step_shapes(eng, make_requests(7, "uniform:8:200", "uniform:1:12", seed=seed))
    sizes = default_batch_sizes(3)
    assert buckets_g == sorted({next(c for c in sizes if c >= key[1]) for key, decode in seen if decode})
    assert {s.key(ratios) for s in eager_g} == {key for key, decode in seen if not decode}
    shapes = graph_shapes(eng, reqs, buckets_g)
    assert [len(s.num_new) for s in shapes] == list(buckets_g)  # one row per request of the bucket


def test_warm_up_on_the_cpu_only_plans() -> None:
    eng = Engine(TINY, config=EngineConfig(device="cpu", max_running=2, max_batched_tokens=64, block_size=64))
    report = warm_up(eng, make_requests(3, 40, 3, seed=0))
    assert report.eager_shapes > 0 and report.compile.workers == 0 and report.kernels_loaded == 0
    stats = eng.run(make_requests(3, 40, 3, seed=0))
    assert stats.summary()["warmup"] == {}  # the torch backend has nothing to warm: auto leaves it off


def test_engine_config_rejects_a_non_bool_warmup() -> None:
    with pytest.raises(TypeError, match="warmup"):
        EngineConfig(warmup="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warmed_run_compiles_nothing_inside_its_steps(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a cold cache: the workers compile
    config = EngineConfig(device="cuda", max_running=4, max_batched_tokens=128, block_size=64, warmup=True)
    for cold in (True, False):
        eng = Engine(TINY, config=config)
        stats = eng.run(make_requests(6, "uniform:16:200", 24, seed=6))
        s = stats.summary()
        assert s["warmup"]["error"] == ""
        assert s["warmup"]["warm_start"] is not cold  # the second run finds the manifest
        c = s["warmup"]["compile"]
        if cold:
            assert c["tasks"] > 0 and c["slowest_compile_s"] > 0 and c["workers"] > 0
            assert c["specialisations"] > 0 and c["census_error"] == "", s["warmup"]
        else:
            assert c["workers"] == 0
        assert "warm-up" in WarmupReport.from_dict(s["warmup"]).describe()
        assert s["warmup"]["load_errors"] == [] and s["warmup"]["load_compiles"] == [], s["warmup"]
        assert s["warmup"]["eager_shapes"] > 0
        assert s["jit_kernels"] == 0, s["jit_s"]
        assert s["graph_buckets"] == s["warmup"]["graph_buckets"]


def test_each_planned_shape_runs_on_a_synthetic_cache() -> None:
    """What the compile workers do, on the CPU with the torch backend: one layer of each kind over each shape."""
    from dsv4.engine.shape_run import kind_layers, run_shape

    eng = Engine(TINY, config=EngineConfig(device="cpu", max_running=3, max_batched_tokens=96, block_size=64))
    reqs = make_requests(4, "uniform:8:150", 3, seed=2)
    eager, _ = plan_step_shapes(eng, reqs)
    shapes = eager + graph_shapes(eng, reqs, [1, 2])
    layers = kind_layers(TINY, eng.layer_ids)
    assert {TINY.layer_kind(li) for li in layers} == {TINY.layer_kind(li) for li in eng.layer_ids}
    for s in shapes:
        assert run_shape(TINY, layers, "official", "torch", 64, s, "cpu") > 0


def test_warm_up_s_cuda_path_records_and_reloads_its_specialisations(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path) -> None:
    """``warm_up``'s CUDA path on the CPU, its GPU parts stood in: the workers' specialisations are loaded into the
    process and written to the manifest; a second warm-up finds the manifest, runs no workers and loads the same
    specialisations from it; a manifest entry that fails to load is named and skipped (the GPU test above runs the
    real thing)."""
    import json
    import types

    from dsv4.engine import warmup
    from dsv4.engine.compile_workers import WorkerPass, WorkerStats
    from dsv4.kernels import census
    from dsv4.kernels.census import KernelSpec

    specs = [KernelSpec.from_data(json.dumps({"name": f"dsv4.kernels.k{i}", "key": f"key{i}"})) for i in range(3)]
    shapes = [StepShape((5, 1), 2), StepShape((1,), 1)]
    loaded, workers_runs = [], []

    def fake_workers(n, run_args, shapes_, layers, device, bar=None, meanwhile=None):
        workers_runs.append((n, [run_args(s, layers) for s in shapes_]))
        return WorkerPass(WorkerStats(workers=n, tasks=len(shapes_), specialisations=len(specs)), list(specs),
                          {"launched"})

    gone: set[str] = set()

    def fake_compile_spec(spec):
        if spec.key in gone:
            raise RuntimeError("gone from the disk cache")
        loaded.append(spec.key)

    monkeypatch.setattr(warmup, "stored_step_shapes", lambda engine, requests: (shapes, [], False))
    monkeypatch.setattr(warmup, "_manifest_path", lambda engine, s: str(tmp_path / "dsv4-warmup" / "m.json"))
    monkeypatch.setattr(warmup, "compile_in_workers", fake_workers)
    monkeypatch.setattr(census, "compile_spec", fake_compile_spec)
    engine = types.SimpleNamespace(device=torch.device("cuda"), backend="triton", parallel=None, cfg=TINY,
                                   layer_ids=list(range(TINY.num_layers)), numerics=dsv4.Numerics.official(),
                                   config=EngineConfig(block_size=64))

    requests = make_requests(2, 16, 2, seed=0)
    cold = warm_up(engine, requests, workers=2)
    assert not cold.warm_start and cold.error == "" and cold.compile.workers == 2 and cold.compile.tasks == 2
    assert loaded == ["key0", "key1", "key2"] and cold.kernels_loaded == 0  # loaded here, nothing compiled
    assert workers_runs[0][0] == 2 and [a[-2] for a in workers_runs[0][1]] == shapes
    manifest = json.loads((tmp_path / "dsv4-warmup" / "m.json").read_text())
    assert [KernelSpec.from_data(d) for d in manifest["specs"]] == specs
    assert WarmupReport.from_dict(manifest["report"]) == cold

    gone.add("key2")
    warm = warm_up(engine, requests, workers=2)
    assert warm.warm_start and warm.compile.workers == 0 and len(workers_runs) == 1
    assert loaded == ["key0", "key1", "key2", "key0", "key1"]  # the manifest's list; key2 failed to load
    assert len(warm.load_errors) == 1 and "gone from the disk cache" in warm.load_errors[0]
    assert "failed to load" in warm.describe()
