"""The pipelined Hopper attention kernel in Gluon: persistent programs of a copy, a score and a value warpgroup.

The op of ``sm90_serial`` — per query token and 64 heads (an *item*), its keys in chunks of 64 (read that module
for the key set and the numerics) — with the work divided between warpgroups instead of every warpgroup doing every
phase, and one program per multiprocessor taking items one after the other (program ``p``: items ``p``,
``p + programs``, …; ``plan.persistent_programs``). Warp specialization, 4 + 4 + 4 warps, the program's chunks
numbered ``g`` across its items:

    copy warpgroup (worker):  per item its metadata and queries (once the previous item's last S is done:
        ``q_free``), then per chunk its keys into key tiles ``g % 2`` (once both compute warpgroups released chunk
        g−2 there: ``kv_free``) → ``kv_ready``: BF16 key rows or the FP8 pages (``sm90_pipelined_copy``).
    score warpgroup (default partition), chunk g:  S = Q·Kᵀ for the whole chunk → the online softmax over whole
        rows → P and α = 2^(m_old − m_new) into shared memory → ``p_ready`` → O[:, 0:256] = O·α + P·K[:, 0:256] →
        ``kv_free``; per item the row maxima and sums for the value warpgroup (``done``), the lse and O[:, 0:256]
    value warpgroup (worker), chunk g:  wait ``p_ready`` → O[:, 256:512] = O·α + P·K[:, 256:512] → ``kv_free``;
        per item O[:, 256:512] with the rope dims rotated back

so the value warpgroup's half of P·V runs while the score warpgroup computes the next S and softmax, the copies run
beside both, and an item's output is written while the next item's queries and first keys come in. The arithmetic
is ``sm90_serial``'s (P rounded to BF16); over BF16 rows also its per-element softmax sums, so the outputs are its
bits; over FP8 pages the sums are per row (the copy warpgroup's registers leave the score warpgroup too few for
per-element ones). Outputs go out in 16-byte stores (``_store_rows``), issued after the loads for the items ahead.

No splits: the persistent programs already spread a step's items over the GPU, and the copy warpgroup's protocol
assumes every item has chunks. Registers per thread: the value warpgroup ``VALUE_REGS`` / ``FP8_VALUE_REGS``, the
copy warpgroup ``PRODUCER_REGS`` / ``FP8_PRODUCER_REGS`` (BF16 rows / FP8 pages), the score warpgroup the rest.
"""

from __future__ import annotations

import torch

from .args import AttentionArgs
from .plan import AttentionPlan
from .sm90_common import _HAVE_GLUON

__all__ = ["FP8_PRODUCER_REGS", "FP8_VALUE_REGS", "PRODUCER_REGS", "VALUE_REGS", "launch"]

#: registers per thread of the value warpgroup (O's second half: 128 of them) and of the copy warpgroup over BF16
#: rows; the score warpgroup gets the rest (read at each launch)
VALUE_REGS = 168
PRODUCER_REGS = 88
#: the same over FP8 pages: the copy warpgroup holds the next chunk's bytes while it dequantizes one (as
#: ``sm90_ws.PRODUCER_REGS``); the score warpgroup keeps row sums instead of per-element ones
FP8_VALUE_REGS = 160
FP8_PRODUCER_REGS = 152

