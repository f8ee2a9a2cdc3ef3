"""The writes before attention and the ring commit on a second CUDA stream (``LayerPlan.overlap``,
``ops.side_stream.SideStream``).

CPU: the Triton backend's plan overlaps exactly where the device has streams and the writes run as kernels; off
CUDA ``SideStream`` runs its work in place. GPU (marked ``gpu``): a V4-Flash layer of each kind, over prefill
chunks and decode steps of requests whose compressor windows close at different steps, gives the same outputs and
leaves the same cache bytes with the overlap as without it — eagerly, also with the second stream held back a few
milliseconds before its work (what it reads must stay untouched however far the current stream runs ahead), and as
CUDA-graph replays (the fork and join captured as graph edges).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dsv4
from dsv4.cache.snapshot import cache_tensors
from dsv4.config import LayerKind
from dsv4.kernels.device import DeviceFacts
from dsv4.ops import triton_ops
from dsv4.ops.side_stream import SideStream

H200 = DeviceFacts(kernels=True, sm_count=132, sm90=False, fp8_gemm="scaled_mm", streams=True)


def _cache(cfg: dsv4.ModelConfig, li: int, device: str, requests: int = 3) -> dsv4.HybridCache:
    cache = dsv4.HybridCache(cfg, layers=[li], max_requests=requests, num_blocks=8 * requests, device=device)
    for r in range(requests):
        cache.add_request(f"r{r}")
    return cache


@pytest.mark.parametrize("streams", [True, False])
def test_plan_overlaps_where_the_writes_run_as_kernels_on_a_device_with_streams(streams: bool) -> None:
    cfg = dsv4.ModelConfig.preset("v4-flash")
    cache = _cache(cfg, 2, "cpu")  # a CSA layer
    batch = cache.prepare_forward({f"r{r}": 1 for r in range(3)})
    plan = triton_ops.plan_step(batch, cache, device=dataclasses.replace(H200, streams=streams))
    lp = plan.layer(LayerKind.CSA)
    assert lp.write is not None
    assert lp.overlap is streams
    assert any("second stream" in line for line in lp.describe()) is streams
    # the caller's choice: every launch on its own stream
    off = triton_ops.plan_step(batch, cache, device=dataclasses.replace(H200, streams=streams), streams=False)
    assert not off.layer(LayerKind.CSA).overlap and off.layer(LayerKind.CSA).write == lp.write
    # a format the write kernels do not handle: the torch ops write, nothing to overlap
    exact = dsv4.HybridCache(cfg, layers=[2], max_requests=1, num_blocks=8, device="cpu", numerics="exact")
    exact.add_request("r0")
    b = exact.prepare_forward({"r0": 1})
    assert not triton_ops.plan_step(b, exact, device=H200).layer(LayerKind.CSA).overlap


def test_layer_plans_with_or_without_streams() -> None:
    cfg = dsv4.ModelConfig.preset("v4-flash")
    layer = dsv4.Attention(dsv4.AttentionWeights.random(cfg, 2, seed=0), cfg, 2, backend="torch")
    cache = _cache(cfg, 2, "cpu")
    batch = cache.prepare_forward({f"r{r}": 1 for r in range(3)})
    for streams in (True, False):  # the torch backend plans nothing either way
        assert layer.plan_step(batch, cache, streams=streams).layers == {}


def test_side_stream_off_cuda_runs_in_place() -> None:
    calls = []
    with SideStream(torch.device("cpu"), enabled=True) as side:
        assert side.run(lambda a, b: calls.append((a, b)) or a + b, 2, 3) == 5
    assert calls == [(2, 3)]


# ------------------------------------------------------------------------------------------------ GPU
def _gpu_layer(li: int) -> tuple[dsv4.ModelConfig, dsv4.Attention]:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = dsv4.ModelConfig.preset("v4-flash")
    w = dsv4.AttentionWeights.random(cfg, li, seed=11, device="cuda")
    return cfg, dsv4.Attention(w, cfg, li, backend="triton", check_inputs=False, nan_policy="off")


def _assert_same_caches(a: dsv4.HybridCache, b: dsv4.HybridCache, what: str) -> None:
    ta, tb = cache_tensors(a), cache_tensors(b)
    assert ta.keys() == tb.keys()
    for key in ta:
        assert torch.equal(ta[key], tb[key]), f"{what}: cache tensor {key} differs"


def _slow_side_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``SideStream.run`` first keeps its stream busy for a few milliseconds: the current stream runs far ahead,
    so a tensor the side's work reads that the current stream's allocations could take over gets overwritten."""
    run = SideStream.run

    def slow_run(self, fn, *args):
        def late(*a):
            torch.cuda._sleep(10_000_000)  # on the second stream: run() launches fn's work there
            return fn(*a)
        return run(self, late, *args)

    monkeypatch.setattr(SideStream, "run", slow_run)


