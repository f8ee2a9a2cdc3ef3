"""FP8 (E4M3) helpers and FP8 storage formats.

* ``ue8m0_exponent`` / ``pow2_scale``: the power-of-two ("ue8m0") scale rule of DeepSeek's kernels
  (``fast_log2_ceil`` / ``fast_round_scale`` in ``inference/kernel.py``), SPEC §2.4.
* Block-64 FP8 (the official KV format, SPEC §2.4 / §7.2): E4M3 codes plus one UE8M0 exponent byte per block.
* Per-token FP8 (the seeds' format, with a floor so zeros never give NaN): E4M3 codes plus one fp32 scale per vector.
* vLLM-style FP8 indexer key: per-token FP8 over 128 values with one fp32 scale (132 bytes, see ``layouts``).

All computation is plain torch in fp32 and works on any device.
"""

from __future__ import annotations

import struct
from typing import Callable

import torch
from torch import Tensor

from ._checks import as_float32, check_block, check_uint8

__all__ = [
    "E4M3_MAX", "FP8_BLOCK_AMAX_FLOOR", "FP8_PER_TOKEN_AMAX_FLOOR", "FP8_KEY_AMAX_FLOOR",
    "ue8m0_exponent", "pow2_from_exponent", "pow2_scale", "ue8m0_encode", "ue8m0_decode",
    "e4m3_encode", "e4m3_decode",
    "quantize_fp8_block", "dequantize_fp8_block", "qdq_fp8_block",
    "quantize_fp8_per_token", "dequantize_fp8_per_token", "qdq_fp8_per_token",
    "quantize_fp8_key", "dequantize_fp8_key", "qdq_fp8_key",
]

E4M3_MAX = 448.0
#: amax floor of the official block-64 FP8 quantizer (``act_quant_kernel``: ``max(amax, 1e-4)``).
FP8_BLOCK_AMAX_FLOOR = 1e-4
#: amax floor of the per-token format.  The seeds floored the *scale* at 1e-12 (amax ~ 4.5e-10); we floor amax at
#: 1e-10 before dividing by 448, so the scale is always a normal fp32 (>= 2.2e-13) and an all-zero vector encodes to
#: zero codes and decodes to exact zeros (never 0/0 = NaN).
FP8_PER_TOKEN_AMAX_FLOOR = 1e-10
#: amax floor of the vLLM-style FP8 indexer key (vLLM's ``indexer_k_quant_and_cache``: ``max(amax, 1e-4) / 448``).
FP8_KEY_AMAX_FLOOR = 1e-4


def div_scalar(a: Tensor, d: float) -> Tensor:
    """``a / d`` as a correctly rounded fp32 division on every device.

    (On CUDA, ``tensor / python_scalar`` is computed as ``tensor * (1 / scalar)``, which can differ by one ulp; dividing
    by a same-device tensor keeps the true division.)
    """
    return a / torch.full_like(a, d)


