"""The warp-specialized Hopper (sm_90) attention kernel in Gluon, for long key lists (``kernel="gluon_ws"``).

Same semantics, arguments and key set as ``triton_kernel`` and the same math per chunk as ``sm90_serial`` (read
those); what differs is who does what. A producer partition (4 warps) looks up, loads and dequantizes each 64-key
chunk into one of two BF16 key buffers while the consumer partition (8 warps = 2 warpgroups) runs S = Q·Kᵀ, the
online softmax and O = O·α + P·K on the other; the two hand the buffers over through mbarriers (``k_ready`` /
``k_free``):

    producer, chunk c:  wait k_free[c % 2] → chunk c's scale words and c+1's block tables (copied by cp.async
                        an iteration ago) → start the copies of c+1's scale words and c+2's block tables →
                        dequantize chunk c (registers → buffer), refilling each 64-dim block's registers with
                        chunk c+1's as soon as it is stored → arrive k_ready[c % 2]; entries of c+3
    consumer, chunk c:  wait k_ready[c % 2] → S = Q·Kᵀ → softmax → P → O += P·K → arrive k_free[c % 2]

Raw bytes move as 32-bit words (four E4M3 codes or two BF16 values) and are dequantized by
``ptx.DEQUANT_E4M3_WORDS`` (the serial kernel's exact products); the BF16 tiles are written through 32-bit views of
their shared memory (the 128-byte swizzle permutes 16-byte pieces, the same for either element type). The softmax
denominators are row sums per chunk. Registers: the producer's are ``PRODUCER_REGS`` per thread, the consumers get
the rest of the 64K. A value loaded in one producer iteration and carried into the next would be copied between
registers at the loop's end, waiting for the load: hence the scale words and block tables through shared memory.

It pays off where a program runs many chunks (``plan.WS_MIN_CHUNKS``, ``WS_MIN_CHUNKS_ALL`` for HCA; see RESULTS.md,
"Sparse attention: a warp-specialized Gluon kernel for long key lists"). Its row loads need q / kv_new rows
16-byte aligned (``args.rows_are_words``).
"""

from __future__ import annotations

import torch

from .. import ptx
from ..device import KV_DATA_BYTES
from .args import AttentionArgs
from .plan import AttentionPlan
from .sm90_common import _HAVE_GLUON

__all__ = ["PRODUCER_REGS", "dequant_probe", "launch"]

NUM_WARPS = 8  # the consumer partition: two warpgroups of wgmma and softmax
PRODUCER_WARPS = 4  # the producer partition: lookups, loads, dequantization
PRODUCER_REGS = 152  # registers per producer thread (the consumers get the rest: 176); read at each launch

if _HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .sm90_common import (BH, BN, MODE_LIST, NOPE_DIM, TILE_SL, _block_exponents, _dim_tiles, _fresh_rows,
                              _masked_scores, _probabilities, _program_token, _rescale, _running_max, _split_chunks)
    from .sm90_output import _write_output

