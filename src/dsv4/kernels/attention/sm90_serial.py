"""The serial Hopper (sm_90) attention kernel in Gluon: every warpgroup does every phase, one chunk ahead.

Same semantics, arguments and key set as ``triton_kernel`` (read its docstring); what differs is how the keys
reach the tensor cores. A chunk's raw bytes are streamed into shared memory with asynchronous copies one chunk
ahead, and the index and block-table loads run two and three chunks ahead, so a chunk's math only waits for data
requested an iteration earlier:

    iteration c:  copy chunk c+1 (cp.async)  |  block tables of c+2  |  entry indices of c+3
                  wait for chunk c's copy → dequantize its codes into a BF16 key tile in shared memory
                  S = Q·Kᵀ (wgmma, Q in shared memory) → online softmax → P (BF16, shared memory)
                  O = O·α + P·K (wgmma)

One program (8 warps = 2 warpgroups) holds one query token and 64 heads. The ``[64 heads, 512 dims]`` FP32 output
accumulator is split by dims across the two warpgroups (each wgmma of ``P·K`` has N = 256), the ``[64, 64]``
scores by keys. Shared memory: Q and the BF16 key tile (64 KB each), P (8 KB) and two copy stages of raw bytes
(7 × 4 KB codes + 8 KB rope values + scales + validity per stage) — one program per multiprocessor.

Dequantization is exact (E4M3 code × 2^(e−127) is a BF16): four codes at a time by the inline PTX
``ptx.DEQUANT_E4M3`` (integer ops place each code's fields in a BF16, two BF16 multiplies by powers of two scale it),
so the products are the Triton kernel's. The softmax denominator is kept per element (``l_acc``) and reduced once
after the loop, so the per-chunk row max is the only exchange between the warpgroups. The output:
``sm90_output._write_output``.

``KEYS_BF16`` (``keys="bf16"`` plans): the step's keys already dequantized into BF16 rows (``bf16_keys``), each
chunk's rows copied straight into one of two sets of key tiles a chunk ahead (``_issue_bf16_chunk``: no block
tables, no dequantization) — the same tile bits, so the FP8 path's outputs bit for bit.

``CLUSTER`` > 1 (``merge="cluster"`` plans): each token's splits run as one thread-block cluster
(``cluster_launch``); every split writes its partial, waits at ``barrier.cluster`` and merges ``ceil(64 / splits)``
of the heads from all the partials (``sm90_output._cluster_combine``) — one launch instead of the attention grid and
the combine kernel (see RESULTS.md, "Sparse attention: split partials merged in clusters"). ``resident_clusters``
asks the driver how many such clusters the GPU holds at once, for the plan.
"""

from __future__ import annotations

import functools

import torch

from .. import census, ptx
from . import cluster_launch
from .args import AttentionArgs
from .plan import AttentionPlan
from .sm90_common import NUM_WARPS, _HAVE_GLUON

__all__ = ["dequant_probe", "launch", "resident_clusters"]

STAGES = 2  # copy stages of raw key bytes

