"""The indexer's plan for one step: every launch decision of its scores and its top-k, decided once on the host.

``plan_indexer`` takes plain host numbers — the step's shapes (tokens, requests, the longest request's new tokens,
the addressable entries bound), the layer's (heads, k, key format, score dtype, ratio, pool geometry) and the
device's (multiprocessors, Hopper) — and never positions or device data, so a CUDA graph captured with the plan stays
right on later steps of the same shapes. It runs on any machine (pass ``sm_count`` / ``sm90`` for the device planned
for). The launchers (``scores.index_scores``, ``topk.radix_topk``) only consume it; the rules are in ``scores_plan``
and ``topk_plan``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .scores_plan import SCORE_FORMATS, ScoresPlan, head_pad, plan_scores
from .topk_plan import TopkPlan, plan_topk

__all__ = ["IndexerPlan", "ScoresPlan", "TopkPlan", "head_pad", "plan_indexer"]


@dataclass(frozen=True)
class IndexerPlan:
    """Launch decisions of one step's indexer (CSA layers).

    Attributes:
        scores: the index scores' launch; ``None`` where the key format has no scores kernel (the caller computes
            the scores another way, e.g. ``nvfp4`` through the torch backend).
        topk: the top-k over the ``[tokens, max(1, entries)]`` score buffer.
    """

    scores: ScoresPlan | None
    topk: TopkPlan

    def describe(self) -> str:
        """Two lines (``dsv4 run --explain``): the scores' kernel and grid, the top-k's algorithm and scratch."""
        scores = self.scores.describe() if self.scores is not None else "scores: no kernel for this key format (torch)"
        return f"indexer {scores}\nindexer {self.topk.describe()}"


def plan_indexer(*, tokens: int, requests: int, max_new: int, entries: int, k: int, heads: int,
                 key_format: str | None, score_dtype: torch.dtype, ratio: int, block_size: int,
                 entries_per_page: int, sm_count: int, sm90: bool, interpreted: bool = False) -> IndexerPlan:
    """The indexer's launches for one step.

    Args:
        tokens, requests, max_new: the step's tokens (score rows), requests, and longest request's new tokens.
        entries: the addressable entries bound (``StepBatch.addressable_entries(ratio)``); the score buffer is
            ``max(1, entries)`` columns wide.
        k: entries selected per token (``index_topk``).
        heads: indexer heads.
        key_format: the indexer keys' format (``"mxfp4"``, ``"fp8"``, ``"fp32"``); ``None`` or another format: no
            scores kernel (``scores=None``).
        score_dtype: ``torch.bfloat16`` (official) or ``torch.float32``.
        ratio, block_size, entries_per_page: the layer's compression ratio and pool geometry.
        sm_count, sm90, interpreted: the device planned for (``dsv4.kernels.device``: ``sm_count``, ``is_sm90``,
            ``interpreting``).
    """
    scores = None
    if key_format in SCORE_FORMATS:
        scores = plan_scores(key_format=key_format, heads=heads, requests=requests, max_new=max_new, entries=entries,
                             ratio=ratio, block_size=block_size, entries_per_page=entries_per_page,
                             sm_count=sm_count, sm90=sm90, interpreted=interpreted)
    topk = plan_topk(tokens, max(1, entries), k, score_dtype, sm_count=sm_count, sm90=sm90, interpreted=interpreted)
    return IndexerPlan(scores, topk)
