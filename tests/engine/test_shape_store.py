"""The stored replay (``dsv4.engine.shape_store``): a second warm-up of the same workload reads the step shapes the
replay found instead of replaying; any change the replay depends on misses; an entry that is not whole, not this
workload's, or not possible is never trusted.

The oracle is the replay itself (``plan_step_shapes``, run fresh): the stored shapes must equal it exactly (order
included), and whatever is on disk, ``step_shapes`` must return what it returns.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys

import pytest

import dsv4
from dsv4.engine import Engine, EngineConfig, make_requests
from dsv4.engine import shape_store, warmup
from dsv4.engine.shape_store import _checksum, entry_path, step_shapes_key
from dsv4.engine.warmup import plan_step_shapes, warm_up
from dsv4.engine.warmup import stored_step_shapes as step_shapes

TINY = dsv4.ModelConfig.preset("tiny")
CONFIG_ARGS = dict(device="cpu", max_running=3, max_batched_tokens=96, block_size=64, seed=0)
CONFIG = EngineConfig(**CONFIG_ARGS)


def _requests(n: int = 7, seed: int = 0) -> list:
    return make_requests(n, "uniform:8:200", "uniform:1:12", seed=seed)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(TINY, config=CONFIG)


@pytest.fixture(autouse=True)
def graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps as CUDA graphs (as on CUDA with Triton): the replay then finds graph buckets too."""
    monkeypatch.setattr(Engine, "_want_graphs", lambda self: True)


def test_a_second_warm_up_reads_what_the_replay_found(engine: Engine, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    truth = plan_step_shapes(engine, _requests())
    assert truth[0] and truth[1]  # eager shapes and graph buckets both
    first = warm_up(engine, _requests())
    assert not first.shapes_stored
    monkeypatch.setattr(warmup, "plan_step_shapes", lambda *a: pytest.fail("replayed although stored"))
    second = warm_up(engine, _requests())
    assert second.shapes_stored and second.graph_buckets == truth[1] and second.eager_shapes == len(truth[0])
    eager, buckets, stored = step_shapes(engine, _requests())
    assert stored and (eager, buckets) == truth


def test_the_stored_shapes_are_those_a_replay_in_another_process_finds(engine: Engine, tmp_path) -> None:
    """The entry is written by a fresh interpreter (another string-hash seed): the scheduling is the same there."""
    code = ("import dsv4; from dsv4.engine import Engine, EngineConfig, make_requests; "
            "from dsv4.engine.warmup import stored_step_shapes as step_shapes; "
            "Engine._want_graphs = lambda self: True; "
            f"eng = Engine(dsv4.ModelConfig.preset('tiny'), config=EngineConfig(**{CONFIG_ARGS!r})); "
            "assert not step_shapes(eng, make_requests(7, 'uniform:8:200', 'uniform:1:12', seed=0), "
            f"{str(tmp_path)!r})[2]")
    src = os.path.join(os.path.dirname(dsv4.__file__), "..")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": src,
                                                                   "PYTHONHASHSEED": "12345"})
    eager, buckets, stored = step_shapes(engine, _requests(), str(tmp_path))
    assert stored and (eager, buckets) == plan_step_shapes(engine, _requests())


def _changed(engine: Engine, change: str) -> tuple[Engine, list]:
    """``engine`` and the requests with one thing the replay reads changed."""
    eng, reqs = copy.copy(engine), _requests()
    if change == "a request's length":
        reqs[3] = dataclasses.replace(reqs[3], gen_len=reqs[3].gen_len + 1)
    elif change == "one request more":
        reqs = _requests(8)
    elif change == "an arrival step":
        reqs[5].arrival_step = 2
    elif change == "the step budget":
        eng.config = dataclasses.replace(CONFIG, max_batched_tokens=64)
    elif change == "the block size":
        eng.config = dataclasses.replace(CONFIG, block_size=128)
    elif change == "max running":
        eng.config = dataclasses.replace(CONFIG, max_running=2)
    elif change == "the graph sizes":
        eng.config = dataclasses.replace(CONFIG, graph_batch_sizes=(3,))
    elif change == "the layers":
        eng.layer_ids = eng.layer_ids[:-1]
    elif change == "the numerics":
        eng.numerics = dsv4.Numerics.exact()
    elif change == "the model":
        eng.cfg = dataclasses.replace(TINY, window=32)
    else:
        raise AssertionError(change)
    return eng, reqs


@pytest.mark.parametrize("change", ["a request's length", "one request more", "an arrival step", "the step budget",
                                    "the block size", "max running", "the graph sizes", "the layers", "the numerics",
                                    "the model"])