if _HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

    from .sm90_common import (BH, BLK_L, BN, DATA_BYTES, KEY_L, MODE_LIST, NOPE_DIM, Q_L, TILE3_L, TILE_SL,
                              _block_exponents, _dim_tiles, _fresh_rows, _issue_bf16_chunk, _probabilities,
                              _program_token, _rescale, _running_max, _split_chunks)
    from .sm90_output import _write_output

    NSTAGE = gl.constexpr(STAGES)
    DEQUANT_PTX = gl.constexpr(ptx.DEQUANT_E4M3)

    @gluon.jit
    def _chunk_entries(c, t, pos, start, slot, n_comp, ring_pos_ptr, stride_rpos, idx_ptr, stride_idx,
                       WINDOW: gl.constexpr, WINDOW_CHUNKS: gl.constexpr, MODE: gl.constexpr):
        """First lookup of chunk ``c`` (issued three chunks ahead, consumed by ``_chunk_blocks``): int64 ``[64]``
        the position each window slot holds (ring), or each compressed key's entry index (−1 = none)."""
        n = gl.arange(0, BN, layout=KEY_L)
        if c < WINDOW_CHUNKS:
            j = c * BN + n
            p = pos - (WINDOW - 1) + j
            in_ring = (j < WINDOW) & (p >= 0) & (p < start)
            held = gl.load(ring_pos_ptr + slot * stride_rpos + gl.maximum(p, 0) % WINDOW, mask=in_ring, other=-1)
            raw = held.to(gl.int64)
        else:
            j = (c - WINDOW_CHUNKS) * BN + n
            listed = j < n_comp
            if MODE == MODE_LIST:
                raw = gl.load(idx_ptr + t * stride_idx + j, mask=listed, other=-1).to(gl.int64)
            else:
                raw = gl.where(listed, j, -1).to(gl.int64)
        return raw

    @gluon.jit
    def _chunk_blocks(c, raw, req, block_tables_ptr, stride_bt,
                      RATIO: gl.constexpr, BLOCK_SIZE: gl.constexpr, WINDOW_CHUNKS: gl.constexpr):
        """Second lookup of chunk ``c`` (two chunks ahead): int32 ``[64]`` each compressed entry's physical block
        (−1 = unmapped or no entry); window chunks need none (zeros)."""
        if c < WINDOW_CHUNKS:
            block = gl.zeros([BN], gl.int32, layout=KEY_L)
        else:
            first_pos = gl.maximum(raw, 0) * RATIO
            block = gl.load(block_tables_ptr + req * stride_bt + first_pos // BLOCK_SIZE, mask=raw >= 0, other=-1)
        return block

    @gluon.jit
    def _tile_offsets(rows, FIRST: gl.constexpr, NB: gl.constexpr):
        """``[64, NB, 64]`` offsets ``rows[k] + (FIRST + blk)·64 + i`` (elements) of blocks ``FIRST … FIRST+NB−1``
        of 64 key rows (``rows`` int64 ``[64]``); the 16 consecutive elements a thread holds are aligned."""
        blk = gl.arange(0, NB, layout=gl.SliceLayout(0, BLK_L))
        col = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, TILE3_L)))
        off = gl.expand_dims(gl.expand_dims(rows, 1), 2) + gl.expand_dims(gl.expand_dims((FIRST + blk) * 64, 0), 2)
        return off + gl.expand_dims(gl.expand_dims(col, 0), 1)

    @gluon.jit
    def _copy_tile(base, rows, ok3, dst, FIRST: gl.constexpr, NB: gl.constexpr):
        """Asynchronous copy of blocks ``FIRST …`` of 64 key rows (``_tile_offsets``) into ``dst`` ``[64, NB, 64]``
        (rows not ``ok3`` zero-filled, not read)."""
        ptrs = gl.max_contiguous(base + _tile_offsets(rows, FIRST, NB), [1, 1, 16])
        async_copy.async_copy_global_to_shared(dst, ptrs, mask=ok3)

    @gluon.jit
    def _issue_chunk(c, live, raw, block, stage, pos, start, slot,
                     ring_ptr, stride_ring, pool_ptr, stride_page,
                     codes0, codes1, codes2, rope_stage, scale_smem, valid_smem,
                     WINDOW: gl.constexpr, RATIO: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                     PAGE_ENTRIES: gl.constexpr, WINDOW_CHUNKS: gl.constexpr):
        """Start the asynchronous copies of chunk ``c``'s raw bytes into copy stage ``stage`` (nothing is read when
        not ``live``; rows without a key are zero-filled) and record which keys are real in ``valid_smem``."""
        n = gl.arange(0, BN, layout=KEY_L)
        if c < WINDOW_CHUNKS:
            j = c * BN + n
            p = pos - (WINDOW - 1) + j
            ring_slot = gl.maximum(p, 0) % WINDOW
            ok = live & (raw == p) & (raw >= 0)
            fresh = live & (j < WINDOW) & (p >= start) & (p >= 0)
            base = ring_ptr
            ring_page = slot * stride_ring
            rows = ring_page + ring_slot * DATA_BYTES
            scale_off = (ring_page + WINDOW * DATA_BYTES) // 8 + ring_slot
            valid = ok | fresh
        else:
            ok = live & (raw >= 0) & (block >= 0)
            base = pool_ptr
            page = gl.maximum(block, 0).to(gl.int64) * stride_page
            entry_slot = (gl.maximum(raw, 0) * RATIO % BLOCK_SIZE) // RATIO
            rows = page + entry_slot * DATA_BYTES
            scale_off = (page + PAGE_ENTRIES * DATA_BYTES) // 8 + entry_slot
            valid = ok
        rows = gl.multiple_of(rows, 16)
        ok3 = gl.expand_dims(gl.expand_dims(ok, 1), 2)
        _copy_tile(base, rows, ok3, codes0.index(stage), 0, 4)
        _copy_tile(base, rows, ok3, codes1.index(stage), 4, 2)
        _copy_tile(base, rows, ok3, codes2.index(stage), 6, 1)
        # The rope values follow the 448 codes: BF16 element (row + 448) / 2, as group 0 of a BF16 row.
        _copy_tile(base.to(gl.pointer_type(gl.bfloat16)), (rows + NOPE_DIM) // 2, ok3, rope_stage.index(stage), 0, 1)
        async_copy.async_copy_global_to_shared(scale_smem.index(stage), base.to(gl.pointer_type(gl.int64)) + scale_off,
                                               mask=ok)
        valid_smem.index(stage).store(gl.convert_layout(valid, KEY_L).to(gl.int32))
        async_copy.commit_group()

    @gluon.jit
    def _e4m3_to_bf16(codes, e):
        """``code · 2^(e − 127)`` as BF16, exact (``ptx.DEQUANT_E4M3``): ``codes`` uint8 ``[64, NB, 64]`` E4M3, ``e``
        int32 ``[64, NB]`` each block's UE8M0 exponent."""
        e3 = gl.expand_dims(e, 2)
        # Two power-of-two multipliers, both BF16: 2^(min(e,134)−7) restores the code's 2^−120 bias, 2^(max(e,134)−134)
        # completes scales beyond BF16's largest power (1 for every e ≤ 134).
        s1 = ((gl.minimum(e3, 134) + 120) << 7).to(gl.int16).to(gl.bfloat16, bitcast=True)
        s2 = ((gl.maximum(e3, 134) - 7) << 7).to(gl.int16).to(gl.bfloat16, bitcast=True)
        s1, _ = gl.broadcast(s1, codes)
        s2, _ = gl.broadcast(s2, codes)
        return gl.inline_asm_elementwise(DEQUANT_PTX, "=r,=r,r,r,r,r,r", [codes, s1, s2], dtype=gl.bfloat16,
                                         is_pure=True, pack=4)

    @gluon.jit
    def _dequantize_group(src, dst, scales, fresh, new_rows, kv_new_ptr, is_window,
                          FIRST: gl.constexpr, NB: gl.constexpr, IS_ROPE: gl.constexpr):
        """One group of chunk keys into its BF16 tile ``dst`` ``[64, NB·64]``: FP8 codes ``src`` ``[64, NB, 64]``
        × 2^(e_b − 127) per block (exact in BF16), or the BF16 rope values as stored (``IS_ROPE``); the window keys
        of this step (``fresh``) from ``kv_new`` rows ``new_rows`` (element offsets)."""
        if IS_ROPE:
            k = src.load(TILE3_L)
        else:
            k = _e4m3_to_bf16(src.load(TILE3_L), _block_exponents(scales, FIRST, NB))
        if is_window:
            fresh3 = gl.expand_dims(gl.expand_dims(fresh, 1), 2)
            k_new = gl.load(kv_new_ptr + _tile_offsets(new_rows, FIRST, NB), mask=fresh3, other=0.0)
            k = gl.where(fresh3, k_new, k)
        dst.store(gl.reshape(k, [BN, NB * 64]))

    @gluon.jit
    def _dequantize_chunk(c, stage, pos, start, first_row, kv_new_ptr, stride_kvt,
                          codes0, codes1, codes2, rope_stage, scale_smem, k0, k1, k2, k3,
                          WINDOW: gl.constexpr, WINDOW_CHUNKS: gl.constexpr):
        """Chunk ``c``'s keys (copy stage ``stage``) as the BF16 tiles ``k0 … k3`` (dims 0-255, 256-383, 384-447,
        448-511); window keys of this step from ``kv_new``."""
        scales = scale_smem.index(stage).load(KEY_L)
        is_window = c < WINDOW_CHUNKS
        fresh, new_row = _fresh_rows(c, pos, start, WINDOW)
        fresh = fresh & is_window
        new_rows = (first_row + new_row) * stride_kvt
        _dequantize_group(codes0.index(stage), k0, scales, fresh, new_rows, kv_new_ptr, is_window, 0, 4, False)
        _dequantize_group(codes1.index(stage), k1, scales, fresh, new_rows, kv_new_ptr, is_window, 4, 2, False)
        _dequantize_group(codes2.index(stage), k2, scales, fresh, new_rows, kv_new_ptr, is_window, 6, 1, False)
        _dequantize_group(rope_stage.index(stage), k3, scales, fresh, new_rows, kv_new_ptr, is_window, 7, 1, True)

    @gluon.jit
    def _load_q_group(q_ptr, row_off, head_ok, dst, FIRST: gl.constexpr, NB: gl.constexpr):
        """Dims ``64·FIRST …`` of the 64 heads' queries (rows ``row_off``, absent heads zero) into ``dst``."""
        ok3 = gl.expand_dims(gl.expand_dims(head_ok, 1), 2)
        dst.store(gl.reshape(gl.load(q_ptr + _tile_offsets(row_off, FIRST, NB), mask=ok3, other=0.0), [BH, NB * 64]))

    @gluon.jit
    def _attend_chunk(q0, q1, q2, q3, k0, k1, k2, k3, p_smem, valid_smem, m_i, l_acc, o0, o1, o2, o3, qk_scale):
        """One chunk of 64 keys (BF16 tiles ``k0 … k3`` in shared memory, which keys are real in ``valid_smem``)
        against the 64 heads' queries ``q0 … q3``: S = Q·Kᵀ (wgmma), the online softmax (base 2) with running max
        ``m_i`` ``[64]`` and per-element sums ``l_acc`` ``[64, 64]``, P (BF16) through ``p_smem``, O = O·α + P·K
        into ``o0 … o3`` (FP32 ``[64, 256 / 128 / 64 / 64]``). Returns the updated ``(m_i, l_acc, o0, o1, o2,
        o3)``."""
        S_L: gl.constexpr = l_acc.type.layout
        s = warpgroup_mma(q0, k0.permute((1, 0)), gl.zeros([BH, BN], gl.float32, layout=S_L), use_acc=False,
                          is_async=True)
        s = warpgroup_mma(q1, k1.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(q2, k2.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(q3, k3.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        valid = valid_smem.load(gl.SliceLayout(0, S_L)) != 0
        s = gl.where(gl.expand_dims(valid, 0), s * qk_scale, float("-inf"))
        # Online softmax (base 2). The sums stay per element (l_acc) and are reduced once after the loop: the row
        # max is the only exchange between the two warpgroups (each holds half of a head's keys) per chunk.
        m_new, alpha = _running_max(m_i, s)
        l_acc = l_acc * gl.expand_dims(alpha, 1)
        o0 = _rescale(o0, alpha)
        o1 = _rescale(o1, alpha)
        o2 = _rescale(o2, alpha)
        o3 = _rescale(o3, alpha)
        p = _probabilities(s, m_new)
        l_acc = l_acc + p
        # The probabilities are rounded to BF16 for P·V; the denominator keeps the FP32 ones (SPEC §3 step 5).
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        o0 = warpgroup_mma(p_smem, k0, o0, is_async=True)
        o1 = warpgroup_mma(p_smem, k1, o1, is_async=True)
        o2 = warpgroup_mma(p_smem, k2, o2, is_async=True)
        o3 = warpgroup_mma(p_smem, k3, o3, is_async=True)
        o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=[o0, o1, o2, o3])
        return m_new, l_acc, o0, o1, o2, o3

    @gluon.jit
    def _sparse_attention_sm90_kernel(
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
        keys_ptr, stride_kb, key_entries,  # KEYS_BF16: bf16 [B, WINDOW + key_entries, 512] (bf16_keys)
        WINDOW: gl.constexpr, RATIO: gl.constexpr, BLOCK_SIZE: gl.constexpr, PAGE_ENTRIES: gl.constexpr,
        MODE: gl.constexpr, SPLIT: gl.constexpr, CLUSTER: gl.constexpr, KEYS_BF16: gl.constexpr,
    ):
        """Grid ``(T · ceil(H / 64), splits)``: token ``t``, head block and split of its key chunks; or clusters of
        ``CLUSTER`` programs, the splits of one token and head block, which merge their partials themselves
        (``_write_output``)."""
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
        O0_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 128, 16])
        O1_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 64, 16])
        O2_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
        RAW_SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
        VEC_SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        WINDOW_CHUNKS: gl.constexpr = (WINDOW + BN - 1) // BN

        t, hb, split, req, pos, start, first_row, slot = _program_token(
            token_request_ptr, positions_ptr, cu_seqlens_ptr, start_pos_ptr, token_slots_ptr, H, CLUSTER)

        # Dims in four groups (0-255, 256-383, 384-447, rope 448-511), each its own tile.
        q0, q1, q2, q3 = _dim_tiles(BH, 0)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, BN], TILE_SL)
        valid_smem = gl.allocate_shared_memory(gl.int32, [NSTAGE, BN], VEC_SL)

        # The queries, loaded and stored synchronously (faster here than an asynchronous copy overlapping the first
        # lookups).
        heads = hb * BH + gl.arange(0, BH, layout=KEY_L)
        q_rows = t * stride_qt + heads * stride_qh
        _load_q_group(q_ptr, q_rows, heads < H, q0, 0, 4)
        _load_q_group(q_ptr, q_rows, heads < H, q1, 4, 2)
        _load_q_group(q_ptr, q_rows, heads < H, q2, 6, 1)
        _load_q_group(q_ptr, q_rows, heads < H, q3, 7, 1)

        n_comp, c_begin, c_end = _split_chunks(t, split, visible_ptr, num_compressed, chunks_per_split,
                                               WINDOW_CHUNKS, MODE)

        m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
        l_acc = gl.zeros([BH, BN], gl.float32, layout=S_L)  # Σ p per head and key column
        o0 = gl.zeros([BH, 256], gl.float32, layout=O0_L)
        o1 = gl.zeros([BH, 128], gl.float32, layout=O1_L)
        o2 = gl.zeros([BH, 64], gl.float32, layout=O2_L)
        o3 = gl.zeros([BH, 64], gl.float32, layout=O2_L)

        if KEYS_BF16:
            # The keys already in BF16 (dequantized once per step): each chunk copied straight into one of two
            # sets of key tiles, a chunk ahead; no block tables, no dequantization.
            k0, k1, k2, k3 = _dim_tiles(BN, NSTAGE)
            key_rows = keys_ptr + req * stride_kb
            kv_new_rows = kv_new_ptr + first_row * stride_kvt
            e0 = _chunk_entries(c_begin, t, pos, start, slot, n_comp, ring_pos_ptr, stride_rpos, idx_ptr, stride_idx,
                                WINDOW, WINDOW_CHUNKS, MODE)
            _issue_bf16_chunk(c_begin, c_begin < c_end, e0, 0, pos, start, key_rows, key_entries, kv_new_rows,
                              stride_kvt, k0, k1, k2, k3, valid_smem, WINDOW, WINDOW_CHUNKS, Q_L)
            e1 = _chunk_entries(c_begin + 1, t, pos, start, slot, n_comp, ring_pos_ptr, stride_rpos, idx_ptr,
                                stride_idx, WINDOW, WINDOW_CHUNKS, MODE)
            e2 = _chunk_entries(c_begin + 2, t, pos, start, slot, n_comp, ring_pos_ptr, stride_rpos, idx_ptr,
                                stride_idx, WINDOW, WINDOW_CHUNKS, MODE)
            for c in range(c_begin, c_end):
                stage = (c - c_begin) % NSTAGE
                # Chunk c's keys are in (each thread's copies, fenced for the tensor cores, published by the
                # barrier), and every warpgroup is done with chunk c−1's tiles: the other set takes chunk c+1.
                async_copy.wait_group(0)
                fence_async_shared()
                gl.thread_barrier()
                _issue_bf16_chunk(c + 1, c + 1 < c_end, e1, 1 - stage, pos, start, key_rows, key_entries,
                                  kv_new_rows, stride_kvt, k0, k1, k2, k3, valid_smem, WINDOW, WINDOW_CHUNKS, Q_L)
                e1 = e2
                e2 = _chunk_entries(c + 3, t, pos, start, slot, n_comp, ring_pos_ptr, stride_rpos, idx_ptr,
                                    stride_idx, WINDOW, WINDOW_CHUNKS, MODE)
                m_i, l_acc, o0, o1, o2, o3 = _attend_chunk(
                    q0, q1, q2, q3, k0.index(stage), k1.index(stage), k2.index(stage), k3.index(stage), p_smem,
                    valid_smem.index(stage), m_i, l_acc, o0, o1, o2, o3, qk_scale)
        else:
            k0, k1, k2, k3 = _dim_tiles(BN, 0)
            codes0 = gl.allocate_shared_memory(gl.uint8, [NSTAGE, BN, 4, 64], RAW_SL)
            codes1 = gl.allocate_shared_memory(gl.uint8, [NSTAGE, BN, 2, 64], RAW_SL)
            codes2 = gl.allocate_shared_memory(gl.uint8, [NSTAGE, BN, 1, 64], RAW_SL)
            rope_stage = gl.allocate_shared_memory(gl.bfloat16, [NSTAGE, BN, 1, 64], RAW_SL)
            scale_smem = gl.allocate_shared_memory(gl.int64, [NSTAGE, BN], VEC_SL)
            # Prologue: chunk c_begin in flight, the lookups of c_begin+1 done, the entries of c_begin+2 requested.
            e0 = _chunk_entries(c_begin, t, pos, start, slot, n_comp, ring_pos_ptr, stride_rpos, idx_ptr, stride_idx,
                                WINDOW, WINDOW_CHUNKS, MODE)
            b0 = _chunk_blocks(c_begin, e0, req, block_tables_ptr, stride_bt, RATIO, BLOCK_SIZE, WINDOW_CHUNKS)
            _issue_chunk(c_begin, c_begin < c_end, e0, b0, 0, pos, start, slot, ring_ptr, stride_ring, pool_ptr,
                         stride_page, codes0, codes1, codes2, rope_stage, scale_smem, valid_smem,
                         WINDOW, RATIO, BLOCK_SIZE, PAGE_ENTRIES, WINDOW_CHUNKS)
            e1 = _chunk_entries(c_begin + 1, t, pos, start, slot, n_comp, ring_pos_ptr, stride_rpos, idx_ptr,
                                stride_idx, WINDOW, WINDOW_CHUNKS, MODE)
            b1 = _chunk_blocks(c_begin + 1, e1, req, block_tables_ptr, stride_bt, RATIO, BLOCK_SIZE, WINDOW_CHUNKS)
            e2 = _chunk_entries(c_begin + 2, t, pos, start, slot, n_comp, ring_pos_ptr, stride_rpos, idx_ptr,
                                stride_idx, WINDOW, WINDOW_CHUNKS, MODE)
            for c in range(c_begin, c_end):
                stage = (c - c_begin) % NSTAGE
                # Look ahead: copy chunk c+1, block tables of c+2, entries of c+3 (used next iteration: no stall).
                _issue_chunk(c + 1, c + 1 < c_end, e1, b1, 1 - stage, pos, start, slot, ring_ptr, stride_ring,
                             pool_ptr, stride_page, codes0, codes1, codes2, rope_stage, scale_smem, valid_smem,
                             WINDOW, RATIO, BLOCK_SIZE, PAGE_ENTRIES, WINDOW_CHUNKS)
                b1 = _chunk_blocks(c + 2, e2, req, block_tables_ptr, stride_bt, RATIO, BLOCK_SIZE, WINDOW_CHUNKS)
                e1 = e2
                e2 = _chunk_entries(c + 3, t, pos, start, slot, n_comp, ring_pos_ptr, stride_rpos, idx_ptr,
                                    stride_idx, WINDOW, WINDOW_CHUNKS, MODE)

                # Chunk c's bytes are in (every thread waited for its own copies; the barrier publishes them, and
                # orders this chunk's writes of the key tiles / P after the previous chunk's wgmma reads).
                async_copy.wait_group(1)
                gl.thread_barrier()
                _dequantize_chunk(c, stage, pos, start, first_row, kv_new_ptr, stride_kvt, codes0, codes1, codes2,
                                  rope_stage, scale_smem, k0, k1, k2, k3, WINDOW, WINDOW_CHUNKS)
                fence_async_shared()
                gl.thread_barrier()
                m_i, l_acc, o0, o1, o2, o3 = _attend_chunk(q0, q1, q2, q3, k0, k1, k2, k3, p_smem,
                                                           valid_smem.index(stage), m_i, l_acc, o0, o1, o2, o3,
                                                           qk_scale)
        async_copy.wait_group(0)
        l_i = gl.sum(l_acc, 1)

        _write_output(o0, o1, o2, o3, m_i, l_i, q0, q1, q2, heads, t, hb, H, pos, split, num_splits, sink_ptr,
                      inv_freq_ptr, o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, po_ptr, plse_ptr, SPLIT, CLUSTER)

    @gluon.jit
    def _probe_group(pages_ptr, out_ptr, rows, scales, FIRST: gl.constexpr, NB: gl.constexpr):
        codes = gl.load(pages_ptr + _tile_offsets(rows * DATA_BYTES, FIRST, NB))
        k = _e4m3_to_bf16(codes, _block_exponents(scales, FIRST, NB))
        gl.store(out_ptr + _tile_offsets(rows * 512, FIRST, NB), k)

    @gluon.jit
    def _dequant_probe_kernel(pages_ptr, out_ptr):
        """Test probe: the key tiles the kernel forms from 64 entries (``pages_ptr``: 64 × 576 data bytes, then
        64 × 8 scale bytes) → BF16 ``out_ptr`` ``[64, 512]``, through the same conversion as ``_dequantize_group``."""
        rows = gl.arange(0, BN, layout=KEY_L).to(gl.int64)
        scales = gl.load(pages_ptr.to(gl.pointer_type(gl.int64)) + (BN * DATA_BYTES) // 8 + rows)
        _probe_group(pages_ptr, out_ptr, rows, scales, 0, 4)
        _probe_group(pages_ptr, out_ptr, rows, scales, 4, 2)
        _probe_group(pages_ptr, out_ptr, rows, scales, 6, 1)
        rope_ptr = pages_ptr.to(gl.pointer_type(gl.bfloat16))
        rope = gl.load(rope_ptr + _tile_offsets((rows * DATA_BYTES + NOPE_DIM) // 2, 0, 1))
        gl.store(out_ptr + _tile_offsets(rows * 512, 7, 1), rope)


def dequant_probe(pages: torch.Tensor, out: torch.Tensor) -> None:
    """Run ``_dequant_probe_kernel`` (tests): ``pages`` uint8 ``[64·584]``, ``out`` BF16 ``[64, 512]``."""
    _dequant_probe_kernel[(1,)](pages, out, num_warps=NUM_WARPS)


def _kernel_kwargs(plan: AttentionPlan, args: AttentionArgs, key_rows: torch.Tensor | None, cluster: int) -> dict:
    """The kernel's keywords after the shared arguments: the BF16 key rows (``key_rows`` bf16 ``[B, WINDOW +
    entries, 512]``, or ``None``: the FP8 pages are read), the geometry constexprs, the cluster size."""
    if key_rows is None:
        keys = dict(keys_ptr=args.q, stride_kb=0, key_entries=0, KEYS_BF16=False)
    else:
        keys = dict(keys_ptr=key_rows, stride_kb=key_rows.stride(0), key_entries=key_rows.shape[1] - plan.window,
                    KEYS_BF16=True)
    return dict(keys, **plan.constexprs, CLUSTER=cluster, num_warps=NUM_WARPS)


def launch(plan: AttentionPlan, args: AttentionArgs, key_rows: torch.Tensor | None) -> None:
    """Launch the kernel of a ``kernel="gluon"`` plan over ``plan.grid``; with ``merge="cluster"`` each token's
    splits as one cluster of consecutive programs that merge their partials themselves."""
    positional = args.positional()
    if plan.merge != "cluster":
        _sparse_attention_sm90_kernel[plan.grid](*positional, **_kernel_kwargs(plan, args, key_rows, 1))
        return
    grid = (plan.items, 1)
    kwargs = _kernel_kwargs(plan, args, key_rows, plan.splits)
    compiled = cluster_launch.compiled_kernel(_sparse_attention_sm90_kernel, grid, positional, kwargs)
    cluster_launch.launch(_sparse_attention_sm90_kernel, compiled, grid, plan.splits, positional, kwargs)


#: the pointer arguments' dtypes, for compiling the kernel without tensors (``resident_clusters``)
_POINTER_DTYPES = {
    "q_ptr": torch.bfloat16, "kv_new_ptr": torch.bfloat16, "ring_ptr": torch.uint8, "ring_pos_ptr": torch.int32,
    "pool_ptr": torch.uint8, "block_tables_ptr": torch.int32, "idx_ptr": torch.int32, "visible_ptr": torch.int64,
    "token_request_ptr": torch.int32, "positions_ptr": torch.int64, "cu_seqlens_ptr": torch.int32,
    "start_pos_ptr": torch.int64, "token_slots_ptr": torch.int64, "sink_ptr": torch.float32,
    "inv_freq_ptr": torch.float32, "o_ptr": torch.bfloat16, "lse_ptr": torch.float32, "po_ptr": torch.float32,
    "plse_ptr": torch.float32, "keys_ptr": torch.bfloat16,
}


#: the cluster specialisation ``resident_clusters`` compiles (a CSA decode split)
_PROBE_CONSTEXPRS = dict(WINDOW=128, RATIO=4, BLOCK_SIZE=256, PAGE_ENTRIES=64, MODE=1, SPLIT=True, CLUSTER=2,
                         KEYS_BF16=False)


def _probe_args() -> tuple:
    """The kernel's non-constexpr arguments as a launch without tensors takes them (``JITFunction.warmup``): each
    pointer's torch dtype, 64 for every integer (strides, counts), 1.0 for the softmax scale."""
    return tuple(_POINTER_DTYPES[p.name] if p.name.endswith("_ptr") else (1.0 if p.name == "qk_scale" else 64)
                 for p in _sparse_attention_sm90_kernel.params if p.name not in _PROBE_CONSTEXPRS)


@functools.lru_cache(maxsize=None)
def _probe_compiled(device_index: int):
    """``_PROBE_CONSTEXPRS``' specialisation compiled for ``device_index`` from argument dtypes alone: what
    ``resident_clusters`` asks the driver about."""
    with torch.cuda.device(device_index), census.device_query():  # a question to the driver, not a launch
        return cluster_launch.compiled_kernel(_sparse_attention_sm90_kernel, (1, 1), _probe_args(),
                                              dict(_PROBE_CONSTEXPRS, num_warps=NUM_WARPS))


@functools.lru_cache(maxsize=None)
def resident_clusters(device_index: int, size: int) -> int:
    """How many clusters of ``size`` programs of this kernel CUDA device ``device_index`` holds at once (the
    driver's ``cuOccupancyMaxActiveClusters``; 0 when it cannot say). Every specialisation of the kernel takes a
    whole multiprocessor (over 200 KB of shared memory), so one compiled specialisation answers for all; a plan
    asks only where a cluster merge applies (cached per device and size: the driver is asked once)."""
    if not 2 <= size <= cluster_launch.MAX_CLUSTER:
        return 0
    return cluster_launch.max_active_clusters(_probe_compiled(device_index), size)
