"""Normalized Sylvester Walsh-Hadamard transform (SPEC §2.3): ``Had(v) = H_n v / sqrt(n)``.

``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``; ``H_n`` is symmetric and ``H_n H_n^T = n I``, so the normalized
transform is orthonormal. This matches ``fast_hadamard_transform.hadamard_transform(x, scale=n**-0.5)`` up to fp32
summation order.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

__all__ = ["hadamard_matrix", "hadamard_transform"]


def _check_pow2(n: int, fn: str) -> None:
    if not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"{fn}: size must be a power of two >= 1, got {n!r}")


@lru_cache(maxsize=None)
def _hadamard_cached(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h.to(dtype=dtype, device=device)


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> Tensor:
    """Sylvester-ordered ``+-1`` Hadamard matrix (unnormalized).

    Args:
        n: size, a power of two.
        dtype, device: of the result (default fp32 on the CPU).
    Returns:
        ``[n, n]`` tensor with entries +-1. Cached per ``(n, dtype, device)``: do not modify it in place.
    """
    _check_pow2(n, "hadamard_matrix")
    return _hadamard_cached(n, dtype, torch.device(device if device is not None else "cpu"))


def hadamard_transform(x: Tensor) -> Tensor:
    """Normalized transform ``x @ H_n * n**-0.5`` along the last dim, computed in fp32.

    Implemented as ``log2(n)`` add/subtract butterfly stages in fp32 (no matmul, so it is never run in TF32), then a
    multiply by ``fp32(n**-0.5)`` as ``fast_hadamard_transform`` does.

    Args:
        x: floating ``[..., n]``, ``n`` a power of two.
    Returns:
        float32 ``[..., n]``.
    """
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point or x.dim() == 0:
        raise ValueError("hadamard_transform: expected a floating tensor with at least one dimension")
    n = x.shape[-1]
    _check_pow2(n, "hadamard_transform")
    y = x.float()
    lead = y.shape[:-1]
    h = 1
    while h < n:
        # y viewed as [..., n / 2h, 2, h]: pairs (a, b) at distance h become (a + b, a - b).
        yb = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = yb[..., 0, :], yb[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*lead, n)
        h *= 2
    return y * (1.0 / math.sqrt(n))
