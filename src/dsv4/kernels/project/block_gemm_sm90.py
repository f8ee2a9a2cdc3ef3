"""The official FP8 projections at decode row counts on Hopper: a warp-specialized, stream-K Gluon GEMM.

``y = x @ wᵀ`` for E4M3 activation codes ``[M, K]`` (M ≤ 64, quantized before: ``fp8_gemm.quantize_activations``
or a norm launch's attached codes) with UE8M0 block scales, and a ``BlockFp8Weight`` ``[N, K]``: the math of
``block_gemm._block_fp8_gemm_tma_kernel`` (per 128-wide K block a fresh FP8 tensor-core sum, times both scales,
added in FP32), organised for a GEMM that is bound by reading the weight once:

* **Stream-K.** The ``tiles × K blocks`` iterations (a tile: ``2 · slice`` output columns by all rows) are cut into
  one equal contiguous range per program (one program per SM): every SM streams the same share of the weight
  whatever the tile count, with no wave tail and no K split to choose. A tile whose K blocks several programs
  share is finished by the last of them to arrive: each stores its FP32 partial in the workspace slot of its rank
  among the tile's programs and counts itself in (a counter per tile and slice); the last sums the slots in rank
  order (the result does not depend on arrival order) and resets the counter.
* **Warp specialization.** One producer warp streams, per iteration, the activation box ``[64, 128]`` and two
  weight boxes ``[slice, 128]`` into a ``stages``-deep shared-memory ring with the copy engine (TMA); two consumer
  warpgroups each multiply the activation box by their weight box on the tensor cores and promote the block's
  sum. Nothing in the loop waits at a CTA barrier.
* **Wide tiles.** Every program reads the activation box of each of its K blocks from L2: with 128-column slices
  (256-column tiles) those reads are a quarter of the weight's bytes at 64 rows, not a half or all of them.

The results differ from the Triton kernel's only where a tile is split (its partial sums are added in another
grouping); both are within the FP32 summation bound of the reference (``tests/kernels/project``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
from torch import Tensor

from ...formats.block_fp8 import ACT_BLOCK, BlockFp8Weight

try:  # Gluon ships with Triton ≥ 3.4
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

__all__ = ["HAVE_GLUON", "MAX_ROWS", "StreamKConfig", "stream_k_config", "stream_k_linear", "stream_k_slots"]

#: rows per launch (the tensor cores' M: one warpgroup instruction row tile)
MAX_ROWS = 64
#: shared memory a launch may use for its ring (of the H100 / H200's 227 KiB per block)
RING_BYTES = 200 * 1024
#: registers per thread of the consumer warpgroups and of the producer warp
CONSUMER_REGS, PRODUCER_REGS = 168, 40


@dataclasses.dataclass(frozen=True)
class StreamKConfig:
    """One launch: ``programs`` programs, each two warpgroups of ``slice`` output columns (tiles of ``2 · slice``
    columns), a ring of ``stages`` K blocks."""

    programs: int
    slice: int = 128
    stages: int = 5

    def __post_init__(self) -> None:
        if self.slice not in (64, 128) or self.programs < 1 or self.stages < 2:
            raise ValueError(f"StreamKConfig: slice must be 64 or 128, programs ≥ 1, stages ≥ 2; got {self}")
        if self.stages * self.stage_bytes > RING_BYTES:
            raise ValueError(f"StreamKConfig: {self.stages} stages of {self.stage_bytes} bytes exceed {RING_BYTES}")

    @property
    def tile_cols(self) -> int:
        return 2 * self.slice

    @property
    def stage_bytes(self) -> int:
        return (MAX_ROWS + self.tile_cols) * ACT_BLOCK

    def describe(self) -> str:
        return f"stream-K {self.programs} programs, {self.tile_cols}-column tiles, {self.stages} stages"


@functools.lru_cache(maxsize=None)
def stream_k_config(N: int, K: int, sms: int, slice: int = 128, min_blocks: int = 4) -> StreamKConfig:
    """The launch for an ``[N, K]`` weight on a device of ``sms`` SMs, with the deepest ring (≤ 8 stages) that
    fits. Programs: at least as many tiles as SMs — one per SM, or a few fewer where that count divides the tiles
    (whole tiles only: no partials); fewer tiles — one per SM, or fewer where each would stream fewer than
    ``min_blocks`` iterations (a small weight: more programs would add partials, not bandwidth)."""
    ring = StreamKConfig(programs=1, slice=slice, stages=2)
    stages = min(8, RING_BYTES // ring.stage_bytes)
    tiles = triton.cdiv(N, ring.tile_cols)
    if tiles >= sms:
        programs = next((p for p in range(sms, (9 * sms) // 10 - 1, -1) if tiles % p == 0), sms)
    else:
        programs = max(1, min(sms, tiles * triton.cdiv(K, ACT_BLOCK) // min_blocks))
    return StreamKConfig(programs=programs, slice=slice, stages=stages)


def stream_k_slots(N: int, K: int, config: StreamKConfig) -> int:
    """Workspace slots (``[slots, M, N]`` FP32 partials) a launch needs: the most programs that share one of the
    stream-K tiles (those left over after each program's whole tiles; the kernel's ``_schedule``)."""
    nkb = triton.cdiv(K, ACT_BLOCK)
    tiles = triton.cdiv(N, config.tile_cols)
    programs = min(config.programs, tiles * nkb)
    rem = (tiles % programs) * nkb if tiles >= programs else tiles * nkb
    if rem == 0:
        return 1
    if programs >= rem:
        return nkb
    return min(nkb, triton.cdiv(nkb, rem // programs) + 1)


if HAVE_GLUON:
    BM = gl.constexpr(MAX_ROWS)
    BK = gl.constexpr(ACT_BLOCK)
    CONSUMER_NREG = gl.constexpr(CONSUMER_REGS)
    PRODUCER_NREG = gl.constexpr(PRODUCER_REGS)

    @gluon.jit
    def _schedule(NKB, total):
        """This program's share: ``R`` whole tiles (iterations ``[a0, a0 + R·NKB)``), then the stream-K range
        ``[b0, b1)`` of the ``rem`` iterations past ``base`` (the tiles left over after every program's R)."""
        P = gl.num_programs(0)
        pid = gl.program_id(0)
        R = (total // NKB) // P
        base = R * P * NKB
        rem = total - base
        return pid * R * NKB, R * NKB, base + pid * rem // P, base + (pid + 1) * rem // P, base, rem

    @gluon.jit
    def _next(tile, kb, i, n_a, b0, NKB):
        """The ``(tile, K block)`` of the program's iteration ``i + 1``, given iteration ``i``'s: the next block,
        the next tile after a tile's last, or the stream-K range's first after the whole tiles."""
        last = kb == NKB - 1
        tile_n = gl.where(last, tile + 1, tile)
        kb_n = gl.where(last, 0, kb + 1)
        jump = i + 1 == n_a
        return gl.where(jump, b0 // NKB, tile_n), gl.where(jump, b0 % NKB, kb_n)

    @gluon.jit
    def _producer(x_desc, w_desc, x_s, w_s, xs_s, ws_s, ready, empty, x_scale_ptr, scale_stride, w_scale_ptr, M, N,
                  a0, n_a, b0, n, NKB, BOX: gl.constexpr, STAGES: gl.constexpr):
        """One warp: the program's ``i``-th iteration into ring slot ``i % STAGES`` once both consumers have
        released it (``empty``): the activation box and two weight boxes (TMA), the block's activation scales and
        the two slices' weight scales (``cp.async``); ``ready`` completes when all have landed."""
        nbytes: gl.constexpr = x_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes
        SC_L: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
        rows = gl.arange(0, BM, layout=SC_L)
        slices = gl.arange(0, 2, layout=gl.BlockedLayout([2], [32], [1], [0]))
        tile = gl.where(n_a > 0, a0 // NKB, b0 // NKB)
        kb = gl.where(n_a > 0, 0, b0 % NKB)
        for i in range(0, n):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # the ring's first round passes
            async_copy.async_copy_global_to_shared(xs_s.index(s), x_scale_ptr + kb * scale_stride + rows,
                                                   mask=rows < M)
            col0 = (2 * tile + slices) * BOX
            async_copy.async_copy_global_to_shared(ws_s.index(s), w_scale_ptr + (col0 // 128) * NKB + kb,
                                                   mask=col0 < N)
            async_copy.mbarrier_arrive(ready.index(s))  # holds the phase until this thread's copies land
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(x_desc, [0, kb * BK], ready.index(s), x_s.index(s))
            tma.async_copy_global_to_shared(w_desc, [2 * tile * BOX, kb * BK], ready.index(s), w_s.index(2 * s))
            tma.async_copy_global_to_shared(w_desc, [(2 * tile + 1) * BOX, kb * BK], ready.index(s),
                                            w_s.index(2 * s + 1))
            tile, kb = _next(tile, kb, i, n_a, b0, NKB)

    @gluon.jit
    def _sum_partials(part_ptr, out_ptr, col0, M, N, MN, sharers, BOX: gl.constexpr, SLOTS: gl.constexpr):
        """``out[:, col0 … col0 + BOX]`` = the sum of the ``sharers`` (≤ ``SLOTS``) partials in rank order, 16 rows
        at a time (memory to memory, in a layout of few registers; every slot's load issued before the first
        sum)."""
        SUM_L: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
        cols = col0 + gl.arange(0, BOX, layout=gl.SliceLayout(0, SUM_L))
        for r0 in range(0, M, 16):
            rows = r0 + gl.arange(0, 16, layout=gl.SliceLayout(1, SUM_L))
            offs = gl.expand_dims(rows, 1) * N + gl.expand_dims(cols, 0)
            ok = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
            total = gl.load(part_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")
            for r in gl.static_range(1, SLOTS):
                total += gl.load(part_ptr + r * MN + offs, mask=ok & (r < sharers), other=0.0, cache_modifier=".cg")
            gl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)

    @gluon.jit
    def _finish_slice(acc, tile, C, rows, row_ok, out_ptr, part_ptr, count_ptr, M, N, NKB, MN, b0, b1, base, rem,
                      BOX: gl.constexpr, SLOTS: gl.constexpr, COL_L: gl.constexpr):
        """Slice ``C`` of ``tile`` (columns ``(2·tile + C)·BOX …``): stored where this program ran all the tile's
        K blocks; else stored as this program's partial (slot: its rank among the tile's programs), and summed by
        the last of the tile's programs to arrive. A stream-K iteration g's program is ``((g − base + 1)·P −
        1) // rem``."""
        col0 = (2 * tile + C) * BOX
        cols = col0 + gl.arange(0, BOX, layout=COL_L)
        offs = gl.expand_dims(rows, 1) * N + gl.expand_dims(cols, 0)  # < 2³¹: checked at launch
        ok = gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < N, 0)
        t0 = tile * NKB
        if (t0 < base) | ((b0 <= t0) & (b1 >= t0 + NKB)):
            gl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)
        else:
            P = gl.num_programs(0)
            first = ((t0 - base + 1) * P - 1) // rem
            sharers = ((t0 + NKB - base) * P - 1) // rem - first + 1
            gl.store(part_ptr + (gl.program_id(0) - first) * MN + offs, acc, mask=ok)
            gl.thread_barrier()  # the warpgroup's partial stored before the release below
            counter = count_ptr + 2 * tile + C
            arrived = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == sharers - 1:
                _sum_partials(part_ptr, out_ptr, col0, M, N, MN, sharers, BOX, SLOTS)
                gl.atomic_xchg(counter, 0)

    @gluon.jit
    def _consumer(x_s, w_s, xs_s, ws_s, ready, empty, out_ptr, part_ptr, count_ptr, M, N, NKB, MN, a0, n_a, b0, n,
                  base, rem, C: gl.constexpr, BOX: gl.constexpr, STAGES: gl.constexpr, SLOTS: gl.constexpr):
        """One warpgroup: column slice ``C`` (of 2) of every tile of this program's share. Per iteration the
        block's ``[64, BOX]`` sum on the tensor cores times the rows' activation scales and the slice's weight
        scale (from the ring), added to the FP32 accumulator; at the last of a tile's blocks in the share, the
        slice finished (``_finish_slice``)."""
        MMA_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BOX, 32])
        ROW_L: gl.constexpr = gl.SliceLayout(1, MMA_L)
        COL_L: gl.constexpr = gl.SliceLayout(0, MMA_L)
        PAIR_L: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])
        rows = gl.arange(0, BM, layout=ROW_L)
        row_ok = rows < M
        pick = gl.arange(0, 2, layout=PAIR_L) == C
        b1 = b0 + n - n_a
        acc = gl.zeros([BM, BOX], gl.float32, MMA_L)
        tile = gl.where(n_a > 0, a0 // NKB, b0 // NKB)
        kb = gl.where(n_a > 0, 0, b0 % NKB)
        for i in range(0, n):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            block = warpgroup_mma(x_s.index(s), w_s.index(2 * s + C).permute((1, 0)),
                                  gl.zeros([BM, BOX], gl.float32, MMA_L), use_acc=False, is_async=True)
            w_scale = gl.sum(gl.where(pick, ws_s.index(s).load(PAIR_L), 0.0), axis=0)
            scale = gl.expand_dims(xs_s.index(s).load(ROW_L) * w_scale, 1)
            block = warpgroup_mma_wait(0, deps=[block])
            mbarrier.arrive(empty.index(s))
            acc = acc + block * scale
            tile_n, kb_n = _next(tile, kb, i, n_a, b0, NKB)
            if (tile_n != tile) | (i + 1 == n):
                _finish_slice(acc, tile, C, rows, row_ok, out_ptr, part_ptr, count_ptr, M, N, NKB, MN, b0, b1, base,
                              rem, BOX, SLOTS, COL_L)
                acc = gl.zeros([BM, BOX], gl.float32, MMA_L)
            tile = tile_n
            kb = kb_n

    @gluon.jit
    def _stream_k_kernel(x_desc, x_scale_ptr, scale_stride, w_desc, w_scale_ptr, out_ptr, part_ptr, count_ptr, M, N,
                         NKB, MN, total, BOX: gl.constexpr, STAGES: gl.constexpr, SLOTS: gl.constexpr):
        """Program ``p`` of ``P``: its whole tiles and its stream-K range (``_schedule``) of the ``total = tiles ·
        NKB`` iterations.

        x_desc: E4M3 codes ``[M, K]`` in ``[64, 128]`` boxes; x_scale: fp32, block ``kb`` of row ``m`` at
        ``kb·scale_stride + m``; w_desc: E4M3 ``[N, K]`` in ``[BOX, 128]`` boxes; w_scale: fp32 ``[⌈N/128⌉,
        NKB]``; out: ``[M, N]`` (MN = M·N); part: fp32 ``[SLOTS, M, N]`` partials; count: int32 per ``BOX``
        columns (0 before and after). Boxes past the tensors' ends arrive as zeros (TMA)."""
        a0, n_a, b0, b1, base, rem = _schedule(NKB, total)
        n = n_a + b1 - b0
        x_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, BK], x_desc.layout)
        w_s = gl.allocate_shared_memory(gl.float8e4nv, [2 * STAGES, BOX, BK], w_desc.layout)
        VEC_SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        xs_s = gl.allocate_shared_memory(gl.float32, [STAGES, BM], VEC_SL)
        ws_s = gl.allocate_shared_memory(gl.float32, [STAGES, 2], VEC_SL)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)  # both consumer warpgroups
        gl.warp_specialize([
            (_consumer, (x_s, w_s, xs_s, ws_s, ready, empty, out_ptr, part_ptr, count_ptr, M, N, NKB, MN, a0, n_a, b0,
                         n, base, rem, 0, BOX, STAGES, SLOTS)),
            (_consumer, (x_s, w_s, xs_s, ws_s, ready, empty, out_ptr, part_ptr, count_ptr, M, N, NKB, MN, a0, n_a, b0,
                         n, base, rem, 1, BOX, STAGES, SLOTS)),
            (_producer, (x_desc, w_desc, x_s, w_s, xs_s, ws_s, ready, empty, x_scale_ptr, scale_stride, w_scale_ptr,
                         M, N, a0, n_a, b0, n, NKB, BOX, STAGES)),
        ], [4, 1], [CONSUMER_NREG, PRODUCER_NREG])


