"""Prefill chunks of sparse attention over BF16 key rows, in Gluon for Hopper (sm_90): a score warpgroup and a value
warpgroup.

The op of ``sparse_attention_sm90`` with ``KEYS_BF16`` — one program per query token and 64 heads, its keys in
chunks of 64 copied from the step's keys dequantized once (``sparse_attention.bf16_keys``); read those modules for
the key set and the numerics — with the two warpgroups' work divided instead of both doing every phase. There, both
compute S = Q·Kᵀ for half of a chunk's keys (each reads all of Q from shared memory), exchange the row maxima, and
then both run P·V on half of the dims, one phase after the other. Here (warp specialization, 4 + 4 warps):

    score warpgroup (default partition), chunk c:  S = Q·Kᵀ for the whole chunk (m64n64: Q read once) → the online
        softmax over whole rows (no exchange) → P and α = 2^(m_old − m_new) into shared memory → ``p_ready`` →
        O[:, 0:256] = O·α + P·K[:, 0:256]; meanwhile the copies of chunk c+1 (once the value warpgroup has
        released its buffers: ``kv_free``)
    value warpgroup (worker), chunk c:  wait ``p_ready`` → O[:, 256:512] = O·α + P·K[:, 256:512] → ``kv_free``

so the value warpgroup's half of P·V runs while the score warpgroup computes the next S and softmax. Two buffers
of key tiles, P and α. The arithmetic is the same as ``sparse_attention_sm90``'s (the same MMA reduction per
element, the per-element softmax sums, P rounded to BF16): the outputs are its bits (GPU test).

Registers: the score warpgroup holds S, the per-element sums and O's first half (~220 per thread), the value
warpgroup O's second half (``VALUE_REGS``). Needs a CUDA device of compute capability 9.x; no splits (prefill chunks
have enough programs), no interpreter path.
"""

from __future__ import annotations

import torch

try:  # Gluon ships with Triton ≥ 3.4; without it the other kernels serve
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .sparse_attention_sm90 import (TILE_SL, _copy_keys, _dim_tiles, _issue_bf16_chunk, _program_token,
                                        _rescale, _split_chunks, _store_group, _store_rope, _unrotation)

    _HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    _HAVE_GLUON = False

__all__ = ["VALUE_REGS", "launch"]

BLOCK_H = 64  # heads per program: the wgmma M
BLOCK_N = 64  # keys per chunk
#: registers per thread of the value warpgroup (O's second half: 128 of them); the score warpgroup gets the rest
VALUE_REGS = 168

