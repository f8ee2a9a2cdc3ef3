"""The lightning indexer (SPEC §5): ``I[t,s] = Σ_h w[t,h]·ReLU(q[t,h]·K[s])`` and causal top-k (SPEC §6)."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..numerics import Numerics
from ..weights import IndexerWeights
from .primitives import linear, project
from .rope import apply_rope

__all__ = ["indexer_queries", "indexer_head_weights", "index_scores", "rounded_indexer_queries", "select_topk",
           "topk_differences", "topk_within"]


def indexer_queries(
    q_latent: torch.Tensor, iw: IndexerWeights, positions: torch.Tensor, inv_freq: torch.Tensor, cfg: ModelConfig, numerics: Numerics
) -> torch.Tensor:
    """Indexer queries from the shared query latent: project, RoPE (compressed table), Hadamard + quantize.

    Args:
        q_latent: ``[T, q_lora_rank]`` ``c^Q`` (act dtype). positions: ``[T]``.
    Returns:
        ``[T, H_I, c_I]`` float32 (values on the index format's grid).
    """
    return rounded_indexer_queries(project(q_latent, iw.wq_b, numerics), positions, inv_freq, cfg, numerics)


def rounded_indexer_queries(
    q: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, cfg: ModelConfig, numerics: Numerics
) -> torch.Tensor:
    """The indexer queries from their projection ``q = W_Iq c^Q`` ``[T, H_I·c_I]`` (act dtype): RoPE (compressed
    table), Hadamard + quantize. Returns ``[T, H_I, c_I]`` float32 (values on the index format's grid)."""
    q = q.unflatten(-1, (cfg.index_n_heads, cfg.index_head_dim))
    return numerics.qdq_index(apply_rope(q, positions, inv_freq))


def indexer_head_weights(x: torch.Tensor, iw: IndexerWeights, cfg: ModelConfig, numerics: Numerics) -> torch.Tensor:
    """Per-head score weights ``w[t,h] = (W_w x_t)[h] · c_I^{-1/2} · H_I^{-1/2}``. Returns ``[T, H_I]`` float32."""
    return linear(x, iw.weights_proj, numerics.act_dtype).float() * cfg.index_weight_scale


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, score_dtype: torch.dtype) -> torch.Tensor:
    """Index scores of every query against every key (no causality applied here).

    Args:
        q: ``[T, H_I, c_I]`` float32. weights: ``[T, H_I]`` float32. keys: ``[n, c_I]`` float32.
    Returns:
        ``[T, n]`` in ``score_dtype`` (accumulated in FP32, rounded once; BF16 in the official numerics).
    """
    per_head = torch.relu(torch.einsum("thc,nc->thn", q, keys.float()))
    return (per_head * weights.unsqueeze(-1)).sum(dim=1).to(score_dtype)


def select_topk(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """Causal top-k: the ``min(k, n)`` best entries among the visible ones, −1 where fewer are visible.

    Args:
        scores: ``[T, n]`` index scores over all ``n`` entries that exist.
        visible: ``[T]`` number of entries query ``t`` may see, ``⌊(t+1)/m⌋`` (entries ``0 … visible−1``).
        k: ``index_topk``.
    Returns:
        ``[T, min(k, n)]`` int64 entry indices, −1 for invalid slots. Order within a row is unspecified.
    """
    n = scores.shape[-1]
    k_eff = min(k, n)
    if k_eff == 0:
        return torch.empty((scores.shape[0], 0), dtype=torch.int64, device=scores.device)
    future = torch.arange(n, device=scores.device)[None, :] >= visible[:, None]
    chosen = scores.float().masked_fill(future, float("-inf")).topk(k_eff, dim=-1).indices
    return torch.where(chosen >= visible[:, None], torch.full_like(chosen, -1), chosen)


def topk_differences(scores: torch.Tensor, want: torch.Tensor, got: torch.Tensor, rel: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """Compare two top-k selections "up to ties" (``torch.topk`` breaks ties arbitrarily).

    Args:
        scores: ``[T, n]`` the index scores both selections were made from (e.g. the reference's).
        want, got: int64 ``[T, k1]`` / ``[T, k2]`` selected entry indices, −1 = invalid (widths may differ).
        rel: relative tolerance when comparing the selected scores.
    Returns:
        ``differs``: bool ``[T]``, rows whose sets differ; ``ties_only``: bool ``[T]``, rows whose sets differ but
        select the same multiset of scores (so the difference is a tie). A correct top-k has
        ``differs == ties_only``.
    """
    T = want.shape[0]
    differs = torch.zeros(T, dtype=torch.bool)
    ties_only = torch.zeros(T, dtype=torch.bool)
    for t in range(T):
        a = sorted(want[t][want[t] >= 0].tolist())
        b = sorted(got[t][got[t] >= 0].tolist())
        if a == b:
            continue
        differs[t] = True
        if len(a) == len(b):
            sa = torch.sort(scores[t, a].double()).values
            sb = torch.sort(scores[t, b].double()).values
            ties_only[t] = bool(torch.allclose(sa, sb, rtol=rel, atol=1e-6))
    return differs, ties_only


def topk_within(scores: torch.Tensor, visible: torch.Tensor, got: torch.Tensor, k: int, rel: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether each row of ``got`` is a causal top-k of ``scores`` up to a slack: the test for a selection made
    from *other* scores than these (an engine's, whose GEMMs round differently and whose FP4-quantized index
    queries can flip a code on a one-ulp change).

    A row passes when its valid entries (≥ 0) are distinct, all visible (``< visible[t]``), ``min(k, visible[t])``
    of them, and no visible entry left out scores more than ``rel · max|scores[t, :visible[t]]|`` above the
    lowest entry taken — i.e. ``got`` is an exact top-k of some scores within half that slack of these.

    Args:
        scores: ``[T, n]`` the reference's index scores (unmasked). visible: int ``[T]`` entries each row sees.
        got: int64 ``[T, k']`` selected entry indices, −1 = none. k: ``index_topk``. rel: slack, relative to the
            row's largest score magnitude.
    Returns:
        ``(ok bool [T], gap float [T])``: ``gap`` = (best left-out − lowest taken) / row scale (≤ 0: an exact top-k;
        −inf when nothing visible was left out).
    """
    T, n = scores.shape
    s = scores.float()
    vis = torch.arange(n, device=s.device)[None, :] < visible.to(s.device)[:, None]
    valid = got >= 0
    causal = (~valid | (got < visible.to(got.device)[:, None])).all(dim=1)
    taken = torch.zeros((T, n + 1), dtype=torch.int32, device=s.device)
    taken.scatter_add_(1, torch.where(valid & (got < n), got, n), torch.ones_like(got, dtype=torch.int32))
    distinct = (taken[:, :n] <= 1).all(dim=1)
    count_ok = valid.sum(dim=1) == torch.clamp(visible.to(got.device), max=k)
    sel = (taken[:, :n] > 0) & vis
    scale = torch.where(vis, s.abs(), torch.zeros_like(s)).amax(dim=1).clamp_min(1e-30)
    lowest_taken = torch.where(sel, s, torch.full_like(s, float("inf"))).amin(dim=1)
    best_left = torch.where(vis & ~sel, s, torch.full_like(s, float("-inf"))).amax(dim=1)
    gap = torch.where(sel.any(dim=1), (best_left - lowest_taken) / scale, torch.full_like(scale, float("-inf")))
    ok = causal & distinct & count_ok & (gap <= rel)
    return ok, gap
