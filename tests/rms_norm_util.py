"""Shared check of ``tests/test_rms_norm.py`` (imported by its interpreter subprocess too)."""

from __future__ import annotations

import torch


def check_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` within one BF16 step of ``want`` everywhere and equal on at least 99% of the elements."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.bfloat16
    g, w = got.float(), want.float()
    assert torch.isfinite(g).all()
    step = torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(2.0**-126))) - 7)
    over = (g - w).abs() > step
    assert not over.any(), f"{int(over.sum())} elements beyond one BF16 step, e.g. {g[over][:4]} vs {w[over][:4]}"
    differ = float((g != w).float().mean())
    assert differ <= 0.01, f"{differ:.2%} of the elements differ"
