"""Index scores over paged MXFP4 keys, written in Gluon for Hopper (sm_90): decode steps and prefill chunks.

Same semantics and arguments as ``scores._scores_kernel`` for MXFP4 keys in pages holding a multiple of 64 entries
(block size 256 with ratio 4), and the same numerics (``fp8_operands``: E2M1 → E4M3 exactly in registers, each
block's power-of-two scale folded into its bytes relative to the key's largest block, the key scale applied after
the head sum). What differs is the data path: nothing passes through shared memory but the query operand, loaded
once.

* A thread's share of a key tile is exactly its registers of the FP8 ``wgmma`` A operand. Lane ``4g + j`` of warp
  ``w`` handles keys ``16w + g`` and ``16w + g + 8`` and, of each, packed bytes ``16j … 16j + 15`` — block ``j``,
  one 16-byte load per key, both keys from one address. The MMA's reduction order over channels is free, so its K
  index is defined to be where the conversion leaves each channel (``κ = 32s + 16·half + 4j + r`` ↔ channel
  ``32j + 8s + 4·half + r``; the query operand is laid out to match), and the converted bytes *are* the operand: no
  layout change.
* Each thread needs one block's lookup tables per key (its own ``j``) and the key's largest block exponent, from
  the key's 4-byte scale word, loaded by the thread itself.
* Codes are carried as int32 words and each converted operand is used in the iteration that makes it: byte-typed
  tensors carried across iterations would be split into one register per byte.

Queries per program (``QT``, ``scores_plan.sm90_queries_per_program``). Single-token decode runs one query against
its heads (``N = HP``) in a software pipeline, all in registers, unrolled by two (``_decode_tiles``): tile ``i`` is
converted and its MMA started (asynchronous ``wgmma``); tile ``i + 2``'s codes are requested into the registers tile
``i``'s leave; while the MMA runs, tile ``i − 1``'s head sum (relu as ``x + |x|`` on the FMA pipe) reduces within
each quad of lanes and its scores are stored straight from the accumulator's layout. Multi-token steps — prefill
chunks, 2-4-token decodes — score ``QT`` queries of a request per program (``N = QT · HP``; the key tile converted
once for all, the head sums per query from the accumulator's column groups, each query's scores stored below its own
visible count): there one accumulator is live, each tile's MMA awaited before its head sum (``_chunk_tiles``), and
two programs per SM overlap each other's MMA and head sums. The register cap per ``QT`` is the plan's
(``scores_plan.sm90_register_cap``).

The kernel is bound by instruction issue and latency rather than bytes (see benchmarks/RESULTS.md, "Indexer scores:
each tile's page looked up two tiles ahead; what ptxas does with the loop").
"""

from __future__ import annotations

import torch

from .. import ptx
from ..device import has_gluon
from .scores_plan import SM90_BLOCK_N, ScoresPlan

__all__ = ["launch"]

