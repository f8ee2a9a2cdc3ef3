"""Small shared primitives: RMSNorm (SPEC §2.1) and a linear layer in the activation dtype."""

from __future__ import annotations

import torch

__all__ = ["rms_norm", "linear"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``w ⊙ x / sqrt(mean(x²) + eps)`` over the last dim, computed in FP32 and cast back to ``x.dtype``.

    Args:
        x: ``[..., n]`` any float dtype.
        weight: ``[n]`` or ``None`` for the unweighted (per-head query) norm.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x @ weight.T`` with both operands in ``dtype`` (BF16 GEMM with FP32 accumulation, or FP32).

    Args:
        x: ``[..., in]``; weight: ``[out, in]``. Returns ``[..., out]`` in ``dtype``.
    """
    return torch.nn.functional.linear(x.to(dtype), weight.to(device=x.device, dtype=dtype))
