"""Context parallelism without processes: the softmax of a query over keys split into parts, merged by the parts'
log-sum-exp (``distributed.merge``), against one softmax and an FP64 oracle; the CP layout's partitions (entries,
window columns); a CP rank's cache geometry."""

from __future__ import annotations

import pytest
import torch

import dsv4
from dsv4.cache import HybridCache
from dsv4.cache.errors import InvalidPlanError
from dsv4.cache.integrity import canonical_ring_positions
from dsv4.distributed.cp_ops import held_entries, window_columns
from dsv4.distributed.merge import merge_partials, partial_attention
from dsv4.reference.core import attend_with_sink


def _case(seed: int, T: int = 7, H: int = 4, K: int = 40, D: int = 64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g)
    keys = torch.randn(T, K, D, generator=g) * 2
    valid = torch.rand(T, K, generator=g) < 0.7
    valid[0] = False  # a query with no key at all: output 0, lse = the sink
    sink = torch.randn(H, generator=g)
    return q, keys, valid, sink


def _oracle(q, keys, valid, sink, scale):
    """FP64: o = Σ e^z k / (Σ e^z + e^sink), lse = log(Σ e^z + e^sink)."""
    z = torch.einsum("thd,tkd->thk", q.double(), keys.double()) * scale
    z = z.masked_fill(~valid[:, None, :], float("-inf"))
    e = torch.cat((z, sink.double()[None, :, None].expand(z.shape[0], -1, 1)), dim=-1)
    lse = torch.logsumexp(e, dim=-1)
    p = torch.exp(z - lse[..., None])
    return torch.einsum("thk,tkd->thd", p, keys.double()), lse


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_parts_merge_into_one_softmax(parts, seed):
    q, keys, valid, sink = _case(seed)
    scale = q.shape[-1] ** -0.5
    owner = torch.randint(0, parts, keys.shape[:2], generator=torch.Generator().manual_seed(seed + 9))
    owner[1] = 0  # a query whose keys are all in one part: the other parts are empty
    outs = [partial_attention(q, keys, valid & (owner == r), scale, torch.float32) for r in range(parts)]
    o, lse = merge_partials(torch.stack([a for a, _ in outs]), torch.stack([b for _, b in outs]), sink)
    want_o, want_lse = _oracle(q, keys, valid, sink, scale)
    assert float((o.double() - want_o).norm() / want_o.norm()) < 2e-6
    assert float((lse.double() - want_lse).abs().max()) < 2e-5
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.allclose(lse[0], sink)
    one_o, one_lse = attend_with_sink(q, keys, valid, sink, scale, torch.float32, torch.float32)
    assert float((o - one_o).norm() / one_o.norm()) < 2e-6
    assert torch.allclose(lse, one_lse, atol=2e-5, rtol=0)


def test_bf16_probabilities_merge_within_their_rounding():
    """With BF16 probabilities each part rounds relative to its own maximum: the merge stays within that rounding
    of one softmax (2^-8 of the output's scale), never further."""
    q, keys, valid, sink = _case(4)
    scale = q.shape[-1] ** -0.5
    owner = torch.arange(keys.shape[1])[None, :].expand(keys.shape[:2]) % 2
    outs = [partial_attention(q, keys, valid & (owner == r), scale, torch.bfloat16) for r in range(2)]
    o, _ = merge_partials(torch.stack([a for a, _ in outs]), torch.stack([b for _, b in outs]), sink)
    one, _ = attend_with_sink(q, keys, valid, sink, scale, torch.bfloat16, torch.float32)
    assert 0 < float((o - one).norm() / one.norm()) < 2.0**-8


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_entries_and_window_columns_partition(cp):
    for n in (0, 1, 5, 64):
        held = [held_entries(n, r, cp, torch.device("cpu")) for r in range(cp)]
        assert sorted(torch.cat(held).tolist()) == list(range(n))
        assert all(bool((h % cp == r).all()) for r, h in enumerate(held))
    for W in (16, 128):
        for mode in ("split", "first"):
            cols = torch.stack([window_columns(W, r, cp, mode, torch.device("cpu")) for r in range(cp)])
            assert torch.equal(cols.sum(0), torch.ones(W, dtype=torch.long))  # every column on exactly one rank
            if mode == "split":
                assert cols.sum(1).max() - cols.sum(1).min() <= 1
            else:
                assert bool(cols[0].all())


def test_context_parallel_cache_geometry():
    cfg = dsv4.ModelConfig.preset("tiny")
    one = HybridCache(cfg, layers=[0, 1, 2], num_blocks=8, block_size=64)
    ranks = [HybridCache(cfg, layers=[0, 1, 2], num_blocks=8, block_size=64, cp_rank=r, cp_size=2) for r in range(2)]
    for li in (1, 2):
        assert ranks[0].schemas[li].entries_per_block * 2 == one.schemas[li].entries_per_block
    assert ranks[0].pool.nbytes() <= 0.55 * one.pool.nbytes()
    assert ranks[0].state.nbytes() == one.state.nbytes()  # the state is replicated
    for c in [one, *ranks]:
        c.add_request("a")
        c.prepare_forward({"a": 150})
    assert ranks[0].block_table("a") == ranks[1].block_table("a") == one.block_table("a")
    with pytest.raises(InvalidPlanError, match="multiple of 128"):  # HCA (m=16): 4 entries per 64-token block
        HybridCache(cfg, layers=[2], num_blocks=8, block_size=64, cp_rank=0, cp_size=8)
    with pytest.raises(InvalidPlanError, match="cp_rank"):
        HybridCache(cfg, layers=[2], num_blocks=8, block_size=64, cp_rank=2, cp_size=2)


def test_context_parallel_cache_save_restore():
    """A CP rank's request moves out and back (``preempt_request`` / ``restore_request``): its pages — the
    entries it holds, at local slots — come back byte for byte, and the snapshot checks read only those."""
    cfg = dsv4.ModelConfig.preset("tiny")
    cache = HybridCache(cfg, layers=[1, 2], num_blocks=8, block_size=64, cp_rank=1, cp_size=2)
    cache.add_request("a")
    cache.claim_step(cache.prepare_forward({"a": 150}))
    g = torch.Generator().manual_seed(3)
    for li in (1, 2):
        layer, m = cache.layer(li), cfg.ratio(li)
        layer.ring_positions[cache.slot("a")] = canonical_ring_positions(150, cfg.window)  # as if the layers ran
        held = held_entries(150 // m, 1, 2, torch.device("cpu"))
        block = torch.tensor(cache.block_table("a"))[held * m // 64]
        slot = (held * m % 64) // m // 2
        for pages, storage in ((layer.kv_pages, layer.schema.kv_storage), (layer.index_pages, layer.schema.index_storage)):
            if storage is not None:
                storage.write(pages, block, slot, torch.randn(held.numel(), storage.dim, generator=g))
    before = {li: cache.layer(li).kv_pages[cache.block_table("a")].clone() for li in (1, 2)}
    snap = cache.preempt_request("a")
    cache.restore_request("a", snap)
    for li in (1, 2):
        assert torch.equal(cache.layer(li).kv_pages[cache.block_table("a")], before[li])
    cache.check_invariants()
