"""``StepPlan``: every launch decision of a step, built once on the host (``triton_ops.plan_step``), on the CPU.

Plans are made for an H200-like device (``DeviceFacts``: 132 multiprocessors, Hopper kernels) over a CPU cache of
V4-Flash layers, so the documented rules are checked without a GPU: which write launches, which attention kernel
and how many splits for decode and prefill steps; that a plan depends only on the step's fixed-shape geometry;
that a layer refuses a plan made for another shape; and that the plan prints.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import dsv4
from dsv4.config import LayerKind
from dsv4.kernels.device import DeviceFacts

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

H200 = DeviceFacts(kernels=True, sm_count=132, sm90=True, resident_clusters=lambda n: 132 // n)
OFF_HOPPER = DeviceFacts(kernels=True, sm_count=108, sm90=False)


def _flash_cache(requests: int, context: int) -> dsv4.HybridCache:
    cfg = dsv4.ModelConfig.preset("v4-flash")
    per = -(-(context + 4096) // 256)
    cache = dsv4.HybridCache(cfg, layers=[0, 2, 3], max_requests=requests, num_blocks=requests * per, device="cpu")
    for r in range(requests):
        cache.add_request(f"r{r}")
    if context:
        cache.prepare_forward({f"r{r}": context for r in range(requests)})  # positions only
    return cache


def _plan(cache: dsv4.HybridCache, new: int, device: DeviceFacts = H200):
    from dsv4.ops import triton_ops

    batch = cache.prepare_forward({rid: new for rid in cache.active_requests})
    return batch, triton_ops.plan_step(batch, cache, device)


def test_decode_plan_h200() -> None:
    """B=64 decode at 8K context: compressors as leads only (HCA entries in 8 channel slices), CSA's top-k lists
    and HCA's visible entries over Gluon kernels without splits (64 tokens fill the GPU's 132 SMs once)."""
    batch, plan = _plan(_flash_cache(64, 8191), 1)
    csa, hca, swa = (plan.layer(k) for k in (LayerKind.CSA, LayerKind.HCA, LayerKind.SWA))
    assert csa.kernels and csa.write.entry_programs == 0 and not csa.write.separate_entries
    assert csa.write.grid == 64 * 2 + 16 and csa.write.warps == 4  # main + indexer leads, 16 window programs
    assert hca.write.parts == 8 and hca.write.grid == 64 * 8 + 16
    assert swa.write.ratio == 0 and swa.write.grid == 16
    assert csa.attention.mode == "list" and csa.attention.num_compressed == 512
    assert hca.attention.mode == "all" and hca.attention.num_compressed == batch.addressable_entries(128)
    assert swa.attention.mode == "window"
    for lp in (csa, hca, swa):
        assert lp.attention.kernel.startswith("gluon") and lp.attention.keys == "fp8"
        assert lp.attention.splits * lp.attention.tokens * 1 <= 132 or lp.attention.splits == 1


def test_small_batch_decode_splits_and_merges() -> None:
    """B=8 decode at 32K context: too few tokens to fill the GPU, so each token's chunks split; CSA's serial
    Gluon kernel merges them in clusters where the device holds them, the combine kernel otherwise."""
    _, plan = _plan(_flash_cache(8, 32767), 1)
    a = plan.layer(LayerKind.CSA).attention
    assert a.splits > 1 and a.merge in ("cluster", "combine_kernel")
    _, no_clusters = _plan(_flash_cache(8, 32767), 1, DeviceFacts(kernels=True, sm_count=132, sm90=True))
    assert no_clusters.layer(LayerKind.CSA).attention.merge in ("combine_kernel", "none")


def test_prefill_plan_h200() -> None:
    """One 4K prefill chunk: CSA entries in their own launch (one warp per entry), 2 warps for the state launch's
    long step rule, keys dequantized once into BF16 rows for attention."""
    _, plan = _plan(_flash_cache(1, 0), 4096)
    csa = plan.layer(LayerKind.CSA)
    assert csa.write.separate_entries and csa.write.entry_programs == 1024
    assert csa.write.csa_entries_grid == 2 * 1024 + 1024
    assert csa.attention.keys == "bf16"


def test_off_hopper_plan_uses_the_triton_kernel() -> None:
    _, plan = _plan(_flash_cache(8, 1000), 1, OFF_HOPPER)
    assert {plan.layer(k).attention.kernel for k in LayerKind} == {"triton"}


def test_plan_depends_only_on_the_step_shape() -> None:
    """Two steps of the same shape at other positions, slots and blocks get equal plans (a captured CUDA graph
    replays one plan on every later step of its bucket)."""
    cache = _flash_cache(4, 300)
    b1, p1 = _plan(cache, 1)
    b2, p2 = _plan(cache, 1)
    assert b1.start_positions != b2.start_positions and b1.shape_key() == b2.shape_key()
    assert p1 == p2


def test_layer_refuses_a_plan_of_another_shape() -> None:
    cfg = dsv4.ModelConfig.preset("tiny")
    cache = dsv4.HybridCache(cfg, layers=[1], max_requests=2, num_blocks=16, block_size=64)
    for r in ("a", "b"):
        cache.add_request(r)
    layer = dsv4.Attention(dsv4.AttentionWeights.random(cfg, 1, seed=0), cfg, 1, backend="torch")
    b1 = cache.prepare_forward({"a": 5, "b": 3})
    x = torch.randn(8, cfg.hidden_size)
    plan = layer.plan_step(b1, cache)
    layer(x, b1, cache, plan)
    from dsv4.ops import StepPlan

    other = StepPlan("torch", {}, "another step", shape=((1, 1), 1, 64, 16, (4,), ()))
    snap = cache.snapshot()
    b2 = cache.prepare_forward({"a": 1, "b": 1})
    snap = cache.snapshot()
    with pytest.raises(ValueError, match="another step shape"):
        layer(torch.randn(2, cfg.hidden_size), b2, cache, other)
    cache.assert_same(snap)


def test_plan_describes_itself() -> None:
    _, plan = _plan(_flash_cache(64, 8191), 1)
    text = plan.describe()
    for word in ("SWA", "CSA", "HCA", "write", "attention", "B=64"):
        assert word in text, text


def test_projection_plan_h200() -> None:
    """FP8 projections on an H200 (cuBLAS over the quantized values as the fallback): decode steps of 4 and 64 rows
    run the two large projections (``wq_b``, ``wo_b``) and the stacks ``wq_a+wkv``, ``wq_b+indexer.wq_b`` on the
    Triton block GEMM, a prefill chunk none; every launch's tiles divide the weight blocks and split K without
    empty splits; 64 rows take the TMA kernel (activations quantized before), on a persistent grid only unsplit."""
    from dsv4.kernels.project.plan import fp8_projection_shapes

    facts = DeviceFacts(kernels=True, sm_count=132, sm90=True, resident_clusters=lambda n: 132 // n, fp8_gemm="bf16")
    cfg = dsv4.ModelConfig.preset("v4-flash")
    shapes = fp8_projection_shapes(cfg)
    assert shapes["wq_a+wkv"] == (shapes["wq_a"][0] + shapes["wkv"][0], shapes["wq_a"][1])
    assert shapes["wq_b+indexer.wq_b"] == (shapes["wq_b"][0] + shapes["indexer.wq_b"][0], shapes["wq_b"][1])
    large = {shapes["wq_b"], shapes["wo_b"], shapes["wq_a+wkv"], shapes["wq_b+indexer.wq_b"]}
    for requests, new, triton_shapes in ((4, 1, large), (64, 1, large), (1, 2048, set())):
        _, plan = _plan(_flash_cache(requests, 1024), new, facts)
        for kind in (LayerKind.CSA, LayerKind.HCA, LayerKind.SWA):
            proj = plan.layer(kind).projection
            assert proj.rows == requests * new and proj.fallback == "bf16" and not proj.unstacked
            assert set(proj.launches) == triton_shapes, (requests, new)
            for (n, k), launch in proj.launches.items():
                kblocks = -(-k // 128)
                assert 128 % launch.bn == 0 and launch.bm >= min(requests * new, 16)
                assert launch.tma == (requests * new > 16)
                assert launch.programs in ((132,) if launch.tma and launch.split == 1 else (0,))
                assert (launch.split - 1) * -(-kblocks // launch.split) < kblocks  # the last split has blocks
        assert "projections:" in plan.describe()
    _, plan = _plan(_flash_cache(4, 1024), 1, OFF_HOPPER)  # no FP8 GEMM fact: the torch reference's project
    assert plan.layer(LayerKind.CSA).projection is None


def test_projection_ways_where_scaled_mm_works() -> None:
    """With ``torch._scaled_mm`` as the device's FP8 GEMM, a prefill chunk runs ``wq_b`` and ``wo_b`` on it and the
    projections whose outputs the layer quantizes again (the stacks, ``wq_a``, ``wkv``, the indexer's ``wq_b``)
    on the exact BF16 way — so the query stack runs as its parts, the input stack whole; a decode step's Triton
    launches are unchanged, every stack whole."""
    from dsv4.kernels.project.plan import EXACT_SUMS, fp8_projection_shapes

    facts = DeviceFacts(kernels=True, sm_count=132, sm90=True, resident_clusters=lambda n: 132 // n,
                        fp8_gemm="scaled_mm")
    shapes = fp8_projection_shapes(dsv4.ModelConfig.preset("v4-flash"))
    _, prefill = _plan(_flash_cache(1, 1024), 2048, facts)
    _, decode = _plan(_flash_cache(64, 1024), 1, facts)
    for kind in (LayerKind.CSA, LayerKind.HCA, LayerKind.SWA):
        proj = prefill.layer(kind).projection
        assert not proj.launches
        for name, shape in shapes.items():
            assert proj.way(*shape) == ("bf16" if name in EXACT_SUMS else "scaled_mm"), name
        assert not proj.stacked(*shapes["wq_b+indexer.wq_b"]) and proj.stacked(*shapes["wq_a+wkv"])
        assert decode.layer(kind).projection.launches.keys() == {
            shapes[n] for n in ("wq_b", "wo_b", "wq_a+wkv", "wq_b+indexer.wq_b")}
        assert not decode.layer(kind).projection.unstacked
    assert "(bf16 for " in prefill.describe() and "as their parts" in prefill.describe()


def test_projection_shapes_of_a_tensor_parallel_rank() -> None:
    """A rank of 2 holds half the query heads and half the output groups: its ``wq_b`` rows and ``wo_b`` columns
    are the sharded weights' (``AttentionWeights.shard``), and so are its query stack's rows (its ``wq_b`` and the
    whole indexer's), so the plan's launches are found for them."""
    from dsv4.kernels.project.plan import fp8_projection_shapes
    from dsv4.query_stack import query_stack, stack_query_projections

    cfg = dsv4.ModelConfig.preset("v4-flash")
    w = dsv4.AttentionWeights.random(cfg, 2, seed=0).shard(0, 2)
    shapes = fp8_projection_shapes(cfg, heads=cfg.num_heads // 2)
    assert shapes["wq_b"] == tuple(w.wq_b.shape) and shapes["wo_b"] == tuple(w.wo_b.shape)
    stack = query_stack(stack_query_projections(w.for_numerics(dsv4.Numerics.official())))
    assert stack is not None and shapes["wq_b+indexer.wq_b"] == tuple(stack.shape)


def test_input_codes_follow_the_plan() -> None:
    """The engine's residual norm makes the next layer's input codes (``Attention.input_takes_codes``) exactly where
    the step plan gives that layer's input stack ``[W_qa; W_kv]`` a TMA launch of the block GEMM: a decode step of
    17–64 rows on a Hopper device; not 4 rows (the pointer kernel quantizes in every program), not a prefill chunk
    (cuBLAS), not off Hopper, not without an FP8 GEMM."""
    cfg = dsv4.ModelConfig.preset("v4-flash")
    layer = dsv4.Attention(dsv4.AttentionWeights.random(cfg, 0), cfg, 0)
    h200 = DeviceFacts(kernels=True, sm_count=132, sm90=True, resident_clusters=lambda n: 132 // n, fp8_gemm="bf16")
    off_hopper = DeviceFacts(kernels=True, sm_count=108, sm90=False, fp8_gemm="bf16")
    for requests, new, device, want in ((64, 1, h200, True), (32, 1, h200, True), (4, 1, h200, False),
                                        (1, 2048, h200, False), (64, 1, off_hopper, False), (64, 1, H200, False)):
        cache = _flash_cache(requests, 1024)
        _, plan = _plan(cache, new, device)
        assert layer.input_takes_codes(cache, plan) is want, (requests, new, device)
