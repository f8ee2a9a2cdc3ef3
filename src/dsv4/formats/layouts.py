"""Byte layouts of the caches (SPEC §7.2, §11). All multi-byte values are little-endian.

* KV entry (FlashMLA "MODEL1" / vLLM ``fp8_ds_mla``), 584 B: 576 data bytes = 448 E4M3 codes (block-64 UE8M0
  quantization of the nope dims) + 64 BF16 rope values (128 B); 8 scale bytes = 7 UE8M0 exponents + 1 zero pad byte.
  A page of ``bs`` entries holds all ``bs * 576`` data bytes, then all ``bs * 8`` scale bytes, then padding up to
  ``ceil(bs * 584 / 576) * 576`` bytes.
* MXFP4 indexer key, 68 B: 64 bytes of packed E2M1 (element 2i in the low nibble) + 4 UE8M0 bytes. A page of ``bs``
  keys holds all ``bs * 64`` value bytes, then all ``bs * 4`` scale bytes (DeepGEMM's paged logits cache).
* FP8 indexer key (vLLM), 132 B: 128 E4M3 codes + one fp32 scale (4 bytes).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import as_float32, check_little_endian, check_uint8
from .fp4 import dequantize_mxfp4, quantize_mxfp4
from .fp8 import dequantize_fp8_block, dequantize_fp8_key, quantize_fp8_block, quantize_fp8_key

__all__ = [
    "KV_NOPE_DIM", "KV_ROPE_DIM", "KV_DIM", "KV_DATA_BYTES", "KV_SCALE_BYTES", "KV_ENTRY_BYTES", "KV_FP8_BLOCK",
    "INDEXER_KEY_DIM", "MXFP4_KEY_BYTES", "FP8_KEY_BYTES",
    "kv_page_bytes", "encode_kv_entries", "decode_kv_entries", "kv_page_views",
    "encode_mxfp4_keys", "decode_mxfp4_keys", "mxfp4_page_bytes", "mxfp4_page_views",
    "encode_fp8_keys", "decode_fp8_keys",
]

KV_NOPE_DIM = 448
KV_ROPE_DIM = 64
KV_DIM = KV_NOPE_DIM + KV_ROPE_DIM  # 512
KV_FP8_BLOCK = 64
KV_DATA_BYTES = KV_NOPE_DIM + 2 * KV_ROPE_DIM  # 576
KV_SCALE_BYTES = 8  # 7 UE8M0 + 1 pad
KV_ENTRY_BYTES = KV_DATA_BYTES + KV_SCALE_BYTES  # 584
INDEXER_KEY_DIM = 128
MXFP4_KEY_BYTES = INDEXER_KEY_DIM // 2 + INDEXER_KEY_DIM // 32  # 68
FP8_KEY_BYTES = INDEXER_KEY_DIM + 4  # 132


def _check_block_size(block_size: int, fn: str) -> None:
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"{fn}: block_size must be a positive int, got {block_size!r}")


def _check_page(page: Tensor, nbytes: int, fn: str) -> None:
    check_uint8(page, fn, "page", size=nbytes)
    if page.stride(-1) != 1:
        raise ValueError(f"{fn}: page must be contiguous in its last dimension")


# --------------------------------------------------------------------------------------------------------------------
# 584-B KV entry
# --------------------------------------------------------------------------------------------------------------------

def kv_page_bytes(block_size: int) -> int:
    """Bytes of one KV page of ``block_size`` entries: ``ceil(block_size * 584 / 576) * 576``."""
    _check_block_size(block_size, "kv_page_bytes")
    return -(-block_size * KV_ENTRY_BYTES // KV_DATA_BYTES) * KV_DATA_BYTES


def encode_kv_entries(x: Tensor, *, check: bool = True) -> tuple[Tensor, Tensor]:
    """Encode KV vectors into the 584-byte entry format.

    Args:
        x: floating ``[..., 512]`` (fp32 or bf16): dims 0..447 are quantized to FP8 (block 64, UE8M0), dims
            448..511 (rope) are rounded to BF16 (RNE).
        check: verify finiteness (host sync).
    Returns:
        data: uint8 ``[..., 576]``: 448 E4M3 codes, then the 64 rope values as little-endian BF16 bytes.
        scales: uint8 ``[..., 8]``: 7 UE8M0 exponent bytes (``127 + log2(scale)``), then one 0 pad byte.
    """
    fn = "encode_kv_entries"
    check_little_endian(fn)
    x32 = as_float32(x, fn, check=check, size=KV_DIM)
    codes, exps = quantize_fp8_block(x32[..., :KV_NOPE_DIM], KV_FP8_BLOCK, check=False)
    rope = x32[..., KV_NOPE_DIM:].to(torch.bfloat16).contiguous().view(torch.uint8)
    data = torch.cat((codes, rope), dim=-1)
    scales = torch.cat((exps, exps.new_zeros(*exps.shape[:-1], 1)), dim=-1)
    return data, scales


def decode_kv_entries(data: Tensor, scales: Tensor) -> Tensor:
    """Inverse of :func:`encode_kv_entries`.

    Args:
        data: uint8 ``[..., 576]``; scales: uint8 ``[..., 8]`` (the pad byte is ignored).
    Returns:
        float32 ``[..., 512]``: dequantized nope dims then the BF16 rope values widened to fp32.
    """
    fn = "decode_kv_entries"
    check_little_endian(fn)
    check_uint8(data, fn, "data", size=KV_DATA_BYTES)
    check_uint8(scales, fn, "scales", size=KV_SCALE_BYTES)
    if tuple(data.shape[:-1]) != tuple(scales.shape[:-1]):
        raise ValueError(f"{fn}: data {tuple(data.shape)} and scales {tuple(scales.shape)} leading dims differ")
    nope = dequantize_fp8_block(data[..., :KV_NOPE_DIM], scales[..., :KV_NOPE_DIM // KV_FP8_BLOCK], KV_FP8_BLOCK)
    rope = data[..., KV_NOPE_DIM:].contiguous().view(torch.bfloat16).float()
    return torch.cat((nope, rope), dim=-1)


def kv_page_views(page: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Views (no copy) of the entries inside KV pages.

    Args:
        page: uint8 ``[..., kv_page_bytes(block_size)]`` (e.g. ``[num_pages, page_bytes]``), contiguous last dim.
        block_size: entries per page.
    Returns:
        data: uint8 view ``[..., block_size, 576]``; entry j's data starts at byte ``j * 576``.
        scales: uint8 view ``[..., block_size, 8]``; entry j's scales start at byte ``block_size * 576 + j * 8``.
    """
    fn = "kv_page_views"
    _check_block_size(block_size, fn)
    _check_page(page, kv_page_bytes(block_size), fn)
    nd = block_size * KV_DATA_BYTES
    data = page[..., :nd].unflatten(-1, (block_size, KV_DATA_BYTES))
    scales = page[..., nd:nd + block_size * KV_SCALE_BYTES].unflatten(-1, (block_size, KV_SCALE_BYTES))
    return data, scales


