"""One DeepSeek-V4 attention layer over a whole sequence at positions ``0 … S−1`` (stateless).

Reads top to bottom like SPEC §3: query path, shared KV (window entries), compressed entries (CSA/HCA),
the lightning indexer (CSA), one softmax with sink over window ∪ compressed keys, inverse RoPE, grouped output
projection. Every function documents shapes and dtypes; quantization points come from ``Numerics``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import LayerKind, ModelConfig, require_config
from ..numerics import Numerics, NumericsLike, resolve_numerics
from ..validate import require_instance, require_int
from ..weights import AttentionWeights
from .compressor import compress
from .core import attend_with_sink, window_indices
from .indexer import index_scores, indexer_head_weights, indexer_queries, select_topk
from .primitives import project, rms_norm
from .rope import apply_rope, rope_inv_freq

__all__ = ["ReferenceResult", "attention", "forward", "query_path", "query_projection", "window_kv", "output_projection", "grouped_output",
           "compressed_entry_indices"]


@dataclass
class ReferenceResult:
    """Everything the reference computed for one layer (the cache and kernels are checked against these).

    Attributes:
        y: ``[S, d]`` layer output (act dtype).
        q: ``[S, H, D]`` queries after head norm and RoPE.
        q_latent: ``[S, q_lora_rank]`` shared query latent ``c^Q``.
        kv: ``[S, D]`` window entries (RoPE'd, quantized as stored).
        entries: ``[n, D]`` compressed entries as stored (``n = ⌊S/m⌋``; empty for SWA).
        index_keys: ``[n, c_I]`` float32 indexer keys as stored (CSA; else ``None``).
        index_q: ``[S, H_I, c_I]`` float32 indexer queries (CSA; else ``None``).
        index_scores: ``[S, n]`` index scores before masking (CSA; else ``None``).
        entry_idx: ``[S, K]`` int64 compressed entries each query attends (−1 = invalid): CSA top-k, HCA all.
        o: ``[S, H, D]`` attention output after inverse RoPE, before the output projection.
        lse: ``[S, H]`` float32 log-sum-exp of the softmax denominator (sink included).
    """

    y: torch.Tensor
    q: torch.Tensor
    q_latent: torch.Tensor
    kv: torch.Tensor
    entries: torch.Tensor
    index_keys: torch.Tensor | None
    index_q: torch.Tensor | None
    index_scores: torch.Tensor | None
    entry_idx: torch.Tensor
    o: torch.Tensor
    lse: torch.Tensor


def query_path(
    w: AttentionWeights, cfg: ModelConfig, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, numerics: Numerics
) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC §3 steps 1–2: ``c^Q = RMSNorm(W_qa x)``; ``q = W_qb c^Q`` per head, unweighted RMSNorm, RoPE.

    Args:
        x: ``[T, d]``; positions: ``[T]``. Returns ``q`` ``[T, H, D]`` and ``c^Q`` ``[T, q_lora_rank]`` (act dtype).
    """
    q, q_latent = query_projection(w, cfg, x, numerics)
    return apply_rope(rms_norm(q, None, cfg.norm_eps), positions, inv_freq), q_latent


def query_projection(
    w: AttentionWeights, cfg: ModelConfig, x: torch.Tensor, numerics: Numerics,
    norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC §3 step 1 and the projection of step 2: ``c^Q = RMSNorm(W_qa x)``, ``W_qb c^Q`` split into heads
    (``query_path`` before its per-head norm and RoPE).

    Args:
        x: ``[T, d]``. norm: the RMSNorm ``(x, weight, eps)`` (a backend's ``rms_norm`` op in ``dsv4.Attention``).
    Returns:
        ``W_qb c^Q`` ``[T, H, D]`` and ``c^Q`` ``[T, q_lora_rank]`` (act dtype).
    """
    q_latent = norm(project(x, w.wq_a, numerics), w.q_norm, cfg.norm_eps)
    return project(q_latent, w.wq_b, numerics).unflatten(-1, (cfg.num_heads, cfg.head_dim)), q_latent


def window_kv(
    w: AttentionWeights, cfg: ModelConfig, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, numerics: Numerics
) -> torch.Tensor:
    """SPEC §3 step 3: ``kv = RoPE(RMSNorm(W_kv x))``, rounded as the KV storage format (nope dims).

    Args:
        x: ``[T, d]``; positions: ``[T]``. Returns ``[T, D]`` act dtype (the token's window entry, key and value).
    """
    kv = rms_norm(project(x, w.wkv, numerics), w.kv_norm, cfg.norm_eps)
    return numerics.qdq_kv(apply_rope(kv, positions, inv_freq), cfg.nope_dim)


def output_projection(
    w: AttentionWeights, cfg: ModelConfig, o: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, numerics: Numerics
) -> torch.Tensor:
    """SPEC §3 steps 6–7 after attention: inverse RoPE at the query position, then ``grouped_output``.

    Args:
        o: ``[T, H, D]`` attention output. Returns ``[T, d]`` act dtype.
    """
    return grouped_output(w, cfg, apply_rope(o, positions, inv_freq, inverse=True), numerics)


def grouped_output(
    w: AttentionWeights, cfg: ModelConfig, o: torch.Tensor, numerics: Numerics,
    proj: Callable[[torch.Tensor, object, Numerics], torch.Tensor] = project,
) -> torch.Tensor:
    """SPEC §3 step 7: grouped ``W_oa`` (G contiguous head groups; a BF16 GEMM in the official model), then ``W_ob``
    (an FP8 GEMM: ``proj``, the reference's ``project`` or a backend's).

    Args:
        o: ``[T, H, D]`` attention output after the inverse RoPE. Returns ``[T, d]`` act dtype.
    """
    act = numerics.act_dtype
    groups = o.reshape(o.shape[0], cfg.o_groups, -1).to(act)  # [T, G, H/G·D], heads contiguous per group
    wo_a = w.wo_a.to(o.device, act).unflatten(0, (cfg.o_groups, cfg.o_lora_rank))  # [G, o_lora, H/G·D]
    y_groups = torch.einsum("tgi,goi->tgo", groups, wo_a)
    return proj(y_groups.flatten(1), w.wo_b, numerics)


def compressed_entry_indices(visible: torch.Tensor, n: int) -> torch.Tensor:
    """HCA: every visible entry. ``visible``: ``[T]``. Returns ``[T, n]`` int64, −1 where ``i ≥ visible``."""
    idx = torch.arange(n, device=visible.device)[None, :].expand(visible.shape[0], n)
    return torch.where(idx < visible[:, None], idx, torch.full_like(idx, -1))


def forward(
    w: AttentionWeights, cfg: ModelConfig, layer_idx: int, x: torch.Tensor, numerics: NumericsLike = "official"
) -> ReferenceResult:
    """The full layer over ``x`` at positions ``0 … S−1``; returns every intermediate (see ``ReferenceResult``).

    Args:
        x: ``[S, d]`` attention input (the output of ``attn_norm``), any float dtype; cast to the act dtype.
    """
    require_instance("w", w, AttentionWeights, "build them with AttentionWeights.random / from_checkpoint")
    require_config(cfg)
    require_int("layer_idx", layer_idx)
    nm = resolve_numerics(numerics)
    w.check(cfg, layer_idx)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor [S, {cfg.hidden_size}], got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != cfg.hidden_size:
        raise ValueError(f"x must be [S, {cfg.hidden_size}], got {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise ValueError("x contains NaN or Inf")
    kind = cfg.layer_kind(layer_idx)
    act = nm.act_dtype
    x = x.to(act)
    S = x.shape[0]
    positions = torch.arange(S, device=x.device)
    inv_freq = rope_inv_freq(cfg, kind, x.device)

    q, q_latent = query_path(w, cfg, x, positions, inv_freq, nm)
    kv = window_kv(w, cfg, x, positions, inv_freq, nm)

    # Window keys: tokens t−W+1 … t of the same sequence.
    win_idx = window_indices(positions, cfg.window)
    keys = [kv[win_idx.clamp(min=0)]]
    valid = [win_idx >= 0]

    entries = kv.new_zeros((0, cfg.head_dim))
    index_keys = index_q = scores = None
    entry_idx = torch.empty((S, 0), dtype=torch.int64, device=x.device)
    if kind is not LayerKind.SWA:
        assert w.compressor is not None, f"layer {layer_idx} is {kind.name} but its weights have no compressor"
        m = cfg.ratio(layer_idx)
        overlap = kind is LayerKind.CSA
        entries = nm.qdq_kv(compress(x, w.compressor, overlap, inv_freq, cfg.norm_eps, act), cfg.nope_dim)
        visible = (positions + 1) // m  # entry i is visible to t iff (i+1)·m ≤ t+1
        if kind is LayerKind.CSA:
            assert w.indexer is not None, f"layer {layer_idx} is CSA but its weights have no indexer"
            index_keys = nm.qdq_index(compress(x, w.indexer.compressor, True, inv_freq, cfg.norm_eps, act))
            index_q = indexer_queries(q_latent, w.indexer, positions, inv_freq, cfg, nm)
            scores = index_scores(index_q, indexer_head_weights(x, w.indexer, cfg, nm), index_keys, nm.score_dtype)
            entry_idx = select_topk(scores, visible, cfg.index_topk)
        else:
            entry_idx = compressed_entry_indices(visible, entries.shape[0])
        keys.append(entries[entry_idx.clamp(min=0)] if entries.shape[0] else kv.new_zeros((S, 0, cfg.head_dim)))
        valid.append(entry_idx >= 0)

    o, lse = attend_with_sink(
        q, torch.cat(keys, dim=1), torch.cat(valid, dim=1), w.attn_sink.to(x.device), cfg.softmax_scale, nm.prob_dtype, act
    )
    o = apply_rope(o, positions, inv_freq, inverse=True)
    y = grouped_output(w, cfg, o, nm)
    return ReferenceResult(y, q, q_latent, kv, entries, index_keys, index_q, scores, entry_idx, o, lse)


def attention(
    w: AttentionWeights, cfg: ModelConfig, layer_idx: int, x: torch.Tensor, numerics: NumericsLike = "official"
) -> torch.Tensor:
    """DeepSeek-V4 attention of layer ``layer_idx`` over ``x`` ``[S, d]`` at positions ``0 … S−1``.

    ``numerics="official"`` reproduces the DeepSeek reference's rounding (FP8/MXFP4 cache formats, BF16
    activations); ``"exact"`` computes in FP32 without quantization. Returns ``[S, d]`` in the act dtype.
    """
    return forward(w, cfg, layer_idx, x, numerics).y