if _HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from .sm90_common import (BH, BN, NOPE_DIM, TILE_SL, _dim_tiles, _masked_scores, _probabilities, _rescale,
                              _running_max)
    from .sm90_output import _store_rope, _unrotation
    from .sm90_pipelined_copy import KEY4_L, _copy_partition, _dequant_partition, _item_chunks

    S_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
    OA_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
    OB1_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16]))
    OB2_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
    # [64 heads, dims] of an output group: 8 consecutive dims per thread (16-byte stores), a warp's 16 heads as in
    # the accumulators (the conversion stays within each warp)
    OUT_L = gl.constexpr(gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0]))

    @gluon.jit
    def _store_rows(o, inv, dst_ptr, stride_oh, hb, H, FIRST: gl.constexpr):
        """``o · inv`` rounded to BF16 (``o``: fp32 accumulator ``[64, W]`` of dims ``64·FIRST …`` of head block
        ``hb``, ``inv`` per head) at ``dst_ptr + h·stride_oh + 64·FIRST + i`` (heads ≥ ``H`` not stored), 16 bytes
        per store: a quarter of the stores the accumulator's own layout takes (``sm90_output._store_group``),
        each sector written whole."""
        val = gl.convert_layout(_rescale(o, inv).to(dst_ptr.dtype.element_ty), OUT_L)
        heads = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, OUT_L))
        cols = FIRST * 64 + gl.arange(0, o.shape[1], layout=gl.SliceLayout(0, OUT_L))
        gl.store(dst_ptr + gl.expand_dims(heads * stride_oh, 1) + gl.expand_dims(cols, 0), val,
                 mask=gl.expand_dims(heads < H, 1))

    @gluon.jit
    def _sink(sink_ptr, hb, H, L: gl.constexpr):
        """The sinks of head block ``hb`` in base 2, fp32 ``[64]`` in layout ``L`` (0 for heads ≥ ``H``)."""
        heads = hb * BH + gl.arange(0, BH, layout=L)
        return gl.load(sink_ptr + heads, mask=heads < H, other=0.0) * 1.4426950408889634

    @gluon.jit
    def _score_partition(q0, q1, q2, q3, k0, k1, k2, k3, p_smem, alpha_smem, stats_smem, valid_smem, kv_ready, kv_free,
                         q_free, p_ready, done, stats_free, items, qk_scale, sink_ptr, o_ptr, stride_ot, stride_oh,
                         lse_ptr, stride_lt, WINDOW_CHUNKS: gl.constexpr, MODE: gl.constexpr,
                         ELEMENT_SUMS: gl.constexpr):
        """The score warpgroup, over the program's items: per chunk S = Q·Kᵀ, the online softmax, P and α for the
        value warpgroup (``p_ready``), O[:, 0:256] = O·α + P·K[:, 0:256], the key tiles released (``kv_free``;
        the queries after an item's last S: ``q_free``); after each item its row maxima and sums for the value
        warpgroup (``done``; the buffer of item i−2's freed by ``stats_free``), the lse and its half of the
        output. The softmax denominators are sums per head and key column (``ELEMENT_SUMS``: the serial kernel's
        order, its bits) or per head."""
        H = items[1]
        first = gl.program_id(0)
        step = gl.num_programs(0)
        HL: gl.constexpr = gl.SliceLayout(1, S_L)
        t, hb, _, _, _, c_begin, c_end = _item_chunks(first, items, WINDOW_CHUNKS, MODE)
        nt, nhb, _, _, _, nc_begin, nc_end = _item_chunks(first + step, items, WINDOW_CHUNKS, MODE)
        sink = _sink(sink_ptr, hb, H, HL)
        g = 0
        for it in range(gl.cdiv(items[0] - first, step)):
            heads = hb * BH + gl.arange(0, BH, layout=HL)
            m_i = gl.full([BH], float("-inf"), gl.float32, layout=HL)
            if ELEMENT_SUMS:  # Σ p per head and key column (as sm90_serial)
                l_acc = gl.zeros([BH, BN], gl.float32, layout=S_L)
            else:
                l_acc = gl.zeros([BH], gl.float32, layout=HL)
            o0 = gl.zeros([BH, 256], gl.float32, layout=OA_L)
            for c in range(c_begin, c_end):
                buf = g % 2
                mbarrier.wait(kv_ready.index(buf), (g // 2) & 1)
                s = _masked_scores(q0, q1, q2, q3, k0.index(buf), k1.index(buf), k2.index(buf), k3.index(buf),
                                   valid_smem.index(buf), qk_scale, S_L)
                m_i, alpha = _running_max(m_i, s)
                o0 = _rescale(o0, alpha)
                p = _probabilities(s, m_i)
                if ELEMENT_SUMS:
                    l_acc = l_acc * gl.expand_dims(alpha, 1) + p
                else:
                    l_acc = l_acc * alpha + gl.sum(p, 1)
                # P (BF16, as SPEC §3 step 5) and α for the value warpgroup; the buffer's last reader (chunk g−2)
                # is done: this chunk's keys were copied in only after that (kv_free).
                p_smem.index(buf).store(p.to(gl.bfloat16))
                alpha_smem.index(buf).store(gl.convert_layout(alpha, KEY4_L))
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(p_ready.index(buf))
                mbarrier.arrive(q_free, pred=c == c_end - 1)  # every S of the item is done
                o0 = warpgroup_mma(p_smem.index(buf), k0.index(buf), o0, is_async=True)
                o0 = warpgroup_mma_wait(0, deps=[o0])
                gl.thread_barrier()
                mbarrier.arrive(kv_free.index(buf))
                g += 1
            mbarrier.arrive(q_free, pred=c_end <= c_begin)  # an item without chunks (none without splits) too

            if ELEMENT_SUMS:
                # The row sums in sm90_serial's order (each of its warpgroups sums 32 key columns, then
                # the two partial sums are added), so that the denominators — and the outputs — are its bits.
                l_i = gl.convert_layout(gl.sum(gl.sum(gl.reshape(l_acc, [BH, 2, BN // 2]), axis=2), axis=1), HL)
            else:
                l_i = l_acc
            par = it % 2
            mbarrier.wait(stats_free.index(par), ((it // 2) & 1) ^ 1)  # the value warpgroup read item it−2's
            stats_smem.index(2 * par).store(gl.convert_layout(m_i, KEY4_L))
            stats_smem.index(2 * par + 1).store(gl.convert_layout(l_i, KEY4_L))
            gl.thread_barrier()
            mbarrier.arrive(done.index(par))
            # The loads for the items ahead before this item's stores (a load issued after them would wait for them).
            nnt, nnhb, _, _, _, nnc_begin, nnc_end = _item_chunks(first + (it + 2) * step, items, WINDOW_CHUNKS,
                                                                   MODE)
            nsink = _sink(sink_ptr, nhb, H, HL)
            m_use = gl.where(m_i == float("-inf"), 0.0, m_i)
            denom = l_i + gl.exp2(sink - m_use)
            gl.store(lse_ptr + t * stride_lt + heads, (m_use + gl.log2(denom)) * 0.6931471805599453, mask=heads < H)
            _store_rows(o0, 1.0 / denom, o_ptr + t * stride_ot, stride_oh, hb, H, 0)
            t, hb, c_begin, c_end, sink = nt, nhb, nc_begin, nc_end, nsink
            nt, nhb, nc_begin, nc_end = nnt, nnhb, nnc_begin, nnc_end

    @gluon.jit
    def _value_partition(k1, k2, k3, p_smem, alpha_smem, stats_smem, p_ready, kv_free, done, stats_free, items,
                         sink_ptr, inv_freq_ptr, o_ptr, stride_ot, stride_oh, WINDOW_CHUNKS: gl.constexpr,
                         MODE: gl.constexpr):
        """The value warpgroup, over the program's items: per chunk O[:, 256:512] = O·α + P·K[:, 256:512] once the
        score warpgroup's P is in (``p_ready``), then the key tiles released (``kv_free``); after each item its
        half of the output, the rope dims rotated back."""
        H = items[1]
        first = gl.program_id(0)
        step = gl.num_programs(0)
        VL: gl.constexpr = gl.SliceLayout(1, OB1_L)  # per head, as the accumulators' rows
        g = 0
        for it in range(gl.cdiv(items[0] - first, step)):
            # The item's metadata in every iteration: carried over from the last one (as the score warpgroup does)
            # the kernel hung with Triton 3.6 wherever items' chunk counts differ.
            t, hb, _, pos, _, c_begin, c_end = _item_chunks(first + it * step, items, WINDOW_CHUNKS, MODE)
            # What the item's output needs besides O, requested while its chunks run.
            cos, sin = _unrotation(pos, inv_freq_ptr, 4)
            sink = _sink(sink_ptr, hb, H, VL)
            o1 = gl.zeros([BH, 128], gl.float32, layout=OB1_L)
            o2 = gl.zeros([BH, 64], gl.float32, layout=OB2_L)
            o3 = gl.zeros([BH, 64], gl.float32, layout=OB2_L)
            for c in range(c_begin, c_end):
                buf = g % 2
                mbarrier.wait(p_ready.index(buf), (g // 2) & 1)
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
                g += 1
            par = it % 2
            mbarrier.wait(done.index(par), (it // 2) & 1)
            m_i = stats_smem.index(2 * par).load(VL)
            l_i = stats_smem.index(2 * par + 1).load(VL)
            gl.thread_barrier()
            mbarrier.arrive(stats_free.index(par))
            m_use = gl.where(m_i == float("-inf"), 0.0, m_i)
            inv = 1.0 / (l_i + gl.exp2(sink - m_use))
            _store_rows(o1, inv, o_ptr + t * stride_ot, stride_oh, hb, H, 4)
            _store_rows(o2, inv, o_ptr + t * stride_ot, stride_oh, hb, H, 6)
            _store_rope(_rescale(o3, inv).to(gl.bfloat16), o_ptr + t * stride_ot + NOPE_DIM, stride_oh, hb * BH, H,
                        cos, sin)

    @gluon.jit
    def _pipelined_kernel(
        q_ptr, stride_qt, stride_qh,  # [T, H, 512] bf16
        kv_new_ptr, stride_kvt,  # [T, 512] bf16
        ring_ptr, stride_ring,  # uint8 [slots, ring_page_bytes] (FP8 pages only)
        ring_pos_ptr, stride_rpos,  # int32 [slots, W]
        pool_ptr, stride_page,  # uint8 [num_blocks, page_bytes] (FP8 pages only)
        block_tables_ptr, stride_bt,  # int32 [B, max_blocks] (FP8 pages only)
        idx_ptr, stride_idx,  # MODE_LIST: int [T, num_compressed] entry indices (−1 = none)
        visible_ptr,  # MODE_ALL: int64 [T] entries visible to each token
        token_request_ptr, positions_ptr, cu_seqlens_ptr, start_pos_ptr, token_slots_ptr,
        sink_ptr, inv_freq_ptr,  # fp32 [H], fp32 [32]
        o_ptr, stride_ot, stride_oh,  # [T, H, 512] bf16
        lse_ptr, stride_lt,  # fp32 [T, H]
        po_ptr, plse_ptr,  # split partials: not used (no splits)
        H, num_compressed, chunks_per_split, num_splits, qk_scale,
        keys_ptr, stride_kb, key_entries,  # bf16 [B, WINDOW + key_entries, 512] (bf16_keys)
        num_items,  # T · ceil(H / 64): (token, head block)
        WINDOW: gl.constexpr, RATIO: gl.constexpr, BLOCK_SIZE: gl.constexpr, PAGE_ENTRIES: gl.constexpr,
        MODE: gl.constexpr, SPLIT: gl.constexpr, KEYS_BF16: gl.constexpr, VALUE_REGS_C: gl.constexpr,
        PRODUCER_REGS_C: gl.constexpr,
    ):
        """Grid ``(programs,)``, persistent: program ``p`` takes items ``p, p + programs, …`` one after the other;
        the score warpgroup (this partition), the value warpgroup and the copy warpgroup (workers of
        ``VALUE_REGS_C`` / ``PRODUCER_REGS_C`` registers per thread), which copies BF16 key rows (``KEYS_BF16``)
        or dequantizes the FP8 pages. No splits (``SPLIT`` false)."""
        gl.static_assert(not SPLIT, "the pipelined kernel takes no splits")
        VEC_SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        WINDOW_CHUNKS: gl.constexpr = (WINDOW + BN - 1) // BN
        q0, q1, q2, q3 = _dim_tiles(BH, 0)
        k0, k1, k2, k3 = _dim_tiles(BN, 2)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BH, BN], TILE_SL)
        alpha_smem = gl.allocate_shared_memory(gl.float32, [2, BH], VEC_SL)
        stats_smem = gl.allocate_shared_memory(gl.float32, [4, BH], VEC_SL)  # per item parity: row max, row sum
        valid_smem = gl.allocate_shared_memory(gl.int32, [2, BN], VEC_SL)
        kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        kv_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        done = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        stats_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for b in gl.static_range(2):
            mbarrier.init(kv_ready.index(b), count=1)
            mbarrier.init(kv_free.index(b), count=2)  # the score and the value warpgroup
            mbarrier.init(p_ready.index(b), count=1)
            mbarrier.init(done.index(b), count=1)
            mbarrier.init(stats_free.index(b), count=1)
        mbarrier.init(q_free, count=1)
        items = (num_items, H, token_request_ptr, positions_ptr, cu_seqlens_ptr, start_pos_ptr, token_slots_ptr,
                 visible_ptr, num_compressed, chunks_per_split, ring_pos_ptr, stride_rpos, idx_ptr, stride_idx,
                 keys_ptr, stride_kb, kv_new_ptr, stride_kvt, num_splits, ring_ptr, stride_ring, block_tables_ptr,
                 stride_bt)
        # The partitions' argument tuples are written out in each call: a tuple bound to a name first loses its
        # constexpr elements (Triton 3.6), and the score warpgroup's ELEMENT_SUMS must stay one.
        if KEYS_BF16:
            gl.warp_specialize([
                (_score_partition, (q0, q1, q2, q3, k0, k1, k2, k3, p_smem, alpha_smem, stats_smem, valid_smem,
                                    kv_ready, kv_free, q_free, p_ready, done, stats_free, items, qk_scale, sink_ptr,
                                    o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, WINDOW_CHUNKS, MODE, True)),
                (_value_partition, (k1, k2, k3, p_smem, alpha_smem, stats_smem, p_ready, kv_free, done, stats_free,
                                    items, sink_ptr, inv_freq_ptr, o_ptr, stride_ot, stride_oh, WINDOW_CHUNKS,
                                    MODE)),
                (_copy_partition, (q0, q1, q2, q3, k0, k1, k2, k3, valid_smem, kv_ready, kv_free, q_free, items,
                                   q_ptr, stride_qt, stride_qh, key_entries, WINDOW, WINDOW_CHUNKS, MODE)),
            ], [4, 4], [VALUE_REGS_C, PRODUCER_REGS_C])
        else:
            scale_smem = gl.allocate_shared_memory(gl.int64, [2, BN], VEC_SL)
            block_smem = gl.allocate_shared_memory(gl.int32, [4, BN], VEC_SL)
            entry_smem = gl.allocate_shared_memory(idx_ptr.dtype.element_ty, [4, BN], VEC_SL)
            gl.warp_specialize([
                (_score_partition, (q0, q1, q2, q3, k0, k1, k2, k3, p_smem, alpha_smem, stats_smem, valid_smem,
                                    kv_ready, kv_free, q_free, p_ready, done, stats_free, items, qk_scale, sink_ptr,
                                    o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, WINDOW_CHUNKS, MODE, False)),
                (_value_partition, (k1, k2, k3, p_smem, alpha_smem, stats_smem, p_ready, kv_free, done, stats_free,
                                    items, sink_ptr, inv_freq_ptr, o_ptr, stride_ot, stride_oh, WINDOW_CHUNKS,
                                    MODE)),
                (_dequant_partition, (q0, q1, q2, q3, k0, k1, k2, k3, valid_smem, scale_smem, block_smem, entry_smem,
                                      kv_ready, kv_free, q_free, items, q_ptr, stride_qt, stride_qh, pool_ptr,
                                      stride_page, WINDOW, RATIO, BLOCK_SIZE, PAGE_ENTRIES, MODE, WINDOW_CHUNKS)),
            ], [4, 4], [VALUE_REGS_C, PRODUCER_REGS_C])


def launch(plan: AttentionPlan, args: AttentionArgs, key_rows: torch.Tensor | None) -> None:
    """Launch the kernel of a ``kernel="gluon_pipelined"`` plan: ``plan.persistent_programs`` programs over the
    step's ``plan.items`` items; ``key_rows`` the step's BF16 key rows (``bf16_keys``; ``keys="bf16"``) or ``None``
    (the FP8 pages are dequantized per chunk)."""
    if plan.items == 0:
        return
    if key_rows is None:
        key_args = (args.q, 0, 0)
        regs = (FP8_VALUE_REGS, FP8_PRODUCER_REGS)
    else:
        key_args = (key_rows, key_rows.stride(0), key_rows.shape[1] - plan.window)
        regs = (VALUE_REGS, PRODUCER_REGS)
    _pipelined_kernel[plan.grid](*args.positional(), *key_args, plan.items, **plan.constexprs,
                                 KEYS_BF16=key_rows is not None, VALUE_REGS_C=regs[0], PRODUCER_REGS_C=regs[1],
                                 num_warps=4)
