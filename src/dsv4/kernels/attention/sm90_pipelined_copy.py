"""The copy warpgroup of the pipelined Hopper attention kernel (``sm90_pipelined``), and the step's items.

A program of the pipelined kernel takes (token, head block) *items* one after the other (``_item_chunks``,
``_item_rows``); its copy warpgroup brings each item's queries and then each chunk's keys into key tiles ``g % 2``
(the program's ``g``-th chunk), from one of two sources:

* BF16 key rows (``_copy_partition``, ``keys="bf16"``): asynchronous copies of the rows ``bf16_keys`` wrote, the
  next chunk's lookup in flight meanwhile;
* the FP8 pages (``_dequant_partition``): each chunk dequantized from registers as ``sm90_ws``'s producer does
  (chunk c+1's bytes requested block by block while chunk c is converted), its lookups running ahead through
  shared memory (c+1's scale words, c+3's block tables, c+4's entries copied asynchronously and read back an
  iteration later — no loaded value carried in registers across the loop) and chunk c+2's rows prefetched into L2.
  Window chunks are looked up only in an item's prologue: ``plan.FP8_MAX_WINDOW``.
"""

from __future__ import annotations

from .sm90_common import _HAVE_GLUON

if _HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

    from .sm90_common import BH, BN, MODE_LIST, NOPE_DIM, _copy_keys, _issue_bf16_chunk, _split_chunks
    from .sm90_ws import (KEY_L, _chunk_address, _chunk_blocks, _chunk_entries, _copy_blocks, _copy_scales,
                          _dequantize_chunk, _request_chunk)

    ROWS_L = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))  # [64, dims]: 16-byte pieces
    KEY4_L = gl.constexpr(gl.SliceLayout(1, ROWS_L))  # [64]: one value per key or head
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
    def _copy_queries(q0, q1, q2, q3, t, hb, items, q_ptr, stride_qt, stride_qh):
        """Start the asynchronous copies of head block ``hb``'s queries of token ``t`` into ``q0 … q3`` (absent
        heads zero-filled; committed with the next group)."""
        heads = hb * BH + gl.arange(0, BH, layout=KEY4_L)
        q_rows = q_ptr + t * stride_qt + heads * stride_qh
        q_ok = gl.expand_dims(heads < items[1], 1)
        _copy_keys(q_rows, q_ok, q0, 0, 256)
        _copy_keys(q_rows, q_ok, q1, 256, 128)
        _copy_keys(q_rows, q_ok, q2, 384, 64)
        _copy_keys(q_rows, q_ok, q3, NOPE_DIM, 64)

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
                           PAGE_ENTRIES: gl.constexpr, MODE: gl.constexpr, WINDOW_CHUNKS: gl.constexpr):
        """The copy warpgroup over the FP8 pages, over the program's items: each item's queries (after
        ``q_free``, as ``_copy_partition``), then its chunks looked up, loaded and dequantized into key tiles
        ``g % 2`` (after ``kv_free``) → ``kv_ready``. While chunk c is dequantized (as
        ``sm90_ws``'s producer: each 64-dim block's registers refilled with chunk c+1's), the
        lookups run ahead through shared memory — chunk c+1's scale words, c+3's block tables and c+4's entries
        copied asynchronously into ``scale_smem`` (2 slots) / ``block_smem`` / ``entry_smem`` (4 slots each,
        by ``g``), read back an iteration later: no loaded value is carried in registers across the loop, whose
        end would wait for it — and chunk c+2's rows are prefetched into L2."""
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
            _prefetch_rows(_chunk_address(c_begin + 1, c_begin + 1 < c_end, e1, b1, pos, start, ring_row, pool_ptr,
                                          stride_page, WINDOW, RATIO, BLOCK_SIZE, PAGE_ENTRIES, WINDOW_CHUNKS))
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
                e2 = _read_entries(c + 2, entry_smem.index((g + 2) % 4), n_comp, WINDOW_CHUNKS, MODE)
                _prefetch_rows(_chunk_address(c + 2, c + 2 < c_end, e2, block_smem.index((g + 2) % 4).load(KEY_L), pos,
                                              start, ring_row, pool_ptr, stride_page, WINDOW, RATIO, BLOCK_SIZE,
                                              PAGE_ENTRIES, WINDOW_CHUNKS))
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
