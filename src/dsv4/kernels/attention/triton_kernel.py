"""Sparse attention with sink over the paged 584-B KV entries (SPEC §3 step 5–6, §6), for Hopper.

One program handles one query token, one block of ``BLOCK_H`` (64) heads and one *split* (a contiguous range of
key chunks). All heads of the block share every key load: the keys are the single shared KV head (K ≡ V). The
same kernel serves decode (1–4 tokens per request, split-KV when there are few programs) and prefill chunks
(many tokens, no split): every token has its own key set, so the tensor-core M dimension is the heads.

Key set of a query at position ``t`` of request ``b`` (SPEC §6), in chunks of ``BLOCK_N`` keys:

* window chunks first: positions ``t−W+1 … t``; a position ``≥ start_pos[b]`` is one of this step's tokens and is
  read from ``kv_new`` (BF16, already rounded as stored), an older one from the request's ring page (slot
  ``p mod W``; present iff ``ring_positions[slot, p mod W] == p``);
* then compressed chunks: CSA the entry list ``entry_idx[t, :]`` (−1 = none), HCA every entry ``i < visible[t]``
  (no index list at all). Entry ``i`` lives in block ``block_tables[b, (i·m) // block_size]`` at slot
  ``((i·m) % block_size) // m``.

The 512 dims are processed as 8 blocks of 64: blocks 0–6 are the FP8 blocks (each with its own UE8M0 scale per
key), block 7 the BF16 rope dims. A key block is dequantized in registers (E4M3 code × 2^(e−127) is exact in
BF16) and feeds the tensor-core products ``S += Q_b·K_bᵀ`` and ``O_b += P·K_b``; no BF16 copy of the keys is
written to memory. The softmax is the online one in base 2 with P rounded to BF16 for P·V and FP32 sums; the sink
enters the denominator at the end. With several splits per token each program writes an FP32 partial
(``o/l`` and its log-sum-exp) and ``_combine_kernel`` merges them — or, with the Hopper kernel of
``sparse_attention_sm90``, the splits of a token run as one thread-block cluster and merge them themselves
(``combine``).

Prefill chunks (``keys``): each key serves many queries there, so ``bf16_keys`` first writes the step's keys
dequantized once as BF16 rows (``_bf16_keys_kernel``: every request's ring, then the entries its tokens see) and the
Hopper kernel copies chunks of rows instead of dequantizing the pages per query — the same values.

The inverse RoPE of the output (rotation of the last 64 dims by ``−t``, adjacent pairs) is fused into the final
store; like the reference, the output is rounded to BF16 before the rotation and again after it.

Development: the kernels also run in the Triton interpreter (``TRITON_INTERPRET=1``, CPU tensors; then BF16
products are upcast to FP32 and ``tl.cos`` replaces libdevice, see ``INTERPRET``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import cluster_launch
from . import sm90_pipelined as sparse_attention_sm90_pipelined
from . import sm90_serial as sparse_attention_sm90
from . import sm90_ws as sparse_attention_sm90_ws

__all__ = ["sparse_attention_fwd", "bf16_keys", "num_sms", "choose_impl", "choose_splits", "step_splits",
           "rows_are_words"]

HEAD_DIM = 512  # 448 FP8 nope dims + 64 BF16 rope dims
ENTRY_BYTES = 584  # a stored entry: 576 data bytes + 8 scale bytes
LOG2E = 1.4426950408889634
#: ``impl="auto"`` runs ``sparse_attention_sm90_pipelined`` over FP8 pages for steps without splits from this many
#: 64-key chunks per token (H200, 2026-11-26, against the serial / warp-specialized kernels in the same call: Flash
#: CSA B=128 (10 chunks) 57.0 vs 57.8 µs, Pro CSA B=64 / 128 (18) 78.6 / 146.0 vs 86.0 / 164.9, HCA-128K B=128 (18)
#: 77.6 vs 82.4, HCA-1M B=128 (130) 425.1 vs 441.6; window-only steps (2 chunks) keep the serial kernel)
PIPELINED_MIN_CHUNKS = 8
# Kernel constants (globals a @triton.jit function reads must be tl.constexpr).
NOPE_DIM = tl.constexpr(448)
DATA_BYTES = tl.constexpr(576)  # per entry: 448 E4M3 codes + 64 BF16 rope values
SCALE_BYTES = tl.constexpr(8)  # per entry: 7 UE8M0 exponents + pad
# Where a token's compressed entries come from.
MODE_WINDOW = tl.constexpr(0)  # none (SWA layers)
MODE_LIST = tl.constexpr(1)  # entry_idx[t, :], −1 = none (CSA top-k)
MODE_ALL = tl.constexpr(2)  # every i < visible[t] (HCA)


# ------------------------------------------------------------------------------------------------ device helpers
@triton.jit
def _key_block(
    pages_ptr, data_off, scales, ok, new_ptrs, fresh, wide,
    B: tl.constexpr, HAS_NEW: tl.constexpr, BF16_MATH: tl.constexpr, DEQUANT_BITS: tl.constexpr = False,
):
    """Dims ``64·B … 64·B+63`` of ``BLOCK_N`` keys as a BF16 ``[BLOCK_N, 64]`` tile (rows not ``ok`` → 0).

    Args:
        pages_ptr: uint8 base of the pages; data_off: int64 ``[BLOCK_N]`` byte offset of each entry's 576 data
            bytes (a multiple of 16); scales: int64 ``[BLOCK_N]`` each entry's 8 scale bytes (little-endian word).
        ok: ``[BLOCK_N]`` rows to read from the pages.
        new_ptrs / fresh: ``HAS_NEW`` only: ``[BLOCK_N, 1]`` pointers to BF16 rows of ``kv_new`` and the rows
            to take from there instead.
        B: 0–6 FP8 block ``B`` (E4M3 × 2^(e_B − 127), exact in BF16); 7 the BF16 rope values.
        BF16_MATH: scale in BF16 (fewer conversions); else in FP32 (the interpreter's BF16 arithmetic is wrong).
        wide / DEQUANT_BITS: see ``_dequant_bits``.
    """
    col = tl.arange(0, 64)
    if B < 7:
        codes = tl.load(pages_ptr + data_off[:, None] + (B * 64 + col)[None, :], mask=ok[:, None], other=0)
        e = (scales >> (8 * B)) & 0xFF
        fp8 = codes.to(tl.float8e4nv, bitcast=True)
        if DEQUANT_BITS:
            k = _dequant_bits(codes, e[:, None], wide, BF16_MATH)
        elif BF16_MATH:
            # UE8M0 byte e → 2^(e−127): e << 7 is exactly that BF16 (its exponent field is bits 7…14).
            scale = (e << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
            k = fp8.to(tl.bfloat16) * scale[:, None]
        else:
            scale = (e << 23).to(tl.int32).to(tl.float32, bitcast=True)
            k = (fp8.to(tl.float32) * scale[:, None]).to(tl.bfloat16)
    else:
        rope = pages_ptr.to(tl.pointer_type(tl.bfloat16)) + (data_off // 2 + NOPE_DIM // 2)
        k = tl.load(rope[:, None] + col[None, :], mask=ok[:, None], other=0.0)
    if HAS_NEW:
        k_new = tl.load(new_ptrs + (B * 64 + col)[None, :], mask=fresh[:, None], other=0.0)
        k = tl.where(fresh[:, None], k_new.to(tl.bfloat16), k)
    return k


@triton.jit
def _dequant_bits(codes, e, wide, BF16_MATH: tl.constexpr):
    """Variant ``dequant="bits"``: E4M3 ``codes`` (uint8) × 2^(``e`` − 127) as BF16, built from the code bits.

    ``sign << 15 | magnitude << 4`` is a BF16 holding the E4M3 exponent field and mantissa in place, i.e. the
    value × 2^−120 (E4M3 subnormals land on BF16 subnormals, still exact); one multiply by the power of two
    2^(e − 7) restores it and applies the scale. That multiplier is a BF16 only for ``e ≤ 134``: when ``wide``
    (some exponent of the chunk above 134, |x| ≥ 2^15) a second multiply by 2^(e − 134) follows. Exact like the
    conversion path (products of powers of two), with integer ops instead of FP8 → FP16 → FP32 → BF16.
    Without ``BF16_MATH`` (the interpreter, whose BF16 subnormals are wrong) the same is done in FP32.
    """
    if BF16_MATH:
        x = codes.to(tl.uint16)
        kb = (((x & 0x80) << 8) | ((x & 0x7F) << 4)).to(tl.bfloat16, bitcast=True)
        s1 = ((tl.minimum(e, 134) + 120) << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        k = kb * s1
        if wide:
            s2 = ((tl.maximum(e, 134) - 7) << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            k = (k.to(tl.float32) * s2.to(tl.float32)).to(tl.bfloat16)
    else:
        x = codes.to(tl.uint32)
        kb = (((x & 0x80) << 24) | ((x & 0x7F) << 20)).to(tl.float32, bitcast=True)  # value × 2^−120
        scale = (e << 23).to(tl.int32).to(tl.float32, bitcast=True)
        k = (kb * 1.329227995784916e36 * scale).to(tl.bfloat16)  # 2^120
    return k


@triton.jit
def _wide_scales(scales, DEQUANT_BITS: tl.constexpr):
    """Whether any of the chunk's 7 UE8M0 exponents exceeds 134 (``_dequant_bits`` then needs two multiplies);
    always false without ``DEQUANT_BITS``."""
    wide = 0
    if DEQUANT_BITS:
        top = scales & 0xFF
        for b in tl.static_range(1, 7):
            top = tl.maximum(top, (scales >> (8 * b)) & 0xFF)
        wide = tl.max(top, 0) > 134
    return wide


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    """``acc + a @ b`` with FP32 accumulation (the interpreter multiplies BF16 wrongly: upcast there)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _attend_chunk(
    pages_ptr, data_off, scales, ok, new_ptrs, fresh, valid,
    q0, q1, q2, q3, q4, q5, q6, q7,
    m_i, l_i, a0, a1, a2, a3, a4, a5, a6, a7,
    qk_scale,
    HAS_NEW: tl.constexpr, BF16_MATH: tl.constexpr, INTERPRET: tl.constexpr, DEQUANT_BITS: tl.constexpr = False,
):
    """One online-softmax step (base 2; ``qk_scale`` = softmax scale · log2 e) over a chunk of ``BLOCK_N`` keys.

    The 512 dims are handled as 8 blocks of 64 (7 FP8 blocks with their own scales, then the rope dims):
    ``q0…q7`` ``[BLOCK_H, 64]`` bf16 query blocks, ``a0…a7`` ``[BLOCK_H, 64]`` fp32 output accumulators,
    ``m_i`` / ``l_i`` ``[BLOCK_H]`` running max (−inf = none yet) and sum; ``valid`` ``[BLOCK_N]`` the real keys.
    Key arguments as ``_key_block``.
    """
    wide = _wide_scales(scales, DEQUANT_BITS)
    k0 = _key_block(pages_ptr, data_off, scales, ok, new_ptrs, fresh, wide, 0, HAS_NEW, BF16_MATH, DEQUANT_BITS)
    k1 = _key_block(pages_ptr, data_off, scales, ok, new_ptrs, fresh, wide, 1, HAS_NEW, BF16_MATH, DEQUANT_BITS)
    k2 = _key_block(pages_ptr, data_off, scales, ok, new_ptrs, fresh, wide, 2, HAS_NEW, BF16_MATH, DEQUANT_BITS)
    k3 = _key_block(pages_ptr, data_off, scales, ok, new_ptrs, fresh, wide, 3, HAS_NEW, BF16_MATH, DEQUANT_BITS)
    k4 = _key_block(pages_ptr, data_off, scales, ok, new_ptrs, fresh, wide, 4, HAS_NEW, BF16_MATH, DEQUANT_BITS)
    k5 = _key_block(pages_ptr, data_off, scales, ok, new_ptrs, fresh, wide, 5, HAS_NEW, BF16_MATH, DEQUANT_BITS)
    k6 = _key_block(pages_ptr, data_off, scales, ok, new_ptrs, fresh, wide, 6, HAS_NEW, BF16_MATH, DEQUANT_BITS)
    k7 = _key_block(pages_ptr, data_off, scales, ok, new_ptrs, fresh, wide, 7, HAS_NEW, BF16_MATH, DEQUANT_BITS)

    s = tl.zeros((q0.shape[0], k0.shape[0]), tl.float32)
    s = _dot(q0, tl.trans(k0), s, INTERPRET)
    s = _dot(q1, tl.trans(k1), s, INTERPRET)
    s = _dot(q2, tl.trans(k2), s, INTERPRET)
    s = _dot(q3, tl.trans(k3), s, INTERPRET)
    s = _dot(q4, tl.trans(k4), s, INTERPRET)
    s = _dot(q5, tl.trans(k5), s, INTERPRET)
    s = _dot(q6, tl.trans(k6), s, INTERPRET)
    s = _dot(q7, tl.trans(k7), s, INTERPRET)
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # The probabilities are rounded to BF16 for P·V; the denominator keeps the FP32 ones (SPEC §3 step 5).
    pb = p.to(tl.bfloat16)
    a0 = _dot(pb, k0, a0 * alpha[:, None], INTERPRET)
    a1 = _dot(pb, k1, a1 * alpha[:, None], INTERPRET)
    a2 = _dot(pb, k2, a2 * alpha[:, None], INTERPRET)
    a3 = _dot(pb, k3, a3 * alpha[:, None], INTERPRET)
    a4 = _dot(pb, k4, a4 * alpha[:, None], INTERPRET)
    a5 = _dot(pb, k5, a5 * alpha[:, None], INTERPRET)
    a6 = _dot(pb, k6, a6 * alpha[:, None], INTERPRET)
    a7 = _dot(pb, k7, a7 * alpha[:, None], INTERPRET)
    return m_new, l_i, a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _locate_entries(
    c, t, req, n_comp, idx_ptr, stride_idx, block_tables_ptr, stride_bt, scale_words, stride_page,
    RATIO: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGE_ENTRIES: tl.constexpr, MODE: tl.constexpr,
    BLOCK_N: tl.constexpr, WINDOW_CHUNKS: tl.constexpr,
):
    """Where the ``BLOCK_N`` compressed entries of key chunk ``c`` live: ``(page, entry_slot, scales, ok)`` — int64
    byte offset of each entry's page, its slot in the page, its 8 scale bytes (little-endian word) and whether it
    exists (listed, not −1, block mapped). A chunk past the token's entries gives ``ok`` all false (no reads)."""
    j = (c - WINDOW_CHUNKS) * BLOCK_N + tl.arange(0, BLOCK_N)
    listed = j < n_comp
    if MODE == MODE_LIST:
        entry = tl.load(idx_ptr + t * stride_idx + j, mask=listed, other=-1).to(tl.int64)
    else:
        entry = tl.where(listed, j, -1).to(tl.int64)
    first_pos = tl.maximum(entry, 0) * RATIO
    block = tl.load(block_tables_ptr + req * stride_bt + first_pos // BLOCK_SIZE, mask=entry >= 0, other=-1)
    ok = (entry >= 0) & (block >= 0)
    entry_slot = (first_pos % BLOCK_SIZE) // RATIO
    page = tl.maximum(block, 0).to(tl.int64) * stride_page
    scales = tl.load(scale_words + (page + PAGE_ENTRIES * DATA_BYTES) // 8 + entry_slot, mask=ok, other=0)
    return page, entry_slot, scales, ok


@triton.jit
def _cos_sin(angle, INTERPRET: tl.constexpr):
    """``cos``/``sin`` of fp32 angles up to ~1e6 rad with libdevice's full range reduction (the interpreter has no
    libdevice: ``tl.cos``/``tl.sin`` there)."""
    if INTERPRET:
        return tl.cos(angle), tl.sin(angle)
    else:
        return libdevice.cos(angle), libdevice.sin(angle)


@triton.jit
def _store_rope(o, pos, inv_freq, o_ptrs, mask, INTERPRET: tl.constexpr):
    """Store the rope dims ``o`` ``[BLOCK_H, 64]`` fp32 with the inverse RoPE at ``pos`` (``inv_freq``: fp32
    ``[32]``, loaded): rounded to the output dtype, rotated by ``−pos·ω_i`` per pair ``(2i, 2i+1)`` in FP32 and
    rounded again (as ``apply_rope`` on the reference's output)."""
    BLOCK_H: tl.constexpr = o.shape[0]
    o = o.to(o_ptrs.dtype.element_ty).to(tl.float32)
    re, im = tl.split(tl.reshape(o, (BLOCK_H, 32, 2)))
    angle = pos.to(tl.float32) * inv_freq
    cos, sin = _cos_sin(angle, INTERPRET)
    sin = -sin
    out = tl.reshape(tl.join(re * cos[None, :] - im * sin[None, :], re * sin[None, :] + im * cos[None, :]), (BLOCK_H, 64))
    tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------------ kernels
@triton.jit
def _sparse_attention_kernel(
    q_ptr, stride_qt, stride_qh,  # [T, H, 512] bf16
    kv_new_ptr, stride_kvt,  # [T, 512] bf16
    ring_ptr, stride_ring,  # uint8 [slots, ring_page_bytes]
    ring_pos_ptr, stride_rpos,  # int32 [slots, W]
    pool_ptr, stride_page,  # uint8 [num_blocks, page_bytes]
    block_tables_ptr, stride_bt,  # int32 [B, max_blocks]
    idx_ptr, stride_idx,  # MODE_LIST: int [T, num_compressed] entry indices (−1 = none)
    visible_ptr,  # MODE_ALL: int64 [T] entries visible to each token
    token_request_ptr, positions_ptr, cu_seqlens_ptr, start_pos_ptr, token_slots_ptr,
    sink_ptr, inv_freq_ptr,  # fp32 [H], fp32 [32]
    o_ptr, stride_ot, stride_oh,  # [T, H, 512] act dtype
    lse_ptr, stride_lt,  # fp32 [T, H]
    po_ptr, plse_ptr,  # fp32 [T, S, H, 512], [T, S, H] (SPLIT only)
    H, num_compressed, chunks_per_split, num_splits, qk_scale,
    WINDOW: tl.constexpr, RATIO: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGE_ENTRIES: tl.constexpr,
    MODE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BF16_MATH: tl.constexpr, INTERPRET: tl.constexpr, PREFETCH: tl.constexpr = False,
    DEQUANT_BITS: tl.constexpr = False,
):
    """Grid ``(T · ceil(H / BLOCK_H), splits)``: token ``t``, head block and split of its key chunks."""
    head_blocks = tl.cdiv(H, BLOCK_H)
    t = (tl.program_id(0) // head_blocks).to(tl.int64)  # the head blocks of one token run side by side
    hb = tl.program_id(0) % head_blocks
    split = tl.program_id(1)

    req = tl.load(token_request_ptr + t).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    start = tl.load(start_pos_ptr + req).to(tl.int64)
    first_row = tl.load(cu_seqlens_ptr + req).to(tl.int64)
    slot = tl.load(token_slots_ptr + t).to(tl.int64)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < H
    col = tl.arange(0, 64)
    q_row = q_ptr + t * stride_qt + heads[:, None] * stride_qh + col[None, :]
    q0 = tl.load(q_row + 0 * 64, mask=head_ok[:, None], other=0.0)
    q1 = tl.load(q_row + 1 * 64, mask=head_ok[:, None], other=0.0)
    q2 = tl.load(q_row + 2 * 64, mask=head_ok[:, None], other=0.0)
    q3 = tl.load(q_row + 3 * 64, mask=head_ok[:, None], other=0.0)
    q4 = tl.load(q_row + 4 * 64, mask=head_ok[:, None], other=0.0)
    q5 = tl.load(q_row + 5 * 64, mask=head_ok[:, None], other=0.0)
    q6 = tl.load(q_row + 6 * 64, mask=head_ok[:, None], other=0.0)
    q7 = tl.load(q_row + 7 * 64, mask=head_ok[:, None], other=0.0)

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    a0 = tl.zeros((BLOCK_H, 64), tl.float32)
    a1 = tl.zeros((BLOCK_H, 64), tl.float32)
    a2 = tl.zeros((BLOCK_H, 64), tl.float32)
    a3 = tl.zeros((BLOCK_H, 64), tl.float32)
    a4 = tl.zeros((BLOCK_H, 64), tl.float32)
    a5 = tl.zeros((BLOCK_H, 64), tl.float32)
    a6 = tl.zeros((BLOCK_H, 64), tl.float32)
    a7 = tl.zeros((BLOCK_H, 64), tl.float32)

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
    # (at most a few chunks: not software-pipelined, which keeps its shared memory for the loop below)
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
        # (multiple_of must see the op that computes the offsets: on a helper's argument it is lost)
        data_off = tl.multiple_of(page + ring_slot * DATA_BYTES, 16)
        m_i, l_i, a0, a1, a2, a3, a4, a5, a6, a7 = _attend_chunk(
            ring_ptr, data_off, scales, from_ring, new_ptrs, fresh, from_ring | fresh,
            q0, q1, q2, q3, q4, q5, q6, q7, m_i, l_i, a0, a1, a2, a3, a4, a5, a6, a7, qk_scale,
            True, BF16_MATH, INTERPRET, DEQUANT_BITS,
        )

    # ---- compressed entries from the pool, through the block table
    c_first = tl.maximum(c_begin, WINDOW_CHUNKS)
    if PREFETCH:
        # Variant "prefetch": chunk c+1's entry index → block table → scale loads are issued before chunk c's
        # math, so a chunk waits on one load latency (its codes) instead of three dependent ones.
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
            m_i, l_i, a0, a1, a2, a3, a4, a5, a6, a7 = _attend_chunk(
                pool_ptr, data_off, cur_scales, cur_ok, kv_new_ptr, cur_ok, cur_ok,
                q0, q1, q2, q3, q4, q5, q6, q7, m_i, l_i, a0, a1, a2, a3, a4, a5, a6, a7, qk_scale,
                False, BF16_MATH, INTERPRET, DEQUANT_BITS,
            )
    else:
        for c in range(c_first, c_end):
            page, entry_slot, scales, ok = _locate_entries(
                c, t, req, n_comp, idx_ptr, stride_idx, block_tables_ptr, stride_bt, scale_words, stride_page,
                RATIO, BLOCK_SIZE, PAGE_ENTRIES, MODE, BLOCK_N, WINDOW_CHUNKS,
            )
            data_off = tl.multiple_of(page + entry_slot * DATA_BYTES, 16)
            m_i, l_i, a0, a1, a2, a3, a4, a5, a6, a7 = _attend_chunk(
                pool_ptr, data_off, scales, ok, kv_new_ptr, ok, ok,
                q0, q1, q2, q3, q4, q5, q6, q7, m_i, l_i, a0, a1, a2, a3, a4, a5, a6, a7, qk_scale,
                False, BF16_MATH, INTERPRET, DEQUANT_BITS,
            )

    if SPLIT:
        # Partial: o/l and its log-sum-exp (base 2); an empty split has lse −inf and o 0.
        has = l_i > 0
        inv = 1.0 / tl.where(has, l_i, 1.0)
        plse = tl.where(has, tl.where(m_i == float("-inf"), 0.0, m_i) + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        row = (t * num_splits + split) * H + heads
        out = po_ptr + row[:, None] * 512 + col[None, :]
        tl.store(out + 0 * 64, a0 * inv[:, None], mask=head_ok[:, None])
        tl.store(out + 1 * 64, a1 * inv[:, None], mask=head_ok[:, None])
        tl.store(out + 2 * 64, a2 * inv[:, None], mask=head_ok[:, None])
        tl.store(out + 3 * 64, a3 * inv[:, None], mask=head_ok[:, None])
        tl.store(out + 4 * 64, a4 * inv[:, None], mask=head_ok[:, None])
        tl.store(out + 5 * 64, a5 * inv[:, None], mask=head_ok[:, None])
        tl.store(out + 6 * 64, a6 * inv[:, None], mask=head_ok[:, None])
        tl.store(out + 7 * 64, a7 * inv[:, None], mask=head_ok[:, None])
        tl.store(plse_ptr + row, plse, mask=head_ok)
    else:
        sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0) * 1.4426950408889634
        m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
        denom = l_i + tl.exp2(sink - m_use)
        tl.store(lse_ptr + t * stride_lt + heads, (m_use + tl.log2(denom)) * 0.6931471805599453, mask=head_ok)
        inv = 1.0 / denom
        out = o_ptr + t * stride_ot + heads[:, None] * stride_oh + col[None, :]
        dt = o_ptr.dtype.element_ty
        tl.store(out + 0 * 64, (a0 * inv[:, None]).to(dt), mask=head_ok[:, None])
        tl.store(out + 1 * 64, (a1 * inv[:, None]).to(dt), mask=head_ok[:, None])
        tl.store(out + 2 * 64, (a2 * inv[:, None]).to(dt), mask=head_ok[:, None])
        tl.store(out + 3 * 64, (a3 * inv[:, None]).to(dt), mask=head_ok[:, None])
        tl.store(out + 4 * 64, (a4 * inv[:, None]).to(dt), mask=head_ok[:, None])
        tl.store(out + 5 * 64, (a5 * inv[:, None]).to(dt), mask=head_ok[:, None])
        tl.store(out + 6 * 64, (a6 * inv[:, None]).to(dt), mask=head_ok[:, None])
        _store_rope(a7 * inv[:, None], pos, tl.load(inv_freq_ptr + tl.arange(0, 32)), out + 7 * 64, head_ok[:, None],
                    INTERPRET)


@triton.jit
def _dequant_probe_kernel(pages_ptr, out_ptr, BF16_MATH: tl.constexpr, DEQUANT_BITS: tl.constexpr):
    """Test hook: the key blocks ``_key_block`` builds for 64 entries stored as one page (64 × 576 data bytes,
    then 64 × 8 scale bytes), written as bf16 ``[64, 512]`` to ``out_ptr``."""
    n = tl.arange(0, 64)
    data_off = tl.multiple_of(n.to(tl.int64) * DATA_BYTES, 16)
    scales = tl.load(pages_ptr.to(tl.pointer_type(tl.int64)) + 64 * DATA_BYTES // 8 + n)
    ok = n >= 0
    wide = _wide_scales(scales, DEQUANT_BITS)
    for b in tl.static_range(8):
        k = _key_block(pages_ptr, data_off, scales, ok, out_ptr, ok, wide, b, False, BF16_MATH, DEQUANT_BITS)
        tl.store(out_ptr + n[:, None] * 512 + b * 64 + tl.arange(0, 64)[None, :], k)


@triton.jit
def _split_block(po_ptr, plse_ptr, t, s0, num_splits, H, heads, head_ok, BLOCK_S: tl.constexpr):
    """Splits ``s0 … s0 + BLOCK_S − 1`` of token ``t``'s partials for ``heads`` in one load each: their log-sum-exps
    fp32 ``[BLOCK_S, BLOCK_H]`` (−inf where absent), nope rows ``[BLOCK_S, BLOCK_H, 512]`` (dims 448… and absent rows
    zero) and rope rows ``[BLOCK_S, BLOCK_H, 64]``."""
    split = tl.arange(0, BLOCK_S)
    rows = (t * num_splits + s0 + split[:, None]) * H + heads[None, :]
    ok = (s0 + split[:, None] < num_splits) & head_ok[None, :]
    d = tl.arange(0, 512)
    plse = tl.load(plse_ptr + rows, mask=ok, other=float("-inf"))
    part = po_ptr + rows[:, :, None] * 512
    po_nope = tl.load(part + d[None, None, :], mask=ok[:, :, None] & (d < NOPE_DIM)[None, None, :], other=0.0)
    po_rope = tl.load(part + NOPE_DIM + tl.arange(0, 64)[None, None, :], mask=ok[:, :, None], other=0.0)
    return plse, po_nope, po_rope


@triton.jit
def _combine_kernel(
    po_ptr, plse_ptr,  # fp32 [T, S, H, 512], [T, S, H]
    positions_ptr, sink_ptr, inv_freq_ptr,
    o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt,
    H, num_splits,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Merge the splits of one token and head block (grid ``(ceil(H / BLOCK_H), T)``):
    ``o = Σ_s 2^{lse_s − M} o_s / (Σ_s 2^{lse_s − M} + 2^{sink − M})`` with ``M`` the largest of the ``lse_s`` and
    the sink, then the inverse RoPE.

    The partials are read ``BLOCK_S`` splits at a time, each block's partial rows and log-sum-exps in one load
    (``[BLOCK_S, BLOCK_H, 512]``): one straight-line pass when every split fits one load (decode), else blocks
    merged with a running max (the sums so far rescaled when it grows). The sink, position and RoPE frequencies
    (not written by the attention grid) are requested first: a decode step's combine is a chain of dependent memory
    round trips.
    """
    hb = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < H
    d = tl.arange(0, 512)
    r = tl.arange(0, 64)
    sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0) * 1.4426950408889634
    pos = tl.load(positions_ptr + t)
    inv_freq = tl.load(inv_freq_ptr + tl.arange(0, 32))
    # Straight-line for decode: the loop form takes 143 registers (3 programs per SM, not 4: a second wave at B=8).
    if num_splits <= BLOCK_S:
        plse, po_nope, po_rope = _split_block(po_ptr, plse_ptr, t, 0, num_splits, H, heads, head_ok, BLOCK_S)
        m = tl.max(plse, 0)
        w = tl.exp2(plse - tl.where(m == float("-inf"), 0.0, m)[None, :])  # 0 where absent
        nope = tl.sum(w[:, :, None] * po_nope, 0)  # dims 448… unused
        rope = tl.sum(w[:, :, None] * po_rope, 0)
        weight = tl.sum(w, 0)
    else:  # blocks of splits merged with a running max (the sums so far rescaled when it grows)
        m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        nope = tl.zeros((BLOCK_H, 512), tl.float32)
        rope = tl.zeros((BLOCK_H, 64), tl.float32)
        weight = tl.zeros((BLOCK_H,), tl.float32)
        for s0 in range(0, num_splits, BLOCK_S):
            plse, po_nope, po_rope = _split_block(po_ptr, plse_ptr, t, s0, num_splits, H, heads, head_ok, BLOCK_S)
            m_new = tl.maximum(m, tl.max(plse, 0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # 0 while no split has a key
            grown = tl.exp2(m - m_use)  # rescales the sums so far: ≤ 1, and 0 before the first key
            w = tl.exp2(plse - m_use[None, :])
            nope = nope * grown[:, None] + tl.sum(w[:, :, None] * po_nope, 0)
            rope = rope * grown[:, None] + tl.sum(w[:, :, None] * po_rope, 0)
            weight = weight * grown + tl.sum(w, 0)
            m = m_new
    # The sink joins the max (the sums are relative to m): neither 2^(sink − M) nor the rescale 2^(m − M) can
    # overflow, and the denominator is at least 1, however far every key's score lies below the sink. (The reference
    # kernel's max takes the real keys only, SPEC §3 step 5, as the unsplit kernels do: the same o and lse wherever
    # its 2^(sink − max) is finite; where that overflows, the reference gives lse = +inf (o = 0), this merge a finite
    # lse.)
    top = tl.maximum(m, sink)
    kept = tl.exp2(m - top)  # 1 where m ≥ sink; 0 where no split has a key
    denom = weight * kept + tl.exp2(sink - top)
    tl.store(lse_ptr + t * stride_lt + heads, (top + tl.log2(denom)) * 0.6931471805599453, mask=head_ok)
    scaled = denom / kept  # denom itself where m ≥ sink (the division's bits as before); inf where kept is 0
    out = o_ptr + t * stride_ot + heads[:, None] * stride_oh
    tl.store(out + d[None, :], (nope / scaled[:, None]).to(o_ptr.dtype.element_ty),
             mask=head_ok[:, None] & (d[None, :] < NOPE_DIM))
    _store_rope(rope / scaled[:, None], pos, inv_freq, out + NOPE_DIM + r[None, :], head_ok[:, None], INTERPRET)


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


# ------------------------------------------------------------------------------------------------ launcher
_NUM_SMS: dict[int, int] = {}
#: rows per program of ``_bf16_keys_kernel``: enough programs to fill the GPU for a step of one request
BF16_KEY_ROWS = 16


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (cached; 132 when not a CUDA device, e.g. the interpreter)."""
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


def choose_splits(programs: int, max_chunks: int, sms: int, min_chunks: int = 2,
                  policy: str = "fill") -> tuple[int, int]:
    """Split each token's key chunks so that ``programs · splits`` fills the GPU about once.

    Args:
        programs: programs without splitting (tokens × head blocks).
        max_chunks: the most key chunks any token has (host bound).
        sms: multiprocessors; min_chunks: fewest chunks per split worth a partial's write and read.
        policy: ``"fill"`` at least one program per multiprocessor (may spill into a short second wave);
            ``"waves"`` the most splits whose programs still fit in one wave (one program per multiprocessor:
            the kernel runs one CTA per SM), so the slowest SM runs ``chunks_per_split`` chunks, not twice that.
    Returns:
        ``(num_splits, chunks_per_split)``.
    """
    if programs >= sms or max_chunks <= min_chunks:
        return 1, max(max_chunks, 1)
    if policy == "waves":
        splits = min(max(sms // programs, 1), max(max_chunks // min_chunks, 1))
    elif policy == "fill":
        splits = min(-(-sms // programs), max(max_chunks // min_chunks, 1))
    else:
        raise ValueError(f"unknown split policy {policy!r}")
    per = -(-max_chunks // splits)
    return -(-max_chunks // per), per


def step_splits(impl: str, num_splits: int | None, programs: int, max_chunks: int, sms: int, min_chunks: int,
                policy: str) -> tuple[int, int]:
    """``(num_splits, chunks_per_split)`` of a step for ``sparse_attention_fwd``'s ``impl`` / ``num_splits``:
    ``"gluon_pipelined"`` takes none (its persistent programs share the items; a split without chunks broke its
    warpgroups' protocol — ``sparse_attention_sm90_pipelined``), a given ``num_splits`` is met as closely as
    ``max_chunks`` allows, else ``choose_splits`` (``programs``, ``max_chunks``, ``sms``, ``min_chunks``,
    ``policy`` as there)."""
    if impl == "gluon_pipelined":
        return 1, max(max_chunks, 1)
    if num_splits is None:
        return choose_splits(programs, max_chunks, sms, min_chunks, policy)
    per = -(-max_chunks // max(1, min(num_splits, max_chunks)))
    return -(-max_chunks // per), per


def _use_bf16_keys(keys: str, impl: str, gluon_ok: bool, tokens: int, requests: int, window: int,
                   entries: int | None, keys_per_token: int) -> bool:
    """Whether ``sparse_attention_fwd`` dequantizes the step's keys once into BF16 rows (``keys`` as there):
    ``gluon_ok`` — a Hopper GPU and 16-byte aligned q / kv_new rows; ``entries`` the host bound on any token's
    visible compressed entries (``None``: unknown); ``keys_per_token`` the keys each token attends."""
    if keys not in ("auto", "bf16", "fp8"):
        raise ValueError(f"unknown keys {keys!r}")
    if keys == "fp8":
        return False
    applies = gluon_ok and impl in ("auto", "gluon", "gluon_pipelined") and entries is not None
    if keys == "bf16":
        if not applies:
            raise ValueError("keys='bf16' needs a Gluon kernel (a Hopper GPU, impl 'auto', 'gluon' or "
                             f"'gluon_pipelined', 16-byte aligned q / kv_new rows; impl {impl!r}) and a bound on the "
                             "visible entries (max_visible with entry_idx)")
        return True
    if not applies:
        return False
    gathered = requests * (window + entries) * HEAD_DIM * 2
    return gathered * 8 <= tokens * keys_per_token * ENTRY_BYTES


def bf16_keys(ring: torch.Tensor, pool: torch.Tensor | None, block_tables: torch.Tensor, cu_seqlens: torch.Tensor,
              start_pos: torch.Tensor, token_slots: torch.Tensor, *, window: int, ratio: int, block_size: int,
              entries: int, workspace=None) -> torch.Tensor:
    """A step's keys dequantized once (``_bf16_keys_kernel``): bf16 ``[B, window + entries, 512]``, per request
    its ring's ``window`` slots as stored, then its compressed entries ``0 … entries − 1`` (those its tokens see;
    zero rows beyond). ``entries`` ≥ every token's visible entries (host bound); 0 for window-only layers."""
    B = block_tables.shape[0]
    shape = (B, window + entries, HEAD_DIM)
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


def _check_combine(combine: str, impl: str, splits: int) -> bool:
    """Whether ``sparse_attention_fwd`` tries to merge a step's split partials in clusters (``combine`` as there;
    ``splits`` per token): never for ``"kernel"``, 1 split, or another kernel than the serial Gluon one, where
    ``"cluster"`` raises."""
    if combine not in ("auto", "cluster", "kernel"):
        raise ValueError(f"unknown combine {combine!r}")
    if combine == "kernel" or splits == 1:
        return False
    applies = impl == "gluon" and splits <= cluster_launch.MAX_CLUSTER
    if not applies and combine == "cluster":
        raise ValueError(f"combine='cluster' needs impl 'gluon' (got {impl!r}) and 2-{cluster_launch.MAX_CLUSTER} "
                         f"splits (got {splits})")
    return applies


def rows_are_words(q: torch.Tensor, kv_new: torch.Tensor) -> bool:
    """Whether every query row (``q`` ``[T, H, 512]``) and new-entry row (``kv_new`` ``[T, 512]``) starts 16-byte
    aligned, so ``sparse_attention_sm90_ws`` can read them as 16-byte words: strides in multiples of 8 BF16
    elements and base addresses multiples of 16."""
    return (q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0 and kv_new.stride(0) % 8 == 0
            and q.data_ptr() % 16 == 0 and kv_new.data_ptr() % 16 == 0)


def choose_impl(impl: str, hopper: bool, rows_in_words: bool, chunks_per_split: int, all_entries: bool = False,
                unsplit: bool = False) -> str:
    """The kernel ``sparse_attention_fwd`` runs for ``impl`` (its argument) over FP8 pages: ``"auto"`` is
    ``"triton"`` off Hopper; on Hopper, when the q / kv_new rows can be read as 16-byte words (``rows_in_words``),
    ``"gluon_pipelined"`` (``sparse_attention_sm90_pipelined``) for a step it takes (``unsplit``: no splits — the
    tokens' head blocks fill the GPU — and a window of at most its ``FP8_MAX_WINDOW`` keys) from
    ``PIPELINED_MIN_CHUNKS`` chunks per token, else ``"gluon_ws"``
    (``sparse_attention_sm90_ws``) from ``WS_MIN_CHUNKS`` chunks per split (``WS_MIN_CHUNKS_ALL`` where every
    visible entry is attended, ``all_entries``: HCA); otherwise ``"gluon"``. An explicit choice is checked.

    Raises:
        ValueError: an unknown ``impl``, a Gluon kernel without a Hopper GPU (``hopper``), or ``"gluon_ws"`` /
            ``"gluon_pipelined"`` without ``rows_in_words``.
    """
    if impl == "auto":
        if not hopper:
            return "triton"
        if rows_in_words and unsplit and chunks_per_split >= PIPELINED_MIN_CHUNKS:
            return "gluon_pipelined"
        least = sparse_attention_sm90_ws.WS_MIN_CHUNKS_ALL if all_entries else sparse_attention_sm90_ws.WS_MIN_CHUNKS
        ws = rows_in_words and chunks_per_split >= least
        return "gluon_ws" if ws else "gluon"
    if impl not in ("gluon", "gluon_ws", "gluon_pipelined", "triton"):
        raise ValueError(f"unknown impl {impl!r}")
    if impl != "triton" and not hopper:
        raise ValueError(f"impl={impl!r} needs a CUDA device of compute capability 9.x")
    if impl in ("gluon_ws", "gluon_pipelined") and not rows_in_words:
        raise ValueError(f"impl={impl!r} reads q and kv_new rows as 16-byte words: their strides must be "
                         "multiples of 8 and their data 16-byte aligned")
    return impl


def sparse_attention_fwd(
    q: torch.Tensor,
    kv_new: torch.Tensor,
    ring: torch.Tensor,
    ring_positions: torch.Tensor,
    pool: torch.Tensor | None,
    block_tables: torch.Tensor,
    token_request: torch.Tensor,
    positions: torch.Tensor,
    cu_seqlens: torch.Tensor,
    start_pos: torch.Tensor,
    token_slots: torch.Tensor,
    sink: torch.Tensor,
    inv_freq: torch.Tensor,
    scale: float,
    *,
    window: int,
    ratio: int = 0,
    block_size: int = 1,
    entry_idx: torch.Tensor | None = None,
    visible: torch.Tensor | None = None,
    max_entries: int = 0,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    workspace=None,
    block_h: int = 64,
    block_n: int = 64,
    num_warps: int = 8,
    num_stages: int = 1,
    num_splits: int | None = None,
    min_chunks: int | None = None,
    bf16_math: bool = True,
    split_policy: str = "waves",
    prefetch: bool = False,
    dequant: str = "cvt",
    impl: str = "auto",
    combine: str = "auto",
    keys: str = "auto",
    max_visible: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``T`` query tokens over their window and compressed entries, sink, inverse RoPE.

    Args:
        q: ``[T, H, 512]`` bf16 queries (head-normed, RoPE'd).
        kv_new: ``[T, 512]`` bf16 this step's window entries as stored.
        ring: uint8 ``[slots, ring_page_bytes]`` SWA ring pages (``window`` entries of 584 B each).
        ring_positions: int32 ``[slots, window]`` position held by each ring slot (−1 = empty).
        pool: uint8 ``[num_blocks, page_bytes]`` compressed-entry pages (``block_size // ratio`` entries), or
            ``None`` for window-only layers.
        block_tables: int32 ``[B, max_blocks]`` physical block of each logical block (−1 = none).
        token_request / positions / cu_seqlens / start_pos / token_slots: the ``StepBatch`` fields
            (int32 ``[T]``, int64 ``[T]``, int32 ``[B+1]``, int64 ``[B]``, int64 ``[T]``).
        sink: fp32 ``[H]`` sink logits; inv_freq: fp32 ``[32]`` RoPE frequencies; scale: softmax scale.
        window, ratio, block_size: the layer's geometry (``ratio`` 0: window only).
        entry_idx: int ``[T, K]`` entries to attend (CSA), −1 = none; or
        visible: int64 ``[T]`` entries visible to each token (HCA: attend all ``i < visible[t]``) with
            ``max_entries`` ≥ every ``visible[t]`` (a host bound).
        out / lse: optional outputs ``[T, H, 512]`` (dtype of ``q``) / fp32 ``[T, H]``.
        workspace: a ``dsv4.cache.Workspace`` for the split partials (else they are allocated).
        block_h, block_n, num_warps, num_stages: tiling (heads per program, keys per chunk).
        num_splits: force the number of key splits (default: ``choose_splits`` with ``min_chunks`` chunks or
            more per split; ``step_splits``).
        bf16_math: dequantize with BF16 multiplies (else FP32; same values).

    Kernel variants under measurement (same results; the defaults are the measured baseline):
        split_policy: ``choose_splits`` policy, ``"waves"`` (default) or ``"fill"``. Measured on an H200
            (2026-11-22): waves is faster at most decode shapes (Flash CSA B=8/64/128: 43/69/104 µs vs 100/86/130;
            HCA-1M B=64 504 vs 659) and equal on prefill (never split).
        prefetch: locate chunk ``c+1``'s compressed entries (index, block table, scales) during chunk ``c``.
        dequant: ``"cvt"`` (E4M3 → BF16 conversion, then × scale) or ``"bits"`` (``_dequant_bits``).
        impl: ``"auto"`` (``choose_impl``: on a GPU of compute capability 9.x with Gluon available
            ``"gluon_pipelined"`` for steps without splits from ``PIPELINED_MIN_CHUNKS`` chunks per token,
            ``"gluon_ws"`` from ``sparse_attention_sm90_ws.WS_MIN_CHUNKS`` chunks per split, ``WS_MIN_CHUNKS_ALL``
            for HCA, else ``"gluon"``; ``"triton"`` elsewhere), ``"triton"`` this module's kernel, ``"gluon"`` the
            Hopper kernel of ``sparse_attention_sm90`` (asynchronous copies of the raw keys one chunk ahead),
            ``"gluon_ws"`` the warp-specialized one of ``sparse_attention_sm90_ws`` (a producer partition
            dequantizes while the consumers compute; q and kv_new rows 16-byte aligned: ``rows_are_words``), or
            ``"gluon_pipelined"`` the kernel of ``sparse_attention_sm90_pipelined`` (persistent programs of a copy,
            a score and a value warpgroup; the copy warpgroup copies BF16 key rows or dequantizes the FP8 pages;
            no splits: ``num_splits`` does not apply to it), which ``"auto"`` also runs wherever the keys are BF16
            rows and there are no splits.
            The Gluon kernels need compute capability 9.x; ``block_h``, ``block_n``, ``num_warps``,
            ``num_stages``, ``prefetch`` and ``dequant`` do not apply to them.
        combine: how split partials are merged: ``"kernel"`` by ``_combine_kernel`` after the attention grid;
            ``"cluster"`` by the splits themselves — each token's splits launched as one thread-block cluster that
            merges its partials after a cluster barrier (``sparse_attention_sm90``, ``kernels.cluster``: one
            launch, no second kernel's start and dependent loads); ``"auto"`` (default) ``"cluster"`` where it
            applies — the ``"gluon"`` kernel, 2 to 16 splits, every cluster of the step on the device at once —
            else ``"kernel"``. ``"cluster"`` where it does not apply raises ``ValueError``.
        keys: where the serial Gluon kernel gets its keys: ``"fp8"`` from the pages, each chunk dequantized by
            the program that attends it; ``"bf16"`` from the step's keys dequantized once into BF16 rows first
            (``bf16_keys``: every request's ring and the entries its tokens see — prefill chunks, where each key
            serves many queries); ``"auto"`` (default) ``"bf16"`` where those rows are at most 1/8 of the bytes
            the kernel would read as FP8 keys, the Gluon kernel applies and the entries' bound is known, else
            ``"fp8"``. The values are the same bits either way. ``"bf16"`` runs ``"gluon_pipelined"`` where there are
            no splits (with ``impl`` ``"auto"``), else the serial Gluon kernel (or ``"gluon_pipelined"`` when
            named).
        max_visible: a host bound on the compressed entries any token of the step sees (``"bf16"`` keys with
            ``entry_idx``; with ``visible`` it is ``max_entries``).
    Returns:
        ``(o [T, H, 512], lse fp32 [T, H])``: ``o`` with the inverse RoPE applied, ``lse`` with the sink.
    """
    T, H, D = q.shape
    if D != HEAD_DIM:
        raise ValueError(f"sparse_attention_fwd supports head_dim {HEAD_DIM}, got {D}")
    if out is None:
        out = torch.empty_like(q)
    if lse is None:
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse

    if entry_idx is not None:
        mode, num_compressed = MODE_LIST, entry_idx.shape[1]
        if num_compressed == 0:
            mode = MODE_WINDOW
    elif visible is not None:
        mode, num_compressed = MODE_ALL, int(max_entries)
        if num_compressed == 0:
            mode = MODE_WINDOW
    else:
        mode, num_compressed = MODE_WINDOW, 0
    if mode != MODE_WINDOW and pool is None:
        raise ValueError("compressed entries need the pool pages")

    hopper = sparse_attention_sm90.available(q.device)
    rows_in_words = rows_are_words(q, kv_new)
    try:  # validates before anything is computed; either Gluon kernel takes the same tiling
        gluon = choose_impl(impl, hopper, rows_in_words, 0) != "triton"
    except ValueError as err:
        raise ValueError(f"{err} (device {q.device}, q strides {tuple(q.stride())}, kv_new strides "
                         f"{tuple(kv_new.stride())})") from None
    if gluon:
        block_h, block_n = sparse_attention_sm90.BLOCK_H, sparse_attention_sm90.BLOCK_N
    if min_chunks is None:
        # Gluon: a split of one chunk pays off (H100, Flash CSA B=1 / 8: 24.7 / 27.1 -> 20.1 / 23.6 us; neutral at
        # the other shapes); the Triton kernel's per-program start is dearer.
        min_chunks = 1 if gluon else 2
    block_h = max(16, min(block_h, triton.next_power_of_2(H)))
    head_blocks = triton.cdiv(H, block_h)
    max_chunks = triton.cdiv(window, block_n) + triton.cdiv(num_compressed, block_n)
    splits, per = step_splits(impl, num_splits, T * head_blocks, max_chunks, num_sms(q.device), min_chunks,
                              split_policy)

    entries = num_compressed if mode == MODE_ALL else (max_visible if mode == MODE_LIST else 0)
    bf16 = _use_bf16_keys(keys, impl, hopper and rows_in_words, T, block_tables.shape[0], window, entries,
                          window + min(num_compressed, entries or num_compressed))
    fits_pipelined = splits == 1 and window <= sparse_attention_sm90_pipelined.FP8_MAX_WINDOW
    if impl == "gluon_pipelined":
        impl = choose_impl(impl, hopper, rows_in_words, per, mode == MODE_ALL, fits_pipelined)
    elif bf16:  # the pipelined kernel where there are no splits, else the serial one
        impl = "gluon_pipelined" if impl == "auto" and splits == 1 else "gluon"
    else:
        impl = choose_impl(impl, hopper, rows_in_words, per, mode == MODE_ALL, fits_pipelined)

    if splits > 1:
        if workspace is not None:
            po = workspace.get("sparse_attention.partial_o", (T, splits, H, HEAD_DIM), torch.float32)
            plse = workspace.get("sparse_attention.partial_lse", (T, splits, H), torch.float32)
        else:
            po = torch.empty((T, splits, H, HEAD_DIM), dtype=torch.float32, device=q.device)
            plse = torch.empty((T, splits, H), dtype=torch.float32, device=q.device)
    else:
        po = plse = lse  # unused

    page_entries = block_size // ratio if ratio else 1
    interpret = q.device.type != "cuda"  # TRITON_INTERPRET=1 on CPU tensors (development only)
    pool_t = pool if pool is not None else ring
    idx_t = entry_idx if mode == MODE_LIST else positions
    vis_t = visible if mode == MODE_ALL else positions
    stride_page = pool_t.stride(0)
    if dequant not in ("cvt", "bits"):
        raise ValueError(f"unknown dequant {dequant!r}")
    # Both kernels take the same arguments (see _sparse_attention_kernel's signature) and geometry constexprs.
    grid = (T * head_blocks, splits)
    args = (
        q, q.stride(0), q.stride(1),
        kv_new, kv_new.stride(0),
        ring, ring.stride(0),
        ring_positions, ring_positions.stride(0),
        pool_t, stride_page,
        block_tables, block_tables.stride(0) if block_tables.dim() == 2 else 0,
        idx_t, idx_t.stride(0) if idx_t.dim() == 2 else 0,
        vis_t,
        token_request, positions, cu_seqlens, start_pos, token_slots,
        sink, inv_freq,
        out, out.stride(0), out.stride(1),
        lse, lse.stride(0),
        po, plse,
        H, num_compressed, per, splits, float(scale) * LOG2E,
    )
    geometry = dict(WINDOW=window, RATIO=max(ratio, 1), BLOCK_SIZE=block_size, PAGE_ENTRIES=page_entries,
                    MODE=int(mode), SPLIT=splits > 1)
    key_rows = None
    if bf16:
        key_rows = bf16_keys(ring, pool, block_tables, cu_seqlens, start_pos, token_slots, window=window,
                             ratio=ratio, block_size=block_size, entries=entries, workspace=workspace)
    # Each token's splits as one cluster that merges its partials itself, where that applies and fits.
    clustered = _check_combine(combine, impl, splits) and sparse_attention_sm90.launch_in_clusters(
        grid, args, geometry, key_rows)
    if combine == "cluster" and splits > 1 and not clustered:  # (a step without splits has nothing to merge)
        raise ValueError(f"combine='cluster': the device does not hold all {grid[0]} clusters of {splits} programs "
                         "at once")
    if clustered:
        return out, lse
    if impl == "gluon":
        sparse_attention_sm90.launch(grid, args, geometry, key_rows)
    elif impl == "gluon_pipelined":
        sparse_attention_sm90_pipelined.launch(grid, args, geometry, key_rows, num_sms(q.device))
    elif impl == "gluon_ws":
        sparse_attention_sm90_ws.launch(grid, args, geometry)
    else:
        _sparse_attention_kernel[grid](
            *args, **geometry, BLOCK_H=block_h, BLOCK_N=block_n, INTERPRET=interpret,
            BF16_MATH=bf16_math and not interpret, PREFETCH=prefetch, DEQUANT_BITS=dequant == "bits",
            num_warps=num_warps, num_stages=num_stages,
        )
    if splits > 1:
        # 16 partial rows (splits × heads) per load: many small programs, all their loads in flight.
        combine_s = min(16, triton.next_power_of_2(splits))
        combine_h = max(1, min(16 // combine_s, triton.next_power_of_2(H)))
        _combine_kernel[(triton.cdiv(H, combine_h), T)](
            po, plse, positions, sink, inv_freq,
            out, out.stride(0), out.stride(1), lse, lse.stride(0),
            H, splits,
            BLOCK_H=combine_h, BLOCK_S=combine_s, INTERPRET=interpret, num_warps=4,
        )
    return out, lse
