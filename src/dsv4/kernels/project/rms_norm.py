"""Weighted RMSNorm of the layer's activations in one launch: ``w ⊙ x / sqrt(mean(x²) + eps)``, BF16 in and out.

``reference.primitives.rms_norm`` on the torch backend is about eight kernels (casts, square, mean, add, rsqrt, two
products, the cast back), each a pass over the rows. Here one program normalizes one row:

* 512 channels (the window KV ``RMSNorm(W_kv x)``, which the cache stores): one warp per row, the sum of squares
  in the order of torch's CUDA reduce kernel for ``rows`` rows (``csa_entries.add_chunk_squares`` /
  ``entry_rms_scale``, the compressor entries' RMSNorm) — the same bits as the torch backend
  (``tests/kernels/write/test_write_path_gpu.py::test_rms_norm_lanes_order_matches_torch`` checks that order, 1 to
  9,438 rows);
* other widths (``c^Q``, 1,536 channels for V4-Flash): Triton's summation order — within one BF16 step of the torch
  backend's (``tests/kernels/project/test_rms_norm.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..torch_order import add_chunk_squares, entry_rms_scale, zero_square_sums
from ..quant import bf16_round, rsqrtf
from .fp8_gemm import as_codes, attach_codes, new_codes, store_row_codes

__all__ = ["rms_norm"]


@triton.jit
def _rms_norm_512_kernel(x_ptr, stride_x, w_ptr, out_ptr, rows, eps):
    """Row ``pid`` of bf16 ``x`` ``[rows, 512]`` (rows ``stride_x`` apart) → bf16 ``out`` (contiguous; one warp;
    torch's order for ``rows`` rows)."""
    row = tl.program_id(0).to(tl.int64)
    src = x_ptr + row * stride_x
    cols = tl.arange(0, 128)  # thread l: channels 128k + 4l … 128k + 4l + 3 of chunk k
    sums = zero_square_sums()
    for k in tl.static_range(4):
        sums = add_chunk_squares(tl.load(src + k * 128 + cols).to(tl.float32), k, *sums)
    r = entry_rms_scale(*sums, rows, eps)
    for k in tl.static_range(4):
        x = tl.load(src + k * 128 + cols).to(tl.float32)
        y = bf16_round(tl.load(w_ptr + k * 128 + cols) * (x * r))
        tl.store(out_ptr + row * 512 + k * 128 + cols, y.to(tl.bfloat16))


@triton.jit
def _rms_norm_kernel(x_ptr, stride_x, w_ptr, out_ptr, codes_ptr, scale_ptr, rows, C, inv_c, eps,
                     BLOCK: tl.constexpr, QUANTIZE: tl.constexpr):
    """Row ``pid`` of bf16 ``x`` ``[rows, C]`` (rows ``stride_x`` apart) → bf16 ``out`` (contiguous; ``C ≤ BLOCK``;
    Triton's summation order; the mean as torch takes it: the sum times fp32 ``inv_c = 1/C``); ``QUANTIZE``: also
    the row's FP8 codes and scales (``fp8_gemm.store_row_codes``)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < C
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    r = rsqrtf(tl.sum(x * x) * inv_c + eps)
    y = bf16_round(tl.load(w_ptr + cols, mask=ok, other=0.0) * (x * r))
    tl.store(out_ptr + row * C + cols, y.to(tl.bfloat16), mask=ok)
    if QUANTIZE:
        store_row_codes(y, row, codes_ptr, scale_ptr, C, rows, BLOCK)


def rms_norm(x: Tensor, weight: Tensor, eps: float, quantize: bool = False) -> Tensor:
    """``reference.primitives.rms_norm(x, weight, eps)`` in one launch.

    Args:
        x: bf16 ``[rows, C]``, rows any stride apart (a column block of a wider GEMM output is read in place).
            weight: ``[C]`` (used as fp32). eps: the epsilon.
        quantize: the same launch also makes the result's official FP8 codes and scales and attaches them
            (``fp8_gemm.attach_codes``: the FP8 GEMM that reads the result skips its quantization launch); C ≠ 512.
    Returns:
        bf16 ``[rows, C]``, contiguous: bit for bit the torch backend's for C = 512, else within one BF16 step.
    Raises:
        ValueError: ``x`` not a bf16 matrix, ``weight`` not ``[C]``, or ``quantize`` with C = 512.
    """
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"rms_norm takes a bf16 [rows, C] tensor, got {x.dtype} {list(x.shape)}")
    rows, C = x.shape
    if weight.shape != (C,):
        raise ValueError(f"weight must be [{C}], got {list(weight.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    w = weight.to(device=x.device, dtype=torch.float32).contiguous()
    out = torch.empty((rows, C), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    if C == 512:
        if quantize:
            raise ValueError("rms_norm: quantize is not offered for the 512-channel (window KV) norm")
        _rms_norm_512_kernel[(rows,)](x, x.stride(0), w, out, rows, float(eps), num_warps=1, enable_fp_fusion=False)
        return out
    block = max(128 if quantize else 1, triton.next_power_of_2(C))  # whole 128-blocks to quantize
    codes, scales = new_codes(rows, C, x.device) if quantize else (out, out)
    _rms_norm_kernel[(rows,)](x, x.stride(0), w, out, codes, scales, rows, C, 1.0 / C, float(eps), BLOCK=block,
                              QUANTIZE=quantize, num_warps=max(1, min(8, block // 256)), enable_fp_fusion=False)
    return attach_codes(out, *as_codes(codes, scales)) if quantize else out
