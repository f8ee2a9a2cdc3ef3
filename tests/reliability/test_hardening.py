"""Issue 35 behaviours beyond the one-call rows of docs/errors.md: the NaN policies (rollback then retry, device-side
flags), the step accounting around CUDA-graph replays (claim_step, pad tickets), snapshots (checksum through
serialisation, data a snapshot lacks), the CLI's help and ``dsv4 bench`` on a CPU."""

from __future__ import annotations

import copy
import io
import textwrap
from pathlib import Path

import pytest
import torch

import dsv4
from dsv4.cache import HybridCache, NonFiniteError, StaleBatchError, StepOrderError
from dsv4.engine.graphs import pad_step_batch
from dsv4.layer import Attention

TINY = dsv4.ModelConfig.preset("tiny")
LAYERS = (0, 1, 2)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def weights() -> dict[int, dsv4.AttentionWeights]:
    return {li: dsv4.AttentionWeights.random(TINY, li, seed=40 + li) for li in LAYERS}


def new_cache(**kw) -> HybridCache:
    args = dict(layers=LAYERS, max_requests=3, num_blocks=8, block_size=16)
    args.update(kw)
    return HybridCache(TINY, **args)


def busy(weights, **layer_kw) -> tuple[HybridCache, dict[int, Attention]]:
    """Requests a (25 tokens) and b (9) run through every layer."""
    cache = new_cache()
    layers = {li: Attention(copy.deepcopy(w), TINY, li, backend="torch", **layer_kw) for li, w in weights.items()}
    for rid in "ab":
        cache.add_request(rid)
    batch = cache.prepare_forward({"a": 25, "b": 9})
    x = torch.randn(34, TINY.hidden_size, generator=torch.Generator().manual_seed(1))
    for layer in layers.values():
        layer(x, batch, cache)
    return cache, layers


def test_rolled_back_step_then_retry_equals_a_clean_run(weights) -> None:
    """A step refused for NaN / Inf (finite inputs overflowing) writes nothing: the same batch then runs with good
    input, and every output and cache byte equals a twin that never saw the bad input."""
    (seen, layers), (twin, twin_layers) = busy(weights), busy(weights)
    bs = [c.prepare_forward({"a": 3, "b": 1}) for c in (seen, twin)]
    x = torch.randn(4, TINY.hidden_size)
    for li in LAYERS:
        before = seen.snapshot()
        with pytest.raises(NonFiniteError, match="overflowed"):
            layers[li](x.sign() * 3e38, bs[0], seen)
        seen.assert_same(before)
        assert torch.equal(layers[li](x, bs[0], seen), twin_layers[li](x, bs[1], twin))
    assert not seen.differences(twin.snapshot())


def test_flag_policy_records_the_request_without_a_sync_and_spares_the_others(weights) -> None:
    """``nan_policy="flag"``: the step runs (no host check), the affected request is flagged on the device, the
    other request's outputs are exact; releasing the request clears its flag."""
    cache, layers = busy(weights, check_inputs=False, nan_policy="flag")
    clean_cache, clean_layers = busy(weights)
    assert cache.nonfinite_requests() == []
    x = torch.randn(4, TINY.hidden_size)
    bad = x.clone()
    bad[0, 0] = float("nan")  # request a's first token
    b1, b2 = cache.prepare_forward({"a": 3, "b": 1}), clean_cache.prepare_forward({"a": 3, "b": 1})
    for li in LAYERS:
        y = layers[li](bad, b1, cache)
        assert torch.equal(y[3], clean_layers[li](x, b2, clean_cache)[3])  # b is untouched
    assert cache.nonfinite_requests() == ["a"]
    cache.release("a")
    assert cache.nonfinite_requests() == [] and int(cache.nonfinite.sum()) == 0


def test_flag_policy_detects_weights_changed_after_build(weights) -> None:
    cache, layers = busy(weights, nan_policy="flag")
    layers[2].weights.compressor.wkv[0, 0] = float("inf")
    layers[2].reload_weights()  # a step computes with the device copy made at its first step
    batch = cache.prepare_forward({"a": 16})  # closes HCA windows: entries reach the pool
    for li in LAYERS:
        layers[li](torch.randn(16, TINY.hidden_size), batch, cache)
    assert cache.nonfinite_requests() == ["a"]


def test_claim_step_accounts_for_a_replayed_step(weights) -> None:
    """The graph path: the real batch is claimed for every layer before the replay; its step is then complete
    (the next prepare_forward is allowed, no data is marked missing), and a layer can no longer run it."""
    cache, layers = busy(weights)
    batch = cache.prepare_forward({"a": 1, "b": 1})
    assert cache.claim_step(batch) == [0, 1, 2]
    with pytest.raises(StepOrderError, match="already ran"):
        layers[1](torch.randn(2, TINY.hidden_size), batch, cache)
    nxt = cache.prepare_forward({"a": 1})
    layers[0](torch.randn(1, TINY.hidden_size), nxt, cache)  # accepted: nothing missing


def test_pad_tickets_run_freely_and_copies_carry_the_step(weights) -> None:
    """A static batch of pad rows only is not accounted (capture warm-ups run it repeatedly); copying the current
    step into it hands it that step's ticket, so eager runs of it are accounted like the step itself."""
    cache, layers = busy(weights)
    cache.add_request("pad")
    cache.claim_step(cache.prepare_forward({"pad": 16}))
    pad_slot, pad_block = cache.slot("pad"), cache.block_table("pad")[0]
    static = pad_step_batch(cache, [], [], 3, 1, 4, pad_slot, pad_block)
    for _ in range(2):
        for li in LAYERS:
            layers[li](torch.randn(3, TINY.hidden_size), static, cache)
    batch = cache.prepare_forward({"a": 1, "b": 1})
    static.copy_(pad_step_batch(cache, ["a", "b"], [1, 1], 3, 1, 4, pad_slot, pad_block))
    assert static.ticket == batch.ticket
    x = torch.randn(3, TINY.hidden_size)
    layers[0](x, static, cache)
    with pytest.raises(StepOrderError, match="already ran"):
        layers[0](x, batch, cache)
    with pytest.raises(StepOrderError, match=r"cannot prepare_forward now"):
        cache.prepare_forward({"a": 1})
    with pytest.raises(StaleBatchError, match="not the cache's current step"):
        pad_step_batch(cache, ["b", "a"], [1, 1], 3, 1, 4, pad_slot, pad_block)


