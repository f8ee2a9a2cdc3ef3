"""The official FP8 projections on the GPU (SPEC §1.3; ``formats.block_fp8`` defines them): activations quantized
per 1 × 128 block with UE8M0 scales in one launch (``quantize_activations``), then a block-scaled FP8 GEMM.

Two ways to run the GEMM over the same products (every product of two E4M3 values and two powers of two is exact
in FP32):

* ``"scaled_mm"`` — ``torch._scaled_mm`` with blockwise scales (FP8 tensor cores; the activation scales as a
  column-major ``[M, K/128]``, the weight scales as the transpose of their ``[N/128, K/128]``), where the device
  and torch take that recipe (``scaled_mm_works``: one probe per device). cuBLASLt takes it only for a row count
  that is a multiple of 4 (others: ``CUBLAS_STATUS_NOT_SUPPORTED``), so the rows are padded to one, and returns
  wrong values unless K/128 is a multiple of 4 (``scaled_mm_fits``; every V4 projection's K is). The tensor cores
  sum each 128-wide K block to about 14 bits (1.3–1.5e-4 relative, measured: ``benchmarks/probe_scaled_mm.py``),
  as the Triton block GEMM and the official model's FP8 kernels do, then add the blocks in FP32;
* ``"bf16"`` — a BF16 tensor-core GEMM over the quantized activations' values and the weight's values (both exact
  in BF16), summed in FP32: the reference's sums up to their order. The weight's BF16 copy is made once per weight.

The device's way is the step plan's fallback (``kernels.project.plan.ProjectionPlan``; decode rows over the large
weights take ``block_gemm`` instead); a projection whose shape ``scaled_mm_fits`` refuses (the tiny preset's) takes
``"bf16"``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...formats.block_fp8 import ACT_BLOCK, BlockFp8Weight
from .. import census
from ..quant import exp2i, fp8_block_qdq

__all__ = ["GEMMS", "as_codes", "attach_codes", "attached_codes", "fp8_linear", "new_codes", "quantize_activations",
           "scaled_mm_fits", "scaled_mm_works", "store_row_codes"]

GEMMS = ("scaled_mm", "bf16")
#: 128-value blocks per program of the quantization launch, and its warps (measured on the H200 over 4–16 blocks
#: and 2–8 warps: 16 × 4 is the fastest or within 0.6 µs of it at 8,192 rows, K = 1,024 / 4,096 / 8,192, and at
#: 64 rows; benchmarks/RESULTS.md, "FP8 projections")
BLOCKS_PER_PROGRAM = 16
QUANTIZE_WARPS = 4
#: ``torch._scaled_mm``'s blockwise recipe wants rows and K blocks in multiples of this (cuBLASLt's alignment)
SCALED_MM_ALIGN = 4


@triton.jit
def _quantize_activations_kernel(x_ptr, stride_x, out_ptr, scale_ptr, M, SCALE_ROWS, K, NB,
                                 VALUES: tl.constexpr, BLOCKS: tl.constexpr):
    """Row ``pid0``, blocks ``pid1·BLOCKS …`` of ``x`` ``[M, K]``: E4M3 codes (uint8 ``[SCALE_ROWS, K]``) or,
    ``VALUES``, their values (bf16 ``[SCALE_ROWS, K]``); the block scales (fp32, column-major ``[NB, SCALE_ROWS]``:
    ``scale_ptr + b·SCALE_ROWS + row``). Rows ``M … SCALE_ROWS − 1`` are pad rows: zeros and zero scales."""
    row = tl.program_id(0).to(tl.int64)
    pad = row >= M
    blk = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    cols = blk[:, None] * 128 + tl.arange(0, 128)[None, :]
    ok = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok & ~pad, other=0.0).to(tl.float32)
    code, val, ebyte = fp8_block_qdq(x, 1)
    if VALUES:
        tl.store(out_ptr + row * K + cols, tl.where(pad, 0.0, val).to(tl.bfloat16), mask=ok)
    else:
        tl.store(out_ptr + row * K + cols, tl.where(pad, 0, code).to(tl.uint8), mask=ok)
    tl.store(scale_ptr + blk.to(tl.int64) * SCALE_ROWS + row, tl.where(pad, 0.0, exp2i(ebyte - 127)), mask=blk < NB)


def quantize_activations(x: Tensor, values: bool = False, pad_rows: int = 0) -> tuple[Tensor, Tensor]:
    """The official ``act_quant`` of ``x`` ``[M, K]`` (bit for bit ``formats.block_fp8.quantize_activations``).

    ``pad_rows``: that many rows of zero codes and zero scales after x's (what ``torch._scaled_mm`` needs to reach
    a row count it takes), written by the same launch.

    Returns:
        ``(q, scales)``: ``q`` float8_e4m3fn ``[M + pad_rows, K]`` codes — or, ``values``, bf16
        ``[M + pad_rows, K]`` their values (exact) — and float32 scales ``[M + pad_rows, ⌈K/128⌉]``, column-major
        (a transposed view of a contiguous ``[⌈K/128⌉, M + pad_rows]``).
    """
    M, K = x.shape
    nb = -(-K // ACT_BLOCK)
    rows = M + pad_rows
    out, scales = new_codes(rows, K, x.device, torch.bfloat16 if values else torch.uint8)
    if rows:
        _quantize_activations_kernel[(rows, triton.cdiv(nb, BLOCKS_PER_PROGRAM))](
            x, x.stride(0), out, scales, M, rows, K, nb, VALUES=values, BLOCKS=BLOCKS_PER_PROGRAM,
            num_warps=QUANTIZE_WARPS, enable_fp_fusion=False)
    return (out, scales.t()) if values else as_codes(out, scales)


@triton.jit
def store_row_codes(y, row, codes_ptr, scale_ptr, K, SCALE_ROWS, BLOCK: tl.constexpr):
    """The official ``act_quant`` of one row, for a launch that makes the row: ``y`` fp32 ``[BLOCK]`` its values
    (exact BF16 values, zero past K; BLOCK a multiple of 128) → E4M3 codes at uint8 ``codes_ptr + row·K + c`` and
    the block scales at fp32 ``scale_ptr + b·SCALE_ROWS + row`` — ``quantize_activations``' layout and bits."""
    NB: tl.constexpr = BLOCK // 128
    code, _, ebyte = fp8_block_qdq(tl.reshape(y, (NB, 128)), 1)
    blk = tl.arange(0, NB)
    cols = blk[:, None] * 128 + tl.arange(0, 128)[None, :]
    tl.store(codes_ptr + row * K + cols, code.to(tl.uint8), mask=cols < K)
    tl.store(scale_ptr + blk.to(tl.int64) * SCALE_ROWS + row, exp2i(ebyte - 127), mask=blk * 128 < K)


