"""Triton glue of the lightning indexer: ``indexer_queries`` and ``indexer_topk`` (see ``dsv4.ops.torch_ops``).

``indexer_queries`` returns an ``IndexerQueries`` (only this module's ``indexer_topk`` consumes it): the query
operand of the scores kernel plus one fp32 scale per (token, head). ``indexer_topk`` runs the launches of the step's
``IndexerPlan`` (``dsv4.kernels.indexer.plan``; built here from the batch when none is given, ``indexer_plan``): the
scores kernel into the workspace buffer ``"indexer_scores"``, then the top-k with its scratch in the workspace
buffers ``"indexer_topk.<name>"``, and returns a fixed-width ``[T, k]`` (−1 padded), which keeps the step graph-safe.

Key formats: ``mxfp4`` (official, 68 B), ``fp8`` (vLLM 132 B) and ``fp32`` (exact) run on the kernels. ``nvfp4``
(the prototype's format) falls back to the torch backend's scores (then the same radix top-k): not graph-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import formats
from ..cache.batch import StepBatch
from ..cache.manager import LayerCache
from ..config import ModelConfig
from ..kernels import device, device_facts
from ..kernels.indexer.plan import IndexerPlan, head_pad, plan_indexer
from ..kernels.indexer.queries import mxfp4_queries
from ..kernels.indexer.score_weights import score_weights
from ..kernels.indexer.scores import index_scores
from ..kernels.indexer.topk import radix_topk
from ..kernels.indexer.topk_plan import TopkPlan
from ..numerics import Numerics
from ..reference.indexer import index_scores as _reference_scores, rounded_indexer_queries
from ..reference.primitives import linear
from . import projections, torch_ops
from .step import LayerStep
from .triton_project import projector

__all__ = ["HeadWeights", "IndexerQueries", "head_pad", "head_weights", "indexer_plan", "indexer_queries",
           "indexer_topk", "mxfp4_operand_channels", "queries_from_float", "queries_from_projection", "score_buffer",
           "topk_layer"]


@dataclass
class IndexerQueries:
    """Indexer queries as the scores kernel reads them.

    Attributes:
        fmt: the index format's name (``"mxfp4"``, ``"fp8"``, ``"fp32"``, or ``"nvfp4"`` = torch fallback).
        q: ``[T, 2, HP, 64]``: for ``mxfp4`` uint8 E4M3 bytes of ``e2m1 · 2**(e_j − e_max + 6)``, channels in the
            order of ``mxfp4_operand_channels``; for ``fp8`` uint8 E4M3 codes, ``[:, 0]`` / ``[:, 1]`` = channels
            0–63 / 64–127; for ``fp32`` float32 values split the same way. Padded heads (``h ≥ H``) are zero.
        scale: float32 ``[T, HP]``: ``q_true = scale · value(q)`` per head (0 on padded heads).
        num_heads: ``H``.
        values: float32 ``[T, H, c_I]`` the rounded queries, kept only for the ``nvfp4`` fallback (else ``None``).
    """

    fmt: str
    q: Tensor
    scale: Tensor
    num_heads: int
    values: Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.q.shape[0]


@dataclass(frozen=True)
class HeadWeights:
    """The indexer's per-head weights before their scale (the Triton backend's ``indexer_weights``).

    Attributes:
        projection: ``[T, H_I]``: ``W_w x`` as the official model rounds it (act dtype) or, ``rounded`` False, its
            FP32 sums (the stacked compressor GEMM's columns, any row stride), which their reader rounds to BF16.
        scale: ``c_I^{-1/2} H_I^{-1/2}`` (``ModelConfig.index_weight_scale``).
        rounded: whether ``projection`` is already in the act dtype.
    """

    projection: Tensor
    scale: float
    rounded: bool = True

    def rounded_projection(self) -> Tensor:
        """``projection`` in BF16 (as the official BF16 GEMM rounds its output) where it holds FP32 sums."""
        return self.projection if self.rounded else self.projection.to(torch.bfloat16)


def head_weights(step: LayerStep, x: Tensor) -> HeadWeights:
    """The per-head weight projection of ``x`` ``[T, d]`` (``reference.indexer.indexer_head_weights`` before its
    scale): the stacked compressor GEMM's FP32 sums where ``projections.layer_compressor_projections`` kept them
    with ``x`` (BF16 activations; rounded by ``score_weights``), else one GEMM."""
    w = step.weights.indexer
    sums = projections.take_head_sums(x, w.weights_proj)
    if sums is not None:
        return HeadWeights(sums, step.cfg.index_weight_scale, rounded=False)
    return HeadWeights(linear(x, w.weights_proj, step.numerics.act_dtype), step.cfg.index_weight_scale)


def mxfp4_operand_channels(device: torch.device | str | None = None) -> Tensor:
    """int64 ``[2, 64]``: the channel an MXFP4 query operand holds at ``q[t, half, h, j]`` — ``8k + r`` in half 0
    and ``8k + 4 + r`` in half 1, ``j = 4k + r`` (the order in which the scores kernel unpacks a key's packed
    bytes: each four bytes' eight channels, first four then last four)."""
    j = torch.arange(64, device=device)
    first = 8 * (j // 4) + j % 4
    return torch.stack([first, first + 4])


def _split_halves(v: Tensor, hp: int, mxfp4_order: bool) -> Tensor:
    """``[T, H, 128]`` → ``[T, 2, HP, 64]`` (``mxfp4_operand_channels`` if ``mxfp4_order`` else first/last 64),
    zero pads."""
    T, H, _ = v.shape
    out = v.new_zeros((T, 2, hp, 64))
    if mxfp4_order:
        channels = mxfp4_operand_channels(v.device)
        out[:, 0, :H], out[:, 1, :H] = v[..., channels[0]], v[..., channels[1]]
    else:
        out[:, 0, :H], out[:, 1, :H] = v[..., :64], v[..., 64:]
    return out


def _pad_scale(s: Tensor, hp: int) -> Tensor:
    out = s.new_zeros((s.shape[0], hp), dtype=torch.float32)
    out[:, : s.shape[1]] = s
    return out


def queries_from_float(values: Tensor, fmt: str) -> IndexerQueries:
    """``IndexerQueries`` of float queries already on the index format's grid (e.g. the torch backend's output).

    Used by tests and as the torch path of the non-MXFP4 formats. ``values``: float32 ``[T, H, 128]``; for
    ``mxfp4`` / ``fp8`` the values must be exactly representable (re-quantizing them is then lossless).
    """
    T, H, c = values.shape
    hp = head_pad(H)
    v = values.float()
    if fmt == "mxfp4":
        packed, exps = formats.quantize_mxfp4(v, 32, check=False)
        codes = formats.unpack_nibbles(packed).long()  # [T, H, 128]
        e = exps.long()  # [T, H, 4]
        e_max = e.amax(dim=-1)
        d = (e - e_max[..., None] + 11).repeat_interleave(32, dim=-1)
        mag, sign = codes & 7, (codes >> 3) & 1
        base = torch.where(mag == 1, 8, (mag + 2) * 4)
        byte = torch.where((mag == 0) | (d < 0), 0, base + d * 8) | (sign << 7)
        q = _split_halves(byte.to(torch.uint8), hp, mxfp4_order=True)
        scale = torch.where(e_max >= 7, torch.ldexp(torch.ones_like(e_max, dtype=torch.float32), e_max - 133), 0.0)
        return IndexerQueries(fmt, q, _pad_scale(scale, hp), H)
    if fmt == "fp8":
        codes, scale = formats.quantize_fp8_key(v, check=False)
        return IndexerQueries(fmt, _split_halves(codes, hp, mxfp4_order=False), _pad_scale(scale, hp), H)
    if fmt == "fp32":
        return IndexerQueries(fmt, _split_halves(v, hp, mxfp4_order=False), _pad_scale(torch.ones(T, H, device=v.device), hp), H)
    return IndexerQueries(fmt, v.new_zeros((T, 2, hp, 64)), v.new_zeros((T, hp)), H, values=v)


def indexer_queries(step: LayerStep, q_latent: Tensor, projection: Tensor | None = None) -> IndexerQueries:
    """See ``backend.AttentionBackend.indexer_queries``: from ``projection`` (``triton_write.queries``' column block
    of the layer's stacked query GEMM, read in place) when given, else from ``W_Iq c^Q``'s own GEMM."""
    q = projection if projection is not None else projections.indexer_query_projection(step, q_latent,
                                                                                         projector(step))
    return queries_from_projection(q, step.positions, step.inv_freq, step.cfg, step.numerics)


def queries_from_projection(
    q: Tensor, positions: Tensor, inv_freq: Tensor, cfg: ModelConfig, numerics: Numerics
) -> IndexerQueries:
    """Indexer queries (SPEC §5) from ``q`` ``= W_Iq c^Q`` ``[T, H_I·c_I]`` (rows any stride apart): for MXFP4 one
    fused kernel (RoPE → Hadamard → MXFP4 → operand bytes); other formats round in torch
    (``reference.indexer.rounded_indexer_queries``)."""
    H, c = cfg.index_n_heads, cfg.index_head_dim
    fmt = numerics.index_format
    if fmt == "mxfp4" and c == 128 and inv_freq.numel() == 32 and q.is_cuda:
        hp = head_pad(H)
        q8, scale = mxfp4_queries(q, positions, inv_freq, H, hp)
        return IndexerQueries(fmt, q8, scale, H)
    return queries_from_float(rounded_indexer_queries(q, positions, inv_freq, cfg, numerics), fmt)


def score_buffer(layer: LayerCache, batch: StepBatch, m: int, score_dtype: torch.dtype) -> Tensor:
    """The step's index-score matrix ``[T, max(1, batch.addressable_entries(m))]`` (workspace ``"indexer_scores"``;
    row ``t`` holds scores for entries ``s < visible[t]``). Its width is a bound from the batch's shapes, never
    from the step's positions, so a captured CUDA graph stays right on later steps."""
    return layer.workspace.get("indexer_scores", (batch.num_tokens, max(batch.addressable_entries(m), 1)), score_dtype)


def indexer_plan(layer: LayerCache, batch: StepBatch, m: int, k: int, heads: int, score_dtype: torch.dtype,
                 facts: device.DeviceFacts | None = None) -> IndexerPlan:
    """The indexer's launches for ``batch`` on ``layer`` (``plan_indexer`` from the batch's shapes, the layer's key
    format and pool geometry, and ``facts`` — default: those of the pool's device)."""
    storage = layer.schema.index_storage
    dev = facts if facts is not None else device_facts.facts(layer.index_pages.device)
    return plan_indexer(
        tokens=batch.num_tokens, requests=batch.num_requests, max_new=batch.max_new,
        entries=batch.addressable_entries(m), k=k, heads=heads,
        key_format=storage.name if storage.dim == device.INDEXER_KEY_DIM else None, score_dtype=score_dtype, ratio=m,
        block_size=batch.block_size, entries_per_page=layer.schema.entries_per_block,
        sm_count=dev.sm_count, sm90=dev.sm90, interpreted=device.interpreting())


def indexer_topk(step: LayerStep, q_idx: IndexerQueries, head_weights: HeadWeights | Tensor) -> Tensor:
    """See ``backend.AttentionBackend.indexer_topk``: as ``step.plan.indexer`` says (fixed width ``[T, k]``)."""
    return topk_layer(step.cache, step.batch, step.ratio, q_idx, head_weights, step.cfg.index_topk,
                      step.numerics.score_dtype, plan=step.plan.indexer)


def topk_layer(
    layer: LayerCache, batch: StepBatch, m: int, q_idx: IndexerQueries | Tensor, head_weights: HeadWeights | Tensor,
    k: int, score_dtype: torch.dtype, *, plan: IndexerPlan | None = None,
) -> Tensor:
    """``indexer_topk`` on explicit tensors: index scores over each request's keys in the paged pool, then causal top-k (SPEC §5–6).

    Args:
        q_idx: this module's ``IndexerQueries`` (a float ``[T, H_I, c_I]`` tensor on the format's grid is converted).
        head_weights: float32 ``[T, H_I]``, or ``HeadWeights`` (the projection and its scale).
        k: ``index_topk``; score_dtype: BF16 (official) or FP32.
        plan: the step's indexer plan (``indexer_plan``); built here from the batch when omitted.
    Returns:
        int64 ``[T, k]`` entry indices of each token's request, −1 padded (fixed width: graph-safe).
    Raises:
        ValueError: a plan made for another k or key format (``index_scores``: for another head count).
    """
    storage = layer.schema.index_storage
    if isinstance(q_idx, Tensor):
        q_idx = queries_from_float(q_idx, storage.name)
    if plan is None:
        plan = indexer_plan(layer, batch, m, k, q_idx.num_heads, score_dtype)
    if plan.topk.k != k or (plan.scores is None) != (q_idx.values is not None) or (
            plan.scores is not None and plan.scores.key_format != q_idx.fmt):
        raise ValueError(f"indexer_topk: the plan (k={plan.topk.k}, scores "
                         f"{plan.scores.key_format if plan.scores else 'by torch'}) does not fit this call (k={k}, "
                         f"{q_idx.fmt} queries)")
    visible = batch.visible_entries[m]
    scores = score_buffer(layer, batch, m, score_dtype)
    if not isinstance(head_weights, HeadWeights):
        head_weights = HeadWeights(head_weights, 1.0)
    projection, scale = head_weights.projection, head_weights.scale
    if plan.scores is not None:
        # one launch: the rounding of FP32 sums, the scale, the queries' scales, padding
        w = score_weights(projection, scale, q_idx.scale, round_bf16=not head_weights.rounded)
        index_scores(layer.index_pages, batch.block_tables, batch.cu_seqlens, visible, q_idx.q, w, scores,
                     plan.scores)
    else:  # nvfp4: the torch backend's scores (host loop), then the same top-k
        values, weights = q_idx.values, head_weights.rounded_projection().float() * scale
        for rows, keys in torch_ops.request_index_keys(layer, batch, m):
            scores[rows, : keys.shape[0]] = _reference_scores(values[rows], weights[rows], keys, score_dtype)
    return radix_topk(scores, visible, plan.topk, **topk_scratch(layer, plan.topk))


def topk_scratch(layer: LayerCache, plan: TopkPlan) -> dict[str, Tensor]:
    """The workspace buffers ``"indexer_topk.<name>"`` of the top-k's ``plan`` (``TopkPlan.scratch``), as keyword
    arguments of ``radix_topk``."""
    return {name: layer.workspace.get(f"indexer_topk.{name}", shape, torch.int32, zero=zero_kept)
            for name, (shape, zero_kept) in plan.scratch().items()}