# --------------------------------------------------------------------------------------------------------------------
# 68-B MXFP4 indexer key
# --------------------------------------------------------------------------------------------------------------------

def encode_mxfp4_keys(x: Tensor, *, check: bool = True) -> Tensor:
    """Encode indexer keys (after the Hadamard transform) as 68-byte MXFP4 records.

    Args:
        x: floating ``[..., 128]``.
    Returns:
        uint8 ``[..., 68]``: 64 packed E2M1 bytes (element 2i low nibble, 2i+1 high nibble), then 4 UE8M0 bytes.
    """
    x32 = as_float32(x, "encode_mxfp4_keys", check=check, size=INDEXER_KEY_DIM)
    packed, exps = quantize_mxfp4(x32, 32, check=False)
    return torch.cat((packed, exps), dim=-1)


def decode_mxfp4_keys(b: Tensor) -> Tensor:
    """Inverse of :func:`encode_mxfp4_keys`: uint8 ``[..., 68]`` -> float32 ``[..., 128]``."""
    check_uint8(b, "decode_mxfp4_keys", "keys", size=MXFP4_KEY_BYTES)
    return dequantize_mxfp4(b[..., :64], b[..., 64:], 32)


def mxfp4_page_bytes(block_size: int) -> int:
    """Bytes of one MXFP4 key page: ``block_size * 68``."""
    _check_block_size(block_size, "mxfp4_page_bytes")
    return block_size * MXFP4_KEY_BYTES


def mxfp4_page_views(page: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Views (no copy) of the keys inside MXFP4 key pages.

    Args:
        page: uint8 ``[..., block_size * 68]``, contiguous last dim.
    Returns:
        values: uint8 view ``[..., block_size, 64]`` (key j's packed bytes at ``j * 64``).
        scales: uint8 view ``[..., block_size, 4]`` (key j's UE8M0 bytes at ``block_size * 64 + j * 4``).
    """
    fn = "mxfp4_page_views"
    _check_block_size(block_size, fn)
    _check_page(page, mxfp4_page_bytes(block_size), fn)
    nv = block_size * 64
    return page[..., :nv].unflatten(-1, (block_size, 64)), page[..., nv:].unflatten(-1, (block_size, 4))


# --------------------------------------------------------------------------------------------------------------------
# 132-B FP8 indexer key (vLLM)
# --------------------------------------------------------------------------------------------------------------------

def encode_fp8_keys(x: Tensor, *, check: bool = True) -> Tensor:
    """Encode indexer keys as 132-byte vLLM-style FP8 records (see ``fp8.quantize_fp8_key``).

    Args:
        x: floating ``[..., 128]``.
    Returns:
        uint8 ``[..., 132]``: 128 E4M3 codes, then the fp32 scale as 4 little-endian bytes.
    """
    fn = "encode_fp8_keys"
    check_little_endian(fn)
    x32 = as_float32(x, fn, check=check, size=INDEXER_KEY_DIM)
    codes, scale = quantize_fp8_key(x32, check=False)
    return torch.cat((codes, scale.unsqueeze(-1).contiguous().view(torch.uint8)), dim=-1)


def decode_fp8_keys(b: Tensor) -> Tensor:
    """Inverse of :func:`encode_fp8_keys`: uint8 ``[..., 132]`` -> float32 ``[..., 128]``."""
    fn = "decode_fp8_keys"
    check_little_endian(fn)
    check_uint8(b, fn, "keys", size=FP8_KEY_BYTES)
    scale = b[..., INDEXER_KEY_DIM:].contiguous().view(torch.float32).squeeze(-1)
    return dequantize_fp8_key(b[..., :INDEXER_KEY_DIM], scale)
