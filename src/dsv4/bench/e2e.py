"""End-to-end benchmark: the engine's decode step (the whole layer stack) against its roofline.

For each (batch B, context L) the engine prefills B requests of L tokens, then decodes ``gen`` tokens each;
the figure is the median latency of the decode-only steps that carry all B requests (CUDA-graph replays where the
backend is graph-safe), and the prefill throughput.

Roofline of one decode step (w = 1 token per request), counting the minimum HBM traffic and FLOPs:

* bytes: every layer's weights once (matrices in the engine's activation dtype, BF16) plus, per request and
  layer, the cache it must read: the SWA ring (``window`` × KV entry), CSA all ``L/m`` indexer keys + top-k KV
  entries, HCA all ``L/m'`` KV entries;
* FLOPs: 2 · (matrix parameters) per token, plus attention ``4 · H · D · keys`` per token and layer, plus the CSA
  indexer's ``2 · H_I · c_I · L/m``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch

from ..cache import layer_schemas
from ..config import LayerKind, ModelConfig
from .roofline import roofline_row

__all__ = ["bf16_matrix_params", "decode_step_cost", "fp8_projection_params", "layer_step_flops", "prefill_cost",
           "run_e2e"]


def fp8_projection_params(cfg: ModelConfig, li: int) -> int:
    """Parameters of layer ``li``'s projections that the official inference runs as FP8 GEMMs (SPEC §1.3:
    ``wq_a``, ``wkv``, ``wq_b``, ``wo_b``; CSA also the indexer's ``wq_b``)."""
    d, H, D = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    n = cfg.q_lora_rank * d + D * d + H * D * cfg.q_lora_rank + d * cfg.o_groups * cfg.o_lora_rank
    if cfg.layer_kind(li) is LayerKind.CSA:
        n += cfg.index_n_heads * cfg.index_head_dim * cfg.q_lora_rank
    return n


