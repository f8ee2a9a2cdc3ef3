"""FP4 (E2M1) helpers and FP4 storage formats.

* E2M1 codes: ``code = sign << 3 | exp << 1 | mantissa``; magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6``.
* MXFP4 (the official indexer format, SPEC §2.4): 32-value blocks, power-of-two scale
  ``s = 2**ceil(log2(max(amax, 6 * 2**-126) * fp32(1/6)))`` stored as a UE8M0 byte.
* NVFP4 (the seeds' indexer format, fixed to keep the sign): 16-value groups, one E4M3 scale per group.

Packing: two codes per byte, element ``2i`` in the low nibble, element ``2i+1`` in the high nibble.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

from ._checks import as_float32, check_block, check_uint8
from .fp8 import E4M3_MAX, dequantize_pow2_blocks, div_scalar, quantize_pow2_blocks

__all__ = [
    "E2M1_MAX", "E2M1_VALUES", "MXFP4_AMAX_FLOOR", "NVFP4_SCALE_FLOOR",
    "e2m1_encode", "e2m1_decode", "pack_nibbles", "unpack_nibbles",
    "quantize_mxfp4", "dequantize_mxfp4", "qdq_mxfp4",
    "quantize_nvfp4", "dequantize_nvfp4", "qdq_nvfp4",
]

E2M1_MAX = 6.0
#: The 16 E2M1 code values, indexed by code (codes 8..15 are the negatives; code 8 is -0.0).
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)
#: amax floor of the official FP4 quantizer (``fp4_quant_kernel``): ``6 * 2**-126``, so ``s >= 2**-126``.
MXFP4_AMAX_FLOOR = 6.0 * 2.0 ** -126
#: Smallest NVFP4 group scale: the smallest positive E4M3 subnormal ``2**-9`` (code 0x01). Used when ``amax / 6``
#: rounds to zero in E4M3 (including all-zero groups), so nothing divides by zero.
NVFP4_SCALE_FLOOR = 2.0 ** -9

# Round-to-nearest-even decision points on |x| (see e2m1_encode): code += 1 each time one is passed.
# (threshold, inclusive): inclusive means a tie at the threshold rounds up (to the even-mantissa neighbour).
_E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


@lru_cache(maxsize=None)
def _e2m1_table(device: torch.device) -> Tensor:
    return E2M1_VALUES.to(device)


def e2m1_encode(x: Tensor, *, check: bool = True) -> Tensor:
    """E2M1 codes of ``x``, round-to-nearest-even on the grid ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``.

    Ties go to the neighbour with an even mantissa bit: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
    The sign bit is ``signbit(x)``: -0.0 and negative values that round to zero give code 8 (negative zero), as the
    hardware cast does. Implemented as a sum of 7 threshold comparisons (no per-element Python).

    Args:
        x: floating tensor, any shape, values within ``[-6, 6]`` (converted to fp32).
        check: validate dtype, finiteness and range (host sync). With ``check=False`` magnitudes above 6 saturate
            to 6 and NaN gives code 0 or 8.
    Returns:
        uint8 tensor, same shape, codes in ``[0, 16)``.
    """
    x32 = as_float32(x, "e2m1_encode", check=check)
    if check and x32.numel() and bool((x32.abs() > E2M1_MAX).any()):
        raise ValueError("e2m1_encode: input outside [-6, 6]; clamp before encoding")
    return _e2m1_encode(x32)


def _e2m1_encode(x32: Tensor) -> Tensor:
    m = x32.abs()
    code = torch.zeros(x32.shape, dtype=torch.uint8, device=x32.device)
    for t, inclusive in _E2M1_STEPS:
        code += (m >= t) if inclusive else (m > t)
    return code | (torch.signbit(x32).to(torch.uint8) << 3)


def e2m1_decode(codes: Tensor, *, check: bool = True) -> Tensor:
    """Values of E2M1 codes.

    Args:
        codes: uint8 tensor, any shape, values in ``[0, 16)`` (one code per byte, not packed).
        check: verify the range (host sync).
    Returns:
        float32 tensor, same shape.
    """
    check_uint8(codes, "e2m1_decode")
    if check and codes.numel() and bool((codes > 15).any()):
        raise ValueError("e2m1_decode: codes must be in [0, 16); unpack nibbles first")
    return _e2m1_table(codes.device)[codes.long()]


def pack_nibbles(codes: Tensor) -> Tensor:
    """Pack 4-bit codes two per byte: ``out[..., i] = codes[..., 2i] | codes[..., 2i+1] << 4``.

    Args:
        codes: uint8 ``[..., N]``, ``N`` even, values in ``[0, 16)``.
    Returns:
        uint8 ``[..., N // 2]``.
    """
    check_uint8(codes, "pack_nibbles", multiple=2)
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 ``[..., M]`` -> uint8 codes ``[..., 2M]`` (low nibble first)."""
    check_uint8(packed, "unpack_nibbles", "packed")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def _check_packed(packed: Tensor, scales: Tensor, block: int, fn: str) -> None:
    check_block(block, fn)
    check_uint8(packed, fn, "packed")
    check_uint8(scales, fn, "scales")
    n = packed.shape[-1] * 2
    if tuple(scales.shape[:-1]) != tuple(packed.shape[:-1]) or scales.shape[-1] * block != n:
        raise ValueError(f"{fn}: scales shape {tuple(scales.shape)} does not match packed shape "
                         f"{tuple(packed.shape)} ({block} values per scale, 2 values per byte)")


# --------------------------------------------------------------------------------------------------------------------
# MXFP4 (official): block 32, UE8M0 power-of-two scales with the ceil rule
# --------------------------------------------------------------------------------------------------------------------

def quantize_mxfp4(x: Tensor, block: int = 32, *, check: bool = True) -> tuple[Tensor, Tensor]:
    """Official FP4 quantization (SPEC §2.4, ``fp4_quant_kernel``): per block
    ``s = pow2_scale(max|v|, 6, 6 * 2**-126)``, ``codes = e2m1(clamp(v / s, -6, 6))``.

    Note the ceil rule differs from OCP MX's floor rule.

    Args:
        x: floating ``[..., N]`` (fp32 or bf16; computed in fp32), ``N % block == 0``, ``block`` even.
        check: verify finiteness (host sync).
    Returns:
        packed: uint8 ``[..., N // 2]`` E2M1 codes, two per byte (even element in the low nibble).
        exponents: uint8 ``[..., N // block]`` UE8M0 bytes ``log2(s) + 127``.
        (Values within about one E2M1 step of the fp32 maximum can dequantize to +-inf, as in the kernels.)
    """
    fn = "quantize_mxfp4"
    check_block(block, fn)
    if block % 2:
        raise ValueError(f"{fn}: block must be even, got {block}")
    x32 = as_float32(x, fn, check=check, multiple=block)
    codes, exps = quantize_pow2_blocks(x32, block, E2M1_MAX, MXFP4_AMAX_FLOOR, _e2m1_encode)
    return pack_nibbles(codes), exps


def dequantize_mxfp4(packed: Tensor, exponents: Tensor, block: int = 32) -> Tensor:
    """Inverse of :func:`quantize_mxfp4`.

    Args:
        packed: uint8 ``[..., N // 2]``; exponents: uint8 ``[..., N // block]``.
    Returns:
        float32 ``[..., N]`` = ``e2m1(code) * 2**(exponent - 127)``.
    """
    _check_packed(packed, exponents, block, "dequantize_mxfp4")
    vals = _e2m1_table(packed.device)[unpack_nibbles(packed).long()]
    return dequantize_pow2_blocks(vals, exponents, block)


def qdq_mxfp4(x: Tensor, block: int = 32, *, check: bool = True) -> Tensor:
    """Simulated official FP4 (quantize then dequantize): floating ``[..., N]`` -> float32 ``[..., N]``."""
    return dequantize_mxfp4(*quantize_mxfp4(x, block, check=check), block)


# --------------------------------------------------------------------------------------------------------------------
# NVFP4 (seeds' format, fixed): block 16, E4M3 scales
# --------------------------------------------------------------------------------------------------------------------

def quantize_nvfp4(x: Tensor, block: int = 16, *, check: bool = True) -> tuple[Tensor, Tensor]:
    """NVFP4 quantization with signed codes.

    Per group: ``scale = e4m3_rne(clamp(amax / 6, 2**-9, 448))`` (fp32 division, then RNE to E4M3; the clamp gives
    the smallest subnormal 2**-9 whenever ``amax / 6`` would round to 0 in E4M3, including all-zero groups, and
    saturates at 448 for ``amax > 2688``), ``codes = e2m1(clamp(v / scale, -6, 6))`` (fp32 division by the decoded
    scale). Because the scale is rounded to nearest, values may exceed ``6 * scale`` and clip to +-6.

    Unlike the seed (which clamped to ``[0, 6]`` and rounded to integers), negative values keep their sign and the
    true E2M1 grid is used.

    Args:
        x: floating ``[..., N]`` (computed in fp32), ``N % block == 0``, ``block`` even.
        check: verify finiteness (host sync).
    Returns:
        packed: uint8 ``[..., N // 2]`` E2M1 codes, two per byte (even element in the low nibble).
        scale_codes: uint8 ``[..., N // block]`` E4M3 codes of the group scales.
    """
    fn = "quantize_nvfp4"
    check_block(block, fn)
    if block % 2:
        raise ValueError(f"{fn}: block must be even, got {block}")
    x32 = as_float32(x, fn, check=check, multiple=block)
    xb = x32.unflatten(-1, (-1, block))
    t = torch.clamp(div_scalar(xb.abs().amax(dim=-1), E2M1_MAX), NVFP4_SCALE_FLOOR, E4M3_MAX)
    scale_codes = t.to(torch.float8_e4m3fn).view(torch.uint8)
    scale = scale_codes.view(torch.float8_e4m3fn).float()
    q = torch.clamp(xb / scale.unsqueeze(-1), -E2M1_MAX, E2M1_MAX)
    return pack_nibbles(_e2m1_encode(q).flatten(-2)), scale_codes


def dequantize_nvfp4(packed: Tensor, scale_codes: Tensor, block: int = 16) -> Tensor:
    """Inverse of :func:`quantize_nvfp4`.

    Args:
        packed: uint8 ``[..., N // 2]``; scale_codes: uint8 E4M3 ``[..., N // block]``.
    Returns:
        float32 ``[..., N]`` = ``e2m1(code) * e4m3(scale_code)`` (fp32 multiply).
    """
    _check_packed(packed, scale_codes, block, "dequantize_nvfp4")
    vals = _e2m1_table(packed.device)[unpack_nibbles(packed).long()]
    scale = scale_codes.view(torch.float8_e4m3fn).float()
    return (vals.unflatten(-1, (-1, block)) * scale.unsqueeze(-1)).flatten(-2)


def qdq_nvfp4(x: Tensor, block: int = 16, *, check: bool = True) -> Tensor:
    """Simulated NVFP4 (quantize then dequantize): floating ``[..., N]`` -> float32 ``[..., N]``."""
    return dequantize_nvfp4(*quantize_nvfp4(x, block, check=check), block)
