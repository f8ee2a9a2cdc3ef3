"""The residual update between two layers and the next layer's input norm in one launch.

The engine's stack is ``h ← h + Attention_l(x_l)`` with ``x_l = rms_norm(h)`` (unweighted, cast to the activation
dtype; MoE and mHC are out of scope). In torch the two are about eight kernels per layer (the add, the square, the
mean, the epsilon, the rsqrt, the product, the casts). ``residual_rms_norm`` does one row per program:

    h_out = h + y.float()                                    fp32, bit for bit torch's add
    x     = (h_out * rsqrt(mean(h_out²) + eps)).to(act)      the mean as torch's CUDA kernel takes it (the sum
                                                             times fp32 1/d), Triton's summation order

so ``h_out`` equals the torch result exactly and ``x`` is within one step of the activation dtype (in BF16 nearly
always equal; an fp32 ``x`` within a few fp32 ulps). Variants: no ``y`` (the first layer: only the norm, ``h`` is
read and left alone) and no norm (after the last layer: only the add).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..quant import bf16_round, rsqrtf
from .fp8_gemm import as_codes, attach_codes, new_codes, store_row_codes

__all__ = ["residual_rms_norm"]

_ACT_DTYPES = (torch.bfloat16, torch.float32)


@triton.jit
def _residual_norm_kernel(h_ptr, y_ptr, h_out_ptr, x_ptr, codes_ptr, scale_ptr, rows, d, inv_d, eps, h_stride,
                          y_stride, h_out_stride, x_stride, ADD: tl.constexpr, NORM: tl.constexpr,
                          X_BF16: tl.constexpr, QUANTIZE: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``pid``: ``h_out = h + y`` (``ADD``), ``x = norm(h_out)`` (``NORM``; bf16 when ``X_BF16``, else fp32);
    ``QUANTIZE`` (bf16 ``x``): also ``x``'s FP8 codes and scales (``fp8_gemm.store_row_codes``). ``d ≤ BLOCK``;
    strides in elements. Loads precede stores, so ``h_out`` may be ``h``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < d
    h = tl.load(h_ptr + row * h_stride + cols, mask=ok, other=0.0)
    if ADD:
        h = h + tl.load(y_ptr + row * y_stride + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(h_out_ptr + row * h_out_stride + cols, h, mask=ok)
    if NORM:
        x = h * rsqrtf(tl.sum(h * h) * inv_d + eps)
        if X_BF16:
            x = bf16_round(x)  # round to nearest even here: the interpreter's cast truncates
        tl.store(x_ptr + row * x_stride + cols, x.to(x_ptr.dtype.element_ty), mask=ok)
        if QUANTIZE:
            store_row_codes(tl.where(ok, x, 0.0), row, codes_ptr, scale_ptr, d, rows, BLOCK)


def _require_rows(name: str, t: Tensor, shape: tuple[int, int], dtypes: tuple[torch.dtype, ...],
                  device: torch.device) -> None:
    """``t`` a ``shape`` matrix of one of ``dtypes`` on ``device`` whose rows are contiguous."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must be [{shape[0]}, {shape[1]}], got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, h on {device}")
    if shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name}'s rows must be contiguous (stride 1 along d), got strides {t.stride()}")


def _byte_range(t: Tensor) -> tuple[int, int]:
    """``[first, last)`` bytes of the matrix ``t``."""
    span = (t.shape[0] - 1) * t.stride(0) + t.shape[1] if t.numel() else 0
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def _overlap(a: Tensor, b: Tensor) -> bool:
    (a0, a1), (b0, b1) = _byte_range(a), _byte_range(b)
    return a0 < b1 and b0 < a1