def test_a_changed_workload_or_config_misses(engine: Engine, tmp_path, change: str) -> None:
    assert not step_shapes(engine, _requests(), str(tmp_path))[2]
    eng, reqs = _changed(engine, change)
    assert step_shapes_key(eng, reqs) != step_shapes_key(engine, _requests())
    eager, buckets, stored = step_shapes(eng, reqs, str(tmp_path))
    assert not stored and (eager, buckets) == plan_step_shapes(eng, reqs)


def test_a_source_change_misses_and_unread_fields_hit(engine: Engine, tmp_path, monkeypatch) -> None:
    key = step_shapes_key(engine, _requests())
    other = copy.copy(engine)
    other.config = dataclasses.replace(CONFIG, seed=5, vocab=1000, weights="shared")  # not read by the replay
    assert step_shapes_key(other, _requests(seed=0)) == key
    monkeypatch.setattr(shape_store, "source_digest", lambda *parts: b"another tree")
    assert step_shapes_key(engine, _requests()) != key


def _tamper(entry: dict, how: str) -> str | dict:
    """A damaged copy of ``entry`` (a dict, or the file's text)."""
    e = json.loads(json.dumps(entry))
    reseal = True
    if how == "truncated":
        return json.dumps(entry)[:-9]
    if how == "not json":
        return "\x00\xff garbage"
    if how == "a shape changed, checksum stale":
        e["eager"][0][0][0] += 1
        reseal = False
    elif how == "another schema":
        e["schema"] = "dsv4-step-shapes/0"
    elif how == "another key":
        e["key"] = "0" * 64
    elif how == "an extra field":
        e["note"] = "hi"
    elif how == "more tokens than the budget":
        e["eager"][0][0] = [CONFIG.max_batched_tokens + 1]
    elif how == "more requests than max running":
        e["eager"][0][0] = [1] * (CONFIG.max_running + 1)
    elif how == "a zero token count":
        e["eager"][0][0][0] = 0
    elif how == "a bool for an int":
        e["eager"][0][1] = True
    elif how == "a table wider than the longest request":
        e["eager"][0][1] = 10_000
    elif how == "a shape twice":
        e["eager"].append(e["eager"][0])
    elif how == "a bucket that is no graph size":
        e["buckets"] = e["buckets"] + [5]
    elif how == "buckets out of order":
        e["buckets"] = e["buckets"][::-1]
    else:
        raise AssertionError(how)
    if reseal:  # a forger who recomputes the checksum: the content checks must catch it
        e["sha256"] = _checksum({k: e[k] for k in ("schema", "key", "eager", "buckets") if k in e})
    return e


@pytest.mark.parametrize("how", ["truncated", "not json", "a shape changed, checksum stale", "another schema",
                                 "another key", "an extra field", "more tokens than the budget",
                                 "more requests than max running", "a zero token count", "a bool for an int",
                                 "a table wider than the longest request", "a shape twice",
                                 "a bucket that is no graph size", "buckets out of order"])
def test_a_corrupt_or_tampered_entry_is_ignored_and_replaced(engine: Engine, tmp_path, monkeypatch, how: str) -> None:
    truth = plan_step_shapes(engine, _requests())
    assert not step_shapes(engine, _requests(), str(tmp_path))[2]
    path = entry_path(step_shapes_key(engine, _requests()), str(tmp_path))
    with open(path) as f:
        entry = json.load(f)
    bad = _tamper(entry, how)
    with open(path, "w") as f:
        f.write(bad if isinstance(bad, str) else json.dumps(bad))
    replays = []
    monkeypatch.setattr(warmup, "plan_step_shapes", lambda *a: replays.append(1) or plan_step_shapes(*a))
    eager, buckets, stored = step_shapes(engine, _requests(), str(tmp_path))
    assert not stored and replays == [1] and (eager, buckets) == truth
    with open(path) as f:
        assert json.load(f) == entry  # rewritten whole
    assert step_shapes(engine, _requests(), str(tmp_path))[2]


def test_an_entry_of_another_workload_is_not_used(engine: Engine, tmp_path) -> None:
    """A valid entry copied under another workload's name: its key says whose it is."""
    step_shapes(engine, _requests(), str(tmp_path))
    other = _requests(seed=3)
    src, dst = (entry_path(step_shapes_key(engine, r), str(tmp_path)) for r in (_requests(), other))
    os.replace(src, dst)
    eager, buckets, stored = step_shapes(engine, other, str(tmp_path))
    assert not stored and (eager, buckets) == plan_step_shapes(engine, other)


def test_an_unwritable_cache_directory_only_costs_the_replay(engine: Engine, tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    for _ in range(2):
        eager, buckets, stored = step_shapes(engine, _requests(), str(blocker))
        assert not stored and (eager, buckets) == plan_step_shapes(engine, _requests())
