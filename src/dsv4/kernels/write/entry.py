"""Finishing one compressed entry (SPEC §4.3) and storing it in its pool page (SPEC §7.2).

The pooled FP32 channels are rounded to BF16, normalised by the compressor's weighted RMSNorm (torch's summation
order: ``torch_order.rms_norm_bf16``), the last 64 rotated at position ``i·m``, then

* a main entry (``KIND`` 0, 512 channels) FP8-quantized (block 64, UE8M0) into its 584-B ``fp8_ds_mla`` row: 448
  E4M3 codes + 64 BF16 rope values among the page's data rows, 8 scale bytes after them;
* an indexer key (``KIND`` 1, 128 channels) Hadamard-rotated and MXFP4-quantized into its 68-B row: 64 packed
  E2M1 bytes, 4 UE8M0 bytes after the page's value rows.

Both encode the values the torch backend stores, byte for byte.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..constants import KV_DATA_BYTES, KV_NOPE_DIM
from ..quant import bf16_round, fp8_block_qdq, hadamard128, mxfp4_block_qdq, pack_nibbles, split_halves
from ..rope import rope_pairs
from ..torch_order import rms_norm_bf16
from .pool import pool_entry, pool_in_step

__all__ = ["compress_entry", "finish_entry", "page_row", "rope_last64", "store_fp8_blocks", "store_mxfp4_key"]


@triton.jit
def rope_last64(x, pos_f, inv_freq_ptr, C: tl.constexpr):
    """RoPE of the last 64 of ``x`` fp32 ``[C]`` at ``pos_f``: returns ``(first C−64, rotated 64)`` — the rotated
    part BF16-valued fp32 (rounded once), the rest untouched."""
    if C == 512:
        h0, t0 = split_halves(x, 512)
        h1, t1 = split_halves(t0, 256)
        h2, tail = split_halves(t1, 128)
        head = h0  # (only C = 128 callers use the head)
    else:
        head, tail = split_halves(x, 128)
    re, im = tl.split(tl.reshape(tail, (32, 2)))
    re2, im2 = rope_pairs(re, im, pos_f, tl.load(inv_freq_ptr + tl.arange(0, 32)))
    rot = tl.reshape(tl.join(bf16_round(re2), bf16_round(im2)), (64,))
    return head, rot


@triton.jit
def page_row(pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, b, i, M: tl.constexpr):
    """Entry ``i`` of request ``b`` (ratio ``M``): ``(its page's base pointer, its row j in the page, entries per
    page)``."""
    first = i * M
    blk = tl.load(block_tables_ptr + b.to(tl.int64) * bt_stride + first // block_size).to(tl.int64)
    return pages_ptr + blk * page_bytes, (first % block_size) // M, block_size // M


@triton.jit
def store_fp8_blocks(y, data, scales, NBLK: tl.constexpr):
    """Encode the 64-channel blocks of ``y`` fp32 ``[64·n]`` (BF16 values) as the torch backend does — FP8
    quantize→dequantize, then the codes and scale bytes of the result — and store the first ``NBLK``: codes at
    ``data`` (uint8 pointer), scale bytes at ``scales`` (a block past ``NBLK`` stores a zero scale byte). Rounds by
    the bit arithmetic (``fp8_block_qdq``'s ``BITS``: here the hardware conversion costs registers)."""
    NB: tl.constexpr = y.shape[0] // 64
    blk = tl.arange(0, NB)
    _, v1, _ = fp8_block_qdq(tl.reshape(y, (NB, 64)), 1, BITS=True)
    code, _, ebyte = fp8_block_qdq(v1, 1, BITS=True)
    tl.store(data + blk[:, None] * 64 + tl.arange(0, 64)[None, :], code.to(tl.uint8), mask=(blk < NBLK)[:, None])
    tl.store(scales + blk, tl.where(blk < NBLK, ebyte, 0).to(tl.uint8))


@triton.jit
def store_mxfp4_key(key, packed, scales):
    """An indexer key ``key`` fp32 ``[128]`` (BF16 values, rope dims rotated) as the torch backend encodes it —
    Hadamard, MXFP4 quantize→dequantize, then the codes and scale bytes of the result: 64 packed bytes at
    ``packed``, 4 UE8M0 bytes at ``scales`` (uint8 pointers)."""
    h = tl.reshape(hadamard128(key), (4, 32))
    _, v1, _ = mxfp4_block_qdq(h, 1)
    code, _, ebyte = mxfp4_block_qdq(v1, 1)
    tl.store(packed + tl.arange(0, 64), pack_nibbles(tl.reshape(code, (128,)), 128).to(tl.uint8))
    tl.store(scales + tl.arange(0, 4), ebyte.to(tl.uint8))


@triton.jit
def finish_entry(
    pooled, norm_ptr, inv_freq_ptr, pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, eps, num_emit,
    scratch_ptr, b, i, C: tl.constexpr, M: tl.constexpr, KIND: tl.constexpr, MAXT: tl.constexpr,
):
    """Entry ``i`` of request ``b`` from its pooled channels (fp32 ``[C]``): RMSNorm, RoPE, quantize, write."""
    y = rms_norm_bf16(pooled, tl.load(norm_ptr + tl.arange(0, C)), eps, num_emit, scratch_ptr, C, MAXT)
    head, rot = rope_last64(y, (i * M).to(tl.float32), inv_freq_ptr, C)
    page, j, n_per_page = page_row(pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, b, i, M)
    if KIND == 0:
        # block 7 (the pre-RoPE rope dims) is not stored; the stored bytes encode the rounded values (as torch)
        store_fp8_blocks(y, page + j * KV_DATA_BYTES, page + n_per_page * KV_DATA_BYTES + j * 8, 7)
        rdst = (page + j * KV_DATA_BYTES + KV_NOPE_DIM + tl.arange(0, 64) * 2).to(tl.pointer_type(tl.bfloat16))
        tl.store(rdst, rot.to(tl.bfloat16))
    else:
        key = tl.reshape(tl.trans(tl.join(head, rot)), (128,))  # [first 64 | rotated 64]
        store_mxfp4_key(key, page + j * 64, page + n_per_page * 64 + j * 4)


@triton.jit
def compress_entry(
    a_ptr, z_ptr, AZ_STRIDE: tl.constexpr,
    ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr, norm_ptr, inv_freq_ptr,
    pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, eps, num_emit, scratch_ptr,
    b, i, start, cu, slot,
    C: tl.constexpr, M: tl.constexpr, OVERLAP: tl.constexpr, KIND: tl.constexpr, NW: tl.constexpr,
    MAXT: tl.constexpr, IN_STEP: tl.constexpr = False,
):
    """Pool, normalize, RoPE, quantize entry ``i`` of request ``b`` and write it into its pool page.

    ``KIND`` 0: main entry (C = 512) → 584-B ``fp8_ds_mla``; 1: indexer key (C = 128) → 68-B MXFP4 after the
    Hadamard rotation. ``IN_STEP``: every slot is a token of this step and the entry is a CSA one with m = 4
    (``pool_in_step``). ``a_ptr`` / ``z_ptr``: the step's projections, rows ``AZ_STRIDE`` elements apart.
    """
    if IN_STEP:
        pooled = pool_in_step(a_ptr, z_ptr, AZ_STRIDE, ape_ptr, i, start, cu, C, M, 0, C)
    else:
        pooled = pool_entry(a_ptr, z_ptr, AZ_STRIDE, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr,
                            i, start, cu, slot, C, M, OVERLAP, NW, 0, C)
    finish_entry(pooled, norm_ptr, inv_freq_ptr, pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, eps,
                 num_emit, scratch_ptr, b, i, C, M, KIND, MAXT)
