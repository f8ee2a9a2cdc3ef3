"""Partial interleaved RoPE (SPEC §2.2): the last ``R`` dims of a vector, adjacent channel pairs, FP32 math."""

from __future__ import annotations

import math

import torch

from ..config import LayerKind, ModelConfig

__all__ = ["rope_inv_freq", "apply_rope"]


def rope_inv_freq(cfg: ModelConfig, kind: LayerKind, device: torch.device | str | None = None) -> torch.Tensor:
    """Per-pair angular frequencies ``ω_i`` of a layer kind, as the official ``precompute_freqs_cis``.

    Sliding-only layers: ``ω_i = θ^{-2i/R}`` with θ = ``rope_theta``, no YaRN. CSA/HCA layers: θ =
    ``compress_rope_theta``, with YaRN when ``cfg.compress_rope_type == "yarn"`` (the official models) — pairs
    below ``low`` keep ``ω⁰_i``, pairs above ``high`` get ``ω⁰_i/factor``, linear blend between (no magnitude
    scale) — and plain ``θ^{-2i/R}`` when it is ``"default"``.

    Returns:
        ``[R/2]`` float32.
    """
    dim = cfg.rope_dim
    base = cfg.rope_theta if kind is LayerKind.SWA else cfg.compress_rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if kind is not LayerKind.SWA and cfg.compress_rope_type == "yarn":

        def correction_dim(num_rotations: float) -> float:
            return dim * math.log(cfg.yarn_original_seq_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(cfg.yarn_beta_fast)), 0)
        high = min(math.ceil(correction_dim(cfg.yarn_beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / cfg.yarn_factor * (1 - smooth) + freqs * smooth
    return freqs.to(device)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``2·len(inv_freq)`` dims of ``x`` by ``±p·ω_i`` per adjacent pair ``(2i, 2i+1)``.

    Args:
        x: ``[T, ..., D]`` any float dtype; the leading ``D − R`` dims pass through untouched.
        positions: ``[T]`` integer positions (one per leading row of ``x``).
        inv_freq: ``[R/2]`` float32 from :func:`rope_inv_freq`.
        inverse: rotate by ``−p·ω`` (the inverse RoPE on the attention output, SPEC §3 step 6).
    Returns:
        ``x`` with its rope dims rotated, same shape and dtype (rotation computed in FP32, rounded once).
    """
    half = inv_freq.numel()
    angle = positions.to(torch.float32).reshape(-1, *([1] * (x.dim() - 2)), 1) * inv_freq.to(x.device)
    cos, sin = angle.cos(), angle.sin()
    if inverse:
        sin = -sin
    rope = x[..., -2 * half :].float().unflatten(-1, (half, 2))
    re, im = rope[..., 0], rope[..., 1]
    rotated = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., : -2 * half], rotated.to(x.dtype)), dim=-1)
