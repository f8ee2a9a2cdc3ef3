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
    assert [len(s.num_new) for s in shapes] == [c + 1 for c in buckets_g]  # capacity + the pad row


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
