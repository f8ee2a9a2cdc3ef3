"""One softmax with a sink over keys spread across ranks (context parallelism): each rank holds a disjoint part
``K_r`` of a query's keys, and the parts combine exactly (SPEC §3 step 5), the sink counted once. Two forms:

* ``"sums"`` (``attend_shared_max``) — the ranks agree on the largest logit ``M`` over all keys first (an
  all-reduce of ``[T, H]`` maxima), each sums ``e^{z_j − M}`` and ``bf16(e^{z_j − M}) · k_j`` over its keys, one
  all-reduce adds those up, and ``o = Σ num / (Σ den + e^{sink − M})``: every probability is rounded exactly as
  one process rounds it; only the order of the FP32 sums differs. Two collectives; the logits must be known
  before the sums (a kernel would need the maximum first).
* ``"lse"`` (``partial_attention`` + ``merge_across``) — each rank attends its keys alone (its own maximum, no
  sink) and returns ``(o_r, lse_r)``; one all-gather, then ::

      lse = log(Σ_r e^{lse_r} + e^{sink}),   o = Σ_r e^{lse_r − lse} · o_r

  exact in real arithmetic, one pass over the keys per rank — the form of the attention kernels' split partials
  (``kernels.attention.combine``), so a GPU path merges the Triton attention's ``(o, lse)`` (run with a sink of
  −∞) this way. Under numerics that round probabilities before P·V (BF16, ``"official"``) each rank rounds
  ``e^{z − M_r}`` relative to its own maximum: the output differs from one process's by that rounding (which the
  FP8 input quantization of ``wo_b`` can amplify to whole E4M3 steps of a few of its inputs).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..reference.core import masked_logits, shifted_probabilities
from .collectives import all_gather_stacked, all_reduce_max, all_reduce_sum

__all__ = ["MERGES", "attend_shared_max", "merge_across", "merge_partials", "partial_attention"]

#: how the ranks' parts of a softmax combine (module docstring)
MERGES = ("sums", "lse")


def attend_shared_max(q: Tensor, keys: Tensor, valid: Tensor, sink: Tensor, scale: float, prob_dtype: torch.dtype,
                      group) -> tuple[Tensor, Tensor]:
    """``reference.core.attend_with_sink`` over the union of every rank's keys (``"sums"``, module docstring).

    Args:
        q: ``[T, H, D]``. keys: ``[T, K, D]`` this rank's part (also the values). valid: bool ``[T, K]``.
        sink: ``[H]``. scale, prob_dtype: as ``attend_with_sink``. group: the ranks holding the other parts.
    Returns:
        ``o`` float32 ``[T, H, D]``, ``lse`` float32 ``[T, H]`` (sink included) — the same on every rank.
    """
    kf, logits = masked_logits(q, keys, valid, scale)
    p, row_max = shifted_probabilities(logits, all_reduce_max(logits.amax(dim=-1, keepdim=True), group))
    sums = torch.cat((torch.einsum("thk,tkd->thd", p.to(prob_dtype).float(), kf), p.sum(dim=-1)[..., None]), dim=-1)
    all_reduce_sum(sums, group)
    denom = sums[..., -1] + torch.exp(sink.float()[None, :] - row_max[..., 0])
    return sums[..., :-1] / denom[..., None], row_max[..., 0] + torch.log(denom)


def partial_attention(q: Tensor, keys: Tensor, valid: Tensor, scale: float, prob_dtype: torch.dtype
                      ) -> tuple[Tensor, Tensor]:
    """One part of a softmax without the sink (``"lse"``): ``(o_r, lse_r)`` over this part's keys.

    Args:
        q: ``[T, H, D]`` queries. keys: ``[T, K, D]`` the part's keys (also its values). valid: bool ``[T, K]``.
        scale, prob_dtype: as ``reference.core.attend_with_sink``.
    Returns:
        ``o_r`` float32 ``[T, H, D]`` (0 where the part has no valid key), ``lse_r`` float32 ``[T, H]`` (−inf there).
    """
    kf, logits = masked_logits(q, keys, valid, scale)
    p, row_max = shifted_probabilities(logits)
    denom = p.sum(dim=-1)
    o = torch.einsum("thk,tkd->thd", p.to(prob_dtype).float(), kf) / denom.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    lse = torch.where(denom > 0, row_max[..., 0] + torch.log(denom), torch.full_like(denom, float("-inf")))
    return o, lse


def merge_partials(o_parts: Tensor, lse_parts: Tensor, sink: Tensor) -> tuple[Tensor, Tensor]:
    """Merge ``P`` parts of one softmax and add the sink once (``"lse"``, module docstring).

    Args:
        o_parts: float32 ``[P, T, H, D]``. lse_parts: float32 ``[P, T, H]`` (−inf: an empty part).
        sink: ``[H]`` sink logits.
    Returns:
        ``o`` float32 ``[T, H, D]``, ``lse`` float32 ``[T, H]`` (sink included).
    """
    P, T, H = lse_parts.shape
    lse = torch.logsumexp(torch.cat((lse_parts, sink.float().expand(1, T, H))), dim=0)
    weights = torch.exp(lse_parts - lse)  # [P, T, H]; 0 for an empty part
    return (weights[..., None] * o_parts).sum(dim=0), lse


def merge_across(o: Tensor, lse: Tensor, sink: Tensor, group) -> tuple[Tensor, Tensor]:
    """``merge_partials`` of every rank's ``(o, lse)`` in ``group`` — one all-gather of ``[T, H, D + 1]`` float32
    per rank; every rank computes the same merge. Shapes as ``merge_partials`` without ``P``."""
    D = o.shape[-1]
    parts = all_gather_stacked(torch.cat((o.float(), lse.float()[..., None]), dim=-1), group)
    return merge_partials(parts[..., :D], parts[..., D], sink)
