"""Sparse attention with sink over the paged 584-B KV entries, written in Gluon for Hopper (sm_90).

Same semantics, arguments and key set as ``sparse_attention._sparse_attention_kernel`` (read its docstring for the
key set of a query and the numerics); what differs is how the keys reach the tensor cores. The Triton kernel loads
each chunk's codes into registers right before using them, so every 64-key chunk waits on a dependent chain of
global loads (index → block table → codes). Here the chunk's raw bytes are streamed into shared memory with
asynchronous copies one chunk ahead, and the index and block-table loads run two and three chunks ahead, so a
chunk's math only waits for data that was requested an iteration earlier:

    iteration c:  copy chunk c+1 (cp.async)  |  block tables of c+2  |  entry indices of c+3
                  wait for chunk c's copy → dequantize its codes into a BF16 key tile in shared memory
                  S = Q·Kᵀ (wgmma, Q in shared memory) → online softmax → P (BF16, shared memory)
                  O = O·α + P·K (wgmma)

One program (8 warps = 2 warpgroups) holds one query token and 64 heads. The ``[64 heads, 512 dims]`` FP32 output
accumulator is split by dims across the two warpgroups (each wgmma of ``P·K`` has N = 256), the ``[64, 64]``
scores by keys. Shared memory: Q and the BF16 key tile (64 KB each), P (8 KB) and two copy stages of raw bytes
(7 × 4 KB codes + 8 KB rope values + scales + validity per stage).

Dequantization is exact (E4M3 code × 2^(e−127) is a BF16): four codes at a time by the inline PTX
``ptx.DEQUANT_E4M3`` (integer ops place each code's fields in a BF16, two BF16 multiplies by powers of two scale it;
no FP8 conversion instructions), so the products are those of the Triton kernel. The softmax is the same online
base-2 one with P rounded to BF16 for P·V; its denominator is kept per element (``l_acc``) and reduced once after
the loop, so the per-chunk row max is the only exchange between the warpgroups. With several splits per token the
program writes an FP32 partial and ``sparse_attention._combine_kernel`` merges them; else it applies the sink,
stages the BF16 output through the (then free) query tiles for 16-byte stores, and rotates the rope dims back in
registers.

Prefill chunks (``KEYS_BF16``): where each key serves many queries, ``sparse_attention.bf16_keys`` first
dequantizes the step's keys once into BF16 rows (each request's ring, then the entries its tokens see) and the
kernel copies each chunk's rows straight into one of two sets of key tiles a chunk ahead (``_issue_bf16_chunk``: no
block tables, no dequantization; the window's new tokens from ``kv_new`` as before). The tiles hold the same bits
as the dequantized ones, so the outputs are the FP8 path's bit for bit (GPU test). H200, 4K-query chunks: Flash
1,525 → 1,094 µs, Pro 4,810 → 3,420 (what the probe of the dequantization's cost predicted).

Split steps can also merge without the combine kernel (``launch_in_clusters``): each token's splits run as one
thread-block cluster (``kernels.cluster``), which the hardware schedules at once; every split writes its partial,
waits at ``barrier.cluster`` (release / acquire: the partials are then visible to all), and merges ``ceil(64 /
splits)`` of the heads from all the partials (``_cluster_combine``, the combine kernel's formula in one pass with a
running max). One launch instead of two: on an H200, Pro CSA B=8 (6 splits) 31.7-32.2 → 29.2-29.4 µs, Flash CSA
B=64 (2 splits) 42.8-43.2 → 39.8-40.2, HCA-128K B=8 (9 splits) 27.8-28.4 → 26.5-27.1 (``benchmarks/RESULTS.md``).
The merge itself costs 3-4 µs inside the kernel (its partial stores drained, the barrier, the partial rows read back
from L2) against the combine kernel's 4-6 µs plus its launch. It applies where the device holds all clusters of the
step at once: an H200 holds 15 clusters of 8 programs but only 7 of 10-16 (a cluster's programs share one GPC),
so Flash CSA B=8 (10 splits of one chunk) keeps the combine kernel.

Needs a CUDA device of compute capability 9.x (``available()``); there is no interpreter path.
"""

