"""A step's keys dequantized once into BF16 rows (``bf16_keys``), for the Gluon kernels' ``keys="bf16"`` plans.

In a prefill chunk every key serves many queries: dequantizing the pages once per step and copying rows (no block
tables, no per-chunk conversion) is cheaper than dequantizing them per query program; the rows hold the bits the
kernels' own dequantization gives. Which steps take them: ``plan.use_bf16_keys``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import KV_DATA_BYTES, KV_DIM, KV_NOPE_DIM

__all__ = ["BF16_KEY_ROWS", "bf16_keys"]

#: rows per program of ``_bf16_keys_kernel``: enough programs to fill the GPU for a step of one request
BF16_KEY_ROWS = 16
NOPE_DIM = tl.constexpr(KV_NOPE_DIM)
DATA_BYTES = tl.constexpr(KV_DATA_BYTES)  # per entry: 448 E4M3 codes + 64 BF16 rope values


@triton.jit
def _e4m3_scaled(codes, e):
    """``code · 2^(e − 127)`` rounded once to BF16, from the bits (no FP8 conversion: exact in the interpreter
    too): ``codes`` uint8 E4M3 ``[N, 64]``, ``e`` int32 ``[N, 1]`` UE8M0 exponents. The FP32 product is exact (at
    least 2^−135), so the one rounding is to BF16 — the values the Gluon kernels' dequantization gives."""
    x = codes.to(tl.int32)
    mag = x & 0x7F
    normal = ((((mag >> 3) + 120) << 23) | ((mag & 7) << 20)).to(tl.float32, bitcast=True)
    value = tl.where(mag < 8, (mag & 7).to(tl.float32) * 0.001953125, normal)  # subnormal: m · 2^−9
    value = (value.to(tl.int32, bitcast=True) | ((x & 0x80) << 24)).to(tl.float32, bitcast=True)  # −0 stays −0
    scale = tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)  # 2^(e − 127); e = 0: subnormal
    return (value * scale).to(tl.bfloat16)


@triton.jit
def _bf16_keys_kernel(
    ring_ptr, stride_ring,  # uint8 [slots, ring_page_bytes]
    pool_ptr, stride_page,  # uint8 [num_blocks, page_bytes]
    block_tables_ptr, stride_bt,  # int32 [B, max_blocks]
    cu_seqlens_ptr, start_pos_ptr, token_slots_ptr,  # StepBatch fields
    out_ptr, stride_ob, entries,  # bf16 [B, WINDOW + entries, 512]
    WINDOW: tl.constexpr, RATIO: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGE_ENTRIES: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Grid ``(ceil(WINDOW / ROWS) + ceil(entries / ROWS), B)``: ``ROWS`` rows of request ``b``'s keys in BF16 —
    rows ``0 … WINDOW − 1`` its ring's slots as stored (whatever position they hold), rows ``WINDOW + i`` its
    compressed entries ``i`` up to those its last token of the step sees (``(start + new) // RATIO``; zeros
    beyond). Each entry's 448 E4M3 codes × 2^(e − 127) per 64-dim block (``_e4m3_scaled``) and its 64 BF16 rope
    values."""
    RING_CHUNKS: tl.constexpr = (WINDOW + ROWS - 1) // ROWS
    c = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n = tl.arange(0, ROWS)
    col = tl.arange(0, 64)
    first = tl.load(cu_seqlens_ptr + b)
    new = tl.load(cu_seqlens_ptr + b + 1) - first
    if c < RING_CHUNKS:
        j = c * ROWS + n
        base = tl.load(token_slots_ptr + first) * stride_ring
        ok = (j < WINDOW) & (new > 0)
        data_off = base + j * DATA_BYTES
        scale_off = (base + WINDOW * DATA_BYTES) // 8 + j
        src = ring_ptr
        row = j
        keep = j < WINDOW
    else:
        i = (c - RING_CHUNKS) * ROWS + n
        ok = i < (tl.load(start_pos_ptr + b) + new) // RATIO
        block = tl.load(block_tables_ptr + b * stride_bt + (i * RATIO) // BLOCK_SIZE, mask=ok, other=-1)
        ok = ok & (block >= 0)
        page = tl.maximum(block, 0).to(tl.int64) * stride_page
        slot = (i * RATIO % BLOCK_SIZE) // RATIO
        data_off = page + slot * DATA_BYTES
        scale_off = (page + PAGE_ENTRIES * DATA_BYTES) // 8 + slot
        src = pool_ptr
        row = WINDOW + i
        keep = i < entries
    scales = tl.load(src.to(tl.pointer_type(tl.int64)) + scale_off, mask=ok, other=0)
    out = out_ptr + b * stride_ob + row[:, None] * 512 + col[None, :]
    keep = keep[:, None]
    for blk in tl.static_range(7):
        codes = tl.load(src + data_off[:, None] + (blk * 64 + col)[None, :], mask=ok[:, None], other=0)
        e = ((scales >> (8 * blk)) & 0xFF).to(tl.int32)
        tl.store(out + blk * 64, _e4m3_scaled(codes, e[:, None]), mask=keep)
    rope = src.to(tl.pointer_type(tl.bfloat16)) + (data_off // 2 + NOPE_DIM // 2)
    tl.store(out + NOPE_DIM, tl.load(rope[:, None] + col[None, :], mask=ok[:, None], other=0.0), mask=keep)


def bf16_keys(ring: torch.Tensor, pool: torch.Tensor | None, block_tables: torch.Tensor, cu_seqlens: torch.Tensor,
              start_pos: torch.Tensor, token_slots: torch.Tensor, *, window: int, ratio: int, block_size: int,
              entries: int, workspace=None) -> torch.Tensor:
    """A step's keys dequantized once (``_bf16_keys_kernel``): bf16 ``[B, window + entries, 512]``, per request
    its ring's ``window`` slots as stored, then its compressed entries ``0 … entries − 1`` (those its tokens see;
    zero rows beyond).

    Args:
        ring: uint8 ``[slots, ring_page_bytes]`` SWA ring pages; pool: uint8 ``[num_blocks, page_bytes]``
            compressed-entry pages (``None`` for window-only layers).
        block_tables / cu_seqlens / start_pos / token_slots: the ``StepBatch`` fields (int32 ``[B, max_blocks]``,
            int32 ``[B+1]``, int64 ``[B]``, int64 ``[T]``).
        window, ratio, block_size: the layer's geometry; entries: ≥ every token's visible entries (a host bound;
            0 for window-only layers).
        workspace: a ``dsv4.cache.Workspace`` holding the rows (else allocated).
    """
    B = block_tables.shape[0]
    shape = (B, window + entries, KV_DIM)
    rows = (workspace.get("sparse_attention.bf16_keys", shape, torch.bfloat16) if workspace is not None
            else torch.empty(shape, dtype=torch.bfloat16, device=ring.device))
    chunks = triton.cdiv(window, BF16_KEY_ROWS) + triton.cdiv(entries, BF16_KEY_ROWS)
    if B and chunks:
        _bf16_keys_kernel[(chunks, B)](
            ring, ring.stride(0), pool if pool is not None else ring, pool.stride(0) if pool is not None else 0,
            block_tables, block_tables.stride(0) if block_tables.dim() == 2 else 0, cu_seqlens, start_pos,
            token_slots, rows, rows.stride(0), entries, WINDOW=window, RATIO=max(ratio, 1), BLOCK_SIZE=block_size,
            PAGE_ENTRIES=block_size // ratio if ratio else 1, ROWS=BF16_KEY_ROWS, num_warps=4)
    return rows
