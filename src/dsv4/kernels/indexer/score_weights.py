"""The indexer's per-head score weights as the scores kernels read them, in one launch (SPEC §5):
``w[t, h] = (p[t, h] · s) · q_scale[t, h]`` for the step's ``H`` heads, 0 on the padded heads ``H … HP−1``.

``p`` is the per-head weight projection ``W_w x`` (BF16, as the official model rounds it; or its FP32 sums, which
``round_bf16`` rounds to BF16 first, as the official BF16 GEMM rounds its output; ``s`` = ``c_I^{-1/2} H_I^{-1/2}``)
— or weights already scaled (float32, ``s`` = 1: multiplying by 1 changes no bit) — and
``q_scale`` the MXFP4 queries' per-head scale (``mxfp4_queries``). The torch ops this replaces (a cast, a product
by ``s``, a zero fill, a copy into the padded width and a product by ``q_scale``) round the same two FP32 products
in the same order: the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..quant import bf16_round

__all__ = ["score_weights"]


@triton.jit
def _score_weights_kernel(p_ptr, p_stride, s, qs_ptr, out_ptr, H, HP: tl.constexpr, ROUND_BF16: tl.constexpr):
    """Row ``pid`` of ``out`` fp32 ``[T, HP]`` from ``p`` ``[T, H]`` (row stride ``p_stride``; ``ROUND_BF16``: fp32
    sums, rounded to BF16 first) and ``qs`` fp32 ``[T, HP]``."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HP)
    ok = h < H
    p = tl.load(p_ptr + t * p_stride + h, mask=ok, other=0.0).to(tl.float32)
    if ROUND_BF16:
        p = bf16_round(p)
    w = (p * s) * tl.load(qs_ptr + t * HP + h)
    tl.store(out_ptr + t * HP + h, tl.where(ok, w, 0.0))


def score_weights(p: Tensor, s: float, q_scale: Tensor, round_bf16: bool = False) -> Tensor:
    """``w`` float32 ``[T, HP]`` (see the module docstring).

    Args:
        p: ``[T, H]`` BF16 projection ``W_w x``, float32 sums of it (``round_bf16``) or float32 scaled weights, rows
            with unit inner stride.
        s: the scale applied to ``p`` (``index_weight_scale``, or 1.0 for scaled weights).
        q_scale: float32 ``[T, HP]`` contiguous, ``HP ≥ H`` a power of two.
        round_bf16: ``p`` holds float32 sums to round to BF16 first.
    Raises:
        ValueError: shapes or dtypes that do not fit.
    """
    T, H = p.shape
    HP = q_scale.shape[1] if q_scale.dim() == 2 else -1
    if (q_scale.shape[0] != T or HP < H or HP & (HP - 1) or q_scale.dtype != torch.float32
            or not q_scale.is_contiguous() or p.stride(1) != 1 or p.dtype not in (torch.bfloat16, torch.float32)
            or (round_bf16 and p.dtype != torch.float32)):
        raise ValueError(f"score_weights: p {p.dtype} {list(p.shape)} (round_bf16={round_bf16}) and q_scale "
                         f"{q_scale.dtype} {list(q_scale.shape)} do not fit (q_scale [T, HP ≥ H] float32, HP a power "
                         f"of two; sums to round are float32)")
    out = torch.empty_like(q_scale)
    if T:
        _score_weights_kernel[(T,)](p, p.stride(0), float(s), q_scale, out, H, HP=HP, ROUND_BF16=round_bf16,
                                    num_warps=1, enable_fp_fusion=False)
    return out
