"""Variant ``tile="single"`` of ``dsv4.kernels.sparse_attention``: one ``[BLOCK_N, 512]`` key tile per chunk.

Same key sets, masks, online softmax, split partials and output as ``_sparse_attention_kernel`` (read that
module's docstring first); the difference is the shape of the work per chunk. The blocks kernel issues 8 Q·Kᵀ
products of depth 64 and 8 P·V products of width 64 (``m64n64k16`` tensor-core instructions, each with its own
operand staging); here a chunk's 8 dequantized 64-dim blocks form one ``[BLOCK_N, 512]`` BF16 tile (the codes
are loaded as ``[BLOCK_N, 8, 64]``: block 7 from the BF16 rope bytes, blocks 0–6 scaled by their own UE8M0
exponent, then reshaped), so there is one Q·Kᵀ of depth 512 and one P·V into a ``[BLOCK_H, 512]`` accumulator
(two ``n256`` instructions per k-step). The inverse RoPE is applied to the whole output row with angle 0 (an
exact identity) on the 448 nope dims, which avoids slicing the accumulator.

Launched by ``sparse_attention_fwd(..., tile="single")``; ``prefetch`` and ``dequant`` apply here too.
Self-contained except for the shared helpers it imports; delete this module and the ``tile`` keyword to drop it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .sparse_attention import (
    DATA_BYTES,
    MODE_ALL,
    MODE_LIST,
    NOPE_DIM,
    _cos_sin,
    _dequant_bits,
    _dot,
    _locate_entries,
    _wide_scales,
)


@triton.jit
def _key_tile(
    pages_ptr, data_off, scales, ok, new_ptrs, fresh, wide,
    HAS_NEW: tl.constexpr, BF16_MATH: tl.constexpr, DEQUANT_BITS: tl.constexpr,
):
    """All 512 dims of ``BLOCK_N`` keys as a BF16 ``[BLOCK_N, 512]`` tile (rows not ``ok`` → 0); arguments as
    ``sparse_attention._key_block`` (``new_ptrs`` ``[BLOCK_N, 1]`` pointers to BF16 rows of ``kv_new``)."""
    BLOCK_N: tl.constexpr = data_off.shape[0]
    b = tl.arange(0, 8)
    d3 = (b[:, None] * 64 + tl.arange(0, 64)[None, :])[None, :, :]  # [1, 8, 64] dim index
    nope = (b < 7)[None, :, None]
    codes = tl.load(pages_ptr + data_off[:, None, None] + d3, mask=ok[:, None, None] & nope, other=0)
    e = ((scales[:, None] >> (8 * b)[None, :]) & 0xFF)[:, :, None]  # [BLOCK_N, 8, 1] (block 7: the pad byte)
    if DEQUANT_BITS:
        k = _dequant_bits(codes, e, wide, BF16_MATH)
    elif BF16_MATH:
        scale = (e << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        k = codes.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16) * scale
    else:
        scale = (e << 23).to(tl.int32).to(tl.float32, bitcast=True)
        k = (codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale).to(tl.bfloat16)
    # rope value d (448 ≤ d < 512) is BF16 number d − 448 after the entry's 448 code bytes
    rope_ptrs = pages_ptr.to(tl.pointer_type(tl.bfloat16)) + (data_off // 2 - NOPE_DIM // 2)[:, None, None] + d3
    rope = tl.load(rope_ptrs, mask=ok[:, None, None] & ~nope, other=0.0)
    k = tl.reshape(tl.where(nope, k, rope), (BLOCK_N, 512))
    if HAS_NEW:
        k_new = tl.load(new_ptrs + tl.arange(0, 512)[None, :], mask=fresh[:, None], other=0.0)
        k = tl.where(fresh[:, None], k_new.to(tl.bfloat16), k)
    return k


@triton.jit
def _attend_tile(
    pages_ptr, data_off, scales, ok, new_ptrs, fresh, valid, q, m_i, l_i, acc, qk_scale,
    HAS_NEW: tl.constexpr, BF16_MATH: tl.constexpr, INTERPRET: tl.constexpr, DEQUANT_BITS: tl.constexpr,
):
    """One online-softmax step over a chunk (as ``sparse_attention._attend_chunk``): ``q`` ``[BLOCK_H, 512]``
    bf16, ``acc`` ``[BLOCK_H, 512]`` fp32."""
    wide = _wide_scales(scales, DEQUANT_BITS)
    k = _key_tile(pages_ptr, data_off, scales, ok, new_ptrs, fresh, wide, HAS_NEW, BF16_MATH, DEQUANT_BITS)
    s = _dot(q, tl.trans(k), tl.zeros((q.shape[0], k.shape[0]), tl.float32), INTERPRET)
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _dot(p.to(tl.bfloat16), k, acc * alpha[:, None], INTERPRET)
    return m_new, l_i, acc


@triton.jit
def _store_rotated(o, pos, inv_freq_ptr, o_ptrs, mask, INTERPRET: tl.constexpr):
    """Store ``o`` ``[BLOCK_H, 512]`` fp32 with the inverse RoPE on dims 448… (as ``sparse_attention._store_rope``);
    the nope pairs rotate by angle 0 (cos 1, sin 0: unchanged, the double rounding is a single one)."""
    BLOCK_H: tl.constexpr = o.shape[0]
    o = o.to(o_ptrs.dtype.element_ty).to(tl.float32)
    re, im = tl.split(tl.reshape(o, (BLOCK_H, 256, 2)))
    i = tl.arange(0, 256)
    freq = tl.load(inv_freq_ptr + (i - NOPE_DIM // 2), mask=i >= NOPE_DIM // 2, other=0.0)
    cos, sin = _cos_sin(pos.to(tl.float32) * freq, INTERPRET)
    sin = -sin
    out = tl.join(re * cos[None, :] - im * sin[None, :], re * sin[None, :] + im * cos[None, :])
    out = tl.reshape(out, (BLOCK_H, 512))
    tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _sparse_attention_tile_kernel(
    q_ptr, stride_qt, stride_qh,
    kv_new_ptr, stride_kvt,
    ring_ptr, stride_ring,
    ring_pos_ptr, stride_rpos,
    pool_ptr, stride_page,
    block_tables_ptr, stride_bt,
    idx_ptr, stride_idx,
    visible_ptr,
    token_request_ptr, positions_ptr, cu_seqlens_ptr, start_pos_ptr, token_slots_ptr,
    sink_ptr, inv_freq_ptr,
    o_ptr, stride_ot, stride_oh,
    lse_ptr, stride_lt,
    po_ptr, plse_ptr,
    H, num_compressed, chunks_per_split, num_splits, qk_scale,
    WINDOW: tl.constexpr, RATIO: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGE_ENTRIES: tl.constexpr,
    MODE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BF16_MATH: tl.constexpr, INTERPRET: tl.constexpr, PREFETCH: tl.constexpr = False,
    DEQUANT_BITS: tl.constexpr = False,
):
    """Arguments and grid as ``sparse_attention._sparse_attention_kernel``."""
    head_blocks = tl.cdiv(H, BLOCK_H)
    t = (tl.program_id(0) // head_blocks).to(tl.int64)
    hb = tl.program_id(0) % head_blocks
    split = tl.program_id(1)

    req = tl.load(token_request_ptr + t).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    start = tl.load(start_pos_ptr + req).to(tl.int64)
    first_row = tl.load(cu_seqlens_ptr + req).to(tl.int64)
    slot = tl.load(token_slots_ptr + t).to(tl.int64)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < H
    d = tl.arange(0, 512)
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=head_ok[:, None], other=0.0)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, 512), tl.float32)

    WINDOW_CHUNKS: tl.constexpr = (WINDOW + BLOCK_N - 1) // BLOCK_N
    if MODE == MODE_ALL:
        n_comp = tl.minimum(tl.load(visible_ptr + t).to(tl.int32), num_compressed)
    elif MODE == MODE_LIST:
        n_comp = num_compressed
    else:
        n_comp = 0
    total = WINDOW_CHUNKS + tl.cdiv(n_comp, BLOCK_N)
    c_begin = split * chunks_per_split
    c_end = tl.minimum(c_begin + chunks_per_split, total)
    n = tl.arange(0, BLOCK_N)
    scale_words = pool_ptr.to(tl.pointer_type(tl.int64))

    # ---- window keys: this step's tokens from kv_new, older ones from the ring page
    ring_words = ring_ptr.to(tl.pointer_type(tl.int64))
    for c in tl.range(c_begin, tl.minimum(c_end, WINDOW_CHUNKS), num_stages=1):
        j = c * BLOCK_N + n
        p = pos - (WINDOW - 1) + j
        in_window = (j < WINDOW) & (p >= 0)
        in_step = p >= start
        ring_slot = tl.maximum(p, 0) % WINDOW
        held = tl.load(ring_pos_ptr + slot * stride_rpos + ring_slot, mask=in_window & ~in_step, other=-1)
        from_ring = in_window & ~in_step & (held.to(tl.int64) == p)
        fresh = in_window & in_step
        page = slot * stride_ring
        scales = tl.load(ring_words + (page + WINDOW * DATA_BYTES) // 8 + ring_slot, mask=from_ring, other=0)
        new_ptrs = kv_new_ptr + (first_row + tl.maximum(p - start, 0))[:, None] * stride_kvt
        data_off = tl.multiple_of(page + ring_slot * DATA_BYTES, 16)
        m_i, l_i, acc = _attend_tile(
            ring_ptr, data_off, scales, from_ring, new_ptrs, fresh, from_ring | fresh, q, m_i, l_i, acc, qk_scale,
            True, BF16_MATH, INTERPRET, DEQUANT_BITS,
        )

    # ---- compressed entries from the pool, through the block table
    c_first = tl.maximum(c_begin, WINDOW_CHUNKS)
    if PREFETCH:
        page, entry_slot, scales, ok = _locate_entries(
            c_first, t, req, n_comp, idx_ptr, stride_idx, block_tables_ptr, stride_bt, scale_words, stride_page,
            RATIO, BLOCK_SIZE, PAGE_ENTRIES, MODE, BLOCK_N, WINDOW_CHUNKS,
        )
        for c in range(c_first, c_end):
            data_off = tl.multiple_of(page + entry_slot * DATA_BYTES, 16)
            cur_scales, cur_ok = scales, ok
            page, entry_slot, scales, ok = _locate_entries(
                c + 1, t, req, n_comp, idx_ptr, stride_idx, block_tables_ptr, stride_bt, scale_words, stride_page,
                RATIO, BLOCK_SIZE, PAGE_ENTRIES, MODE, BLOCK_N, WINDOW_CHUNKS,
            )
            m_i, l_i, acc = _attend_tile(
                pool_ptr, data_off, cur_scales, cur_ok, kv_new_ptr, cur_ok, cur_ok, q, m_i, l_i, acc, qk_scale,
                False, BF16_MATH, INTERPRET, DEQUANT_BITS,
            )
    else:
        for c in range(c_first, c_end):
            page, entry_slot, scales, ok = _locate_entries(
                c, t, req, n_comp, idx_ptr, stride_idx, block_tables_ptr, stride_bt, scale_words, stride_page,
                RATIO, BLOCK_SIZE, PAGE_ENTRIES, MODE, BLOCK_N, WINDOW_CHUNKS,
            )
            data_off = tl.multiple_of(page + entry_slot * DATA_BYTES, 16)
            m_i, l_i, acc = _attend_tile(
                pool_ptr, data_off, scales, ok, kv_new_ptr, ok, ok, q, m_i, l_i, acc, qk_scale,
                False, BF16_MATH, INTERPRET, DEQUANT_BITS,
            )

    if SPLIT:
        has = l_i > 0
        inv = 1.0 / tl.where(has, l_i, 1.0)
        plse = tl.where(has, tl.where(m_i == float("-inf"), 0.0, m_i) + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        row = (t * num_splits + split) * H + heads
        tl.store(po_ptr + row[:, None] * 512 + d[None, :], acc * inv[:, None], mask=head_ok[:, None])
        tl.store(plse_ptr + row, plse, mask=head_ok)
    else:
        sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0) * 1.4426950408889634
        m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
        denom = l_i + tl.exp2(sink - m_use)
        tl.store(lse_ptr + t * stride_lt + heads, (m_use + tl.log2(denom)) * 0.6931471805599453, mask=head_ok)
        out = o_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :]
        _store_rotated(acc * (1.0 / denom)[:, None], pos, inv_freq_ptr, out, head_ok[:, None], INTERPRET)


@triton.jit
def _dequant_probe_tile_kernel(pages_ptr, out_ptr, BF16_MATH: tl.constexpr, DEQUANT_BITS: tl.constexpr):
    """Test hook, as ``sparse_attention._dequant_probe_kernel`` for ``_key_tile``."""
    n = tl.arange(0, 64)
    data_off = tl.multiple_of(n.to(tl.int64) * DATA_BYTES, 16)
    scales = tl.load(pages_ptr.to(tl.pointer_type(tl.int64)) + 64 * DATA_BYTES // 8 + n)
    ok = n >= 0
    wide = _wide_scales(scales, DEQUANT_BITS)
    k = _key_tile(pages_ptr, data_off, scales, ok, out_ptr, ok, wide, False, BF16_MATH, DEQUANT_BITS)
    tl.store(out_ptr + n[:, None] * 512 + tl.arange(0, 512)[None, :], k)