if _HAVE_GLUON:
    BH = gl.constexpr(BLOCK_H)
    BN = gl.constexpr(BLOCK_N)
    WARPS = gl.constexpr(4)  # per partition: one warpgroup
    NOPE_DIM = gl.constexpr(448)
    ROWS_L = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))  # [64, dims]: 16-byte pieces
    KEY4_L = gl.constexpr(gl.SliceLayout(1, ROWS_L))  # [64]: one value per key or head
    MODE_LIST = gl.constexpr(1)
    S_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
    OA_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
    OB1_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16]))
    OB2_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))

    @gluon.jit
    def _entries(c, pos, start, n_comp, ring_pos_row, idx_row, WINDOW: gl.constexpr, WINDOW_CHUNKS: gl.constexpr,
                 MODE: gl.constexpr):
        """Chunk ``c``'s lookup (a chunk ahead of its copies): int32 ``[64]`` the position each window slot holds
        (``ring_pos_row``: the token's ring), or each compressed key's entry index (``idx_row``: its list; −1 =
        none). Both loads masked instead of a branch (Triton 3.6 does not lower loads on both sides of a branch
        inside a warp-specialized partition)."""
        n = gl.arange(0, BN, layout=KEY4_L)
        in_window = c < WINDOW_CHUNKS
        j = c * BN + n
        p = pos - (WINDOW - 1) + j
        in_ring = in_window & (j < WINDOW) & (p >= 0) & (p < start)
        held = gl.load(ring_pos_row + gl.maximum(p, 0) % WINDOW, mask=in_ring, other=-1)
        i = j - WINDOW_CHUNKS * BN
        listed = (not in_window) & (i >= 0) & (i < n_comp)
        if MODE == MODE_LIST:
            entry = gl.load(idx_row + gl.maximum(i, 0), mask=listed, other=-1).to(gl.int32)
        else:
            entry = gl.where(listed, i, -1)
        return gl.where(in_window, held, entry)

    @gluon.jit
    def _score_partition(q0, q1, q2, q3, k0, k1, k2, k3, p_smem, alpha_smem, stats_smem, valid_smem, p_ready,
                         kv_free, done, t, hb, H, pos, start, n_comp, c_begin, c_end, q_ptr, stride_qt, stride_qh,
                         kv_new_rows, stride_kvt, ring_pos_row, idx_row, key_rows, key_entries, qk_scale, sink_ptr,
                         o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, WINDOW: gl.constexpr,
                         WINDOW_CHUNKS: gl.constexpr, MODE: gl.constexpr):
        """The score warpgroup: the queries and each chunk's keys copied in, S, the softmax, P / α for the value
        warpgroup, O[:, 0:256]; at the end the row maxima and sums for it (``done``), the lse and its half of the
        output."""
        heads = hb * BH + gl.arange(0, BH, layout=KEY4_L)
        q_rows = q_ptr + t * stride_qt + heads * stride_qh
        q_ok = gl.expand_dims(heads < H, 1)
        _copy_keys(q_rows, q_ok, q0, 0, 256)
        _copy_keys(q_rows, q_ok, q1, 256, 128)
        _copy_keys(q_rows, q_ok, q2, 384, 64)
        _copy_keys(q_rows, q_ok, q3, 448, 64)
        async_copy.commit_group()
        e0 = _entries(c_begin, pos, start, n_comp, ring_pos_row, idx_row, WINDOW, WINDOW_CHUNKS, MODE)
        _issue_bf16_chunk(c_begin, c_begin < c_end, e0, 0, pos, start, key_rows, key_entries, kv_new_rows,
                          stride_kvt, k0, k1, k2, k3, valid_smem, WINDOW, WINDOW_CHUNKS, ROWS_L)
        e1 = _entries(c_begin + 1, pos, start, n_comp, ring_pos_row, idx_row, WINDOW, WINDOW_CHUNKS, MODE)

        m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
        l_acc = gl.zeros([BH, BN], gl.float32, layout=S_L)  # Σ p per head and key column (as sparse_attention_sm90)
        o0 = gl.zeros([BH, 256], gl.float32, layout=OA_L)
        for c in range(c_begin, c_end):
            i = c - c_begin
            buf = i % 2
            # Chunk c's keys (and, the first time, the queries) are in: each thread's copies, fenced for the
            # tensor cores, published to the warpgroup.
            async_copy.wait_group(0)
            fence_async_shared()
            gl.thread_barrier()
            s = warpgroup_mma(q0, k0.index(buf).permute((1, 0)), gl.zeros([BH, BN], gl.float32, layout=S_L),
                              use_acc=False, is_async=True)
            s = warpgroup_mma(q1, k1.index(buf).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma(q2, k2.index(buf).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma(q3, k3.index(buf).permute((1, 0)), s, is_async=True)
            # Meanwhile chunk c+1 into the other buffers, once the value warpgroup is done with chunk c−1 there
            # (its k-th use waits for the release of use k−1; the first use of each buffer passes).
            nxt = 1 - buf
            mbarrier.wait(kv_free.index(nxt), (((i + 1) // 2) & 1) ^ 1)
            _issue_bf16_chunk(c + 1, c + 1 < c_end, e1, nxt, pos, start, key_rows, key_entries, kv_new_rows,
                              stride_kvt, k0, k1, k2, k3, valid_smem, WINDOW, WINDOW_CHUNKS, ROWS_L)
            e1 = _entries(c + 2, pos, start, n_comp, ring_pos_row, idx_row, WINDOW, WINDOW_CHUNKS, MODE)
            s = warpgroup_mma_wait(0, deps=[s])
            valid = valid_smem.index(buf).load(gl.SliceLayout(0, S_L)) != 0
            s = gl.where(gl.expand_dims(valid, 0), s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            alpha = gl.exp2(m_i - gl.where(m_new == float("-inf"), 0.0, m_new))
            l_acc = l_acc * gl.expand_dims(alpha, 1)
            o0 = _rescale(o0, alpha)
            p = gl.exp2(s - gl.expand_dims(gl.where(m_new == float("-inf"), 0.0, m_new), 1))
            l_acc = l_acc + p
            m_i = m_new
            # P (BF16, as SPEC §3 step 5) and α for the value warpgroup; its buffer's last reader (chunk c−2) is
            # done: this chunk's keys were copied in only after that (kv_free).
            p_smem.index(buf).store(p.to(gl.bfloat16))
            alpha_smem.index(buf).store(gl.convert_layout(alpha, KEY4_L))
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(p_ready.index(buf))
            o0 = warpgroup_mma(p_smem.index(buf), k0.index(buf), o0, is_async=True)
            o0 = warpgroup_mma_wait(0, deps=[o0])
        async_copy.wait_group(0)
        # The row sums in sparse_attention_sm90's order (each of its warpgroups sums 32 key columns, then the two
        # partial sums are added), so that the denominators — and the outputs — are its bits.
        l_i = gl.convert_layout(gl.sum(gl.sum(gl.reshape(l_acc, [BH, 2, BN // 2]), axis=2), axis=1),
                                gl.SliceLayout(1, S_L))
        stats_smem.index(0).store(gl.convert_layout(m_i, KEY4_L))
        stats_smem.index(1).store(gl.convert_layout(l_i, KEY4_L))
        gl.thread_barrier()
        mbarrier.arrive(done)

        HL: gl.constexpr = gl.SliceLayout(1, S_L)
        head_ok = gl.convert_layout(heads < H, HL)
        sink = gl.load(sink_ptr + gl.convert_layout(heads, HL), mask=head_ok, other=0.0) * 1.4426950408889634
        m_use = gl.where(m_i == float("-inf"), 0.0, m_i)
        denom = l_i + gl.exp2(sink - m_use)
        gl.store(lse_ptr + t * stride_lt + gl.convert_layout(heads, HL), (m_use + gl.log2(denom)) * 0.6931471805599453,
                 mask=head_ok)
        _store_group(o0, 1.0 / denom, o_ptr, t * stride_ot + heads * stride_oh, heads < H, 0)

    @gluon.jit
    def _value_partition(k1, k2, k3, p_smem, alpha_smem, stats_smem, p_ready, kv_free, done, t, hb, H, pos,
                         c_begin, c_end, sink_ptr, inv_freq_ptr, o_ptr, stride_ot, stride_oh):
        """The value warpgroup: per chunk O[:, 256:512] = O·α + P·K[:, 256:512] once the score warpgroup's P is
        in (``p_ready``), then its buffers released (``kv_free``); at the end its half of the output, the rope
        dims rotated back."""
        o1 = gl.zeros([BH, 128], gl.float32, layout=OB1_L)
        o2 = gl.zeros([BH, 64], gl.float32, layout=OB2_L)
        o3 = gl.zeros([BH, 64], gl.float32, layout=OB2_L)
        for c in range(c_begin, c_end):
            i = c - c_begin
            buf = i % 2
            mbarrier.wait(p_ready.index(buf), (i // 2) & 1)
            alpha = alpha_smem.index(buf).load(KEY4_L)
            o1 = _rescale(o1, alpha)
            o2 = _rescale(o2, alpha)
            o3 = _rescale(o3, alpha)
            o1 = warpgroup_mma(p_smem.index(buf), k1.index(buf), o1, is_async=True)
            o2 = warpgroup_mma(p_smem.index(buf), k2.index(buf), o2, is_async=True)
            o3 = warpgroup_mma(p_smem.index(buf), k3.index(buf), o3, is_async=True)
            o1, o2, o3 = warpgroup_mma_wait(0, deps=[o1, o2, o3])
            gl.thread_barrier()
            mbarrier.arrive(kv_free.index(buf))
        cos, sin = _unrotation(pos, inv_freq_ptr, 4)  # requested before the wait
        heads = hb * BH + gl.arange(0, BH, layout=KEY4_L)
        sink = gl.load(sink_ptr + heads, mask=heads < H, other=0.0) * 1.4426950408889634
        mbarrier.wait(done, 0)
        m_i = stats_smem.index(0).load(KEY4_L)
        l_i = stats_smem.index(1).load(KEY4_L)
        m_use = gl.where(m_i == float("-inf"), 0.0, m_i)
        inv = 1.0 / (l_i + gl.exp2(sink - m_use))
        rows = t * stride_ot + heads * stride_oh
        _store_group(o1, inv, o_ptr, rows, heads < H, 4)
        _store_group(o2, inv, o_ptr, rows, heads < H, 6)
        _store_rope(_rescale(o3, inv).to(gl.bfloat16), o_ptr + t * stride_ot + NOPE_DIM, stride_oh, hb * BH, H,
                    cos, sin)

    @gluon.jit
    def _prefill_kernel(
        q_ptr, stride_qt, stride_qh,  # [T, H, 512] bf16
        kv_new_ptr, stride_kvt,  # [T, 512] bf16
        ring_ptr, stride_ring,  # unused (the ring's rows are in keys_ptr)
        ring_pos_ptr, stride_rpos,  # int32 [slots, W]
        pool_ptr, stride_page,  # unused
        block_tables_ptr, stride_bt,  # unused
        idx_ptr, stride_idx,  # MODE_LIST: int [T, num_compressed] entry indices (−1 = none)
        visible_ptr,  # MODE_ALL: int64 [T] entries visible to each token
        token_request_ptr, positions_ptr, cu_seqlens_ptr, start_pos_ptr, token_slots_ptr,
        sink_ptr, inv_freq_ptr,  # fp32 [H], fp32 [32]
        o_ptr, stride_ot, stride_oh,  # [T, H, 512] bf16
        lse_ptr, stride_lt,  # fp32 [T, H]
        po_ptr, plse_ptr,  # unused (no splits)
        H, num_compressed, chunks_per_split, num_splits, qk_scale,
        keys_ptr, stride_kb, key_entries,  # bf16 [B, WINDOW + key_entries, 512] (sparse_attention.bf16_keys)
        WINDOW: gl.constexpr, RATIO: gl.constexpr, BLOCK_SIZE: gl.constexpr, PAGE_ENTRIES: gl.constexpr,
        MODE: gl.constexpr, SPLIT: gl.constexpr, VALUE_REGS_C: gl.constexpr,
    ):
        """Grid ``(T · ceil(H / 64), 1)``: token ``t`` and head block; the score warpgroup (this partition) and the
        value warpgroup (a worker of ``VALUE_REGS_C`` registers per thread)."""
        VEC_SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        WINDOW_CHUNKS: gl.constexpr = (WINDOW + BN - 1) // BN
        t, hb, split, req, pos, start, first_row, slot = _program_token(
            token_request_ptr, positions_ptr, cu_seqlens_ptr, start_pos_ptr, token_slots_ptr, H, 1)
        q0, q1, q2, q3 = _dim_tiles(BH, 0)
        k0, k1, k2, k3 = _dim_tiles(BN, 2)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BH, BN], TILE_SL)
        alpha_smem = gl.allocate_shared_memory(gl.float32, [2, BH], VEC_SL)
        stats_smem = gl.allocate_shared_memory(gl.float32, [2, BH], VEC_SL)  # final row max, row sum
        valid_smem = gl.allocate_shared_memory(gl.int32, [2, BN], VEC_SL)
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        kv_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for b in gl.static_range(2):
            mbarrier.init(p_ready.index(b), count=1)
            mbarrier.init(kv_free.index(b), count=1)
        mbarrier.init(done, count=1)
        n_comp, c_begin, c_end = _split_chunks(t, 0, visible_ptr, num_compressed, chunks_per_split, WINDOW_CHUNKS,
                                               MODE)
        # The partitions get row pointers and int32 positions (their lookups run in int32).
        ring_pos_row = ring_pos_ptr + slot * stride_rpos
        idx_row = idx_ptr + t * stride_idx
        key_rows = keys_ptr + req * stride_kb
        kv_new_rows = kv_new_ptr + first_row * stride_kvt
        pos = pos.to(gl.int32)
        start = start.to(gl.int32)
        gl.warp_specialize([
            (_score_partition, (q0, q1, q2, q3, k0, k1, k2, k3, p_smem, alpha_smem, stats_smem, valid_smem, p_ready,
                                kv_free, done, t, hb, H, pos, start, n_comp, c_begin, c_end, q_ptr, stride_qt,
                                stride_qh, kv_new_rows, stride_kvt, ring_pos_row, idx_row, key_rows, key_entries,
                                qk_scale, sink_ptr, o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, WINDOW,
                                WINDOW_CHUNKS, MODE)),
            (_value_partition, (k1, k2, k3, p_smem, alpha_smem, stats_smem, p_ready, kv_free, done, t, hb, H, pos,
                                c_begin, c_end, sink_ptr, inv_freq_ptr, o_ptr, stride_ot, stride_oh)),
        ], [4], [VALUE_REGS_C])


def launch(grid: tuple[int, int], args: tuple, geometry: dict, keys: torch.Tensor,
           value_regs: int | None = None) -> None:
    """Launch the kernel for a step without splits (``grid[1] == 1``): ``args`` / ``geometry`` are
    ``sparse_attention_fwd``'s prepared arguments and geometry constexprs, ``keys`` the step's BF16 key rows
    (``sparse_attention.bf16_keys``); ``value_regs`` the value warpgroup's registers per thread (default
    ``VALUE_REGS``, read at each launch)."""
    if grid[1] != 1 or geometry["SPLIT"]:
        raise ValueError(f"the prefill kernel takes no splits (grid {grid})")
    _prefill_kernel[grid](*args, keys, keys.stride(0), keys.shape[1] - geometry["WINDOW"], **geometry,
                          VALUE_REGS_C=VALUE_REGS if value_regs is None else value_regs, num_warps=4)
