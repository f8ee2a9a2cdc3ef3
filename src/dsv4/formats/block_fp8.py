"""DeepSeek's FP8 projections (SPEC §1.3): block-scaled FP8 weights and activations.

* Weights are stored as FP8 E4M3 values with one power-of-two scale per 128 × 128 block (``BlockFp8Weight``: what
  the official checkpoints hold, ``weight`` + ``scale``; ``w = e4m3 · scale`` exactly).
* Activations entering such a GEMM are quantized per row in blocks of 128 along K: ``s = 2^⌈log2(max(amax, 1e-4) /
  448)⌉`` (UE8M0), ``codes = e4m3(clamp(x / s, ±448))`` — the official ``act_quant`` with ``scale_fmt = "ue8m0"``
  (the same rule as the KV cache's block-64 FP8, SPEC §2.4, over 128 values).
* The GEMM multiplies the codes and accumulates in FP32, applying both scales per K block. Every product of two
  E4M3 values times two powers of two is exact in FP32, so ``fp8_linear`` — the dequantized operands multiplied
  in FP32 — forms the same products; results differ only in the order of the FP32 sums.

A K that is not a multiple of 128 ends in a partial block (its scale from the values present: zero padding does
not change a maximum). Plain torch, any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .fp8 import E4M3_MAX, dequantize_fp8_block, pow2_scale, quantize_fp8_block

__all__ = ["ACT_BLOCK", "WEIGHT_BLOCK", "BlockFp8Weight", "dequantize_activations", "fp8_linear",
           "qdq_activations", "quantize_activations"]

#: values per activation scale (along K)
ACT_BLOCK = 128
#: rows × columns per weight scale
WEIGHT_BLOCK = 128
#: amax floor of the weights' scale rule (blocks of zeros get the smallest scale the floor allows)
WEIGHT_AMAX_FLOOR = 1e-4


def _pad_last(x: Tensor, multiple: int) -> Tensor:
    pad = -x.shape[-1] % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


@dataclass(frozen=True)
class BlockFp8Weight:
    """A projection matrix as DeepSeek's checkpoints store it.

    Attributes:
        data: float8_e4m3fn ``[out, in]`` — the E4M3 values.
        scale: float32 ``[⌈out/128⌉, ⌈in/128⌉]`` — one power-of-two scale per 128 × 128 block (as the checkpoint
            stores them; ``from_checkpoint`` converts UE8M0 bytes to float32).
    """

    data: Tensor
    scale: Tensor

    def __post_init__(self) -> None:
        if self.data.dtype != torch.float8_e4m3fn or self.data.dim() != 2:
            raise TypeError(f"BlockFp8Weight.data must be a float8_e4m3fn [out, in] tensor, got {self.data.dtype} "
                            f"{list(self.data.shape)}")
        want = (-(-self.data.shape[0] // WEIGHT_BLOCK), -(-self.data.shape[1] // WEIGHT_BLOCK))
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != want:
            raise TypeError(f"BlockFp8Weight.scale must be float32 {list(want)} for a {list(self.data.shape)} weight, "
                            f"got {self.scale.dtype} {list(self.scale.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes the weight occupies (values + scales): what a GEMM reads."""
        return self.data.numel() + self.scale.numel() * 4

    def to(self, device: torch.device | str | None) -> BlockFp8Weight:
        return BlockFp8Weight(self.data.to(device), self.scale.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``[out, in]`` in ``dtype``: ``e4m3 · scale`` per block (exact in FP32 and in BF16)."""
        out, inp = self.data.shape
        s = self.scale.repeat_interleave(WEIGHT_BLOCK, 0)[:out].repeat_interleave(WEIGHT_BLOCK, 1)[:, :inp]
        return (self.data.float() * s).to(dtype)

    @classmethod
    def quantize(cls, w: Tensor) -> BlockFp8Weight:
        """Quantize ``w`` ``[out, in]`` the way the checkpoints are made: per 128 × 128 block ``s = 2^⌈log2(max(amax,
        1e-4) / 448)⌉``, ``e4m3(w / s)`` rounded to nearest even (``s`` rounds up: nothing clips)."""
        if w.dim() != 2:
            raise ValueError(f"BlockFp8Weight.quantize needs a [out, in] matrix, got {list(w.shape)}")
        out, inp = w.shape
        R, C = -(-out // WEIGHT_BLOCK), -(-inp // WEIGHT_BLOCK)
        padded = torch.nn.functional.pad(w.float(), (0, C * WEIGHT_BLOCK - inp, 0, R * WEIGHT_BLOCK - out))
        blocks = padded.view(R, WEIGHT_BLOCK, C, WEIGHT_BLOCK)
        scale = pow2_scale(blocks.abs().amax(dim=(1, 3)), E4M3_MAX, WEIGHT_AMAX_FLOOR)
        q = torch.clamp(blocks / scale[:, None, :, None], -E4M3_MAX, E4M3_MAX)
        data = q.view(R * WEIGHT_BLOCK, C * WEIGHT_BLOCK)[:out, :inp].to(torch.float8_e4m3fn)
        return cls(data.contiguous(), scale.float().contiguous())


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """The official ``act_quant`` (UE8M0 scales) of ``x`` ``[..., K]``: ``(codes uint8 [..., K] E4M3 bit patterns,
    exponents uint8 [..., ⌈K/128⌉] UE8M0 bytes)``."""
    K = x.shape[-1]
    codes, exps = quantize_fp8_block(_pad_last(x.float(), ACT_BLOCK), ACT_BLOCK, check=False)
    return codes[..., :K], exps


def dequantize_activations(codes: Tensor, exponents: Tensor) -> Tensor:
    """Inverse of ``quantize_activations``: float32 ``[..., K]``."""
    K = codes.shape[-1]
    return dequantize_fp8_block(_pad_last(codes, ACT_BLOCK), exponents, ACT_BLOCK)[..., :K]


def qdq_activations(x: Tensor) -> Tensor:
    """``x`` ``[..., K]`` rounded as the FP8 GEMM's input: float32 ``[..., K]`` values on the E4M3 × UE8M0 grid."""
    return dequantize_activations(*quantize_activations(x))


def fp8_linear(x: Tensor, weight: BlockFp8Weight, out_dtype: torch.dtype) -> Tensor:
    """The official FP8 GEMM ``x @ weightᵀ``: ``x`` ``[..., K]`` quantized per 1 × 128 block, the weight's E4M3
    values and block scales, products summed in FP32, the result rounded to ``out_dtype``. Returns ``[..., out]``."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} features, the weight {weight.shape[1]}")
    return torch.nn.functional.linear(qdq_activations(x), weight.dequantize().to(x.device)).to(out_dtype)
