"""BF16-step comparisons of a kernel's output with the torch backend's (which sums in another order)."""

from __future__ import annotations

import torch


def bf16_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of BF16 values at ``|x|`` (fp32)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2.0**-126))) - 7)


def check_close(got: torch.Tensor, want: torch.Tensor, step: torch.Tensor | None = None,
                equal_fraction: float = 0.99) -> None:
    """BF16 ``got`` finite, within ``step`` of ``want`` everywhere (default: one BF16 step at ``|want|``), and equal
    on at least ``equal_fraction`` of the elements."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.bfloat16
    g, w = got.float(), want.float()
    assert torch.isfinite(g).all()
    over = (g - w).abs() > (bf16_step(w) if step is None else step)
    assert not over.any(), f"{int(over.sum())} elements beyond the bound, e.g. {g[over][:4]} vs {w[over][:4]}"
    differ = float((g != w).float().mean())
    assert differ <= 1 - equal_fraction, f"{differ:.2%} of the elements differ"


def check_queries(got: torch.Tensor, want: torch.Tensor, rope_dim: int = 64) -> None:
    """``check_close`` for queries ``[T, H, D]``: one BF16 step on the nope dims, two steps at the (re, im) pair's
    norm on the rope dims — the rotation keeps the norm, and a one-step difference of each of its two BF16 inputs
    (where two sums of squares round apart) moves an output of smaller magnitude by up to that much."""
    w = want.float()
    step = bf16_step(w)
    pairs = w[..., -rope_dim:].unflatten(-1, (rope_dim // 2, 2))
    norm = pairs.norm(dim=-1, keepdim=True).expand_as(pairs).flatten(-2)
    step[..., -rope_dim:] = torch.maximum(step[..., -rope_dim:], 2 * bf16_step(norm))
    check_close(got, want, step)
