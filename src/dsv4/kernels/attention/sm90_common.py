"""Gluon building blocks shared by the Hopper attention kernels (``sm90_serial``, ``sm90_ws``, ``sm90_pipelined``).

The kernels hold one query token's 64 heads (``BLOCK_H``) against chunks of 64 keys (``BLOCK_N``); the 512 dims of
queries and keys live in four BF16 shared-memory tiles each (dims 0-255, 256-383, 384-447 and the 64 rope dims:
a write to one tile never waits on a read of another), the operands of ``wgmma``. Here: those tiles and layouts,
the scores and online-softmax steps (base 2), a program's token and split of its key chunks, and the copies of
BF16 key rows (``keys="bf16"`` plans, ``bf16_keys``) straight into key tiles.
"""

from __future__ import annotations

from ..device import KV_DATA_BYTES, KV_NOPE_DIM
from .plan import GLUON_BLOCK, MODES

try:  # Gluon ships with Triton ≥ 3.4; without it the Triton kernel serves
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

    _HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    _HAVE_GLUON = False

BLOCK_H = GLUON_BLOCK  # heads per program: the wgmma M of one warpgroup
BLOCK_N = GLUON_BLOCK  # keys per chunk
NUM_WARPS = 8  # the serial kernel's program (two warpgroups), and the warps the output helpers default to

if _HAVE_GLUON:
    BH = gl.constexpr(BLOCK_H)
    BN = gl.constexpr(BLOCK_N)
    NW = gl.constexpr(NUM_WARPS)
    NOPE_DIM = gl.constexpr(KV_NOPE_DIM)
    DATA_BYTES = gl.constexpr(KV_DATA_BYTES)  # per entry: 448 E4M3 codes + 64 BF16 rope values
    MODE_WINDOW = gl.constexpr(MODES.index("window"))
    MODE_LIST = gl.constexpr(MODES.index("list"))
    MODE_ALL = gl.constexpr(MODES.index("all"))

    # Key tiles as [64 keys, blocks, 64 bytes/values]: 16 consecutive elements per thread (one or two 16-B
    # copies), every [64]-per-key vector in the slice layout of the same rows.
    TILE3_L = gl.constexpr(gl.BlockedLayout([1, 1, 16], [8, 1, 4], [8, 1, 1], [2, 1, 0]))
    BLK_L = gl.constexpr(gl.SliceLayout(2, TILE3_L))  # [64, blocks]
    Q_L = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0]))  # [64 heads, dims]: 16-byte stores
    KEY_L = gl.constexpr(gl.SliceLayout(1, BLK_L))  # [64] one value per key
    # A BF16 operand tile of the tensor cores (128-byte swizzle).
    TILE_SL = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))

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
    def _fresh_rows(c, pos, start, WINDOW: gl.constexpr, KL: gl.constexpr = KEY_L):
        """Window chunk ``c``: which keys are this step's tokens (read from ``kv_new``), and their rows there
        (``[64]`` vectors in layout ``KL``)."""
        j = c * BN + gl.arange(0, BN, layout=KL)
        p = pos - (WINDOW - 1) + j
        fresh = (j < WINDOW) & (p >= start)
        return fresh, gl.maximum(p - start, 0)

    @gluon.jit
    def _block_exponents(scales, FIRST: gl.constexpr, NB: gl.constexpr):
        """int32 ``[64, NB]`` UE8M0 exponents of blocks ``FIRST … FIRST+NB−1`` from each key's scale word
        (``scales`` int64 ``[64]``, byte ``b`` = block ``b``)."""
        word = (scales >> (32 * (FIRST // 4))).to(gl.int32)  # the 32-bit half holding these blocks
        blk = gl.arange(0, NB, layout=gl.SliceLayout(0, scales.type.layout.parent))
        return (gl.expand_dims(word, 1) >> gl.expand_dims((FIRST % 4 + blk) * 8, 0)) & 0xFF

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
        _copy_keys(rows, ok, k3.index(buf), NOPE_DIM, 64)
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