def test_snapshot_checksum_survives_serialisation(weights) -> None:
    """A snapshot written with torch.save and read back restores bit-identically; its checksum covers the bytes."""
    cache, _ = busy(weights)
    snap = cache.save_request("a")
    buf = io.BytesIO()
    torch.save(snap, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert back.checksum == snap.checksum and len(snap.checksum) == 64
    cache.release("a")
    cache.restore_request("a", back)
    for (li, name), t in snap.state.items():
        assert torch.equal(cache.state.tensors[li][name][cache.slot("a")], t)


def test_snapshot_between_prepare_and_layers_carries_the_gap(weights) -> None:
    """Saved after prepare_forward and before the layers ran that step: the snapshot says so, and the restored
    request is refused by the layers instead of computing on data it lacks."""
    cache, layers = busy(weights)
    cache.prepare_forward({"a": 2})
    snap = cache.save_request("a")
    assert snap.missing is not None and "no layer had run it" in snap.missing
    cache.restore_request("a2", snap)
    batch = cache.prepare_forward({"a2": 1})
    with pytest.raises(StepOrderError, match="lacks cache data"):
        layers[0](torch.randn(1, TINY.hidden_size), batch, cache)


def test_cli_help_shows_real_defaults_and_every_option_has_help() -> None:
    from dsv4.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in sub.choices.items():
        text = p.format_help()
        assert "default: None" not in text and "(default: False)" not in text, name
        for action in p._actions:
            assert action.help, f"dsv4 {name} {action.option_strings}: no help"
            assert (action.help or "").count("default") <= 1, f"dsv4 {name} {action.option_strings}: default twice"


def test_bench_on_cpu_says_what_needs_a_gpu_and_writes_outside_the_checkout(tmp_path: Path, capsys, monkeypatch) -> None:
    """Scripts that declare REQUIRES_CUDA are skipped with one line each (no CUDA errors); the results go to a new
    temporary directory, never into the checkout."""
    from dsv4.cli import main

    bdir = tmp_path / "benchmarks"
    bdir.mkdir()
    (bdir / "bench_gpu_only.py").write_text("REQUIRES_CUDA = True\nimport torch\ntorch.cuda.init()\n")
    (bdir / "bench_cpu.py").write_text(textwrap.dedent("""
        def run():
            return [{"name": "cpu row", "us": 1.0}]
    """))
    from dsv4.bench import suite

    # the roofline measurement (seconds of CPU GEMMs) is not what this test is about
    monkeypatch.setattr(suite.Roofline, "measure", classmethod(lambda cls, device: cls(1e9, 1e12, float("nan"))))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    assert main(["bench", "--device", "cpu", "--quick", "--dir", str(bdir), "--no-e2e"]) == 0
    text = capsys.readouterr().out
    assert "skipping bench_gpu_only: needs a CUDA GPU" in text and "skipped: needs a CUDA GPU" in text
    assert "cpu row" in text and "CUDA error" not in text and "Traceback" not in text
    written = list((tmp_path / "tmp").glob("dsv4-bench-*/bench-*.json"))
    assert len(written) == 1


@pytest.mark.gpu
def test_flag_policy_inside_a_cuda_graph() -> None:
    """``nan_policy="flag"`` is graph-safe: a decode step of the Triton backend captured once on a pad-only static
    batch (capture fails on any host sync), replayed per step after ``claim_step``; a NaN fed to request a on one
    replay shows in ``nonfinite_requests`` after the replay, and only for a."""
    from dsv4.engine.graphs import reserve_pad

    dev = torch.device("cuda", torch.cuda.current_device())
    li = 1  # CSA: ring, compressor state and pool entries all checked
    layer = Attention(dsv4.AttentionWeights.random(TINY, li, seed=3), TINY, li, backend="triton", check_inputs=False,
                      nan_policy="flag")
    assert layer.graph_safe(dev)
    cache = HybridCache(TINY, layers=[li], max_requests=4, num_blocks=16, block_size=16, device=dev)
    for rid in "ab":
        cache.add_request(rid)
    layer(torch.randn(40, TINY.hidden_size, device=dev), cache.prepare_forward({"a": 20, "b": 20}), cache)
    pad_slot, pad_block = reserve_pad(cache, "pad")
    rows, width = 3, 8
    static = pad_step_batch(cache, [], [], rows, 1, width, pad_slot, pad_block)
    x_static = torch.zeros(rows, TINY.hidden_size, device=dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):
            layer(x_static, static, cache)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(x_static, static, cache)
    for step in range(6):
        batch = cache.prepare_forward({"a": 1, "b": 1})
        padded = pad_step_batch(cache, ["a", "b"], [1, 1], rows, 1, width, pad_slot, pad_block)
        cache.claim_step(batch)
        static.copy_(padded)
        x = torch.randn(rows, TINY.hidden_size, device=dev)
        if step == 4:
            x[0, 0] = float("nan")
        x_static.copy_(x)
        graph.replay()
        torch.cuda.synchronize(dev)
        assert cache.nonfinite_requests() == ([] if step < 4 else ["a"]), step
