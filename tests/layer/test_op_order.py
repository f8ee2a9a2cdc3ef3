"""``Attention`` calls its backend's ops in the order ``ops.backend.OP_NAMES`` documents — the writes before the
query path, so that a second stream forked for them (``LayerPlan.overlap``) runs beside the queries — each layer
kind calling the ops it needs."""

from __future__ import annotations

import pytest
import torch

import dsv4
from dsv4.config import LayerKind
from dsv4.ops import OP_NAMES, torch_ops

TINY = dsv4.ModelConfig.preset("tiny")

EXPECTED = {
    LayerKind.SWA: ["input_projections", "new_entries", "queries", "attend", "append_swa", "output"],
    LayerKind.CSA: ["input_projections", "new_entries", "queries", "indexer_queries", "indexer_weights",
                    "indexer_topk", "attend", "append_swa", "output"],
    LayerKind.HCA: ["input_projections", "new_entries", "queries", "visible_entries", "attend", "append_swa",
                    "output"],
}


@pytest.mark.parametrize("kind", list(EXPECTED), ids=lambda k: k.name)
def test_layer_calls_its_ops_in_the_documented_order(kind: LayerKind, monkeypatch: pytest.MonkeyPatch) -> None:
    li = next(i for i in range(TINY.num_layers) if TINY.layer_kind(i) is kind)
    calls: list[str] = []
    for name in OP_NAMES:
        op = getattr(torch_ops, name)
        monkeypatch.setattr(torch_ops, name, lambda *a, _op=op, _name=name, **k: calls.append(_name) or _op(*a, **k))
    layer = dsv4.Attention(dsv4.AttentionWeights.random(TINY, li, seed=2), TINY, li, backend="torch")
    cache = dsv4.HybridCache(TINY, layers=[li], max_requests=2, num_blocks=16, block_size=16)
    cache.add_request("a"), cache.add_request("b")
    for new in ({"a": 21, "b": 5}, {"a": 1, "b": 1}):
        calls.clear()
        batch = cache.prepare_forward(new)
        layer(torch.randn(batch.num_tokens, TINY.hidden_size), batch, cache)
        assert calls == EXPECTED[kind]
        assert calls == sorted(calls, key=OP_NAMES.index)
