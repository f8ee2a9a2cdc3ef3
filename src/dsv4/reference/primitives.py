"""Small shared primitives: RMSNorm (SPEC §2.1) and a linear layer in the activation dtype."""

from __future__ import annotations

import torch

from ..formats.block_fp8 import BlockFp8Weight, fp8_linear
from ..numerics import Numerics

__all__ = ["rms_norm", "linear", "project"]


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


def project(x: torch.Tensor, weight: torch.Tensor | BlockFp8Weight, numerics: Numerics,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """One of the projections DeepSeek runs as FP8 GEMMs (``wq_a``, ``wq_b``, ``wkv``, ``wo_b``, the indexer's
    ``wq_b``; SPEC §1.3), as ``numerics`` says: ``fp8_projections`` — ``x`` quantized per 1 × 128 block (UE8M0),
    the weight as block-scaled FP8 (a plain weight is quantized the way the checkpoints are), products summed in
    FP32 (``formats.block_fp8.fp8_linear``); else ``linear`` in the activation dtype on the dequantized weight.

    Args:
        x: ``[..., in]``; weight: ``[out, in]`` (a tensor or a ``BlockFp8Weight``).
        out_dtype: the sums' dtype (default ``numerics.act_dtype``); ``torch.float32`` keeps the FP32 sums
            unrounded (the operands are rounded as always) — partial sums that are added up before rounding
            (tensor parallelism, ``dsv4.distributed``).
    Returns ``[..., out]`` in ``out_dtype``.
    """
    act = numerics.act_dtype
    if numerics.fp8_projections:
        w8 = weight if isinstance(weight, BlockFp8Weight) else BlockFp8Weight.quantize(weight)
        return fp8_linear(x, w8, out_dtype or act)
    if isinstance(weight, BlockFp8Weight):
        weight = weight.dequantize()
    if out_dtype is None or out_dtype == act:
        return linear(x, weight, act)
    return linear(x.to(act), weight.to(act), out_dtype)
