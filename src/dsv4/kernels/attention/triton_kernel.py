"""Sparse attention with sink over the paged 584-B KV entries, as a Triton kernel (any GPU; the interpreter).

One program handles one query token, one block of ``BLOCK_H`` heads and one *split* (a contiguous range of key
chunks). All heads of the block share every key load: the keys are the single shared KV head (K ≡ V), so the
tensor-core M dimension is the heads, for decode (1–4 tokens per request) and prefill chunks alike.

Key set of a query at position ``t`` of request ``b`` (SPEC §6), in chunks of ``BLOCK_N`` keys:

* window chunks first: positions ``t−W+1 … t``; a position ``≥ start_pos[b]`` is one of this step's tokens and is
  read from ``kv_new`` (BF16, already rounded as stored), an older one from the request's ring page (slot
  ``p mod W``; present iff ``ring_positions[slot, p mod W] == p``);
* then compressed chunks: ``MODE_LIST`` (CSA) the entry list ``entry_idx[t, :]`` (−1 = none), ``MODE_ALL`` (HCA)
  every entry ``i < visible[t]`` (no index list). Entry ``i`` lives in block ``block_tables[b, (i·m) //
  block_size]`` at slot ``((i·m) % block_size) // m``.

The 512 dims are processed as 8 blocks of 64: blocks 0–6 are the FP8 blocks (each with its own UE8M0 scale per
key), block 7 the BF16 rope dims. A key block is dequantized in registers (E4M3 code × 2^(e−127) is exact in
BF16) and feeds the tensor-core products ``S += Q_b·K_bᵀ`` and ``O_b += P·K_b``; no BF16 copy of the keys is
written to memory. The softmax is the online one in base 2 with P rounded to BF16 for P·V and FP32 sums; the sink
enters the denominator at the end. With several splits per token each program writes an FP32 partial (``o/l`` and
its log-sum-exp) for ``combine``. The inverse RoPE of the output (rotation of the last 64 dims by ``−t``, adjacent
pairs) is fused into the final store; like the reference, the output is rounded to BF16 before the rotation and
again after it.

The kernel also runs in the Triton interpreter (``INTERPRET``: CPU tensors; BF16 products upcast to FP32 there
and ``tl.cos`` in place of libdevice).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..device import KV_DATA_BYTES, KV_NOPE_DIM, interpreting
from .args import AttentionArgs
from .plan import MODES, AttentionPlan

__all__ = ["dequant_probe", "launch"]

# Kernel constants (globals a @triton.jit function reads must be tl.constexpr).
NOPE_DIM = tl.constexpr(KV_NOPE_DIM)
DATA_BYTES = tl.constexpr(KV_DATA_BYTES)  # per entry: 448 E4M3 codes + 64 BF16 rope values
# Where a token's compressed entries come from (plan.MODES).
MODE_WINDOW = tl.constexpr(MODES.index("window"))  # none (SWA layers)
MODE_LIST = tl.constexpr(MODES.index("list"))  # entry_idx[t, :], −1 = none (CSA top-k)
MODE_ALL = tl.constexpr(MODES.index("all"))  # every i < visible[t] (HCA)


@triton.jit
def _key_block(pages_ptr, data_off, scales, ok, new_ptrs, fresh, B: tl.constexpr, HAS_NEW: tl.constexpr,
               INTERPRET: tl.constexpr):
    """Dims ``64·B … 64·B+63`` of ``BLOCK_N`` keys as a BF16 ``[BLOCK_N, 64]`` tile (rows not ``ok`` → 0).

    Args:
        pages_ptr: uint8 base of the pages; data_off: int64 ``[BLOCK_N]`` byte offset of each entry's 576 data
            bytes (a multiple of 16); scales: int64 ``[BLOCK_N]`` each entry's 8 scale bytes (little-endian word).
        ok: ``[BLOCK_N]`` rows to read from the pages.
        new_ptrs / fresh: ``HAS_NEW`` only: ``[BLOCK_N, 1]`` pointers to BF16 rows of ``kv_new`` and the rows
            to take from there instead.
        B: 0–6 FP8 block ``B`` (E4M3 × 2^(e_B − 127), exact in BF16); 7 the BF16 rope values.
        INTERPRET: scale in FP32 (the interpreter's BF16 arithmetic is wrong), else in BF16 (fewer conversions).
    """
    col = tl.arange(0, 64)
    if B < 7:
        codes = tl.load(pages_ptr + data_off[:, None] + (B * 64 + col)[None, :], mask=ok[:, None], other=0)
        e = (scales >> (8 * B)) & 0xFF
        fp8 = codes.to(tl.float8e4nv, bitcast=True)
        if INTERPRET:
            scale = (e << 23).to(tl.int32).to(tl.float32, bitcast=True)
            k = (fp8.to(tl.float32) * scale[:, None]).to(tl.bfloat16)
        else:
            # UE8M0 byte e → 2^(e−127): e << 7 is exactly that BF16 (its exponent field is bits 7…14).
            scale = (e << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
            k = fp8.to(tl.bfloat16) * scale[:, None]
    else:
        rope = pages_ptr.to(tl.pointer_type(tl.bfloat16)) + (data_off // 2 + NOPE_DIM // 2)
        k = tl.load(rope[:, None] + col[None, :], mask=ok[:, None], other=0.0)
    if HAS_NEW:
        k_new = tl.load(new_ptrs + (B * 64 + col)[None, :], mask=fresh[:, None], other=0.0)
        k = tl.where(fresh[:, None], k_new.to(tl.bfloat16), k)
    return k


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
    HAS_NEW: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One online-softmax step (base 2; ``qk_scale`` = softmax scale · log2 e) over a chunk of ``BLOCK_N`` keys.

    The 512 dims are handled as 8 blocks of 64 (7 FP8 blocks with their own scales, then the rope dims):
    ``q0…q7`` ``[BLOCK_H, 64]`` bf16 query blocks, ``a0…a7`` ``[BLOCK_H, 64]`` fp32 output accumulators,
    ``m_i`` / ``l_i`` ``[BLOCK_H]`` running max (−inf = none yet) and sum; ``valid`` ``[BLOCK_N]`` the real keys.
    Key arguments as ``_key_block``.
    """
    k0 = _key_block(pages_ptr, data_off, scales, ok, new_ptrs, fresh, 0, HAS_NEW, INTERPRET)
    k1 = _key_block(pages_ptr, data_off, scales, ok, new_ptrs, fresh, 1, HAS_NEW, INTERPRET)
    k2 = _key_block(pages_ptr, data_off, scales, ok, new_ptrs, fresh, 2, HAS_NEW, INTERPRET)
    k3 = _key_block(pages_ptr, data_off, scales, ok, new_ptrs, fresh, 3, HAS_NEW, INTERPRET)
    k4 = _key_block(pages_ptr, data_off, scales, ok, new_ptrs, fresh, 4, HAS_NEW, INTERPRET)
    k5 = _key_block(pages_ptr, data_off, scales, ok, new_ptrs, fresh, 5, HAS_NEW, INTERPRET)
    k6 = _key_block(pages_ptr, data_off, scales, ok, new_ptrs, fresh, 6, HAS_NEW, INTERPRET)
    k7 = _key_block(pages_ptr, data_off, scales, ok, new_ptrs, fresh, 7, HAS_NEW, INTERPRET)

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
    MODE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
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
            True, INTERPRET,
        )

    # ---- compressed entries from the pool, through the block table
    c_first = tl.maximum(c_begin, WINDOW_CHUNKS)
    for c in range(c_first, c_end):
        page, entry_slot, scales, ok = _locate_entries(
            c, t, req, n_comp, idx_ptr, stride_idx, block_tables_ptr, stride_bt, scale_words, stride_page,
            RATIO, BLOCK_SIZE, PAGE_ENTRIES, MODE, BLOCK_N, WINDOW_CHUNKS,
        )
        data_off = tl.multiple_of(page + entry_slot * DATA_BYTES, 16)
        m_i, l_i, a0, a1, a2, a3, a4, a5, a6, a7 = _attend_chunk(
            pool_ptr, data_off, scales, ok, kv_new_ptr, ok, ok,
            q0, q1, q2, q3, q4, q5, q6, q7, m_i, l_i, a0, a1, a2, a3, a4, a5, a6, a7, qk_scale,
            False, INTERPRET,
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
def _dequant_probe_kernel(pages_ptr, out_ptr, INTERPRET: tl.constexpr):
    """Test probe: the key blocks ``_key_block`` builds for 64 entries stored as one page (64 × 576 data bytes,
    then 64 × 8 scale bytes), written as bf16 ``[64, 512]`` to ``out_ptr``."""
    n = tl.arange(0, 64)
    data_off = tl.multiple_of(n.to(tl.int64) * DATA_BYTES, 16)
    scales = tl.load(pages_ptr.to(tl.pointer_type(tl.int64)) + 64 * DATA_BYTES // 8 + n)
    ok = n >= 0
    for b in tl.static_range(8):
        k = _key_block(pages_ptr, data_off, scales, ok, out_ptr, ok, b, False, INTERPRET)
        tl.store(out_ptr + n[:, None] * 512 + b * 64 + tl.arange(0, 64)[None, :], k)


def dequant_probe(pages, out) -> None:
    """Run ``_dequant_probe_kernel`` (tests): ``pages`` uint8 ``[64·584]``, ``out`` BF16 ``[64, 512]``."""
    _dequant_probe_kernel[(1,)](pages, out, INTERPRET=interpreting(), num_warps=8)


def launch(plan: AttentionPlan, args: AttentionArgs) -> None:
    """Launch the Triton kernel over ``plan.grid`` (a ``kernel="triton"`` plan; ``args`` its arguments)."""
    _sparse_attention_kernel[plan.grid](
        *args.positional(), **plan.constexprs, BLOCK_H=plan.block_h, BLOCK_N=plan.block_n, INTERPRET=interpreting(),
        num_warps=plan.num_warps, num_stages=plan.num_stages)