def _fp32(v: float) -> float:
    """Round a Python float to the nearest fp32 value (returned as a Python float)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


# --------------------------------------------------------------------------------------------------------------------
# Power-of-two (UE8M0) scales
# --------------------------------------------------------------------------------------------------------------------

def ue8m0_exponent(x: Tensor) -> Tensor:
    """``ceil(log2(x))`` from the fp32 bits, exactly as DeepSeek's ``fast_log2_ceil``.

    Computes ``exp_field - 127 + (mantissa_bits != 0)`` of ``x`` viewed as fp32 bits. Exact for positive *normal*
    fp32 values (callers floor their inputs so subnormals never occur).

    Args:
        x: positive tensor, any shape, any floating dtype (converted to fp32 first).
    Returns:
        int32 tensor, same shape: the exponent ``e`` with ``2**(e-1) < x <= 2**e``.
    """
    bits = x.float().contiguous().view(torch.int32)
    exp_field = (bits >> 23) & 0xFF
    mant_nonzero = ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp_field - 127 + mant_nonzero).to(torch.int32)


def pow2_from_exponent(e: Tensor) -> Tensor:
    """``2.0**e`` as fp32 built from the bits (``fast_pow2``): ``((e + 127) << 23)`` viewed as fp32.

    Args:
        e: integer tensor, any shape, values in ``[-126, 127]``.
    Returns:
        float32 tensor, same shape, exact powers of two.
    """
    return ((e.to(torch.int32) + 127) << 23).contiguous().view(torch.float32)


def pow2_scale(amax: Tensor, qmax: float, floor: float) -> Tensor:
    """Power-of-two scale of the official kernels (``fast_round_scale(max(amax, floor), fp32(1/qmax))``).

    ``s = 2**ceil(log2(max(amax, floor) * fp32(1/qmax)))``. Note the multiplication by the fp32 reciprocal (the
    kernel does not divide); the product is rounded to fp32 before the ceil-log2 of :func:`ue8m0_exponent`.

    Args:
        amax: non-negative tensor of block maxima, any shape (computed in fp32).
        qmax: largest code magnitude (448 for E4M3, 6 for E2M1).
        floor: lower bound applied to ``amax`` (must be a positive normal fp32 after ``/qmax``).
    Returns:
        float32 tensor, same shape as ``amax``: exact powers of two with ``amax / s <= qmax`` (never clips).
    """
    inv = _fp32(1.0 / qmax)  # fp32 reciprocal; the product of two fp32 values rounds identically via fp64
    a = torch.clamp_min(amax.float(), floor)
    return pow2_from_exponent(ue8m0_exponent(a * inv))


def ue8m0_encode(s: Tensor) -> Tensor:
    """UE8M0 byte of a power-of-two fp32 scale: ``log2(s) + 127`` (the fp32 exponent field).

    Args:
        s: float32 tensor of powers of two in ``[2**-126, 2**127]``, any shape.
    Returns:
        uint8 tensor, same shape.
    """
    return ((s.float().contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def ue8m0_decode(b: Tensor) -> Tensor:
    """Value of UE8M0 bytes: ``2**(b - 127)``; byte 0 is ``2**-127`` and byte 255 is NaN (OCP E8M0).

    Args:
        b: uint8 tensor, any shape.
    Returns:
        float32 tensor, same shape.
    """
    check_uint8(b, "ue8m0_decode", "exponents")
    bi = b.to(torch.int32)
    s = (bi << 23).view(torch.float32)
    s = torch.where(bi == 0, torch.full_like(s, 2.0 ** -127), s)
    return torch.where(bi == 255, torch.full_like(s, float("nan")), s)


# --------------------------------------------------------------------------------------------------------------------
# E4M3 codes
# --------------------------------------------------------------------------------------------------------------------

def e4m3_encode(x: Tensor, *, check: bool = True) -> Tensor:
    """E4M3 (``float8_e4m3fn``) codes of ``x``, round-to-nearest-even, subnormals down to ``2**-9``.

    The sign of zero is kept (-0.0 and negative values that round to zero give code 0x80).

    Args:
        x: floating tensor, any shape, values within ``[-448, 448]`` (converted to fp32 first).
        check: validate dtype, finiteness and range (host sync). With ``check=False`` out-of-range values
            saturate to +-448 (torch's cast) and NaN gives a NaN code.
    Returns:
        uint8 tensor, same shape: the E4M3 bit patterns.
    """
    x32 = as_float32(x, "e4m3_encode", check=check)
    if check and x32.numel() and bool((x32.abs() > E4M3_MAX).any()):
        raise ValueError("e4m3_encode: input outside [-448, 448]; clamp before encoding")
    return x32.to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(codes: Tensor) -> Tensor:
    """Values of E4M3 codes (0x7F and 0xFF decode to NaN).

    Args:
        codes: uint8 tensor, any shape.
    Returns:
        float32 tensor, same shape.
    """
    check_uint8(codes, "e4m3_decode")
    return codes.view(torch.float8_e4m3fn).float()


# --------------------------------------------------------------------------------------------------------------------
# Generic power-of-two block quantizer (shared by FP8 block-64 and MXFP4)
# --------------------------------------------------------------------------------------------------------------------

def quantize_pow2_blocks(x32: Tensor, block: int, qmax: float, floor: float,
                         encode: Callable[[Tensor], Tensor]) -> tuple[Tensor, Tensor]:
    """Blockwise ``codes = encode(clamp(v / s, -qmax, qmax))`` with ``s = pow2_scale(max|v_blk|, qmax, floor)``.

    Args:
        x32: float32 tensor ``[..., N]`` (already validated), ``N % block == 0``.
        block: values per scale.
        qmax / floor: see :func:`pow2_scale`.
        encode: maps clamped fp32 values to uint8 codes (same shape).
    Returns:
        ``(codes uint8 [..., N], exponents uint8 [..., N // block])`` with exponent byte ``log2(s) + 127``.
    """
    xb = x32.unflatten(-1, (-1, block))
    s = pow2_scale(xb.abs().amax(dim=-1), qmax, floor)
    q = torch.clamp(xb / s.unsqueeze(-1), -qmax, qmax)
    return encode(q).flatten(-2), ue8m0_encode(s)


def dequantize_pow2_blocks(values: Tensor, exponents: Tensor, block: int) -> Tensor:
    """``values[..., i] * 2**(exponents[..., i // block] - 127)``.

    Args:
        values: float32 code values ``[..., N]``; exponents: uint8 ``[..., N // block]``.
    Returns:
        float32 ``[..., N]``.
    """
    s = ue8m0_decode(exponents)
    return (values.unflatten(-1, (-1, block)) * s.unsqueeze(-1)).flatten(-2)


def _check_scales_match(codes_n: int, codes_shape: tuple, scales: Tensor, per: int, fn: str, name: str) -> None:
    if tuple(scales.shape[:-1]) != tuple(codes_shape[:-1]) or scales.shape[-1] * per != codes_n:
        raise ValueError(f"{fn}: {name} shape {tuple(scales.shape)} does not match codes shape {tuple(codes_shape)} "
                         f"with {per} values per scale")


# --------------------------------------------------------------------------------------------------------------------
# Block-64 FP8 with UE8M0 scales (official)
# --------------------------------------------------------------------------------------------------------------------

def quantize_fp8_block(x: Tensor, block: int = 64, *, check: bool = True) -> tuple[Tensor, Tensor]:
    """Official FP8 quantization (SPEC §2.4): per block ``a = max(max|v|, 1e-4)``, ``s = pow2_scale(a, 448, 1e-4)``,
    ``codes = e4m3(clamp(v / s, -448, 448))``.

    Args:
        x: floating tensor ``[..., N]`` (fp32 or bf16; computed in fp32), ``N % block == 0``.
        block: values per scale (64 for the KV cache).
        check: verify finiteness (host sync); dtype/shape checks always run.
    Returns:
        codes: uint8 ``[..., N]`` E4M3 bit patterns.
        (Values within about one E4M3 step of the fp32 maximum can dequantize to +-inf, as in the kernels.)
        exponents: uint8 ``[..., N // block]`` UE8M0 bytes ``log2(s) + 127``.
    """
    check_block(block, "quantize_fp8_block")
    x32 = as_float32(x, "quantize_fp8_block", check=check, multiple=block)
    return quantize_pow2_blocks(x32, block, E4M3_MAX, FP8_BLOCK_AMAX_FLOOR,
                                lambda q: q.to(torch.float8_e4m3fn).view(torch.uint8))


def dequantize_fp8_block(codes: Tensor, exponents: Tensor, block: int = 64) -> Tensor:
    """Inverse of :func:`quantize_fp8_block`.

    Args:
        codes: uint8 ``[..., N]`` E4M3 codes.
        exponents: uint8 ``[..., N // block]`` UE8M0 bytes.
    Returns:
        float32 ``[..., N]``: ``e4m3(code) * 2**(exponent - 127)``.
    """
    fn = "dequantize_fp8_block"
    check_block(block, fn)
    check_uint8(codes, fn, "codes", multiple=block)
    check_uint8(exponents, fn, "exponents")
    _check_scales_match(codes.shape[-1], tuple(codes.shape), exponents, block, fn, "exponents")
    return dequantize_pow2_blocks(codes.view(torch.float8_e4m3fn).float(), exponents, block)


def qdq_fp8_block(x: Tensor, block: int = 64, *, check: bool = True) -> Tensor:
    """Simulated official FP8 (quantize then dequantize). ``x``: floating ``[..., N]``; returns float32 ``[..., N]``."""
    return dequantize_fp8_block(*quantize_fp8_block(x, block, check=check), block)


# --------------------------------------------------------------------------------------------------------------------
# Per-token FP8 with an fp32 scale (seeds' format, fixed; also the vLLM FP8 indexer key)
# --------------------------------------------------------------------------------------------------------------------

def _quantize_per_token(x: Tensor, fn: str, amax_floor: float, check: bool,
                        size: int | None = None) -> tuple[Tensor, Tensor]:
    x32 = as_float32(x, fn, check=check, size=size)
    a = torch.clamp_min(x32.abs().amax(dim=-1), amax_floor)
    scale = div_scalar(a, E4M3_MAX)  # true fp32 division
    q = torch.clamp(x32 / scale.unsqueeze(-1), -E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn).view(torch.uint8), scale


def quantize_fp8_per_token(x: Tensor, *, amax_floor: float = FP8_PER_TOKEN_AMAX_FLOOR,
                           check: bool = True) -> tuple[Tensor, Tensor]:
    """Per-vector FP8: ``scale = max(amax, amax_floor) / 448`` (fp32 division), ``codes = e4m3(clamp(v/scale, +-448))``.

    Args:
        x: floating tensor ``[..., N]`` (computed in fp32), ``N >= 1``.
        amax_floor: lower bound on amax (default 1e-10, see ``FP8_PER_TOKEN_AMAX_FLOOR``): all-zero vectors give
            zero codes and a positive scale.
        check: verify finiteness (host sync).
    Returns:
        codes: uint8 ``[..., N]`` E4M3 codes.
        scale: float32 ``[...]`` dequantization scale (value = e4m3(code) * scale).
    """
    return _quantize_per_token(x, "quantize_fp8_per_token", amax_floor, check)


def dequantize_fp8_per_token(codes: Tensor, scale: Tensor) -> Tensor:
    """Inverse of :func:`quantize_fp8_per_token`.

    Args:
        codes: uint8 ``[..., N]``; scale: float32 ``[...]``.
    Returns:
        float32 ``[..., N]`` = ``e4m3(codes) * scale[..., None]`` (fp32 multiply).
    """
    fn = "dequantize_fp8_per_token"
    check_uint8(codes, fn)
    if not isinstance(scale, Tensor) or not scale.dtype.is_floating_point \
            or tuple(scale.shape) != tuple(codes.shape[:-1]):
        raise ValueError(f"{fn}: scale must be a floating tensor of shape {tuple(codes.shape[:-1])}")
    return codes.view(torch.float8_e4m3fn).float() * scale.float().unsqueeze(-1)


def qdq_fp8_per_token(x: Tensor, *, amax_floor: float = FP8_PER_TOKEN_AMAX_FLOOR, check: bool = True) -> Tensor:
    """Simulated per-token FP8. ``x``: floating ``[..., N]``; returns float32 ``[..., N]``."""
    return dequantize_fp8_per_token(*quantize_fp8_per_token(x, amax_floor=amax_floor, check=check))


def quantize_fp8_key(x: Tensor, *, check: bool = True) -> tuple[Tensor, Tensor]:
    """vLLM-style FP8 indexer key: per-token FP8 over the 128 key values with amax floor 1e-4 (vLLM's) and a plain
    fp32 scale ``max(amax, 1e-4) / 448`` (no power-of-two rounding). Does not reproduce the official MXFP4 numerics.

    Args:
        x: floating ``[..., 128]``.
    Returns:
        codes uint8 ``[..., 128]``, scale float32 ``[...]``.
    """
    return _quantize_per_token(x, "quantize_fp8_key", FP8_KEY_AMAX_FLOOR, check, size=128)


def dequantize_fp8_key(codes: Tensor, scale: Tensor) -> Tensor:
    """Inverse of :func:`quantize_fp8_key`: codes uint8 ``[..., 128]``, scale float32 ``[...]`` -> float32 ``[..., 128]``."""
    check_uint8(codes, "dequantize_fp8_key", size=128)
    return dequantize_fp8_per_token(codes, scale)


def qdq_fp8_key(x: Tensor, *, check: bool = True) -> Tensor:
    """Simulated vLLM FP8 indexer key: floating ``[..., 128]`` -> float32 ``[..., 128]``."""
    return dequantize_fp8_key(*quantize_fp8_key(x, check=check))

