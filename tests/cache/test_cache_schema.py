"""Per-layer cache geometry, bytes per token and the capacity planner (dsv4.cache.schema)."""

import pytest
import torch

from dsv4.cache import HybridCache, InvalidPlanError, LayerCacheSchema, bytes_per_token, layer_schemas, plan_capacity
from dsv4.config import LayerKind, ModelConfig
from dsv4.numerics import Numerics


def test_tiny_schemas():
    cfg = ModelConfig.preset("tiny")
    s = {x.layer_idx: x for x in layer_schemas(cfg, range(cfg.num_attention_layers))}
    assert [s[i].kind for i in range(5)] == [LayerKind.SWA, LayerKind.CSA, LayerKind.HCA, LayerKind.CSA, LayerKind.SWA]
    assert [s[i].ratio for i in range(5)] == [0, 4, 16, 4, 0]
    assert [s[i].entries_per_block for i in range(5)] == [0, 64, 16, 64, 0]
    csa, hca, swa = s[1], s[2], s[0]
    assert csa.kv_page_bytes == -(-64 * 584 // 576) * 576 and csa.index_page_bytes == 64 * 68
    assert hca.kv_page_bytes == -(-16 * 584 // 576) * 576 and hca.index_page_bytes == 0
    assert swa.pool_bytes_per_block == 0 and swa.bytes_per_token == 0
    specs = {t.name: t for t in csa.tensor_specs()}
    assert specs["tail_kv"].shape == (4, 1024) and specs["tail_gate"].fill == float("-inf")
    assert specs["prev_kv"].shape == (4, 512) and specs["prev_gate"].shape == (4, 512)
    assert specs["index_tail_kv"].shape == (4, 256) and specs["index_prev_gate"].shape == (4, 128)
    assert specs["ring"].shape == (csa.kv_storage.page_bytes(16),) and specs["ring_positions"].fill == -1
    assert specs["ring_positions"].dtype == torch.int32
    assert specs["kv_pages"].scope == "block" and specs["index_pages"].scope == "block"
    hspecs = {t.name: t for t in hca.tensor_specs()}
    assert hspecs["tail_kv"].shape == (16, 512) and "prev_kv" not in hspecs and "index_pages" not in hspecs
    assert {t.name for t in swa.tensor_specs()} == {"ring", "ring_positions"}
    # bytes per request / per block are the sums of the specs
    assert csa.state_bytes_per_request == sum(t.nbytes for t in csa.tensor_specs() if t.scope == "request")
    assert csa.pool_bytes_per_block == csa.kv_page_bytes + csa.index_page_bytes


def test_block_size_must_be_multiple_of_ratios():
    cfg = ModelConfig.preset("tiny")
    with pytest.raises(InvalidPlanError, match="block_size 24 must be a positive multiple of layer 2's compression ratio 16"):
        layer_schemas(cfg, block_size=24)
    LayerCacheSchema.build(cfg, 1, block_size=24)  # fine for the CSA layer (ratio 4)


def test_bytes_per_token_flash_pro():
    for name, n_csa, n_hca, spec_total in (("v4-flash", 21, 20, 3514.25), ("v4-pro", 30, 31, 5031.4)):
        cfg = ModelConfig.preset(name)
        kinds = cfg.layer_kinds[: cfg.num_layers]
        assert sum(k is LayerKind.CSA for k in kinds) == n_csa and sum(k is LayerKind.HCA for k in kinds) == n_hca
        # 584-B KV entry, 68-B MXFP4 key; CSA m = 4, HCA m' = 128 (SPEC §7.3)
        derived = n_csa * (584 + 68) / 4 + n_hca * 584 / 128
        assert bytes_per_token(cfg) == pytest.approx(derived, rel=0, abs=1e-9)
        assert bytes_per_token(cfg) == pytest.approx(spec_total, rel=0.01)
    flash = ModelConfig.preset("v4-flash")
    assert bytes_per_token(flash) == pytest.approx(3514.25)
    # other formats: fp32 KV + fp32 keys; per-layer subset; MTP layer (SWA) adds nothing
    assert bytes_per_token(flash, numerics="exact") == pytest.approx(21 * (2048 + 512) / 4 + 20 * 2048 / 128)
    assert bytes_per_token(flash, layers=[2]) == pytest.approx((584 + 68) / 4)
    assert bytes_per_token(flash, layers=range(flash.num_attention_layers)) == bytes_per_token(flash)
    nv = Numerics.official().with_formats(kv_format="fp8_per_token", index_format="nvfp4")
    assert bytes_per_token(flash, layers=[2, 3], numerics=nv) == pytest.approx((580 + 72) / 4 + 580 / 128)


def test_plan_capacity_consistent_and_monotone():
    cfg = ModelConfig.preset("v4-flash")
    ctx = 32768
    prev = None
    for gib in (1, 2, 4, 8, 16, 64):
        p = plan_capacity(cfg, gib << 30, ctx)
        assert p.bytes_per_request == p.fixed_bytes_per_request + p.blocks_per_request * p.pool_bytes_per_block
        assert p.blocks_per_request == ctx // 256
        assert p.max_requests == (gib << 30) // p.bytes_per_request
        assert p.max_requests * p.bytes_per_request <= gib << 30 < (p.max_requests + 1) * p.bytes_per_request
        if prev is not None:
            assert p.max_requests >= prev.max_requests and p.max_context >= prev.max_context
        prev = p
    # the pool growth per block is bytes_per_token × block_size plus page padding (≤ one 576-B row per KV page)
    p = plan_capacity(cfg, 1 << 30, ctx)
    n_layers = 41 + 21  # KV pages of 41 compressed layers + 21 index pages
    assert p.bytes_per_token * 256 <= p.pool_bytes_per_block <= p.bytes_per_token * 256 + 576 * n_layers
    # matches what HybridCache actually allocates
    tiny = ModelConfig.preset("tiny")
    plan = plan_capacity(tiny, 4 << 20, 1000, layers=[1, 2])
    cache = HybridCache(tiny, layers=[1, 2], max_requests=2, num_blocks=3)
    assert cache.memory_bytes() == 2 * plan.fixed_bytes_per_request + 3 * plan.pool_bytes_per_block
    # max_context: the longest request that fits, with block rounding (needs ≤ n blocks ⇔ end ≤ n·bs + m_min − 1)
    n = (plan.memory_bytes - plan.fixed_bytes_per_request) // plan.pool_bytes_per_block
    assert plan.max_context == n * 256 + 3
    assert plan_capacity(tiny, 4 << 20, plan.max_context, layers=[1, 2]).bytes_per_request <= 4 << 20
    assert plan_capacity(tiny, 4 << 20, plan.max_context + 1, layers=[1, 2]).bytes_per_request > 4 << 20
    # not even the state fits
    assert plan_capacity(tiny, 10, 100).max_context == 0 and plan_capacity(tiny, 10, 100).max_requests == 0
    with pytest.raises(InvalidPlanError, match="context_len"):
        plan_capacity(tiny, 1 << 20, tiny.max_position + 1)