def _descriptor(t: Tensor, rows: int) -> "TensorDescriptor":
    return TensorDescriptor.from_tensor(t, [rows, ACT_BLOCK],
                                        gl.NVMMASharedLayout.get_default_for([rows, ACT_BLOCK], gl.float8e4nv))


def _weight_descriptor(w: BlockFp8Weight, box: int) -> "TensorDescriptor":
    """The weight's Gluon TMA descriptor for ``[box, 128]`` boxes, made once per weight and box."""
    cached = getattr(w, "_gluon_descriptors", None)
    if cached is None:
        cached = {}
        object.__setattr__(w, "_gluon_descriptors", cached)
    if box not in cached:
        cached[box] = _descriptor(w.data, box)
    return cached[box]


def stream_k_linear(codes: Tensor, x_scale: Tensor, w: BlockFp8Weight, out: Tensor, config: StreamKConfig,
                    partials: Tensor, counters: Tensor) -> Tensor:
    """``out = (codes · scales) @ wᵀ`` with the official FP8 quantization points, one launch.

    Args:
        codes: float8_e4m3fn ``[M, K]`` activation codes, rows contiguous (M ≤ 64, K a multiple of 16).
        x_scale: fp32 ``[M, ⌈K/128⌉]`` UE8M0 scales with unit row stride (``quantize_activations``' layout: a
            transposed view of ``[⌈K/128⌉, M]``).
        w: ``[N, K]`` block-scaled FP8 weight.
        out: ``[M, N]`` BF16 or FP32 output, contiguous; written.
        config: the launch (``stream_k_config``).
        partials: fp32, at least ``stream_k_slots(N, K, config) · M · N`` elements (contents do not matter).
        counters: int32, at least ``⌈N / config.slice⌉`` elements, all zero (zero again after the launch).
    Returns:
        ``out``.
    """
    M, K = codes.shape
    N = w.shape[0]
    nkb = triton.cdiv(K, ACT_BLOCK)
    slots = stream_k_slots(N, K, config)
    if (M > MAX_ROWS or K % 16 or w.shape[1] != K or codes.dtype != torch.float8_e4m3fn or codes.stride(1) != 1
            or tuple(x_scale.shape) != (M, nkb) or x_scale.stride(0) != 1 or x_scale.dtype != torch.float32):
        raise ValueError(f"stream_k_linear: codes {codes.dtype} {list(codes.shape)} (strides {codes.stride()}), "
                         f"scales {x_scale.dtype} {list(x_scale.shape)} (strides {x_scale.stride()}) and weight "
                         f"{list(w.shape)} do not fit (M ≤ {MAX_ROWS}, K % 16 == 0, unit strides)")
    if (tuple(out.shape) != (M, N) or not out.is_contiguous() or partials.numel() < slots * M * N
            or slots * M * N >= 2**31 or counters.numel() < triton.cdiv(N, config.slice)):
        raise ValueError(f"stream_k_linear: out {list(out.shape)}, {partials.numel()} partials or "
                         f"{counters.numel()} counters do not fit a [{M}, {K}] x [{N}, {K}] GEMM under "
                         f"{config.describe()}")
    if M == 0:
        return out
    total = triton.cdiv(N, config.tile_cols) * nkb
    _stream_k_kernel[(min(config.programs, total),)](
        _descriptor(codes, MAX_ROWS), x_scale, x_scale.stride(1), _weight_descriptor(w, config.slice), w.scale, out,
        partials, counters, M, N, nkb, M * N, total, BOX=config.slice, STAGES=config.stages, SLOTS=slots, num_warps=4)
    return out
