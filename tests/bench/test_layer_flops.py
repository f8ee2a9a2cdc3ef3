"""``dsv4.bench.e2e``'s FLOP count of a layer step (the compute roofline of ``benchmarks/profile_layer.py``):
the matrices against the shapes ``AttentionWeights`` really holds, split by the rate SPEC §1.3 runs them at, and
the keys each new token attends or scores against a brute-force enumeration of positions."""

from __future__ import annotations

import dsv4
from dsv4.bench.e2e import bf16_matrix_params, fp8_projection_params, layer_step_flops
from dsv4.config import LayerKind

TINY = dsv4.ModelConfig.preset("tiny")
FP8 = {"wq_a", "wkv", "wq_b", "wo_b", "indexer.wq_b"}  # SPEC §1.3's FP8 GEMMs
BF16 = {"wo_a", "compressor.wkv", "compressor.wgate", "indexer.weights_proj", "indexer.compressor.wkv",
        "indexer.compressor.wgate"}


def test_matrix_params_are_the_weights_shapes_split_by_rate() -> None:
    for li in range(TINY.num_layers):
        weights = dsv4.AttentionWeights.random(TINY, li, seed=0).named_parameters()
        shapes = {n: v.shape[0] * v.shape[1] if len(v.shape) == 2 else 0 for n, v in weights}
        assert fp8_projection_params(TINY, li) == sum(v for n, v in shapes.items() if n in FP8)
        assert bf16_matrix_params(TINY, li) == sum(v for n, v in shapes.items() if n in BF16)
    flash = dsv4.ModelConfig.preset("v4-flash")
    csa = next(li for li in range(flash.num_layers) if flash.layer_kind(li) is LayerKind.CSA)
    # wq_a 1024 × 4096, wkv 512 × 4096, wq_b 32768 × 1024, wo_b 4096 × 8192, indexer wq_b 8192 × 1024
    assert fp8_projection_params(flash, csa) == 1024 * 4096 + 512 * 4096 + 32768 * 1024 + 4096 * 8192 + 8192 * 1024


def _keys_brute_force(cfg: dsv4.ModelConfig, kind: LayerKind, p: int) -> tuple[int, int]:
    """(keys attended, compressed keys scored) by token ``p``: its window's positions, the compressed entries whose
    windows of ``m`` positions have closed by ``p``."""
    window = len([q for q in range(p + 1) if p - q < cfg.window])
    if kind is LayerKind.SWA:
        return window, 0
    m = cfg.csa_ratio if kind is LayerKind.CSA else cfg.hca_ratio
    closed = len([e for e in range(p + 1) if (e + 1) * m - 1 <= p])
    if kind is LayerKind.CSA:
        return window + min(cfg.index_topk, closed), closed
    return window + closed, 0


def test_step_flops_count_each_new_tokens_keys() -> None:
    for cfg in (TINY, dsv4.ModelConfig.preset("v4-flash")):
        for li in {cfg.layer_kind(i): i for i in range(cfg.num_layers)}.values():
            kind = cfg.layer_kind(li)
            for batch, context, new in ((1, 0, 300), (3, 1000, 1), (2, 37, 130)):
                keys = scored = 0
                for p in range(context, context + new):
                    k, s = _keys_brute_force(cfg, kind, p)
                    keys, scored = keys + k, scored + s
                fp8, bf16 = layer_step_flops(cfg, li, batch, context, new)
                tokens = batch * new
                assert fp8 == 2 * fp8_projection_params(cfg, li) * tokens \
                    + 2 * cfg.index_n_heads * cfg.index_head_dim * scored * batch
                assert bf16 == 2 * bf16_matrix_params(cfg, li) * tokens + 4 * cfg.num_heads * cfg.head_dim * keys * batch