if has_gluon():  # Gluon ships with Triton >= 3.4; the plan picks this kernel only where it runs (``device.is_sm90``)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

    BN = gl.constexpr(SM90_BLOCK_N)
    # A thread's codes of its two keys (16 contiguous, aligned bytes each, the second key 8 rows = 512 bytes after
    # the first) as two vector loads from one address (``gl.load`` does not vectorise over this layout, and one
    # address per key costs a 64-bit add each). Read-only path (the pool does not change in a step), not kept in
    # L1: each code is read once. Unpredicated: every tile lies in an allocated page (``_request_tile_in``).
    LOAD_KEY_PAIR_PTX = gl.constexpr("""
        ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [$8];
        ld.global.nc.L1::no_allocate.v4.b32 {$4, $5, $6, $7}, [$8+512];""")
    # A thread's scores of its two keys (8 apart) from one address: ``$2`` the first key's, ``$4`` / ``$5`` the
    # values (BITS wide, zero-extended to 32 bits), stored where the keys' indices ``$6`` / ``$7`` are below the
    # visible count ``$8``.
    _STORE_PAIR = """{ .reg .pred p, q; .reg .bBITS x, y;
        setp.lt.s32 p, $6, $8; setp.lt.s32 q, $7, $9;
        CVT
        @p st.global.bBITS [$2], x;
        @q st.global.bBITS [$2+STEP], y;
        mov.b32 $0, 0; mov.b32 $1, 0; }"""
    STORE_PAIR_B16_PTX = gl.constexpr(_STORE_PAIR.replace("BITS", "16").replace("STEP", "16").replace(
        "CVT", "cvt.u16.u32 x, $4; cvt.u16.u32 y, $5;"))
    STORE_PAIR_B32_PTX = gl.constexpr(_STORE_PAIR.replace("BITS", "32").replace("STEP", "32").replace(
        "CVT", "mov.b32 x, $4; mov.b32 y, $5;"))
    # the key conversion with int32 words as its packed operand: $2…$5 the word (four copies), tables $6 / $10
    UNPACK_WORD_PTX = gl.constexpr(ptx.unpack_keys_ptx("$6", "$10"))
    E4M3_LO = gl.constexpr(ptx.E4M3_TABLE_LO)
    E4M3_HI = gl.constexpr(ptx.E4M3_TABLE_HI)

    # A key tile's packed codes as [64 keys, 4 blocks j, 4 words s, 4 bytes r]: register bits = r, s and key bit 3,
    # lane bits = j and key bits 0-2, warp bits = key bits 4-5 — the FP8 wgmma A-operand's placement of rows and
    # K indices (module docstring). The codes are loaded and carried as int32 words ([64, 4, 4], the slice without
    # r: a 16-byte load per key and thread) and only broadcast over r for the conversion, whose packed operand is
    # then that word itself (byte tensors carried across iterations would be split into one register per byte).
    CODES_L = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 1, 0], [0, 0, 2, 0], [8, 0, 0, 0]],
        lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]], block_bases=[], shape=[64, 4, 4, 4]))
    WORDS_L = gl.constexpr(gl.SliceLayout(3, CODES_L))  # [64 keys, 4 blocks, 4 words] int32
    BLK_L = gl.constexpr(gl.SliceLayout(2, WORDS_L))  # [64 keys, 4 blocks]: a thread's own block of its two keys
    ROW_L = gl.constexpr(gl.SliceLayout(1, BLK_L))  # [64 keys]: replicated over the four lanes of a quad

    @gluon.jit
    def _load_tile(pages_ptr, page_bytes, page, slot0, ENTRIES: gl.constexpr):
        """Load one tile: ``page`` (int32 scalar, ≥ 0) its page, ``slot0`` its first entry slot in it; every key is
        read, also those past the request's last (stale bytes of an allocated page, whose scores are never
        stored: each key is one row of the MMA and of the head sums). Returns the packed codes as int32 words
        ``[64, 4, 4]`` (``WORDS_L``: key, block, word) and each key's scale word (4 UE8M0 bytes, block ``j`` in
        byte ``j``), int32 ``[64]`` (``ROW_L``)."""
        key = gl.arange(0, BN, layout=ROW_L)
        blk = gl.arange(0, 4, layout=gl.SliceLayout(0, BLK_L))
        # a 32 × 32-bit wide multiply (the page is not negative), not a 64-bit one
        page_off = page.to(gl.uint32).to(gl.uint64) * page_bytes.to(gl.uint32).to(gl.uint64)
        base = (pages_ptr + page_off).to(gl.pointer_type(gl.int32))
        # every register of a thread holds its first key's address (``LOAD_KEY_PAIR_PTX`` adds the second's offset)
        row = (slot0 + (key & ~8)) * 16
        off = gl.expand_dims(gl.expand_dims(row, 1) + gl.expand_dims(blk * 4, 0), 2)
        addr, _ = gl.broadcast((base + off).to(gl.int64, bitcast=True), gl.zeros([BN, 4, 4], gl.int32, WORDS_L))
        codes = gl.inline_asm_elementwise(LOAD_KEY_PAIR_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,l,l,l,l,l,l,l,l", [addr],
                                          dtype=gl.int32, is_pure=True, pack=8)
        scales = gl.load(base + ENTRIES * 16 + slot0 + key)
        return codes, scales

    @gluon.jit
    def _tile_page(bt_row, tile, tile_hi, ENTRIES: gl.constexpr):
        """The physical page of key tile ``tile`` of a request (block-table row ``bt_row``; a tile past
        ``tile_hi`` reads the last tile's entry), int32 scalar."""
        return gl.load(bt_row + (gl.minimum(tile, tile_hi - 1) * BN) // ENTRIES)

    @gluon.jit
    def _request_tile_in(page, pages_ptr, page_bytes, tile, tile_hi, ENTRIES: gl.constexpr):
        """``_load_tile`` of key tile ``tile``, whose page (``_tile_page``) is ``page``. A tile past ``tile_hi``
        (the pipeline's requests beyond a split's end) reads the split's last tile again, an L2 hit: its scores
        are never stored."""
        return _load_tile(pages_ptr, page_bytes, page, (gl.minimum(tile, tile_hi - 1) * BN) % ENTRIES, ENTRIES)

    @gluon.jit
    def _request_tile(bt_row, pages_ptr, page_bytes, tile, tile_hi, ENTRIES: gl.constexpr):
        """``_load_tile`` of key tile ``tile`` of a request (block-table row ``bt_row``), its page looked up right
        before."""
        return _request_tile_in(_tile_page(bt_row, tile, tile_hi, ENTRIES), pages_ptr, page_bytes, tile, tile_hi,
                                ENTRIES)

    @gluon.jit
    def _store_scores(acc, ks, w_half, out_row, out_stride, vis_q, first_key, QT: gl.constexpr, HP: gl.constexpr):
        """Scores of one tile for ``QT`` queries: ``Σ_h w_h · relu(acc[:, (q, h)]) · ks`` (relu as ``x + |x|`` with
        ``w_half = w / 2``, see ``scores._head_sum``), rounded to the output dtype and stored at ``out_row`` (the
        first query's row) ``+ q · out_stride + first_key + i`` for keys below the query's visible count
        (``vis_q``: an int32 scalar for ``QT = 1``, else ``[QT]`` in the query slice of the scores' layout)."""
        p = (acc + gl.abs(acc)) * gl.expand_dims(w_half, 0)
        if QT == 1:
            OUT_L: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
            sc = gl.sum(p, axis=1) * gl.convert_layout(ks, OUT_L)
            idx = first_key + gl.arange(0, BN, layout=OUT_L)
            # a thread's two keys (rows 8 apart) stored from its first key's address (``STORE_PAIR_*_PTX``)
            addr = (out_row + (idx & ~8)).to(gl.int64, bitcast=True)
            vis = gl.zeros_like(idx) + vis_q
            if out_row.dtype.element_ty == gl.float32:
                bits = sc.to(gl.int32, bitcast=True)
                gl.inline_asm_elementwise(STORE_PAIR_B32_PTX, "=r,=r,l,l,r,r,r,r,r,r", [addr, bits, idx, vis],
                                          dtype=gl.int32, is_pure=False, pack=2)
            else:
                bits = sc.to(out_row.dtype.element_ty).to(gl.int16, bitcast=True).to(gl.int32)
                gl.inline_asm_elementwise(STORE_PAIR_B16_PTX, "=r,=r,l,l,r,r,r,r,r,r", [addr, bits, idx, vis],
                                          dtype=gl.int32, is_pure=False, pack=2)
        else:  # [64 keys, QT queries]: each query's heads are a contiguous group of the MMA's columns
            sc = gl.sum(gl.reshape(p, [BN, QT, HP]), axis=2)
            S_L: gl.constexpr = sc.type.layout
            sc = sc * gl.expand_dims(gl.convert_layout(ks, gl.SliceLayout(1, S_L)), 1)
            idx = first_key + gl.arange(0, BN, layout=gl.SliceLayout(1, S_L))
            rows = gl.arange(0, QT, layout=gl.SliceLayout(0, S_L)) * out_stride
            ptrs = out_row + gl.expand_dims(rows, 0) + gl.expand_dims(idx, 1)
            gl.store(ptrs, sc.to(out_row.dtype.element_ty), mask=gl.expand_dims(idx, 1) < gl.expand_dims(vis_q, 0))

    @gluon.jit
    def _byte_max(word):
        """Largest of the four bytes of each int32 ``word`` (unsigned)."""
        a = gl.maximum(word & 0xFF, (word >> 8) & 0xFF)
        b = gl.maximum((word >> 16) & 0xFF, (word >> 24) & 0xFF)
        return gl.maximum(a, b)

    @gluon.jit
    def _convert_tile(codes, scales, A_L: gl.constexpr):
        """A tile's packed codes → the FP8 A operand ``[64, 128]`` (layout ``A_L``, channel order of the module
        docstring) and the keys' scales ``2**(e_max − 133)``, fp32 ``[64]`` (``ROW_L``)."""
        e_max = _byte_max(scales)
        blk = gl.arange(0, 4, layout=gl.SliceLayout(0, BLK_L))
        e = (gl.expand_dims(scales, 1) >> gl.expand_dims(blk * 8, 0)) & 0xFF  # [64, 4]: one per thread and key
        d = e - gl.expand_dims(e_max, 1) + 11
        lo = gl.where(d < 0, 0, E4M3_LO + (d * 8) * 0x01010100)
        hi = gl.where(d < 0, 0, E4M3_HI + (d * 8) * 0x01010101)
        words, _ = gl.broadcast(gl.expand_dims(codes, 3), gl.zeros([BN, 4, 4, 4], gl.int32, CODES_L))
        lo4, _ = gl.broadcast(gl.expand_dims(gl.expand_dims(lo, 2), 3), words)
        hi4, _ = gl.broadcast(gl.expand_dims(gl.expand_dims(hi, 2), 3), words)
        # pack=4: one call per four bytes r, its operands $2…$5 the (same) word, $6… / $10… the tables
        first, last = gl.inline_asm_elementwise(UNPACK_WORD_PTX, "=r,=r,r,r,r,r,r,r,r,r,r,r,r,r",
                                                [words, lo4, hi4], dtype=(gl.uint8, gl.uint8), is_pure=True, pack=4)
        # [key, block j, word s, byte r, half] → [key, s, half, j, r]: K index κ = 32s + 16·half + 4j + r
        both = gl.join(first, last)
        a = gl.reshape(gl.permute(both, [0, 2, 4, 1, 3]), [BN, 128])
        a = gl.convert_layout(a.to(gl.float8e4nv, bitcast=True), A_L)
        ks = (gl.maximum(e_max - 6, 0) << 23).to(gl.float32, bitcast=True)  # 0 for e_max ≤ 6
        return a, ks

    @gluon.jit
    def _decode_tiles(bt_row, pages_ptr, page_bytes, tile_lo, tile_hi, q_op, acc0, w_half, out_row,
                      out_stride, vis_q, A_L: gl.constexpr, ENTRIES: gl.constexpr, HP: gl.constexpr):
        """A split's tiles ``tile_lo … tile_hi − 1`` for one query (``N = HP``). Tile i is converted and its MMA
        started; tile i + 2 is requested into the registers tile i's codes leave, and tile i + 4's page looked
        up (two int32 scalars carried: a request never waits for the block table); while the MMA runs, tile
        i − 1 (its accumulator carried over) is reduced and stored. Unrolled by two so that the two accumulators,
        the two code buffers and the two pages alternate in place (no copies); each converted operand is used in
        the iteration that made it (a byte-typed tensor carried across iterations would be split into one
        register per byte)."""
        codes_x, scales_x = _request_tile(bt_row, pages_ptr, page_bytes, tile_lo, tile_hi, ENTRIES)
        codes_y, scales_y = _request_tile(bt_row, pages_ptr, page_bytes, tile_lo + 1, tile_hi, ENTRIES)
        page_x = _tile_page(bt_row, tile_lo + 2, tile_hi, ENTRIES)
        page_y = _tile_page(bt_row, tile_lo + 3, tile_hi, ENTRIES)
        a, ks_a = _convert_tile(codes_x, scales_x, A_L)
        acc_a = warpgroup_mma(a, q_op, acc0, use_acc=False, is_async=True)
        codes_x, scales_x = _request_tile_in(page_x, pages_ptr, page_bytes, tile_lo + 2, tile_hi, ENTRIES)
        page_x = _tile_page(bt_row, tile_lo + 4, tile_hi, ENTRIES)
        acc_a = warpgroup_mma_wait(0, deps=[acc_a])
        n_tiles = tile_hi - tile_lo
        for t in range(tile_lo + 1, tile_lo + 1 + (n_tiles - 1) // 2 * 2, 2):
            a, ks_b = _convert_tile(codes_y, scales_y, A_L)
            acc_b = warpgroup_mma(a, q_op, acc0, use_acc=False, is_async=True)
            codes_y, scales_y = _request_tile_in(page_y, pages_ptr, page_bytes, t + 2, tile_hi, ENTRIES)
            page_y = _tile_page(bt_row, t + 4, tile_hi, ENTRIES)
            _store_scores(acc_a, ks_a, w_half, out_row, out_stride, vis_q, (t - 1) * BN, 1, HP)
            acc_b = warpgroup_mma_wait(0, deps=[acc_b])
            a, ks_a = _convert_tile(codes_x, scales_x, A_L)
            acc_a = warpgroup_mma(a, q_op, acc0, use_acc=False, is_async=True)
            codes_x, scales_x = _request_tile_in(page_x, pages_ptr, page_bytes, t + 3, tile_hi, ENTRIES)
            page_x = _tile_page(bt_row, t + 5, tile_hi, ENTRIES)
            _store_scores(acc_b, ks_b, w_half, out_row, out_stride, vis_q, t * BN, 1, HP)
            acc_a = warpgroup_mma_wait(0, deps=[acc_a])
        if n_tiles % 2 == 0:  # one tile left
            a, ks_b = _convert_tile(codes_y, scales_y, A_L)
            acc_b = warpgroup_mma(a, q_op, acc0, use_acc=False, is_async=True)
            _store_scores(acc_a, ks_a, w_half, out_row, out_stride, vis_q, (tile_hi - 2) * BN, 1, HP)
            acc_b = warpgroup_mma_wait(0, deps=[acc_b])
            _store_scores(acc_b, ks_b, w_half, out_row, out_stride, vis_q, (tile_hi - 1) * BN, 1, HP)
        else:
            _store_scores(acc_a, ks_a, w_half, out_row, out_stride, vis_q, (tile_hi - 1) * BN, 1, HP)

    @gluon.jit
    def _chunk_tile(codes, scales, tile, bt_row, pages_ptr, page_bytes, tile_hi, q_op, acc0, w_half, out_row,
                    out_stride, vis_q, A_L: gl.constexpr, ENTRIES: gl.constexpr, QT: gl.constexpr,
                    HP: gl.constexpr):
        """One step of ``_chunk_tiles``: key tile ``tile`` (its ``codes`` / ``scales``) converted, its MMA run,
        tile ``tile + 2`` requested meanwhile (returned: the registers this tile's codes leave), the MMA awaited
        and the tile reduced and stored."""
        a, ks = _convert_tile(codes, scales, A_L)
        acc = warpgroup_mma(a, q_op, acc0, use_acc=False, is_async=True)
        codes, scales = _request_tile(bt_row, pages_ptr, page_bytes, tile + 2, tile_hi, ENTRIES)
        acc = warpgroup_mma_wait(0, deps=[acc])
        _store_scores(acc, ks, w_half, out_row, out_stride, vis_q, tile * BN, QT, HP)
        return codes, scales

    @gluon.jit
    def _chunk_tiles(bt_row, pages_ptr, page_bytes, tile_lo, tile_hi, q_op, acc0, w_half, out_row,
                     out_stride, vis_q, A_L: gl.constexpr, ENTRIES: gl.constexpr, QT: gl.constexpr,
                     HP: gl.constexpr):
        """A split's tiles for ``QT > 1`` queries (``N = QT · HP``): tile i is converted, its MMA run and awaited,
        tile i + 2 requested meanwhile, and tile i reduced and stored — one accumulator live (two would not fit
        the registers); other programs on the multiprocessor fill the MMA's wait. Unrolled by two so that the two
        code buffers alternate in place (requests past ``tile_hi`` read the split's last tile again, unused)."""
        codes_x, scales_x = _request_tile(bt_row, pages_ptr, page_bytes, tile_lo, tile_hi, ENTRIES)
        codes_y, scales_y = _request_tile(bt_row, pages_ptr, page_bytes, tile_lo + 1, tile_hi, ENTRIES)
        n_tiles = tile_hi - tile_lo
        for t in range(tile_lo, tile_lo + n_tiles // 2 * 2, 2):
            codes_x, scales_x = _chunk_tile(codes_x, scales_x, t, bt_row, pages_ptr, page_bytes, tile_hi,
                                            q_op, acc0, w_half, out_row, out_stride, vis_q, A_L, ENTRIES, QT, HP)
            codes_y, scales_y = _chunk_tile(codes_y, scales_y, t + 1, bt_row, pages_ptr, page_bytes, tile_hi,
                                            q_op, acc0, w_half, out_row, out_stride, vis_q, A_L, ENTRIES, QT, HP)
        if n_tiles % 2 == 1:  # one tile left
            _chunk_tile(codes_x, scales_x, tile_hi - 1, bt_row, pages_ptr, page_bytes, tile_hi, q_op, acc0,
                        w_half, out_row, out_stride, vis_q, A_L, ENTRIES, QT, HP)

    @gluon.jit
    def _query_operand(q_ptr, t0, nq, QT: gl.constexpr, HP: gl.constexpr):
        """The query operand of tokens ``t0 … t0 + nq − 1`` in shared memory, FP8 ``[QT · HP, 128]`` (row
        ``q · HP + h``; rows of queries ``q ≥ nq`` zero), K index ``κ = 32s + 16·half + 4j + r`` holding
        ``q[t0 + q, half, h, 16j + 4s + r]`` (the key conversion's channel order, module docstring); fenced for
        ``wgmma`` and visible to every warp."""
        Q_SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        Q_L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
        r = gl.arange(0, QT * HP, layout=gl.SliceLayout(1, Q_L))
        kappa = gl.arange(0, 128, layout=gl.SliceLayout(0, Q_L))
        q_off = ((kappa // 16) % 2) * (HP * 64) + ((kappa // 4) % 4) * 16 + (kappa // 32) * 4 + kappa % 4
        row = (t0 + r // HP).to(gl.int64) * (2 * HP * 64) + (r % HP) * 64
        qv = gl.load(q_ptr + gl.expand_dims(row, 1) + gl.expand_dims(q_off, 0),
                     mask=gl.expand_dims(r // HP < nq, 1), other=0)
        q_smem = gl.allocate_shared_memory(gl.float8e4nv, [QT * HP, 128], Q_SL)
        q_smem.store(qv.to(gl.float8e4nv, bitcast=True))
        fence_async_shared()
        gl.thread_barrier()
        return q_smem

    @gluon.jit
    def _scores_sm90_kernel(
        pages_ptr,                  # uint8 [num_blocks, PAGE_BYTES]: the layer's MXFP4 indexer key pages
        bt_ptr, bt_stride,          # int32 [B, max_blocks]: block tables
        cu_ptr,                     # int32 [B + 1]: token offsets of each request
        vis_ptr,                    # int64 [T]: entries visible to each token
        q_ptr,                      # uint8 [T, 2, HP, 64]: query operand (queries.mxfp4_queries)
        w_ptr,                      # fp32 [T, HP]: head weight · query scale (0 for padded heads)
        out_ptr, out_stride,        # [T, out_stride] scores; only s < visible[t] written
        PAGE_BYTES, TILES_PER_SPLIT,
        ENTRIES: gl.constexpr, HP: gl.constexpr, QT: gl.constexpr,
    ):
        """Grid ``(splits, chunks, B)``: a split of request ``b``'s key tiles against its queries ``chunk · QT …``
        (``QT`` of them, the MMA's ``N = QT · HP`` columns; each key tile is converted once for all)."""
        MMA_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, QT * HP, 32])
        A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_L, k_width=4)

        split = gl.program_id(0)
        chunk = gl.program_id(1)
        b = gl.program_id(2)
        tok0 = gl.load(cu_ptr + b)
        t0 = tok0 + chunk * QT
        nq = gl.minimum(gl.load(cu_ptr + b + 1) - t0, QT)
        if nq <= 0:
            return
        n_keys = gl.load(vis_ptr + t0 + nq - 1).to(gl.int32)  # the chunk's last query sees the most keys
        tile_lo = split * TILES_PER_SPLIT
        tile_hi = gl.minimum(tile_lo + TILES_PER_SPLIT, gl.cdiv(n_keys, BN))
        if tile_lo >= tile_hi:
            return

        q_smem = _query_operand(q_ptr, t0, nq, QT, HP)
        col = gl.arange(0, QT * HP, layout=gl.SliceLayout(0, MMA_L))
        w_half = gl.load(w_ptr + t0.to(gl.int64) * HP + col, mask=col // HP < nq, other=0.0) * 0.5
        acc0 = gl.zeros([BN, QT * HP], gl.float32, MMA_L)
        if QT == 1:
            vis_q = n_keys
        else:  # each query's visible count, in the query slice of the scores' layout
            S_L: gl.constexpr = gl.SliceLayout(2, gl.reshape(acc0, [BN, QT, HP]).type.layout)
            qi = gl.arange(0, QT, layout=gl.SliceLayout(0, S_L))
            vis_q = gl.load(vis_ptr + t0 + qi, mask=qi < nq, other=0).to(gl.int32)

        bt_row = bt_ptr + b.to(gl.int64) * bt_stride
        out_row = out_ptr + t0.to(gl.int64) * out_stride
        q_op = q_smem.permute((1, 0))
        if QT == 1:
            _decode_tiles(bt_row, pages_ptr, PAGE_BYTES, tile_lo, tile_hi, q_op, acc0, w_half, out_row,
                          out_stride, vis_q, A_L, ENTRIES, HP)
        else:
            _chunk_tiles(bt_row, pages_ptr, PAGE_BYTES, tile_lo, tile_hi, q_op, acc0, w_half, out_row,
                         out_stride, vis_q, A_L, ENTRIES, QT, HP)


def launch(pages: torch.Tensor, block_tables: torch.Tensor, cu_seqlens: torch.Tensor, visible: torch.Tensor,
           q: torch.Tensor, w: torch.Tensor, out: torch.Tensor, plan: ScoresPlan) -> None:
    """Launch the kernel on the grid of ``plan`` (arguments as ``scores.index_scores``, which checked the plan)."""
    _scores_sm90_kernel[plan.grid](
        pages, block_tables, block_tables.stride(0), cu_seqlens, visible, q, w, out, out.stride(0),
        pages.stride(0), plan.tiles_per_split, ENTRIES=plan.entries_per_page, HP=plan.head_pad,
        QT=plan.queries_per_program, num_warps=plan.num_warps,
        **({"maxnreg": plan.max_registers} if plan.max_registers else {}))
