"""Shared check of ``tests/test_queries.py`` (imported by its interpreter subprocess too)."""

from __future__ import annotations

import torch


def _bf16_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of BF16 values at ``|x|`` (fp32)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2.0**-126))) - 7)


def check(got: torch.Tensor, want: torch.Tensor, rope_dim: int = 64) -> None:
    """``got`` ``[T, H, D]`` within one BF16 step of ``want`` on the nope dims and two steps at the (re, im) pair's
    norm on the rope dims — the rotation keeps the norm, and a one-step difference of each of its two BF16 inputs
    (where the two sums of squares round apart) moves an output of smaller magnitude by up to that much — and equal
    on at least 99% of the elements."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.bfloat16
    g, w = got.float(), want.float()
    assert torch.isfinite(g).all()
    step = _bf16_step(w)
    pairs = w[..., -rope_dim:].unflatten(-1, (rope_dim // 2, 2))
    norm = pairs.norm(dim=-1, keepdim=True).expand_as(pairs).flatten(-2)
    step[..., -rope_dim:] = torch.maximum(step[..., -rope_dim:], 2 * _bf16_step(norm))
    over = (g - w).abs() > step
    assert not over.any(), f"{int(over.sum())} elements beyond one BF16 step, e.g. {g[over][:4]} vs {w[over][:4]}"
    differ = float((g != w).float().mean())
    assert differ <= 0.01, f"{differ:.2%} of the elements differ (the sum order alone flips far fewer)"