#: the attribute under which a launch that made activations keeps their codes (``attach_codes``)
_CODES_ATTR = "_dsv4_fp8_block_codes"


def attach_codes(x: Tensor, codes: Tensor, scales: Tensor) -> Tensor:
    """Keep with ``x`` ``[M, K]`` its ``quantize_activations`` output ``(codes float8_e4m3fn [M, K], scales fp32
    [M, ⌈K/128⌉] column-major)``, made by the launch that wrote ``x``: the next FP8 GEMM over exactly this tensor
    object (``attached_codes``) skips its quantization launch. A view or copy of ``x`` has none; ``x`` must not be
    written again while they are kept (the norms that attach them return a new tensor each call). Returns ``x``."""
    setattr(x, _CODES_ATTR, (codes, scales))
    return x


def attached_codes(x: Tensor) -> tuple[Tensor, Tensor] | None:
    """The codes ``attach_codes`` kept with this tensor object, or ``None``."""
    return getattr(x, _CODES_ATTR, None)


def new_codes(M: int, K: int, device: torch.device, dtype: torch.dtype = torch.uint8) -> tuple[Tensor, Tensor]:
    """Empty ``(codes uint8 [M, K], scales fp32 [⌈K/128⌉, M])`` for a launch that quantizes ``M`` rows
    (``store_row_codes``; ``dtype`` bf16: the codes' values instead); ``as_codes`` gives the uint8 codes
    ``quantize_activations``' types and layout."""
    return (torch.empty((M, K), dtype=dtype, device=device),
            torch.empty((-(-K // ACT_BLOCK), M), dtype=torch.float32, device=device))


def as_codes(codes: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """``new_codes``' buffers as ``quantize_activations`` returns them (float8 codes, column-major scales)."""
    return codes.view(torch.float8_e4m3fn), scales.t()


def _bf16_weight(w: BlockFp8Weight) -> Tensor:
    """The weight's values in BF16 (exact), made once per weight."""
    cached = getattr(w, "_bf16", None)
    if cached is None:
        cached = w.dequantize(torch.bfloat16)
        object.__setattr__(w, "_bf16", cached)
    return cached


def fp8_linear(x: Tensor, w: BlockFp8Weight, out_dtype: torch.dtype, gemm: str) -> Tensor:
    """``x @ wᵀ`` with the official FP8 quantization points (``formats.block_fp8.fp8_linear``'s math).

    Args:
        x: ``[..., K]`` (BF16 activations). w: ``[N, K]`` block-scaled FP8. gemm: ``"scaled_mm"`` or ``"bf16"``
            (``GEMMS``; ``"scaled_mm"`` needs K and N multiples of 128).
    Returns:
        ``[..., N]`` in ``out_dtype``.
    """
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    M, N = x2.shape[0], w.shape[0]
    if gemm == "scaled_mm" and scaled_mm_fits(N, K) and M:
        q, s = quantize_activations(x2, pad_rows=-M % SCALED_MM_ALIGN)
        y = torch._scaled_mm(q, w.data.t(), scale_a=s, scale_b=w.scale.t(), out_dtype=out_dtype)[:M]
    else:
        xq, _ = quantize_activations(x2, values=True)
        y = torch.nn.functional.linear(xq, _bf16_weight(w)).to(out_dtype)
    return y.reshape(*lead, N)


def scaled_mm_fits(n: int, k: int) -> bool:
    """Whether ``torch._scaled_mm``'s blockwise recipe computes an ``[n, k]`` weight right: N a multiple of 128 and
    K of 4 · 128 (cuBLASLt reads the weight scales' K blocks in fours; with K/128 = 2, 3 or 5 it returned wrong
    values on the H200, torch 2.11)."""
    return n % ACT_BLOCK == 0 and k % (SCALED_MM_ALIGN * ACT_BLOCK) == 0


@functools.lru_cache(maxsize=None)
def scaled_mm_works(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` takes the blockwise recipe on ``device`` and matches the BF16 way on a probe
    (K = 512, N = 256; M = 1, 6 and 32: rows padded and not): checked once per device."""
    if device.type != "cuda":
        return False
    with census.device_query():  # a census worker asks too: its plan must pick the way the run's will
        return _scaled_mm_matches_bf16(device)


def _scaled_mm_matches_bf16(device: torch.device) -> bool:
    try:
        g = torch.Generator(device=device).manual_seed(0)
        w = BlockFp8Weight.quantize(torch.randn(256, 512, generator=g, device=device) * 0.05)
        for m in (1, 6, 32):
            x = torch.randn(m, 512, generator=g, device=device).bfloat16()
            a = fp8_linear(x, w, torch.bfloat16, "scaled_mm").float()
            b = fp8_linear(x, w, torch.bfloat16, "bf16").float()
            if a.shape != b.shape or not torch.allclose(a, b, rtol=2e-2, atol=1e-2):
                return False
    except (RuntimeError, TypeError, ValueError):
        return False
    return True
