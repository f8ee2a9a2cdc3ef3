"""The layer's projection GEMMs (SPEC §1.3, §3), shared by both backends: torch matmuls in the numerics'
activation dtype (BF16 GEMMs with FP32 accumulation, or FP32), on the weights ``LayerStep.weights`` holds.

Each function takes the RMSNorm to apply where SPEC §3 has one, so that a backend passes its own (the Triton
backend's is one launch per norm); the products themselves are the reference's (``reference.primitives.linear``).
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor

from ..reference.indexer import indexer_head_weights
from ..reference.layer import grouped_output
from ..reference.primitives import linear
from .step import LayerStep

__all__ = ["Norm", "indexer_query_projection", "indexer_weights", "output", "query_latent", "query_projection",
           "window_kv"]

#: a weighted RMSNorm ``(x [rows, C], weight [C], eps) -> [rows, C]`` in x's dtype
Norm = Callable[[Tensor, Tensor, float], Tensor]


def query_latent(step: LayerStep, x: Tensor, norm: Norm) -> Tensor:
    """``c^Q = RMSNorm_{q_norm}(W_qa x)``: x ``[T, d]`` → ``[T, q_lora_rank]`` act dtype."""
    w = step.weights
    return norm(linear(x, w.wq_a, step.numerics.act_dtype), w.q_norm, step.cfg.norm_eps)


def query_projection(step: LayerStep, q_latent: Tensor) -> Tensor:
    """``W_qb c^Q`` split into heads: ``[T, q_lora_rank]`` → ``[T, H, D]`` act dtype."""
    cfg = step.cfg
    return linear(q_latent, step.weights.wq_b, step.numerics.act_dtype).unflatten(-1, (cfg.num_heads, cfg.head_dim))


def window_kv(step: LayerStep, x: Tensor, norm: Norm) -> Tensor:
    """``RMSNorm_{kv_norm}(W_kv x)``: x ``[T, d]`` → ``[T, D]`` act dtype."""
    w = step.weights
    return norm(linear(x, w.wkv, step.numerics.act_dtype), w.kv_norm, step.cfg.norm_eps)


def indexer_query_projection(step: LayerStep, q_latent: Tensor) -> Tensor:
    """``W_Iq c^Q``: ``[T, q_lora_rank]`` → ``[T, H_I · c_I]`` act dtype (heads not yet split)."""
    return linear(q_latent, step.weights.indexer.wq_b, step.numerics.act_dtype)


def indexer_weights(step: LayerStep, x: Tensor) -> Tensor:
    """The indexer's per-head weights, float32 ``[T, H_I]`` (``reference.indexer.indexer_head_weights``)."""
    return indexer_head_weights(x, step.weights.indexer, step.cfg, step.numerics)


def output(step: LayerStep, o: Tensor) -> Tensor:
    """Grouped ``W_oa``, then ``W_ob``: o ``[T, H, D]`` (after the inverse RoPE) → ``[T, d]`` act dtype."""
    return grouped_output(step.weights, step.cfg, o, step.numerics)