if _HAVE_GLUON:
    DATA_WORDS = gl.constexpr(KV_DATA_BYTES // 4)  # per entry: 448 E4M3 codes + 64 BF16 rope values, as words
    DEQUANT_PTX = gl.constexpr(ptx.DEQUANT_E4M3_WORDS)
    PRODUCER_WARPS_C = gl.constexpr(PRODUCER_WARPS)

    # Register tiles of 32-bit words as [64 rows, blocks, words per block of 64 values]: four consecutive words
    # (16 bytes) per thread and piece; every [64]-per-row vector in the slice layout of the same rows.
    # ``WORD3_L`` for the producer's 4 warps (two rows per thread), ``WORD3_L8`` for 8 warps (the queries).
    WORD3_L = gl.constexpr(gl.BlockedLayout([1, 1, 4], [8, 1, 4], [PRODUCER_WARPS, 1, 1], [2, 1, 0]))
    BLK_L = gl.constexpr(gl.SliceLayout(2, WORD3_L))  # [64, blocks]
    KEY_L = gl.constexpr(gl.SliceLayout(1, BLK_L))  # [64] one value per row
    WORD3_L8 = gl.constexpr(gl.BlockedLayout([1, 1, 4], [8, 1, 4], [NUM_WARPS, 1, 1], [2, 1, 0]))
    KEY_L8 = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(2, WORD3_L8)))
    # The 512 dims are kept in four groups, each its own shared-memory tile (a write to one tile never waits on a
    # read of another): FP8 blocks 0-3, 4-5, 6, then the 64 BF16 rope dims. The tiles are BF16 for wgmma and
    # written through 32-bit views (the 128-byte swizzle permutes 16-byte pieces, the same for either type).
    WORDS_SL = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))

    @gluon.jit
    def _chunk_entries(c, pos, start, n_comp, ring_pos_row, idx_row,
                       WINDOW: gl.constexpr, WINDOW_CHUNKS: gl.constexpr, MODE: gl.constexpr):
        """First lookup of chunk ``c`` (two chunks before its bytes, consumed by ``_copy_blocks``): int32 ``[64]``
        the position each window slot holds (``ring_pos_row``: the token's ring slots), or each compressed key's
        entry index (``idx_row``: the token's entry list; −1 = none)."""
        n = gl.arange(0, BN, layout=KEY_L)
        if c < WINDOW_CHUNKS:
            j = c * BN + n
            p = pos - (WINDOW - 1) + j
            in_ring = (j < WINDOW) & (p >= 0) & (p < start)
            raw = gl.load(ring_pos_row + gl.maximum(p, 0) % WINDOW, mask=in_ring, other=-1)
        else:
            j = (c - WINDOW_CHUNKS) * BN + n
            listed = j < n_comp
            if MODE == MODE_LIST:
                raw = gl.load(idx_row + j, mask=listed, other=-1).to(gl.int32)
            else:
                raw = gl.where(listed, j, -1)
        return raw

    @gluon.jit
    def _chunk_blocks(c, raw, bt_row, RATIO: gl.constexpr, BLOCK_SIZE: gl.constexpr, WINDOW_CHUNKS: gl.constexpr):
        """Second lookup of the split's first chunk ``c`` (the producer's prologue; later chunks' go through
        ``_copy_blocks``): int32 ``[64]`` each compressed entry's physical block from the request's block table
        ``bt_row`` (−1 = unmapped or no entry); window chunks need none (zeros)."""
        if c < WINDOW_CHUNKS:
            block = gl.zeros([BN], gl.int32, layout=KEY_L)
        else:
            block = gl.load(bt_row + gl.maximum(raw, 0) * RATIO // BLOCK_SIZE, mask=raw >= 0, other=-1)
        return block

    @gluon.jit
    def _copy_blocks(c, raw, bt_row, dst, RATIO: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                     WINDOW_CHUNKS: gl.constexpr):
        """``_chunk_blocks`` of chunk ``c`` as an asynchronous copy into ``dst`` (int32 ``[64]``, shared memory;
        keys without an entry get 0, which ``_chunk_address`` ignores): read back an iteration later, so no
        loaded value is carried in registers across the producer's loop. Window chunks copy nothing."""
        if c >= WINDOW_CHUNKS:
            async_copy.async_copy_global_to_shared(dst, bt_row + gl.maximum(raw, 0) * RATIO // BLOCK_SIZE,
                                                   mask=raw >= 0)
        async_copy.commit_group()

    @gluon.jit
    def _word_offsets(rows, FIRST: gl.constexpr, NB: gl.constexpr, W: gl.constexpr):
        """``[64, NB, W]`` word offsets ``rows[k] + (FIRST + blk)·W + i`` of blocks ``FIRST … FIRST+NB−1`` (``W``
        words each: 16 for E4M3 codes, 32 for BF16 values) of 64 rows (``rows`` int64 ``[64]``, in words)."""
        L3: gl.constexpr = rows.type.layout.parent.parent
        blk = gl.arange(0, NB, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        col = gl.arange(0, W, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        off = gl.expand_dims(gl.expand_dims(rows, 1), 2) + gl.expand_dims(gl.expand_dims((FIRST + blk) * W, 0), 2)
        return off + gl.expand_dims(gl.expand_dims(col, 0), 1)

    @gluon.jit
    def _load_words(base, rows, ok, FIRST: gl.constexpr, NB: gl.constexpr, W: gl.constexpr):
        """Words of blocks ``FIRST …`` of 64 rows (``_word_offsets``) from ``base`` (int32 pointer); rows not
        ``ok`` are zeros and not read."""
        ptrs = gl.max_contiguous(base + _word_offsets(rows, FIRST, NB, W), [1, 1, 4])
        return gl.load(ptrs, mask=gl.expand_dims(gl.expand_dims(ok, 1), 2), other=0)

    @gluon.jit
    def _chunk_address(c, live, raw, block, pos, start, ring_row, pool_ptr, stride_page,
                       WINDOW: gl.constexpr, RATIO: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                       PAGE_ENTRIES: gl.constexpr, WINDOW_CHUNKS: gl.constexpr):
        """Where chunk ``c``'s 64 entries lie: window chunks in the token's ring page ``ring_row``, compressed ones
        in the pool pages (``raw`` / ``block``: the chunk's lookups; nothing is read when not ``live``).

        Returns ``(words, rows, ok, scale_ptrs, valid)``: an int32 pointer, each key's first word there (int64
        ``[64]``), which keys are read, each key's int64 scale word (byte ``b`` = block ``b``'s UE8M0 exponent)
        and which keys are real (read, or this step's own window tokens)."""
        n = gl.arange(0, BN, layout=KEY_L)
        if c < WINDOW_CHUNKS:
            j = c * BN + n
            p = pos - (WINDOW - 1) + j
            ring_slot = gl.maximum(p, 0) % WINDOW
            ok = live & (raw == p) & (raw >= 0)
            fresh = live & (j < WINDOW) & (p >= start) & (p >= 0)
            base = ring_row
            rows = (ring_slot * (DATA_WORDS * 4)).to(gl.int64)
            scale_off = ((WINDOW * DATA_WORDS * 4) // 8 + ring_slot).to(gl.int64)
            valid = ok | fresh
        else:
            ok = live & (raw >= 0) & (block >= 0)
            base = pool_ptr
            page = gl.maximum(block, 0).to(gl.int64) * stride_page
            entry_slot = (gl.maximum(raw, 0) * RATIO % BLOCK_SIZE) // RATIO
            rows = page + entry_slot * (DATA_WORDS * 4)
            scale_off = (page + PAGE_ENTRIES * DATA_WORDS * 4) // 8 + entry_slot
            valid = ok
        scale_ptrs = base.to(gl.pointer_type(gl.int64)) + scale_off
        return base.to(gl.pointer_type(gl.int32)), gl.multiple_of(rows // 4, 4), ok, scale_ptrs, valid

    @gluon.jit
    def _request_block(address, FIRST: gl.constexpr):
        """Request block ``FIRST`` of a chunk's entries (``_chunk_address``) into registers: int32 ``[64, 1, 16]``
        words of 64 E4M3 codes, or for ``FIRST`` 7 the 64 BF16 rope values (``[64, 1, 32]``, after the 448 codes)."""
        words, rows, ok, scale_ptrs, valid = address
        if FIRST == 7:
            block = _load_words(words, rows + NOPE_DIM // 4, ok, 0, 1, 32)
        else:
            block = _load_words(words, rows, ok, FIRST, 1, 16)
        return block

    @gluon.jit
    def _request_chunk(address):
        """All of a chunk's codes and rope values into registers: ``(blocks 0 … 6, rope, valid int1 [64])`` (see
        ``_request_block``, ``_chunk_address``; the scale words go through ``_copy_scales``)."""
        words, rows, ok, scale_ptrs, valid = address
        return (_request_block(address, 0), _request_block(address, 1), _request_block(address, 2),
                _request_block(address, 3), _request_block(address, 4), _request_block(address, 5),
                _request_block(address, 6), _request_block(address, 7), valid)

    @gluon.jit
    def _copy_scales(address, dst):
        """Asynchronous copy of a chunk's 64 scale words (``_chunk_address``) into ``dst`` (int64 ``[64]``, shared
        memory; keys not read are zeros). Loaded into registers instead, the words would be copied between
        registers at the loop's end, and that copy waits for the load."""
        words, rows, ok, scale_ptrs, valid = address
        async_copy.async_copy_global_to_shared(dst, scale_ptrs, mask=ok)
        async_copy.commit_group()

    @gluon.jit
    def _bf16_pair(bits):
        """int32 words holding the BF16 ``bits`` (int32, low 16 bits) in both halves."""
        return bits | (bits << 16)

    @gluon.jit
    def _e4m3_to_bf16_words(codes, e):
        """``code · 2^(e − 127)`` as BF16, exact (``ptx.DEQUANT_E4M3``): ``codes`` int32 ``[64, NB, 16]`` words of
        four E4M3 codes, ``e`` int32 ``[64, NB]`` each block's UE8M0 exponent. Returns int32 ``[64, NB·32]``: the
        BF16 pairs in the codes' order."""
        e3 = gl.expand_dims(e, 2)
        # Two power-of-two multipliers, both BF16: 2^(min(e,134)−7) restores the code's 2^−120 bias,
        # 2^(max(e,134)−134) completes scales beyond BF16's largest power (1 for every e ≤ 134).
        s1, _ = gl.broadcast(_bf16_pair((gl.minimum(e3, 134) + 120) << 7), codes)
        s2, _ = gl.broadcast(_bf16_pair((gl.maximum(e3, 134) - 7) << 7), codes)
        lo, hi = gl.inline_asm_elementwise(DEQUANT_PTX, "=r,=r,r,r,r", [codes, s1, s2],
                                           dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
        return gl.reshape(gl.join(lo, hi), [codes.shape[0], codes.shape[1] * 32])

    @gluon.jit
    def _dequantize_block(codes, tile, col, scales, fresh, new_rows, kv_new_words, is_window,
                          FIRST: gl.constexpr, IS_ROPE: gl.constexpr):
        """Block ``FIRST`` of the chunk's keys (dims ``64·FIRST …``) into columns ``col … col+63`` of its BF16 tile
        ``tile`` (written as words): E4M3 codes ``codes`` (int32 ``[64, 1, 16]`` words, registers) × 2^(e − 127)
        (exact in BF16), or the BF16 rope values as stored (``IS_ROPE``, ``[64, 1, 32]``); the window keys of this
        step (``fresh``) from ``kv_new`` rows ``new_rows`` (in words)."""
        if IS_ROPE:
            k = gl.reshape(codes, [BN, 32])
        else:
            k = _e4m3_to_bf16_words(codes, _block_exponents(scales, FIRST, 1))
        if is_window:
            L: gl.constexpr = k.type.layout
            rows = gl.convert_layout(new_rows, gl.SliceLayout(1, L))
            cols = FIRST * 32 + gl.arange(0, 32, layout=gl.SliceLayout(0, L))
            fresh2 = gl.expand_dims(gl.convert_layout(fresh, gl.SliceLayout(1, L)), 1)
            k_new = gl.load(kv_new_words + gl.expand_dims(rows, 1) + gl.expand_dims(cols, 0), mask=fresh2, other=0)
            k = gl.where(fresh2, k_new, k)
        tile.slice(col, 64, dim=1)._reinterpret(gl.int32, [BN, 32], WORDS_SL).store(k)

    @gluon.jit
    def _dequantize_chunk(c, chunk, scales, following, pos, start, kv_new_words, kv_row_words, k0, k1, k2, k3,
                          WINDOW: gl.constexpr, WINDOW_CHUNKS: gl.constexpr):
        """Chunk ``c``'s raw bytes ``chunk`` (``_request_chunk``'s registers) as the BF16 tiles ``k0 … k3`` (dims
        0-255, 256-383, 384-447, 448-511), one 64-dim block at a time; window keys of this step from ``kv_new``
        (``kv_new_words``: the request's first row, as words; ``kv_row_words``: the row stride in words). Each
        block's registers are refilled with the same block of the next chunk (at ``following``) as soon as they
        are used, so those bytes have a whole chunk's time to arrive. ``scales`` int64 ``[64]``: the chunk's scale
        words. Returns the next chunk's registers."""
        w0, w1, w2, w3, w4, w5, w6, rope, valid = chunk
        is_window = c < WINDOW_CHUNKS
        fresh, new_row = _fresh_rows(c, pos, start, WINDOW, KEY_L)
        fresh = fresh & is_window
        new_rows = gl.multiple_of(new_row * kv_row_words, 4)
        _dequantize_block(w0, k0, 0, scales, fresh, new_rows, kv_new_words, is_window, 0, False)
        w0 = _request_block(following, 0)
        _dequantize_block(w1, k0, 64, scales, fresh, new_rows, kv_new_words, is_window, 1, False)
        w1 = _request_block(following, 1)
        _dequantize_block(w2, k0, 128, scales, fresh, new_rows, kv_new_words, is_window, 2, False)
        w2 = _request_block(following, 2)
        _dequantize_block(w3, k0, 192, scales, fresh, new_rows, kv_new_words, is_window, 3, False)
        w3 = _request_block(following, 3)
        _dequantize_block(w4, k1, 0, scales, fresh, new_rows, kv_new_words, is_window, 4, False)
        w4 = _request_block(following, 4)
        _dequantize_block(w5, k1, 64, scales, fresh, new_rows, kv_new_words, is_window, 5, False)
        w5 = _request_block(following, 5)
        _dequantize_block(w6, k2, 0, scales, fresh, new_rows, kv_new_words, is_window, 6, False)
        w6 = _request_block(following, 6)
        _dequantize_block(rope, k3, 0, scales, fresh, new_rows, kv_new_words, is_window, 7, True)
        rope = _request_block(following, 7)
        return w0, w1, w2, w3, w4, w5, w6, rope, following[4]

    @gluon.jit
    def _load_q_group(q_words, row_off, head_ok, dst, FIRST: gl.constexpr, NB: gl.constexpr):
        """Dims ``64·FIRST …`` of the 64 heads' queries (rows ``row_off`` in words, absent heads zero) into
        ``dst``."""
        q = _load_words(q_words, row_off, head_ok, FIRST, NB, 32)
        dst._reinterpret(gl.int32, [BH, NB * 32], WORDS_SL).store(gl.reshape(q, [BH, NB * 32]))

    @gluon.jit
    def _producer(k0, k1, k2, k3, valid_smem, scale_smem, block_smem, k_ready, k_free, c_begin, c_end, n_comp,
                  pos, start,
                  ring_row, ring_pos_row, idx_row, bt_row, kv_new_words, kv_row_words, pool_ptr, stride_page,
                  WINDOW: gl.constexpr, RATIO: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                  PAGE_ENTRIES: gl.constexpr, MODE: gl.constexpr, WINDOW_CHUNKS: gl.constexpr):
        """Producer partition: chunk ``c`` of the split dequantized into key buffer ``(c − c_begin) % 2`` once the
        consumers have freed it (``k_free``), announced by ``k_ready``. Chunk c+1's bytes are requested block by
        block while chunk c is dequantized, its scale words and block tables (``cp.async`` into ``scale_smem`` /
        ``block_smem`` pairs) one chunk and its entries two chunks earlier. Row
        pointers: the token's ring page and ring slots, its entry list, its request's block table and first
        ``kv_new`` row (as words, ``kv_row_words`` apart)."""
        e0 = _chunk_entries(c_begin, pos, start, n_comp, ring_pos_row, idx_row, WINDOW, WINDOW_CHUNKS, MODE)
        b0 = _chunk_blocks(c_begin, e0, bt_row, RATIO, BLOCK_SIZE, WINDOW_CHUNKS)
        e1 = _chunk_entries(c_begin + 1, pos, start, n_comp, ring_pos_row, idx_row, WINDOW, WINDOW_CHUNKS, MODE)
        first = _chunk_address(c_begin, c_begin < c_end, e0, b0, pos, start, ring_row, pool_ptr, stride_page,
                               WINDOW, RATIO, BLOCK_SIZE, PAGE_ENTRIES, WINDOW_CHUNKS)
        _copy_scales(first, scale_smem.index(0))
        chunk = _request_chunk(first)
        _copy_blocks(c_begin + 1, e1, bt_row, block_smem.index(1), RATIO, BLOCK_SIZE, WINDOW_CHUNKS)
        e2 = _chunk_entries(c_begin + 2, pos, start, n_comp, ring_pos_row, idx_row, WINDOW, WINDOW_CHUNKS, MODE)
        for c in range(c_begin, c_end):
            i = c - c_begin
            buf = i % 2
            mbarrier.wait(k_free.index(buf), ((i // 2) & 1) ^ 1)  # the first use of each buffer passes
            # What was copied an iteration ago: this chunk's scale words, the next chunk's blocks (the barrier
            # publishes every thread's copies and ends the last iteration's reads of the slots written below).
            async_copy.wait_group(0)
            gl.thread_barrier()
            scales = scale_smem.index(buf).load(KEY_L)
            b1 = block_smem.index(1 - buf).load(KEY_L)
            following = _chunk_address(c + 1, c + 1 < c_end, e1, b1, pos, start, ring_row, pool_ptr, stride_page,
                                       WINDOW, RATIO, BLOCK_SIZE, PAGE_ENTRIES, WINDOW_CHUNKS)
            _copy_scales(following, scale_smem.index(1 - buf))
            _copy_blocks(c + 2, e2, bt_row, block_smem.index(buf), RATIO, BLOCK_SIZE, WINDOW_CHUNKS)
            e1 = e2
            e2 = _chunk_entries(c + 3, pos, start, n_comp, ring_pos_row, idx_row, WINDOW, WINDOW_CHUNKS, MODE)
            valid_smem.index(buf).store(chunk[8].to(gl.int32))
            chunk = _dequantize_chunk(c, chunk, scales, following, pos, start, kv_new_words, kv_row_words,
                                      k0.index(buf), k1.index(buf), k2.index(buf), k3.index(buf), WINDOW,
                                      WINDOW_CHUNKS)
            fence_async_shared()
            mbarrier.arrive(k_ready.index(buf))

    @gluon.jit
    def _consumer(q0, q1, q2, q3, k0, k1, k2, k3, p_smem, valid_smem, k_ready, k_free, c_begin, c_end,
                  t, hb, H, pos, split, num_splits, qk_scale, sink_ptr, inv_freq_ptr, o_ptr, stride_ot, stride_oh,
                  lse_ptr, stride_lt, po_ptr, plse_ptr, q_ptr, stride_qt, stride_qh, SPLIT: gl.constexpr):
        """Consumer partition (two warpgroups): the queries into shared memory (while the producer looks up and
        loads the first chunk), then per chunk S = Q·Kᵀ, the online softmax, O = O·α + P·K; then the output (or
        the split's partial)."""
        heads = hb * BH + gl.arange(0, BH, layout=KEY_L8)
        head_ok = heads < H
        q_rows = gl.multiple_of((t * stride_qt + heads * stride_qh) // 2, 4)
        q_words = q_ptr.to(gl.pointer_type(gl.int32))
        _load_q_group(q_words, q_rows, head_ok, q0, 0, 4)
        _load_q_group(q_words, q_rows, head_ok, q1, 4, 2)
        _load_q_group(q_words, q_rows, head_ok, q2, 6, 1)
        _load_q_group(q_words, q_rows, head_ok, q3, 7, 1)
        fence_async_shared()
        gl.thread_barrier()
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
        O0_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 128, 16])
        O1_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 64, 16])
        O2_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
        m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
        l_i = gl.zeros([BH], gl.float32, layout=gl.SliceLayout(1, S_L))
        o0 = gl.zeros([BH, 256], gl.float32, layout=O0_L)
        o1 = gl.zeros([BH, 128], gl.float32, layout=O1_L)
        o2 = gl.zeros([BH, 64], gl.float32, layout=O2_L)
        o3 = gl.zeros([BH, 64], gl.float32, layout=O2_L)

        for c in range(c_begin, c_end):
            i = c - c_begin
            buf = i % 2
            mbarrier.wait(k_ready.index(buf), (i // 2) & 1)
            s = _masked_scores(q0, q1, q2, q3, k0.index(buf), k1.index(buf), k2.index(buf), k3.index(buf),
                               valid_smem.index(buf), qk_scale, S_L)
            # Online softmax (base 2), as sm90_serial's but with the row sums taken per chunk.
            m_i, alpha = _running_max(m_i, s)
            o0 = _rescale(o0, alpha)
            o1 = _rescale(o1, alpha)
            o2 = _rescale(o2, alpha)
            o3 = _rescale(o3, alpha)
            p = _probabilities(s, m_i)
            l_i = l_i * alpha + gl.sum(p, 1)
            # The probabilities are rounded to BF16 for P·V; the denominator keeps the FP32 ones (SPEC §3 step 5).
            p_smem.store(p.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
            o0 = warpgroup_mma(p_smem, k0.index(buf), o0, is_async=True)
            o1 = warpgroup_mma(p_smem, k1.index(buf), o1, is_async=True)
            o2 = warpgroup_mma(p_smem, k2.index(buf), o2, is_async=True)
            o3 = warpgroup_mma(p_smem, k3.index(buf), o3, is_async=True)
            o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=[o0, o1, o2, o3])
            mbarrier.arrive(k_free.index(buf))  # after the partition's barrier: both warpgroups are done with it

        _write_output(o0, o1, o2, o3, m_i, l_i, q0, q1, q2, heads, t, hb, H, pos, split, num_splits, sink_ptr,
                      inv_freq_ptr, o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, po_ptr, plse_ptr, SPLIT, 1)

    @gluon.jit
    def _sparse_attention_ws_kernel(
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
        o_ptr, stride_ot, stride_oh,  # [T, H, 512] bf16
        lse_ptr, stride_lt,  # fp32 [T, H]
        po_ptr, plse_ptr,  # fp32 [T, S, H, 512], [T, S, H] (SPLIT only)
        H, num_compressed, chunks_per_split, num_splits, qk_scale,
        WINDOW: gl.constexpr, RATIO: gl.constexpr, BLOCK_SIZE: gl.constexpr, PAGE_ENTRIES: gl.constexpr,
        MODE: gl.constexpr, SPLIT: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        """Grid ``(T · ceil(H / 64), splits)``: token ``t``, head block and split of its key chunks."""
        VEC_SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        WINDOW_CHUNKS: gl.constexpr = (WINDOW + BN - 1) // BN

        t, hb, split, req, pos, start, first_row, slot = _program_token(
            token_request_ptr, positions_ptr, cu_seqlens_ptr, start_pos_ptr, token_slots_ptr, H, 1)
        pos = pos.to(gl.int32)  # the producer's lookups run in int32 (fewer registers)
        start = start.to(gl.int32)

        # Dims in four groups (0-255, 256-383, 384-447, rope 448-511), each its own tile.
        q0, q1, q2, q3 = _dim_tiles(BH, 0)
        # Two buffers of the BF16 key tiles: the producer fills one while the consumers read the other.
        k0, k1, k2, k3 = _dim_tiles(BN, 2)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, BN], TILE_SL)
        valid_smem = gl.allocate_shared_memory(gl.int32, [2, BN], VEC_SL)
        scale_smem = gl.allocate_shared_memory(gl.int64, [2, BN], VEC_SL)
        block_smem = gl.allocate_shared_memory(gl.int32, [2, BN], VEC_SL)
        k_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(2):
            mbarrier.init(k_ready.index(b), count=1)
            mbarrier.init(k_free.index(b), count=1)


        n_comp, c_begin, c_end = _split_chunks(t, split, visible_ptr, num_compressed, chunks_per_split,
                                               WINDOW_CHUNKS, MODE)

        gl.warp_specialize([
            (_consumer, (q0, q1, q2, q3, k0, k1, k2, k3, p_smem, valid_smem, k_ready, k_free, c_begin, c_end,
                         t, hb, H, pos, split, num_splits, qk_scale, sink_ptr, inv_freq_ptr, o_ptr, stride_ot,
                         stride_oh, lse_ptr, stride_lt, po_ptr, plse_ptr, q_ptr, stride_qt, stride_qh, SPLIT)),
            (_producer, (k0, k1, k2, k3, valid_smem, scale_smem, block_smem, k_ready, k_free, c_begin, c_end,
                         n_comp, pos, start,
                         ring_ptr + slot * stride_ring, ring_pos_ptr + slot * stride_rpos, idx_ptr + t * stride_idx,
                         block_tables_ptr + req * stride_bt,
                         (kv_new_ptr + first_row * stride_kvt).to(gl.pointer_type(gl.int32)), stride_kvt // 2,
                         pool_ptr, stride_page, WINDOW, RATIO, BLOCK_SIZE, PAGE_ENTRIES, MODE, WINDOW_CHUNKS)),
        ], [PRODUCER_WARPS_C], [PRODUCER_REGS])

    @gluon.jit
    def _probe_group(words, out_words, rows, scales, FIRST: gl.constexpr, NB: gl.constexpr):
        codes = _load_words(words, rows * DATA_WORDS, rows >= 0, FIRST, NB, 16)
        k = _e4m3_to_bf16_words(codes, _block_exponents(scales, FIRST, NB))
        L: gl.constexpr = k.type.layout
        out_rows = gl.convert_layout(rows * 256, gl.SliceLayout(1, L))
        cols = FIRST * 32 + gl.arange(0, NB * 32, layout=gl.SliceLayout(0, L))
        gl.store(out_words + gl.expand_dims(out_rows, 1) + gl.expand_dims(cols, 0), k)

    @gluon.jit
    def _dequant_probe_kernel(pages_ptr, out_ptr):
        """Test probe: the key tiles the kernel forms from 64 entries (``pages_ptr``: 64 × 576 data bytes, then
        64 × 8 scale bytes) → BF16 ``out_ptr`` ``[64, 512]``, through the same conversion as
        ``_dequantize_block``."""
        rows = gl.arange(0, BN, layout=KEY_L).to(gl.int64)
        words = pages_ptr.to(gl.pointer_type(gl.int32))
        out_words = out_ptr.to(gl.pointer_type(gl.int32))
        scales = gl.load(pages_ptr.to(gl.pointer_type(gl.int64)) + (BN * DATA_WORDS * 4) // 8 + rows)
        _probe_group(words, out_words, rows, scales, 0, 4)
        _probe_group(words, out_words, rows, scales, 4, 2)
        _probe_group(words, out_words, rows, scales, 6, 1)
        rope = _load_words(words, rows * DATA_WORDS + NOPE_DIM // 4, rows >= 0, 0, 1, 32)
        gl.store(out_words + _word_offsets(rows * 256, 7, 1, 32), rope)


def dequant_probe(pages: torch.Tensor, out: torch.Tensor) -> None:
    """Run ``_dequant_probe_kernel`` (tests): ``pages`` uint8 ``[64·584]``, ``out`` BF16 ``[64, 512]``."""
    _dequant_probe_kernel[(1,)](pages, out, num_warps=PRODUCER_WARPS)


def launch(plan: AttentionPlan, args: AttentionArgs) -> None:
    """Launch the kernel of a ``kernel="gluon_ws"`` plan over ``plan.grid`` (FP8 pages; no cluster merge)."""
    _sparse_attention_ws_kernel[plan.grid](*args.positional(), **plan.constexprs, PRODUCER_REGS=PRODUCER_REGS,
                                           num_warps=NUM_WARPS)