def residual_rms_norm(
    h: Tensor,
    y: Tensor | None = None,
    *,
    eps: float,
    act_dtype: torch.dtype = torch.bfloat16,
    norm: bool = True,
    h_out: Tensor | None = None,
    x_out: Tensor | None = None,
    quantize: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``h_out = h + y.float()`` and ``x = (h_out * rsqrt(mean(h_out²) + eps)).to(act_dtype)`` in one launch.

    Args:
        h: fp32 ``[T, d]`` the residual stream (rows contiguous; any ``d ≥ 1``).
        y: ``[T, d]`` bf16 or fp32, the previous layer's output; ``None``: no add (``x`` is the norm of ``h``, which
            is returned as ``h_out`` untouched).
        eps: the norm's epsilon (``ModelConfig.norm_eps``).
        act_dtype: ``x``'s dtype, bf16 or fp32.
        norm: compute ``x``; ``False``: only the add (after the last layer; needs ``y``).
        h_out: fp32 ``[T, d]`` where to write the sum (default: a new tensor); may be ``h`` itself (in place), must
            not otherwise overlap ``h``, ``y`` or ``x_out``. Only with ``y``.
        x_out: ``act_dtype`` ``[T, d]`` where to write ``x`` (default: a new tensor); must not overlap the others.
        quantize: the same launch also makes ``x``'s official FP8 codes and scales and attaches them
            (``fp8_gemm.attach_codes``: the next layer's input GEMM skips its quantization launch); bf16 ``x`` only.
    Returns:
        ``(h_out, x)``: fp32 ``[T, d]`` the residual after the add (bit for bit ``h + y.float()``; ``h`` when ``y``
        is ``None``), and ``act_dtype`` ``[T, d]`` the next layer's input (``None`` when not ``norm``).
    Raises:
        ValueError: a tensor of the wrong shape, dtype, device or layout; overlapping outputs; nothing to compute.
    No host synchronisation; allocates only the outputs not given (graph-safe).
    """
    if not isinstance(h, Tensor) or h.dim() != 2:
        raise ValueError(f"h must be an fp32 [T, d] tensor, got {getattr(h, 'dtype', type(h).__name__)} "
                         f"{list(getattr(h, 'shape', []))}")
    shape, dev = (int(h.shape[0]), int(h.shape[1])), h.device
    if shape[1] < 1:
        raise ValueError("h must have d >= 1 channels")
    _require_rows("h", h, shape, (torch.float32,), dev)
    if act_dtype not in _ACT_DTYPES:
        raise ValueError(f"act_dtype must be torch.bfloat16 or torch.float32, got {act_dtype}")
    eps = float(eps)
    if not eps >= 0.0 or eps == float("inf"):
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    if y is None:
        if not norm:
            raise ValueError("nothing to compute: no y to add and norm=False")
        if h_out is not None:
            raise ValueError("h_out is only written with y (without y, h is returned as is)")
    else:
        _require_rows("y", y, shape, _ACT_DTYPES, dev)
    if not norm and x_out is not None:
        raise ValueError("x_out given with norm=False")
    if quantize and not (norm and act_dtype == torch.bfloat16):
        raise ValueError("quantize needs norm=True and act_dtype torch.bfloat16 (the FP8 GEMMs' activations)")
    if h_out is not None:
        _require_rows("h_out", h_out, shape, (torch.float32,), dev)
        in_place = h_out.data_ptr() == h.data_ptr() and h_out.stride() == h.stride()
        if (not in_place and _overlap(h_out, h)) or _overlap(h_out, y):
            raise ValueError("h_out overlaps h (other than being h itself) or y")
    if x_out is not None:
        _require_rows("x_out", x_out, shape, (act_dtype,), dev)
        if any(t is not None and _overlap(x_out, t) for t in (h, y, h_out)):
            raise ValueError("x_out overlaps h, y or h_out")
    add = y is not None
    if add and h_out is None:
        h_out = torch.empty(shape, dtype=torch.float32, device=dev)
    x = (x_out if x_out is not None else torch.empty(shape, dtype=act_dtype, device=dev)) if norm else None
    if shape[0] > 0:
        T, d = shape
        block = max(128 if quantize else 32, triton.next_power_of_2(d))  # a warp's width; whole 128-blocks
        h_res = h_out if add else h
        codes, scales = new_codes(T, d, dev) if quantize else (h, h)
        _residual_norm_kernel[(T,)](
            h, y if add else h, h_res, x if norm else h, codes, scales, T, d, 1.0 / d, eps, h.stride(0),
            y.stride(0) if add else 0, h_res.stride(0), x.stride(0) if norm else 0,
            ADD=add, NORM=norm, X_BF16=act_dtype == torch.bfloat16, QUANTIZE=quantize, BLOCK=block,
            num_warps=max(1, min(16, block // 512)), enable_fp_fusion=False,
        )
        if quantize:
            attach_codes(x, *as_codes(codes, scales))
    return (h_out if add else h), x
