"""Core attention (SPEC §3 step 5): one softmax over a query's keys with a per-head sink in the denominator."""

from __future__ import annotations

import torch

__all__ = ["attend_with_sink", "masked_logits", "shifted_probabilities", "window_indices"]


def window_indices(positions: torch.Tensor, window: int) -> torch.Tensor:
    """Positions of each query's sliding-window keys ``t−W+1 … t`` (−1 before position 0).

    Args:
        positions: ``[T]`` int. Returns ``[T, W]`` int64, oldest first.
    """
    idx = positions.long()[:, None] - torch.arange(window - 1, -1, -1, device=positions.device)[None, :]
    return idx.masked_fill(idx < 0, -1)


def masked_logits(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``z_hj = scale · q_h·k_j`` in FP32, −inf at invalid keys (args as ``attend_with_sink``).
    Returns ``(keys float32 [T, K, D], z float32 [T, H, K])``."""
    kf = keys.float()
    logits = torch.einsum("thd,tkd->thk", q.float(), kf) * scale
    return kf, logits.masked_fill(~valid[:, None, :], float("-inf"))


def shifted_probabilities(logits: torch.Tensor, row_max: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``p_hj = e^{z_hj − M_h}``: ``M_h`` the largest logit over the valid keys (``row_max`` ``[T, H, 1]``: given,
    e.g. the maximum over several ranks' keys), 0 where there is none. Returns ``(p [T, H, K], M [T, H, 1])``."""
    if row_max is None:
        row_max = logits.amax(dim=-1, keepdim=True)  # the real keys only, as the reference kernel
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    return torch.exp(logits - row_max), row_max


def attend_with_sink(
    q: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    prob_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``o_h = Σ_j e^{z_hj} k_j / (Σ_j e^{z_hj} + e^{sink_h})`` with ``z_hj = scale · q_h·k_j`` (K ≡ V).

    All heads of a query share its keys (MQA with one shared KV head).

    Args:
        q: ``[T, H, D]`` queries. keys: ``[T, K, D]`` each query's keys (also its values).
        valid: ``[T, K]`` bool; invalid slots get logit −∞.
        sink: ``[H]`` sink logits (no value). scale: softmax scale ``D^{-1/2}``.
        prob_dtype: probabilities are cast to this before P·V (BF16 in the official kernel); the denominator uses
            the FP32 probabilities.
        out_dtype: dtype of the output.
    Returns:
        ``o``: ``[T, H, D]`` in ``out_dtype``; ``lse``: ``[T, H]`` float32, ``log(Σ_j e^{z_hj} + e^{sink_h})``.
    """
    kf, logits = masked_logits(q, keys, valid, scale)
    p, row_max = shifted_probabilities(logits)
    denom = p.sum(dim=-1) + torch.exp(sink.float()[None, :] - row_max[..., 0])
    o = torch.einsum("thk,tkd->thd", p.to(prob_dtype).float(), kf) / denom[..., None]
    return o.to(out_dtype), row_max[..., 0] + torch.log(denom)