@pytest.mark.gpu
@pytest.mark.parametrize("slow", [False, True], ids=["", "slow-side"])
@pytest.mark.parametrize("li", [0, 2, 3], ids=["SWA", "CSA", "HCA"])
def test_gpu_overlapped_steps_equal_serial_steps_bit_for_bit(li: int, slow: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, layer = _gpu_layer(li)
    if slow:
        _slow_side_stream(monkeypatch)
    overlapped, serial = _cache(cfg, li, "cuda"), _cache(cfg, li, "cuda")
    g = torch.Generator(device="cuda").manual_seed(li)
    # prefill chunks of different lengths (windows close at different steps), then decode steps
    steps = [{"r0": 300, "r1": 131, "r2": 7}] + [{"r0": 1, "r1": 1, "r2": 1}] * 6
    for n, new in enumerate(steps):
        ba, bb = overlapped.prepare_forward(new), serial.prepare_forward(new)
        plan = triton_ops.plan_step(ba, overlapped)
        assert plan.layer(cfg.layer_kind(li)).overlap
        x = torch.randn(ba.num_tokens, cfg.hidden_size, generator=g, device="cuda").bfloat16()
        ya = layer.forward_with_aux(x, ba, overlapped, plan)
        yb = layer.forward_with_aux(x, bb, serial, triton_ops.plan_step(bb, serial, streams=False))
        assert torch.equal(ya.y, yb.y), f"step {n}: outputs differ"
        assert torch.equal(ya.entry_idx, yb.entry_idx), f"step {n}: selected entries differ"
        _assert_same_caches(overlapped, serial, f"step {n}")


@pytest.mark.gpu
@pytest.mark.parametrize("li", [0, 2, 3], ids=["SWA", "CSA", "HCA"])
def test_gpu_overlapped_graph_replays_equal_serial_ones(li: int) -> None:
    cfg, layer = _gpu_layer(li)
    g = torch.Generator(device="cuda").manual_seed(100 + li)
    prompt = {"r0": 260, "r1": 127, "r2": 128}
    x = torch.randn(3, cfg.hidden_size, generator=g, device="cuda").bfloat16()
    results = []
    for overlap in (True, False):
        cache = _cache(cfg, li, "cuda")
        b = cache.prepare_forward(prompt)
        layer(torch.randn(b.num_tokens, cfg.hidden_size, generator=torch.Generator(device="cuda").manual_seed(1),
                          device="cuda").bfloat16(), b, cache)
        step = cache.repeatable(cache.prepare_forward({r: 1 for r in prompt}))
        plan = triton_ops.plan_step(step, cache, streams=overlap)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer(x, step, cache, plan)  # warm-up outside the capture (compiles, grows the workspace)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = layer(x, step, cache, plan)
        for _ in range(2):
            graph.replay()
        torch.cuda.synchronize()
        results.append((y.clone(), {k: t.clone() for k, t in cache_tensors(cache).items()}))
    (ya, ta), (yb, tb) = results
    assert torch.equal(ya, yb)
    for key in ta:
        assert torch.equal(ta[key], tb[key]), f"cache tensor {key} differs"