def bf16_matrix_params(cfg: ModelConfig, li: int) -> int:
    """Parameters of layer ``li``'s BF16 matrices: the grouped ``wo_a``, the compressors' ``wkv`` / ``wgate``
    (CSA's main and indexer compressors overlap two windows: twice the width), CSA's indexer ``weights_proj``."""
    d, H, D = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    n = cfg.o_groups * cfg.o_lora_rank * (H * D // cfg.o_groups)
    kind = cfg.layer_kind(li)
    if kind is LayerKind.CSA:
        n += 2 * (2 * D * d) + cfg.index_n_heads * d + 2 * (2 * cfg.index_head_dim * d)
    elif kind is LayerKind.HCA:
        n += 2 * D * d
    return n


def _matrix_params(cfg: ModelConfig, li: int) -> int:
    return fp8_projection_params(cfg, li) + bf16_matrix_params(cfg, li)


def layer_step_flops(cfg: ModelConfig, li: int, batch: int, context: int, new: int) -> tuple[int, int]:
    """``(fp8, bf16)`` FLOPs of one step of layer ``li`` in which each of ``batch`` requests holding ``context``
    tokens adds ``new``, by the tensor-core rate they run at in the official inference:

    * FP8: ``2 · params`` per token of the FP8 projections, and CSA's index scores ``2 · H_I · c_I`` per token and
      compressed key it scores (MXFP4 values on FP8 tensor cores);
    * BF16: ``2 · params`` per token of the BF16 matrices, and attention ``4 · H · D`` per token and key it attends
      (its causal window, CSA its top-k of the visible compressed entries, HCA every visible one).

    Each new token at position ``p`` counts the keys visible at ``p`` (``_keys(cfg, li, p + 1)``)."""
    fp8 = 2 * fp8_projection_params(cfg, li) * batch * new
    bf16 = 2 * bf16_matrix_params(cfg, li) * batch * new
    keys = sum(_keys(cfg, li, p + 1) for p in range(context, context + new))
    bf16 += 4 * cfg.num_heads * cfg.head_dim * keys * batch
    if cfg.layer_kind(li) is LayerKind.CSA:
        scored = sum((p + 1) // cfg.csa_ratio for p in range(context, context + new))
        fp8 += 2 * cfg.index_n_heads * cfg.index_head_dim * scored * batch
    return fp8, bf16


def _keys(cfg: ModelConfig, li: int, context: int) -> int:
    kind = cfg.layer_kind(li)
    w = min(cfg.window, context)
    if kind is LayerKind.CSA:
        return w + min(cfg.index_topk, context // cfg.csa_ratio)
    if kind is LayerKind.HCA:
        return w + context // cfg.hca_ratio
    return w


def decode_step_cost(
    cfg: ModelConfig, layers: Sequence[int], batch: int, context: int, numerics: str = "official", weight_bytes: int = 2
) -> tuple[int, int]:
    """``(bytes, flops)`` of one decode step of ``batch`` requests at ``context`` tokens (see module docstring)."""
    schemas = {s.layer_idx: s for s in layer_schemas(cfg, layers, numerics, 256)}
    nbytes = flops = 0
    for li in layers:
        s = schemas[li]
        p = _matrix_params(cfg, li)
        nbytes += p * weight_bytes
        flops += 2 * p * batch
        kv = s.kv_storage.entry_bytes
        per_req = min(cfg.window, context) * kv
        if s.kind is LayerKind.CSA:
            n = context // cfg.csa_ratio
            per_req += n * s.index_storage.entry_bytes + min(cfg.index_topk, n) * kv
            flops += batch * 2 * cfg.index_n_heads * cfg.index_head_dim * n
        elif s.kind is LayerKind.HCA:
            per_req += (context // cfg.hca_ratio) * kv
        nbytes += batch * per_req
        flops += batch * 4 * cfg.num_heads * cfg.head_dim * _keys(cfg, li, context)
    return nbytes, flops


def prefill_cost(cfg: ModelConfig, layers: Sequence[int], tokens: int, context: int) -> tuple[int, int]:
    """``(bytes, flops)`` lower bound of prefilling ``tokens`` tokens of requests of length ``context``: weights
    read once per step is ignored (compute-bound); FLOPs of the projections, the attention over each token's keys
    (its causal window + selected/visible entries, averaged over positions) and the indexer."""
    flops = 0
    for li in layers:
        flops += 2 * _matrix_params(cfg, li) * tokens
        kind = cfg.layer_kind(li)
        avg_keys = min(cfg.window, context)
        if kind is LayerKind.CSA:
            avg_keys += min(cfg.index_topk, context // cfg.csa_ratio // 2)
            flops += tokens * 2 * cfg.index_n_heads * cfg.index_head_dim * (context // cfg.csa_ratio // 2)
        elif kind is LayerKind.HCA:
            avg_keys += context // cfg.hca_ratio // 2
        flops += tokens * 4 * cfg.num_heads * cfg.head_dim * avg_keys
    return 0, flops


def run_e2e(
    device: torch.device,
    roofline: Any,
    quick: bool = False,
    preset: str | None = None,
    layers: Sequence[int] | None = None,
    batches: Sequence[int] | None = None,
    contexts: Sequence[int] | None = None,
    gen: int | None = None,
    backend: str = "auto",
) -> list[dict[str, Any]]:
    """Decode-step latency and prefill throughput of the engine over a (batch, context) grid, as roofline rows."""
    from ..engine import Engine, EngineConfig, make_requests

    cuda = device.type == "cuda"
    cfg = ModelConfig.preset(preset or ("v4-flash" if cuda else "tiny"))
    layer_ids = list(range(cfg.num_layers)) if layers is None else list(layers)
    if batches is None:
        batches = ([8] if quick else [1, 8, 64]) if cuda else [1, 4]
    if contexts is None:
        contexts = ([1024] if quick else [4096]) if cuda else [128]
    gen = gen if gen is not None else (8 if quick else 32)
    rows = []
    for L in contexts:
        for B in batches:
            eng = Engine(cfg, layer_ids, EngineConfig(
                backend=backend, device=str(device), max_running=B, max_batched_tokens=max(B, 8192 if cuda else 512),
                weights="shared", block_size=256 if cfg.window >= 128 else 64, check_finite=False,
            ))
            stats = eng.run(make_requests(B, L, gen, seed=0))
            dec = [s.seconds for s in stats.steps if s.prefill_tokens == 0 and s.num_requests == B]
            pre = [s for s in stats.steps if s.prefill_tokens]
            tag = f"{cfg.name} {len(layer_ids)} layers, {eng.backend}"
            if dec:
                sec = statistics.median(dec)
                nb, fl = decode_step_cost(cfg, layer_ids, B, L + gen // 2, eng.numerics.name)
                rows.append(roofline_row(
                    f"decode step B={B} L={L} ({tag})", sec, nb, fl, roofline.copy_bw, roofline.bf16_rate,
                    batch=B, context=L, tokens_per_s=B / sec, graphs=any(s.graph for s in stats.steps),
                ))
            if pre:
                tok = sum(s.prefill_tokens for s in pre)
                sec = sum(s.seconds for s in pre)
                nb, fl = prefill_cost(cfg, layer_ids, tok, L)
                rows.append(roofline_row(
                    f"prefill {B}x{L} tokens ({tag})", sec, nb, fl, roofline.copy_bw, roofline.bf16_rate,
                    batch=B, context=L, tokens_per_s=tok / sec,
                ))
            del eng
            if cuda:
                torch.cuda.empty_cache()
    return rows
