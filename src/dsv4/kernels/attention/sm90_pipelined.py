"""Sparse attention in Gluon for Hopper (sm_90): persistent programs of a copy, a score and a value warpgroup.

The op of ``sparse_attention_sm90`` — per query token and 64 heads (an *item*), its keys in chunks of 64; read
that module for the key set and the numerics — with the work divided between warpgroups
instead of every warpgroup doing every phase, and one program per SM taking items one after the other (program
``p``: items ``p``, ``p + programs``, …). Warp specialization, 4 + 4 + 4 warps, the program's chunks numbered ``g``
across its items:

    copy warpgroup (worker):  per item its metadata and queries (once the previous item's last S is done:
        ``q_free``), then per chunk its keys into key tiles ``g % 2`` (once both compute warpgroups released chunk
        g−2 there: ``kv_free``) → ``kv_ready``. Two sources (``KEYS_BF16``):
        - BF16 key rows (prefill chunks: the step's keys dequantized once, ``sparse_attention.bf16_keys``):
          ``_copy_partition`` copies them asynchronously, the next chunk's lookup in flight meanwhile;
        - the FP8 pages (decode): ``_dequant_partition`` dequantizes each chunk from registers as
          ``sparse_attention_sm90_ws``'s producer does (chunk c+1's bytes requested block by block while chunk c
          is converted), its lookups running ahead through shared memory (c+1's scale words, c+3's block tables,
          c+4's entries copied asynchronously, read back an iteration later — no loaded value carried in
          registers across the loop) and chunk c+2's rows prefetched into L2 (``FP8_PREFETCH_L2``).
    score warpgroup (default partition), chunk g:  S = Q·Kᵀ for the whole chunk (m64n64: Q read once) → the online
        softmax over whole rows → P and α = 2^(m_old − m_new) into shared memory → ``p_ready`` → O[:, 0:256] =
        O·α + P·K[:, 0:256] → ``kv_free``; per item the row maxima and sums for the value warpgroup (``done``),
        the lse and O[:, 0:256]
    value warpgroup (worker), chunk g:  wait ``p_ready`` → O[:, 256:512] = O·α + P·K[:, 256:512] → ``kv_free``;
        per item O[:, 256:512] with the rope dims rotated back

so the value warpgroup's half of P·V runs while the score warpgroup computes the next S and softmax, the copies,
dequantization and lookups run beside both, and an item's output is written while the next item's queries and
first keys come in. Shared memory: Q, two buffers of key tiles, P, α and the output conversion (221,344 of 232,448
bytes over BF16 rows; 224,352 over FP8 pages with the lookup slots). The arithmetic is ``sparse_attention_sm90``'s
(the same MMA reduction per element, P rounded to BF16); over BF16 rows also its per-element softmax sums, so the
outputs are its bits (GPU test); over FP8 pages the sums are per row (the copy warpgroup's registers leave the
score warpgroup too few for per-element ones), within rounding of the others. The outputs go out in 16-byte stores
(``_store_rows``), issued after the loads for the items ahead (H200, Flash prefill of 4K queries: 808 → 731 µs
against 4-byte stores in the accumulators' layout with loads behind them).

No splits: the persistent programs already spread a step's items over the GPU, and a split without chunks breaks
the copy warpgroup's protocol (``launch`` refuses a grid with splits). Measured on 2026-11-26 (H100) while the
kernel took splits: with empty splits it hung, and with that fixed its queries' copy for an empty split (masked,
so zero-filling) overwrote the queries of the item still running (wrong outputs over BF16 rows); at the shapes
where splits apply it was slower than the serial and warp-specialized kernels anyway (``benchmarks/RESULTS.md``).

Registers per thread: the score warpgroup holds S, the softmax sums and O's first half (the rest of the 64K), the
value warpgroup O's second half (``VALUE_REGS`` / ``FP8_VALUE_REGS``), the copy warpgroup addresses
(``PRODUCER_REGS``) or also the next chunk's bytes (``FP8_PRODUCER_REGS``). Where the time goes over FP8 pages
(ncu, H200, Pro CSA B=64): the score warpgroup is the critical path (the value warpgroup waits on ``p_ready`` most
of its time), itself waiting on ``kv_ready`` about a quarter of its time; see ``benchmarks/RESULTS.md``. Needs a
CUDA device of compute capability 9.x; no interpreter path.
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

    from .sm90_serial import (TILE_SL, _copy_keys, _dim_tiles, _issue_bf16_chunk, _masked_scores,
                                        _probabilities, _rescale, _running_max, _split_chunks, _store_rope,
                                        _unrotation)
    from .sm90_ws import (KEY_L, _chunk_address, _chunk_blocks, _chunk_entries, _copy_blocks,
                                           _copy_scales, _dequantize_chunk, _request_chunk)

    _HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    _HAVE_GLUON = False

__all__ = ["FP8_MAX_WINDOW", "FP8_PRODUCER_REGS", "FP8_VALUE_REGS", "PRODUCER_REGS", "VALUE_REGS", "launch"]

BLOCK_H = 64  # heads per item: the wgmma M
BLOCK_N = 64  # keys per chunk
#: registers per thread of the value warpgroup (O's second half: 128 of them) and of the copy warpgroup; the score
#: warpgroup gets the rest
VALUE_REGS = 168
PRODUCER_REGS = 88
#: the same over FP8 pages: the copy warpgroup holds the next chunk's bytes while it dequantizes one (as
#: ``sparse_attention_sm90_ws.PRODUCER_REGS``); the score warpgroup keeps row sums instead of per-element ones
FP8_VALUE_REGS = 160
FP8_PRODUCER_REGS = 152
#: over FP8 pages, prefetch each chunk's rows into L2 two chunks ahead
FP8_PREFETCH_L2 = True
#: the longest window the FP8 path takes: its copy warpgroup looks up window chunks only in an item's prologue
#: (its first four chunks); later chunks' entries come from the entry list or the visible count
FP8_MAX_WINDOW = 4 * BLOCK_N

if _HAVE_GLUON:
    BH = gl.constexpr(BLOCK_H)
    BN = gl.constexpr(BLOCK_N)
    NOPE_DIM = gl.constexpr(448)
    ROWS_L = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))  # [64, dims]: 16-byte pieces
    KEY4_L = gl.constexpr(gl.SliceLayout(1, ROWS_L))  # [64]: one value per key or head
    MODE_LIST = gl.constexpr(1)
    S_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
    OA_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
    OB1_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16]))
    # [64 heads, dims] of an output group: 8 consecutive dims per thread (16-byte stores), a warp's 16 heads as in
    # the accumulators (the conversion stays within each warp)
    OUT_L = gl.constexpr(gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0]))
    #: ``prefetch.global.L2`` of the line holding ``$1`` where ``$2`` is nonzero (``$0``: unused)
    PREFETCH_LINE_PTX = gl.constexpr("""
        {
        .reg .pred p;
        setp.ne.b32 p, $2, 0;
        @p prefetch.global.L2 [$1];
        mov.u32 $0, 0;
        }
        """)
    # [64 rows, 2, 4] over the copy warpgroup: rows as its KEY_L, 8 points per row (the L2 prefetches)
    PF3_L = gl.constexpr(gl.BlockedLayout([1, 1, 1], [8, 1, 4], [4, 1, 1], [2, 1, 0]))
    OB2_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))

    @gluon.jit
    def _entries(c, pos, start, n_comp, ring_pos_row, idx_row, WINDOW: gl.constexpr, WINDOW_CHUNKS: gl.constexpr,
                 MODE: gl.constexpr):
        """Chunk ``c``'s lookup: int32 ``[64]`` the position each window slot holds (``ring_pos_row``: the token's
        ring), or each compressed key's entry index (``idx_row``: its list; −1 = none). Both loads masked instead
        of a branch (Triton 3.6 does not lower loads on both sides of a branch inside a warp-specialized
        partition)."""
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
    def _store_rows(o, inv, dst_ptr, stride_oh, hb, H, FIRST: gl.constexpr):
        """``o · inv`` rounded to BF16 (``o``: fp32 accumulator ``[64, W]`` of dims ``64·FIRST …`` of head block
        ``hb``, ``inv`` per head) at ``dst_ptr + h·stride_oh + 64·FIRST + i`` (heads ≥ ``H`` not stored), 16 bytes
        per store: a quarter of the stores the accumulator's own layout takes (``sparse_attention_sm90.
        _store_group``), each sector written whole."""
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
    def _item_chunks(item, items, WINDOW_CHUNKS: gl.constexpr, MODE: gl.constexpr):
        """Work item ``item`` ((token · head blocks + head block) · splits + split; here 1 split) of the
        step (``items``: its metadata, as ``_pipelined_kernel`` bundles it): ``(t, head block, split, position,
        compressed keys, first chunk, end chunk)``; an item from ``num_items`` on has no chunks."""
        num_items = items[0]
        H = items[1]
        num_splits = items[18]
        head_blocks = gl.cdiv(H, BH)
        at = gl.minimum(item, num_items - 1)
        query = at // num_splits
        split = at % num_splits
        t = (query // head_blocks).to(gl.int64)
        n_comp, c_begin, c_end = _split_chunks(t, split, items[7], items[8], items[9], WINDOW_CHUNKS, MODE)
        c_end = gl.where(item < num_items, gl.maximum(c_end, c_begin), c_begin)
        return (t, query % head_blocks, split, gl.load(items[3] + t).to(gl.int32), n_comp, c_begin, c_end)

    @gluon.jit
    def _item_rows(t, items):
        """Where token ``t``'s keys are looked up: ``(its request, its ring slot, its request's first position this
        step, its ring positions, its entry list, its request's first kv_new row)``, request and slot int64, the
        position int32, rows as pointers."""
        req = gl.load(items[2] + t).to(gl.int64)
        slot = gl.load(items[6] + t).to(gl.int64)
        return (req, slot, gl.load(items[5] + req).to(gl.int32), items[10] + slot * items[11],
                items[12] + t * items[13], items[16] + gl.load(items[4] + req).to(gl.int64) * items[17])

    @gluon.jit
    def _copy_queries(q0, q1, q2, q3, t, hb, items, q_ptr, stride_qt, stride_qh):
        """Start the asynchronous copies of head block ``hb``'s queries of token ``t`` into ``q0 … q3`` (absent
        heads zero-filled; committed with the next group)."""
        heads = hb * BH + gl.arange(0, BH, layout=KEY4_L)
        q_rows = q_ptr + t * stride_qt + heads * stride_qh
        q_ok = gl.expand_dims(heads < items[1], 1)
        _copy_keys(q_rows, q_ok, q0, 0, 256)
        _copy_keys(q_rows, q_ok, q1, 256, 128)
        _copy_keys(q_rows, q_ok, q2, 384, 64)
        _copy_keys(q_rows, q_ok, q3, 448, 64)

    @gluon.jit
    def _copy_partition(q0, q1, q2, q3, k0, k1, k2, k3, valid_smem, kv_ready, kv_free, q_free, items, q_ptr,
                        stride_qt, stride_qh, key_entries, WINDOW: gl.constexpr, WINDOW_CHUNKS: gl.constexpr,
                        MODE: gl.constexpr):
        """The copy warpgroup over BF16 key rows, over the program's items: each item's queries (once the score
        warpgroup's last S of the item before is done: ``q_free``), then its chunks' keys, each into key tiles
        ``g % 2`` (the program's ``g``-th chunk) once both compute warpgroups are done with chunk g−2 there
        (``kv_free``), announced by ``kv_ready``. The next chunk's lookup is in flight while a chunk's copies
        land."""
        stride_kvt = items[17]
        first = gl.program_id(0)
        step = gl.num_programs(0)
        g = 0
        for it in range(gl.cdiv(items[0] - first, step)):
            t, hb, _, pos, n_comp, c_begin, c_end = _item_chunks(first + it * step, items, WINDOW_CHUNKS, MODE)
            req, _, start, ring_pos_row, idx_row, kv_new_rows = _item_rows(t, items)
            key_rows = items[14] + req * items[15]  # the request's BF16 key rows
            raw = _entries(c_begin, pos, start, n_comp, ring_pos_row, idx_row, WINDOW, WINDOW_CHUNKS, MODE)
            mbarrier.wait(q_free, (it & 1) ^ 1)  # the first item passes
            _copy_queries(q0, q1, q2, q3, t, hb, items, q_ptr, stride_qt, stride_qh)  # committed with chunk 0's
            for c in range(c_begin, c_end):
                buf = g % 2
                mbarrier.wait(kv_free.index(buf), ((g // 2) & 1) ^ 1)  # the first use of each buffer passes
                _issue_bf16_chunk(c, True, raw, buf, pos, start, key_rows, key_entries, kv_new_rows, stride_kvt,
                                  k0, k1, k2, k3, valid_smem, WINDOW, WINDOW_CHUNKS, ROWS_L)
                raw = _entries(c + 1, pos, start, n_comp, ring_pos_row, idx_row, WINDOW, WINDOW_CHUNKS, MODE)
                async_copy.wait_group(0)
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(kv_ready.index(buf))
                g += 1

    @gluon.jit
    def _copy_entries(c, dst, n_comp, idx_row, WINDOW_CHUNKS: gl.constexpr, MODE: gl.constexpr):
        """Chunk ``c``'s entry indices (``c`` past the window) into ``dst`` (``[64]``, shared memory, the entry
        list's dtype): ``MODE_LIST`` an asynchronous copy of the token's list (committed with the next group;
        keys past the list zero-filled, made −1 by ``_read_entries``), else stored as computed (no load)."""
        j = (c - WINDOW_CHUNKS) * BN + gl.arange(0, BN, layout=KEY_L)
        if MODE == MODE_LIST:
            async_copy.async_copy_global_to_shared(dst, idx_row + gl.maximum(j, 0), mask=(j >= 0) & (j < n_comp))
        else:
            dst.store(gl.where((j >= 0) & (j < n_comp), j, -1).to(dst.dtype))

    @gluon.jit
    def _read_entries(c, src, n_comp, WINDOW_CHUNKS: gl.constexpr, MODE: gl.constexpr):
        """Chunk ``c``'s lookup from ``src`` (``_copy_entries``, or stored as ``_chunk_entries`` computed it): int32
        ``[64]``, −1 = none."""
        raw = src.load(KEY_L).to(gl.int32)
        if MODE == MODE_LIST:
            j = (c - WINDOW_CHUNKS) * BN + gl.arange(0, BN, layout=KEY_L)
            raw = gl.where((c < WINDOW_CHUNKS) | (j < n_comp), raw, -1)
        return raw

    @gluon.jit
    def _prefetch_rows(address):
        """Ask L2 for the 576 data bytes of each key of a chunk (``_chunk_address``; keys not read: nothing): eight
        points 80 bytes apart per row, so every 128-byte line it spans (``prefetch.global.L2``, no registers held):
        its register loads, a chunk later, then hit L2."""
        words, rows, ok, scale_ptrs, valid = address
        blk = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, PF3_L)))
        col = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, PF3_L)))
        at = gl.expand_dims(gl.expand_dims(blk * 4, 0), 2) + gl.expand_dims(gl.expand_dims(col, 0), 1)
        rows3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(rows, gl.SliceLayout(1, gl.SliceLayout(2, PF3_L))),
                                              1), 2)
        ok3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(ok, gl.SliceLayout(1, gl.SliceLayout(2, PF3_L))),
                                            1), 2)
        ptrs, ok3 = gl.broadcast(words + rows3 + at * 20, ok3)
        gl.inline_asm_elementwise(PREFETCH_LINE_PTX, "=r,l,r", [ptrs, ok3.to(gl.int32)], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _dequant_partition(q0, q1, q2, q3, k0, k1, k2, k3, valid_smem, scale_smem, block_smem, entry_smem, kv_ready,
                           kv_free, q_free, items, q_ptr, stride_qt, stride_qh, pool_ptr, stride_page,
                           WINDOW: gl.constexpr, RATIO: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                           PAGE_ENTRIES: gl.constexpr, MODE: gl.constexpr, WINDOW_CHUNKS: gl.constexpr,
                           PREFETCH: gl.constexpr):
        """The copy warpgroup over the FP8 pages, over the program's items: each item's queries (after
        ``q_free``, as ``_copy_partition``), then its chunks looked up, loaded and dequantized into key tiles
        ``g % 2`` (after ``kv_free``) → ``kv_ready``. While chunk c is dequantized (as
        ``sparse_attention_sm90_ws``'s producer: each 64-dim block's registers refilled with chunk c+1's), the
        lookups run ahead through shared memory — chunk c+1's scale words, c+3's block tables and c+4's entries
        copied asynchronously into ``scale_smem`` (2 slots) / ``block_smem`` / ``entry_smem`` (4 slots each,
        by ``g``), read back an iteration later: no loaded value is carried in registers across the loop, whose
        end would wait for it — and (``PREFETCH``) chunk c+2's rows are prefetched into L2."""
        gl.static_assert(WINDOW_CHUNKS <= 4, "window chunks are looked up in the item's prologue only")
        kv_row_words = items[17] // 2
        first = gl.program_id(0)
        step = gl.num_programs(0)
        g = 0
        for it in range(gl.cdiv(items[0] - first, step)):
            t, hb, _, pos, n_comp, c_begin, c_end = _item_chunks(first + it * step, items, WINDOW_CHUNKS, MODE)
            req, slot, start, ring_pos_row, idx_row, kv_new_row = _item_rows(t, items)
            ring_row = items[19] + slot * items[20]  # the token's ring page
            bt_row = items[21] + req * items[22]  # its request's block table
            kv_new_words = kv_new_row.to(gl.pointer_type(gl.int32))
            e0 = _chunk_entries(c_begin, pos, start, n_comp, ring_pos_row, idx_row, WINDOW, WINDOW_CHUNKS, MODE)
            e1 = _chunk_entries(c_begin + 1, pos, start, n_comp, ring_pos_row, idx_row, WINDOW, WINDOW_CHUNKS,
                                MODE)
            e2 = _chunk_entries(c_begin + 2, pos, start, n_comp, ring_pos_row, idx_row, WINDOW, WINDOW_CHUNKS,
                                MODE)
            e3 = _chunk_entries(c_begin + 3, pos, start, n_comp, ring_pos_row, idx_row, WINDOW, WINDOW_CHUNKS,
                                MODE)
            b0 = _chunk_blocks(c_begin, e0, bt_row, RATIO, BLOCK_SIZE, WINDOW_CHUNKS)
            b1 = _chunk_blocks(c_begin + 1, e1, bt_row, RATIO, BLOCK_SIZE, WINDOW_CHUNKS)
            b2 = _chunk_blocks(c_begin + 2, e2, bt_row, RATIO, BLOCK_SIZE, WINDOW_CHUNKS)
            # The item before's last copies into the slots have landed (and every thread is done reading them).
            async_copy.wait_group(0)
            gl.thread_barrier()
            entry_smem.index((g + 1) % 4).store(e1.to(entry_smem.dtype))
            entry_smem.index((g + 2) % 4).store(e2.to(entry_smem.dtype))
            entry_smem.index((g + 3) % 4).store(e3.to(entry_smem.dtype))
            block_smem.index((g + 1) % 4).store(b1)
            block_smem.index((g + 2) % 4).store(b2)
            mbarrier.wait(q_free, (it & 1) ^ 1)  # the first item passes
            _copy_queries(q0, q1, q2, q3, t, hb, items, q_ptr, stride_qt, stride_qh)  # committed with the scales
            head = _chunk_address(c_begin, c_begin < c_end, e0, b0, pos, start, ring_row, pool_ptr, stride_page,
                                  WINDOW, RATIO, BLOCK_SIZE, PAGE_ENTRIES, WINDOW_CHUNKS)
            _copy_scales(head, scale_smem.index(g % 2))
            chunk = _request_chunk(head)
            if PREFETCH:
                _prefetch_rows(_chunk_address(c_begin + 1, c_begin + 1 < c_end, e1, b1, pos, start, ring_row,
                                              pool_ptr, stride_page, WINDOW, RATIO, BLOCK_SIZE, PAGE_ENTRIES,
                                              WINDOW_CHUNKS))
            for c in range(c_begin, c_end):
                buf = g % 2
                mbarrier.wait(kv_free.index(buf), ((g // 2) & 1) ^ 1)  # the first use of each buffer passes
                # What was copied an iteration ago has landed; every thread's reads of the slots written below are
                # done.
                async_copy.wait_group(0)
                gl.thread_barrier()
                scales = scale_smem.index(buf).load(KEY_L)
                e1 = _read_entries(c + 1, entry_smem.index((g + 1) % 4), n_comp, WINDOW_CHUNKS, MODE)
                following = _chunk_address(c + 1, c + 1 < c_end, e1, block_smem.index((g + 1) % 4).load(KEY_L), pos,
                                           start, ring_row, pool_ptr, stride_page, WINDOW, RATIO, BLOCK_SIZE,
                                           PAGE_ENTRIES, WINDOW_CHUNKS)
                _copy_scales(following, scale_smem.index(1 - buf))
                if PREFETCH:
                    e2 = _read_entries(c + 2, entry_smem.index((g + 2) % 4), n_comp, WINDOW_CHUNKS, MODE)
                    _prefetch_rows(_chunk_address(c + 2, c + 2 < c_end, e2, block_smem.index((g + 2) % 4).load(KEY_L),
                                                  pos, start, ring_row, pool_ptr, stride_page, WINDOW, RATIO,
                                                  BLOCK_SIZE, PAGE_ENTRIES, WINDOW_CHUNKS))
                e3 = _read_entries(c + 3, entry_smem.index((g + 3) % 4), n_comp, WINDOW_CHUNKS, MODE)
                _copy_entries(c + 4, entry_smem.index(g % 4), n_comp, idx_row, WINDOW_CHUNKS, MODE)
                _copy_blocks(c + 3, e3, bt_row, block_smem.index((g + 3) % 4), RATIO, BLOCK_SIZE, WINDOW_CHUNKS)
                valid_smem.index(buf).store(chunk[8].to(gl.int32))
                chunk = _dequantize_chunk(c, chunk, scales, following, pos, start, kv_new_words, kv_row_words,
                                          k0.index(buf), k1.index(buf), k2.index(buf), k3.index(buf), WINDOW,
                                          WINDOW_CHUNKS)
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(kv_ready.index(buf))
                g += 1

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
            if ELEMENT_SUMS:  # Σ p per head and key column (as sparse_attention_sm90)
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
                # The row sums in sparse_attention_sm90's order (each of its warpgroups sums 32 key columns, then
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
        keys_ptr, stride_kb, key_entries,  # bf16 [B, WINDOW + key_entries, 512] (sparse_attention.bf16_keys)
        num_items,  # T · ceil(H / 64): (token, head block)
        WINDOW: gl.constexpr, RATIO: gl.constexpr, BLOCK_SIZE: gl.constexpr, PAGE_ENTRIES: gl.constexpr,
        MODE: gl.constexpr, SPLIT: gl.constexpr, KEYS_BF16: gl.constexpr, VALUE_REGS_C: gl.constexpr,
        PRODUCER_REGS_C: gl.constexpr, PREFETCH_L2: gl.constexpr,
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
                                      stride_page, WINDOW, RATIO, BLOCK_SIZE, PAGE_ENTRIES, MODE, WINDOW_CHUNKS,
                                      PREFETCH_L2)),
            ], [4, 4], [VALUE_REGS_C, PRODUCER_REGS_C])


def launch(grid: tuple[int, int], args: tuple, geometry: dict, keys: torch.Tensor | None, sms: int,
           value_regs: int | None = None, producer_regs: int | None = None) -> None:
    """Launch the kernel for a step's ``grid`` = (tokens · head blocks, 1) of items as ``min(items, sms)``
    persistent programs: ``args`` / ``geometry`` are ``sparse_attention_fwd``'s prepared arguments and geometry
    constexprs, ``keys`` the step's BF16 key rows (``sparse_attention.bf16_keys``) or ``None`` (the FP8 pages are
    dequantized per chunk), ``sms`` the device's multiprocessors (one program each: its shared memory takes an
    SM); ``value_regs`` the value warpgroup's registers per thread, ``producer_regs`` the copy warpgroup's
    (defaults ``VALUE_REGS`` / ``PRODUCER_REGS`` for BF16 rows, ``FP8_VALUE_REGS`` / ``FP8_PRODUCER_REGS`` for
    FP8 pages; read at each launch)."""
    if grid[1] != 1:
        raise ValueError(f"the pipelined kernel takes no splits (got {grid[1]}): its persistent programs share the "
                         "step's items")
    items = grid[0]
    if keys is None and geometry["WINDOW"] > FP8_MAX_WINDOW:
        raise ValueError(f"the pipelined kernel reads FP8 pages for windows of at most {FP8_MAX_WINDOW} keys "
                         f"(got {geometry['WINDOW']}): use keys='bf16' or another impl")
    if items == 0:
        return
    if keys is None:
        key_args = (args[0], 0, 0)
        regs = (FP8_VALUE_REGS, FP8_PRODUCER_REGS)
    else:
        key_args = (keys, keys.stride(0), keys.shape[1] - geometry["WINDOW"])
        regs = (VALUE_REGS, PRODUCER_REGS)
    _pipelined_kernel[(min(items, sms),)](*args, *key_args, items, **geometry, KEYS_BF16=keys is not None,
                                          PREFETCH_L2=FP8_PREFETCH_L2,
                                          VALUE_REGS_C=regs[0] if value_regs is None else value_regs,
                                          PRODUCER_REGS_C=regs[1] if producer_regs is None else producer_regs,
                                          num_warps=4)