from __future__ import annotations

import torch

from . import cluster_launch
from .. import hopper, ptx

try:  # Gluon ships with Triton ≥ 3.4; without it (or without a GPU) the Triton kernel serves
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    _HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    _HAVE_GLUON = False

__all__ = ["available", "dequant_probe", "launch", "launch_in_clusters"]

BLOCK_H = 64  # heads per program: the wgmma M of one warpgroup
BLOCK_N = 64  # keys per chunk
STAGES = 2  # copy stages of raw key bytes
NUM_WARPS = 8


def available(device: torch.device) -> bool:
    """Whether the Gluon kernel can run on ``device`` (a CUDA device of compute capability 9.x, Gluon present)."""
    return _HAVE_GLUON and hopper.is_sm90(device)


if _HAVE_GLUON:
    BH = gl.constexpr(BLOCK_H)
    BN = gl.constexpr(BLOCK_N)
    NSTAGE = gl.constexpr(STAGES)
    NW = gl.constexpr(NUM_WARPS)
    NOPE_DIM = gl.constexpr(448)
    DATA_BYTES = gl.constexpr(576)  # per entry: 448 E4M3 codes + 64 BF16 rope values
    MODE_WINDOW = gl.constexpr(0)
    MODE_LIST = gl.constexpr(1)
    MODE_ALL = gl.constexpr(2)
    DEQUANT_PTX = gl.constexpr(ptx.DEQUANT_E4M3)

    # Key tiles as [64 keys, blocks, 64 bytes/values]: 16 consecutive elements per thread (one or two 16-B
    # copies), every [64]-per-key vector in the slice layout of the same rows.
    TILE3_L = gl.constexpr(gl.BlockedLayout([1, 1, 16], [8, 1, 4], [8, 1, 1], [2, 1, 0]))
    BLK_L = gl.constexpr(gl.SliceLayout(2, TILE3_L))  # [64, blocks]
    Q_L = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0]))  # [64 heads, dims]: 16-byte stores
    KEY_L = gl.constexpr(gl.SliceLayout(1, BLK_L))  # [64] one value per key
    # A BF16 operand tile of the tensor cores (128-byte swizzle).
    TILE_SL = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    # The 512 dims are kept in four groups, each its own shared-memory tile (a write to one tile never waits on a
    # read of another): FP8 blocks 0-3, 4-5, 6, then the 64 BF16 rope dims.

    @gluon.jit
    def _dim_tiles(ROWS: gl.constexpr, STAGES: gl.constexpr):
        """The four BF16 shared-memory tiles a ``[ROWS, 512]`` operand is kept in (dims 0-255, 256-383, 384-447,
        448-511: a write to one never waits on a read of another), each ``[STAGES, ROWS, dims]`` — or ``[ROWS,
        dims]`` for ``STAGES`` = 0."""
        if STAGES == 0:
            t0 = gl.allocate_shared_memory(gl.bfloat16, [ROWS, 256], TILE_SL)
            t1 = gl.allocate_shared_memory(gl.bfloat16, [ROWS, 128], TILE_SL)
            t2 = gl.allocate_shared_memory(gl.bfloat16, [ROWS, 64], TILE_SL)
            t3 = gl.allocate_shared_memory(gl.bfloat16, [ROWS, 64], TILE_SL)
        else:
            t0 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, ROWS, 256], TILE_SL)
            t1 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, ROWS, 128], TILE_SL)
            t2 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, ROWS, 64], TILE_SL)
            t3 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, ROWS, 64], TILE_SL)
        return t0, t1, t2, t3

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
    def _fresh_rows(c, pos, start, WINDOW: gl.constexpr, KL: gl.constexpr = KEY_L):
        """Window chunk ``c``: which keys are this step's tokens (read from ``kv_new``), and their rows there
        (``[64]`` vectors in layout ``KL``)."""
        j = c * BN + gl.arange(0, BN, layout=KL)
        p = pos - (WINDOW - 1) + j
        fresh = (j < WINDOW) & (p >= start)
        return fresh, gl.maximum(p - start, 0)

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
    def _block_exponents(scales, FIRST: gl.constexpr, NB: gl.constexpr):
        """int32 ``[64, NB]`` UE8M0 exponents of blocks ``FIRST … FIRST+NB−1`` from each key's scale word
        (``scales`` int64 ``[64]``, byte ``b`` = block ``b``)."""
        word = (scales >> (32 * (FIRST // 4))).to(gl.int32)  # the 32-bit half holding these blocks
        blk = gl.arange(0, NB, layout=gl.SliceLayout(0, scales.type.layout.parent))
        return (gl.expand_dims(word, 1) >> gl.expand_dims((FIRST % 4 + blk) * 8, 0)) & 0xFF

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
    def _store_group(o, inv, dst_ptr, row_off, head_ok, FIRST: gl.constexpr):
        """``o · inv`` (``[64, W]`` fp32 accumulator of dims ``64·FIRST …``, ``inv`` per head) at ``dst_ptr +
        row_off[h] + 64·FIRST + i`` in ``dst_ptr``'s dtype."""
        L: gl.constexpr = o.type.layout
        rows = gl.convert_layout(row_off, gl.SliceLayout(1, L))
        ok = gl.convert_layout(head_ok, gl.SliceLayout(1, L))
        cols = FIRST * 64 + gl.arange(0, o.shape[1], layout=gl.SliceLayout(0, L))
        val = o * gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(1, L)), 1)
        gl.store(dst_ptr + gl.expand_dims(rows, 1) + gl.expand_dims(cols, 0), val.to(dst_ptr.dtype.element_ty),
                 mask=gl.expand_dims(ok, 1))

    @gluon.jit
    def _store_tile(tile, dst_ptr, stride_oh, hb, H, FIRST: gl.constexpr):
        """Store the BF16 tile ``tile`` ``[64 heads, W]`` (shared memory) at ``dst_ptr + h·stride_oh + 64·FIRST + i``
        with 16-byte stores (heads ``≥ H`` skipped)."""
        heads = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, Q_L))
        cols = FIRST * 64 + gl.arange(0, tile.shape[1], layout=gl.SliceLayout(0, Q_L))
        ptrs = dst_ptr + gl.expand_dims(heads * stride_oh, 1) + gl.expand_dims(cols, 0)
        gl.store(ptrs, tile.load(Q_L), mask=gl.expand_dims(heads < H, 1))

    @gluon.jit
    def _masked_scores(q0, q1, q2, q3, k0, k1, k2, k3, valid_smem, qk_scale, S_L: gl.constexpr):
        """S = Q·Kᵀ over the four dim tiles (``q0 … q3`` ``[64 heads, dims]``, key tiles ``k0 … k3`` ``[64 keys,
        dims]`` in shared memory; wgmma, waited for) times ``qk_scale`` (base 2), −inf where ``valid_smem`` (int
        ``[64]``) says there is no key: fp32 ``[64, 64]`` in ``S_L``."""
        s = warpgroup_mma(q0, k0.permute((1, 0)), gl.zeros([BH, BN], gl.float32, layout=S_L),
                          use_acc=False, is_async=True)
        s = warpgroup_mma(q1, k1.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(q2, k2.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(q3, k3.permute((1, 0)), s, is_async=True)
        valid = valid_smem.load(gl.SliceLayout(0, S_L)) != 0
        s = warpgroup_mma_wait(0, deps=[s])
        return gl.where(gl.expand_dims(valid, 0), s * qk_scale, float("-inf"))

    @gluon.jit
    def _running_max(m_i, s):
        """One step of the online softmax (base 2) over scores ``s`` ``[64, n]``: the rows' new maxima ``m_new =
        max(m_i, max_j s)`` and the factor ``α = 2^(m_i − m_new)`` of what was summed before (a row still at −inf
        keeps its −inf and gets α = 0)."""
        m_new = gl.maximum(m_i, gl.max(s, 1))
        return m_new, gl.exp2(m_i - gl.where(m_new == float("-inf"), 0.0, m_new))

    @gluon.jit
    def _probabilities(s, m):
        """``2^(s − m)`` per row (``m`` from ``_running_max``; a row at −inf: every score −inf, every p 0)."""
        return gl.exp2(s - gl.expand_dims(gl.where(m == float("-inf"), 0.0, m), 1))

    @gluon.jit
    def _rescale(o, alpha):
        """``o · alpha[:, None]`` (alpha per head, any row layout)."""
        return o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o.type.layout)), 1)

    @gluon.jit
    def _program_token(token_request_ptr, positions_ptr, cu_seqlens_ptr, start_pos_ptr, token_slots_ptr, H,
                       CLUSTER: gl.constexpr):
        """The program's query: ``(t, head block, split, request, position, the request's first position this
        step, its first row in the step, its ring slot)`` from the grid ``(T · ceil(H / 64), splits)`` — or, in
        clusters (``CLUSTER`` > 1), ``T · ceil(H / 64)`` clusters of ``CLUSTER`` consecutive programs, one per
        split — and the ``StepBatch`` fields (all int64 but the head block and split)."""
        head_blocks = gl.cdiv(H, BH)
        if CLUSTER > 1:
            query = gl.program_id(0) // CLUSTER
            split = gl.program_id(0) % CLUSTER
        else:
            query = gl.program_id(0)
            split = gl.program_id(1)
        t = (query // head_blocks).to(gl.int64)
        req = gl.load(token_request_ptr + t).to(gl.int64)
        return (t, query % head_blocks, split, req, gl.load(positions_ptr + t).to(gl.int64),
                gl.load(start_pos_ptr + req).to(gl.int64), gl.load(cu_seqlens_ptr + req).to(gl.int64),
                gl.load(token_slots_ptr + t).to(gl.int64))

    @gluon.jit
    def _split_chunks(t, split, visible_ptr, num_compressed, chunks_per_split, WINDOW_CHUNKS: gl.constexpr,
                      MODE: gl.constexpr):
        """``(compressed keys of token t, first chunk, end chunk)`` of this split: the window's chunks, then the
        compressed keys' (``MODE_ALL``: the token's visible entries; ``MODE_LIST``: its list's width)."""
        if MODE == MODE_ALL:
            n_comp = gl.minimum(gl.load(visible_ptr + t).to(gl.int32), num_compressed)
        elif MODE == MODE_LIST:
            n_comp = num_compressed
        else:
            n_comp = 0
        c_begin = split * chunks_per_split
        return n_comp, c_begin, gl.minimum(c_begin + chunks_per_split, WINDOW_CHUNKS + gl.cdiv(n_comp, BN))

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
    def _issue_bf16_chunk(c, live, raw, buf, pos, start, key_rows, key_entries, kv_new_rows, stride_kvt,
                          k0, k1, k2, k3, valid_smem, WINDOW: gl.constexpr, WINDOW_CHUNKS: gl.constexpr,
                          RL: gl.constexpr):
        """Start the asynchronous copies of chunk ``c``'s BF16 keys straight into key tiles ``buf`` of ``k0 … k3``
        (nothing is read when not ``live``; rows without a key are zero-filled): a window slot from the request's
        BF16 ring rows (``key_rows``: its ``[WINDOW + key_entries, 512]`` block) or, for this step's tokens, from
        ``kv_new_rows`` (the request's first row of ``kv_new``); a compressed entry ``i`` from row ``WINDOW + i``
        (an index beyond the rows — a caller's bound too small — is no key, never an out-of-bounds read). Records
        which keys are real. ``raw``: the chunk's lookup (``_chunk_entries``); ``RL``: the 2-D register layout of
        the copies (16-byte pieces of rows) for the calling warps. Branch-free: Triton 3.6 does not lower loads on
        both sides of a branch inside a warp-specialized partition."""
        raw = gl.convert_layout(raw, gl.SliceLayout(1, RL))
        n = gl.arange(0, BN, layout=gl.SliceLayout(1, RL))
        in_window = c < WINDOW_CHUNKS
        j = c * BN + n
        p = pos - (WINDOW - 1) + j
        fresh = live & in_window & (j < WINDOW) & (p >= start) & (p >= 0)
        held = live & in_window & (raw == p) & (raw >= 0)
        listed = live & (not in_window) & (raw >= 0) & (raw < key_entries)
        ring_row = key_rows + (gl.maximum(p, 0) % WINDOW) * 512
        rows = gl.where(fresh, kv_new_rows + gl.maximum(p - start, 0).to(gl.int64) * stride_kvt,
                        gl.where(in_window, ring_row, key_rows + (WINDOW + gl.maximum(raw, 0)).to(gl.int64) * 512))
        valid = fresh | held | listed
        ok = gl.expand_dims(valid, 1)
        _copy_keys(rows, ok, k0.index(buf), 0, 256)
        _copy_keys(rows, ok, k1.index(buf), 256, 128)
        _copy_keys(rows, ok, k2.index(buf), 384, 64)
        _copy_keys(rows, ok, k3.index(buf), 448, 64)
        ONE_L: gl.constexpr = gl.BlockedLayout([1], [32], [RL.warps_per_cta[0]], [0])
        valid_smem.index(buf).store(gl.convert_layout(valid, ONE_L).to(gl.int32))
        async_copy.commit_group()

    @gluon.jit
    def _copy_keys(rows, ok, dst, FIRST: gl.constexpr, W: gl.constexpr):
        """Asynchronous copy of dims ``FIRST … FIRST + W − 1`` of 64 BF16 rows (``rows``: pointers ``[64]`` in a
        slice of a 2-D layout, 16-byte aligned) into the tile ``dst`` ``[64, W]`` (rows not ``ok`` zero-filled, not
        read)."""
        col = gl.arange(0, W, layout=gl.SliceLayout(0, rows.type.layout.parent))
        ptrs = gl.max_contiguous(gl.expand_dims(rows, 1) + FIRST + gl.expand_dims(col, 0), [1, 8])
        async_copy.async_copy_global_to_shared(dst, ptrs, mask=ok)

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
        keys_ptr, stride_kb, key_entries,  # KEYS_BF16: bf16 [B, WINDOW + key_entries, 512] (sparse_attention.bf16_keys)
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

        # The queries, loaded and stored synchronously (an asynchronous copy overlapped with the first lookups
        # measured slower: H100, Flash CSA B=128 59.4 -> 68.2 us).
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
    def _write_output(o0, o1, o2, o3, m_i, l_i, q0, q1, q2, heads, t, hb, H, pos, split, num_splits, sink_ptr,
                      inv_freq_ptr, o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, po_ptr, plse_ptr,
                      SPLIT: gl.constexpr, CLUSTER: gl.constexpr):
        """The program's result from its accumulators (``o0 … o3`` FP32 ``[64, dims]``, running max ``m_i`` and sum
        ``l_i`` per head, base 2; ``heads`` int ``[64]``): with ``SPLIT`` the partial o/l and its log-sum-exp (an
        empty split: lse −inf, o 0) — then, in a cluster of the token's splits (``CLUSTER`` > 1), this program's
        share of the merge (``_cluster_combine``) once every split's partial is written —, else the sink
        applied, the BF16 output staged through the query tiles ``q0 … q2`` (free once the last S = Q·Kᵀ is
        done) for 16-byte stores, the rope dims rotated back, and the lse."""
        HL: gl.constexpr = heads.type.layout
        head_ok = heads < H
        if SPLIT:
            has = l_i > 0
            inv = 1.0 / gl.where(has, l_i, 1.0)
            plse = gl.where(has, gl.where(m_i == float("-inf"), 0.0, m_i) + gl.log2(gl.where(has, l_i, 1.0)),
                            float("-inf"))
            row = (t * num_splits + split) * H + heads
            _store_group(o0, inv, po_ptr, row * 512, head_ok, 0)
            _store_group(o1, inv, po_ptr, row * 512, head_ok, 4)
            _store_group(o2, inv, po_ptr, row * 512, head_ok, 6)
            _store_group(o3, inv, po_ptr, row * 512, head_ok, 7)
            gl.store(plse_ptr + row, gl.convert_layout(plse, HL), mask=head_ok)
            if CLUSTER > 1:
                cos, sin = _unrotation(pos, inv_freq_ptr)  # requested before the wait
                _cluster_barrier()
                _cluster_combine(po_ptr, plse_ptr, t, hb, H, split, num_splits, cos, sin, sink_ptr, o_ptr,
                                 stride_ot, stride_oh, lse_ptr, stride_lt, CLUSTER)
        else:
            sink = gl.load(sink_ptr + heads, mask=head_ok, other=0.0) * 1.4426950408889634
            m_use = gl.convert_layout(gl.where(m_i == float("-inf"), 0.0, m_i), HL)
            denom = gl.convert_layout(l_i, HL) + gl.exp2(sink - m_use)
            gl.store(lse_ptr + t * stride_lt + heads, (m_use + gl.log2(denom)) * 0.6931471805599453, mask=head_ok)
            inv = 1.0 / denom
            q0.store(_rescale(o0, inv).to(gl.bfloat16))
            q1.store(_rescale(o1, inv).to(gl.bfloat16))
            q2.store(_rescale(o2, inv).to(gl.bfloat16))
            gl.thread_barrier()
            _store_tile(q0, o_ptr + t * stride_ot, stride_oh, hb, H, 0)
            _store_tile(q1, o_ptr + t * stride_ot, stride_oh, hb, H, 4)
            _store_tile(q2, o_ptr + t * stride_ot, stride_oh, hb, H, 6)
            # The rope dims: rounded to BF16, rotated back by −pos, rounded again (as the reference).
            cos, sin = _unrotation(pos, inv_freq_ptr)
            _store_rope(_rescale(o3, inv).to(gl.bfloat16), o_ptr + t * stride_ot + NOPE_DIM, stride_oh, hb * BH, H,
                        cos, sin)

    @gluon.jit
    def _unrotation(pos, inv_freq_ptr, NWARPS: gl.constexpr = NW):
        """``(cos, −sin)`` of ``pos·ω_i`` per rope pair ``i``, fp32 ``[1, 32]`` in ``_store_rope``'s layout of
        ``[heads, 32 pairs, 2]`` over ``NWARPS`` warps."""
        PL: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, 32, 1], [NWARPS, 1, 1], [2, 1, 0])
        pair = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, PL)))
        angle = pos.to(gl.float32) * gl.load(inv_freq_ptr + pair)
        return (gl.expand_dims(gl.extra.libdevice.cos(angle), 0),
                gl.expand_dims(-gl.extra.libdevice.sin(angle), 0))

    @gluon.jit
    def _store_rope(o3, rope_ptr, stride_oh, head0, head_end, cos, sin):
        """Store the rope dims of heads ``head0 …`` (``o3`` BF16 ``[rows, 64]``, any layout) at ``rope_ptr +
        h·stride_oh + i``, rotated back per adjacent pair (``cos`` / ``sin`` of ``−pos·ω_i``: ``_unrotation``) in
        FP32 and rounded to BF16 again; heads from ``head_end`` on are not stored."""
        ROWS: gl.constexpr = o3.shape[0]
        PL: gl.constexpr = cos.type.layout.parent
        ROW2_L: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [PL.warps_per_cta[0], 1], [1, 0])
        pairs = gl.convert_layout(gl.reshape(gl.convert_layout(o3, ROW2_L), [ROWS, 32, 2]), PL)
        re, im = gl.split(pairs.to(gl.float32))
        heads = head0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, PL)))
        pair = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, PL)))
        half = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, PL)))
        out = gl.join(re * cos - im * sin, re * sin + im * cos)
        ptrs = rope_ptr + heads[:, None, None] * stride_oh + (2 * pair)[None, :, None] + half[None, None, :]
        mask = (heads < head_end)[:, None, None] & (half >= 0)[None, None, :]
        gl.store(ptrs, out.to(gl.bfloat16), mask=mask)

    @gluon.jit
    def _cluster_barrier():
        """Every thread of the cluster waits here for every other (``barrier.cluster``, arrive with release and
        wait with acquire semantics: the global writes each CTA made before it are visible to all after it)."""
        ONE_L: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])  # one element per thread
        token = gl.zeros([32 * NW], gl.int32, ONE_L)
        gl.inline_asm_elementwise(
            "barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned; mov.b32 $0, $1;",
            "=r,r", [token], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _cluster_combine(po_ptr, plse_ptr, t, hb, H, rank, num_splits, cos, sin, sink_ptr, o_ptr, stride_ot,
                         stride_oh, lse_ptr, stride_lt, CLUSTER: gl.constexpr):
        """Program ``rank`` of a cluster holding token ``t``'s ``CLUSTER`` splits (head block ``hb``) merges its
        share of the 64 heads — ``ceil(64 / CLUSTER)`` of them, 8 at a time — from every split's partial row
        (``po_ptr`` fp32 ``[T, S, H, 512]``, log-sum-exp ``plse_ptr`` ``[T, S, H]``, base 2) as
        ``sparse_attention._combine_kernel`` does: ``o = Σ_s 2^{lse_s − M} o_s / (Σ_s 2^{lse_s − M} + 2^{sink −
        M})`` with ``M`` the largest of the ``lse_s`` and the sink, the BF16 output with its rope dims rotated back
        (``cos`` / ``sin``: ``_unrotation``), and the lse (natural log)."""
        HPC: gl.constexpr = (BH + CLUSTER - 1) // CLUSTER
        C_L: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])  # [8 heads, 512 dims]
        R_L: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [NW, 1], [1, 0])  # [8 heads, 64 rope dims]
        d = gl.arange(0, 512, layout=gl.SliceLayout(0, C_L))
        r = gl.arange(0, 64, layout=gl.SliceLayout(0, R_L))
        head_end = gl.minimum(H, hb * BH + gl.minimum((rank + 1) * HPC, BH))
        for g in gl.static_range((HPC + 7) // 8):
            head0 = hb * BH + rank * HPC + g * 8
            heads = head0 + gl.arange(0, 8, layout=gl.SliceLayout(1, C_L))
            ok = heads < head_end
            heads_r = head0 + gl.arange(0, 8, layout=gl.SliceLayout(1, R_L))
            ok_r = heads_r < head_end
            # One pass with a running max (the sums so far rescaled when it grows), so that no load waits for
            # another: every split's rows are requested at once.
            m = gl.full([8], float("-inf"), gl.float32, layout=gl.SliceLayout(1, C_L))
            nope = gl.zeros([8, 512], gl.float32, layout=C_L)
            rope = gl.zeros([8, 64], gl.float32, layout=R_L)
            weight = gl.zeros([8], gl.float32, layout=gl.SliceLayout(1, C_L))
            for s in gl.static_range(CLUSTER):
                row = (t * num_splits + s) * H + heads
                plse = gl.load(plse_ptr + row, mask=ok, other=float("-inf"))
                po = gl.load(po_ptr + gl.expand_dims(row * 512, 1) + gl.expand_dims(d, 0),
                             mask=gl.expand_dims(ok, 1) & gl.expand_dims(d < NOPE_DIM, 0), other=0.0)
                row_r = (t * num_splits + s) * H + heads_r
                po_r = gl.load(po_ptr + gl.expand_dims(row_r * 512 + NOPE_DIM, 1) + gl.expand_dims(r, 0),
                               mask=gl.expand_dims(ok_r, 1), other=0.0)
                m_new = gl.maximum(m, plse)
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # 0 while no split has a key
                grown = gl.exp2(m - m_use)  # ≤ 1; 0 before the first split with a key
                w = gl.exp2(plse - m_use)  # 0 where absent
                nope = nope * gl.expand_dims(grown, 1) + gl.expand_dims(w, 1) * po
                grown_r = gl.expand_dims(gl.convert_layout(grown, gl.SliceLayout(1, R_L)), 1)
                rope = rope * grown_r + gl.expand_dims(gl.convert_layout(w, gl.SliceLayout(1, R_L)), 1) * po_r
                weight = weight * grown + w
                m = m_new
            sink = gl.load(sink_ptr + heads, mask=ok, other=0.0) * 1.4426950408889634
            top = gl.maximum(m, sink)
            kept = gl.exp2(m - top)  # 1 where m ≥ sink; 0 where no split has a key
            denom = weight * kept + gl.exp2(sink - top)
            gl.store(lse_ptr + t * stride_lt + heads, (top + gl.log2(denom)) * 0.6931471805599453, mask=ok)
            scaled = denom / kept  # inf where no split has a key: o = 0
            out = o_ptr + t * stride_ot + gl.expand_dims(heads * stride_oh, 1) + gl.expand_dims(d, 0)
            gl.store(out, (nope / gl.expand_dims(scaled, 1)).to(o_ptr.dtype.element_ty),
                     mask=gl.expand_dims(ok, 1) & gl.expand_dims(d < NOPE_DIM, 0))
            scaled_r = gl.expand_dims(gl.convert_layout(scaled, gl.SliceLayout(1, R_L)), 1)
            _store_rope((rope / scaled_r).to(gl.bfloat16), o_ptr + t * stride_ot + NOPE_DIM, stride_oh, head0,
                        head_end, cos, sin)

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


def _key_args(keys: torch.Tensor | None, args: tuple, geometry: dict) -> dict:
    """The kernel's BF16-key arguments: ``keys`` bf16 ``[B, WINDOW + entries, 512]`` (``sparse_attention.
    bf16_keys``) or ``None`` (the FP8 pages are read and dequantized per chunk)."""
    if keys is None:
        return dict(keys_ptr=args[0], stride_kb=0, key_entries=0, KEYS_BF16=False)
    return dict(keys_ptr=keys, stride_kb=keys.stride(0), key_entries=keys.shape[1] - geometry["WINDOW"],
                KEYS_BF16=True)


def launch(grid: tuple[int, int], args: tuple, geometry: dict, keys: torch.Tensor | None = None) -> None:
    """Launch the Gluon kernel: ``args`` / ``geometry`` are ``sparse_attention_fwd``'s prepared arguments and
    geometry constexprs (the Triton kernel's, see there); ``keys``: the step's keys already in BF16, or ``None``."""
    _sparse_attention_sm90_kernel[grid](*args, **geometry, **_key_args(keys, args, geometry), CLUSTER=1,
                                        num_warps=NUM_WARPS)


def launch_in_clusters(grid: tuple[int, int], args: tuple, geometry: dict, keys: torch.Tensor | None = None) -> bool:
    """Launch a split step (``grid`` = (queries · head blocks, splits), ``geometry["SPLIT"]``) with each token's
    splits as one cluster that merges its partials itself (no ``_combine_kernel``; ``kernels.cluster``), if the
    device holds every cluster of the step at once and there are 2 to ``cluster.MAX_CLUSTER`` splits. Returns
    whether it launched (else nothing ran)."""
    splits = grid[1]
    if not (geometry["SPLIT"] and 2 <= splits <= cluster_launch.MAX_CLUSTER):
        return False
    kwargs = dict(geometry, **_key_args(keys, args, geometry), CLUSTER=splits, num_warps=NUM_WARPS)
    compiled = cluster_launch.compiled_kernel(_sparse_attention_sm90_kernel, (grid[0], 1), args, kwargs)
    if cluster_launch.max_active_clusters(compiled, splits) < grid[0]:
        return False
    cluster_launch.launch(_sparse_attention_sm90_kernel, compiled, (grid[0], 1), splits, args, kwargs)
    return True
