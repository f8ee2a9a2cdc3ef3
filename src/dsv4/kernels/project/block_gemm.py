"""The official FP8 projections as one Triton kernel: the block-scaled FP8 GEMM of SPEC §1.3 on FP8 tensor cores.

``y = x @ wᵀ`` for ``x`` BF16 ``[M, K]`` (few rows: a decode step's tokens) and ``w`` a ``BlockFp8Weight``
``[N, K]`` (E4M3, one power-of-two scale per 128 × 128 block). Each program owns a ``[BM, BN]`` tile of ``y`` and a
range of 128-wide K blocks. The activations are quantized as the official ``act_quant`` does (1 × 128 blocks, UE8M0
scales: ``quant.fp8_block_qdq``, the same bits as ``fp8_gemm.quantize_activations``); per K block the program
multiplies the E4M3 codes on FP8 tensor cores (a fresh sum per K block) and adds the block's sum times both scales
into an FP32 accumulator. Every product is exact; the tensor cores sum a block's 128 products to about 14 bits
(1.3e-4 relative against FP64 sums, measured: ``benchmarks/probe_scaled_mm.py``), as the official model's FP8
kernels do, where the reference sums in FP32.

Two kernels, one per way of feeding the tensor cores:

* 17 … 64 rows (``_block_fp8_gemm_tma_kernel``): the activations quantized by one launch before, both operands'
  tiles brought into shared memory by the copy engine (TMA) several stages ahead of the tensor cores; where the
  output tiles outnumber the SMs, one program per SM walks its share of them with the K loops of its tiles
  pipelined as one, so that the next tile's loads overlap this tile's end;
* other row counts (``_block_fp8_gemm_kernel``): each program quantizes its rows' activations itself per K block
  (with ≤ 16 rows, redoing it costs less than a launch) and loads both operands with ordinary loads.

Weight-bound shapes with few output tiles (``wkv``, ``wo_b``) split K over several programs; their FP32 partial
tiles go to a workspace and the last program of a tile to arrive (a counter per tile, which that program resets)
sums them in split order: the result does not depend on arrival order, and the GEMM stays one launch.

``GemmConfig`` is one launch's decisions; ``gemm_config`` the rule, applied by the step's plan
(``ProjectionPlan``) once per step and weight shape. Large row counts (prefill) stay on cuBLAS: this kernel measured
slower there (``benchmarks/RESULTS.md``, "FP8 projections").
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from ...cache.workspace import Workspace
from ...formats.block_fp8 import ACT_BLOCK, WEIGHT_BLOCK, BlockFp8Weight
from ..quant import exp2i, fp8_block_qdq
from .fp8_gemm import quantize_activations

__all__ = ["COUNTERS", "GemmConfig", "block_fp8_linear", "gemm_config"]

#: tile counters (split-K launches use one per output tile; each is back at 0 after the launch)
COUNTERS = 1 << 14


#: row counts that take the TMA kernel (pre-quantized activations, one row tile); others the pointer kernel
TMA_MIN_ROWS, TMA_MAX_ROWS = 17, 64
#: the row tile of a persistent TMA launch whatever its row count (one warpgroup's tensor-core rows; 32-row tiles
#: measured 1–4 µs slower at 17 and 32 rows on the H200)
PERSISTENT_ROWS = 64
#: a TMA launch that splits K keeps at least this many K blocks per split (fewer: the partials' sum costs more than
#: the wider grid gains; measured on the H200 at 32 and 64 rows)
TMA_SPLIT_BLOCKS = 6


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One launch: ``[bm, bn]`` output tiles, K blocks split over ``split`` programs per tile.

    ``tma``: the activations quantized by a launch before (``fp8_gemm.quantize_activations``) and both operands'
    tiles loaded by the copy engine (``_block_fp8_gemm_tma_kernel``); else every program quantizes its rows itself.
    ``programs``: TMA, ``split`` 1 only: that many programs each walk every ``programs``-th output tile (a
    persistent grid; 0: one program per tile)."""

    bm: int
    bn: int
    split: int = 1
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False
    programs: int = 0

    def __post_init__(self) -> None:
        if self.programs and (not self.tma or self.split != 1):
            raise ValueError(f"GemmConfig: a persistent grid needs the TMA kernel and no K split, got {self}")

    def grid(self, M: int, N: int) -> tuple[int, int, int]:
        if self.tma:
            units = triton.cdiv(N, self.bn) * self.split
            return (min(units, self.programs) if self.programs else units), 1, 1
        return triton.cdiv(N, self.bn), triton.cdiv(M, self.bm), self.split

    def describe(self) -> str:
        split = f", split {self.split}" if self.split > 1 else ""
        tma = ", TMA" if self.tma else ""
        persistent = f", {self.programs} programs" if self.programs else ""
        return f"{self.bm}x{self.bn}{split}{tma}{persistent}"


@functools.lru_cache(maxsize=None)
def gemm_config(M: int, N: int, K: int, sms: int) -> GemmConfig:
    """The launch for ``[M, K] @ [N, K]ᵀ`` on a device of ``sms`` SMs.

    The smallest row tile that holds M (16 … 64), except on a persistent grid (below).

    * ``TMA_MIN_ROWS`` … ``TMA_MAX_ROWS`` rows, K a multiple of 16 (as TMA needs): the TMA kernel, 4 warps, 6
      stages. 128-column tiles that fill the SMs run on a persistent grid of one program per SM, 64 rows high
      whatever M (``PERSISTENT_ROWS``; the copy engine reads only M rows of each box); fewer tiles are
      made 64 columns wide and split K while each split keeps ``TMA_SPLIT_BLOCKS`` K blocks and the programs
      stay within two per SM (two resident per SM keep more of the weight in flight).
    * Other row counts: the pointer kernel, 4 warps, 3 stages, 128-column tiles; where those tiles do not cover
      the SMs, K split until about two programs per SM stream the weight (each split keeping ≥ 2 K blocks).

    The choices measured best on the H200 (``benchmarks/bench_fp8_projections.py --sweep``).
    """
    if M <= 0:
        raise ValueError(f"gemm_config: M must be positive, got {M}")
    bm = min(64, max(16, triton.next_power_of_2(M)))
    kblocks = triton.cdiv(K, ACT_BLOCK)
    if TMA_MIN_ROWS <= M <= TMA_MAX_ROWS and K % 16 == 0:
        if triton.cdiv(N, 128) >= sms:
            return GemmConfig(bm=PERSISTENT_ROWS, bn=128, num_stages=6, tma=True, programs=sms)
        tiles = triton.cdiv(N, 64)
        split = _k_split(kblocks, min(kblocks // TMA_SPLIT_BLOCKS, 2 * sms // tiles), tiles)
        return GemmConfig(bm=bm, bn=64, split=split, num_stages=6, tma=True)
    tiles = triton.cdiv(N, 128) * triton.cdiv(M, bm)
    split = 1 if tiles >= sms else _k_split(kblocks, min(triton.cdiv(2 * sms, tiles), kblocks // 2), tiles)
    return GemmConfig(bm=bm, bn=128, split=split)


def _k_split(kblocks: int, want: int, tiles: int) -> int:
    """About ``want`` K splits of ``kblocks`` blocks for ``tiles`` output tiles: the fewest that keep
    ``⌈kblocks / want⌉`` blocks each (none left empty), and none where the tiles would outnumber the counters."""
    split = triton.cdiv(kblocks, triton.cdiv(kblocks, max(1, want)))
    return split if tiles * split <= COUNTERS else 1


@triton.jit
def _store_tile(acc, rows, cols, row_ok, col_ok, N, out_ptr, part_ptr, count_ptr, tile, split, MN,
                BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr):
    """Store FP32 ``acc`` ``[BM, BN]`` at ``out[rows, cols]`` — or, K split, as partial ``split`` of output tile
    ``tile``; the tile's last partial to arrive sums them all in split order and resets the tile's counter."""
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(part_ptr + split * MN + offs, acc, mask=ok)
        tl.debug_barrier()  # every thread's partial stored before the release below
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            total = tl.zeros((BM, BN), dtype=tl.float32)
            for s in tl.static_range(SPLIT):  # unrolled: the partials' loads overlap instead of queueing
                total += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)
            tl.atomic_xchg(count_ptr + tile, 0)


@triton.jit
def _block_fp8_gemm_kernel(x_ptr, stride_x, w_ptr, w_scale_ptr, out_ptr, part_ptr, count_ptr, M, N, K, NKB, MN,
                           KB_PER_SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr):
    """Tile ``(pid0, pid1)`` of ``out`` ``[M, N]``, K blocks ``pid2·KB_PER_SPLIT …``, the activations quantized
    here (see the module docstring).

    x: bf16 ``[M, K]`` (row stride ``stride_x``); w: e4m3 ``[N, K]`` contiguous; w_scale: fp32 ``[⌈N/128⌉, NKB]``;
    part: fp32 ``[SPLIT, M, N]`` workspace (MN = M·N); count: int32 per tile (0 before and after)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    kk = tl.arange(0, 128)
    row_ok = rows < M
    col_ok = cols < N
    w_scale_row = w_scale_ptr + ((pid_n * BN) // 128) * NKB  # BN divides 128: one scale row per tile
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    kb0 = split * KB_PER_SPLIT
    for i in range(0, KB_PER_SPLIT):  # the last split's blocks past K load nothing
        kb = kb0 + i
        k = kb * 128 + kk
        k_ok = k < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        code, _, ebyte = fp8_block_qdq(x, 1)
        a = code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + k[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0)
        block = tl.dot(a, tl.trans(w))
        scale = exp2i(ebyte - 127)[:, None] * tl.load(w_scale_row + kb, mask=kb < NKB, other=0.0)
        acc += block * scale
    _store_tile(acc, rows, cols, row_ok, col_ok, N, out_ptr, part_ptr, count_ptr, pid_m * tl.num_programs(0) + pid_n,
                split, MN, BM, BN, SPLIT)


@triton.jit
def _block_fp8_gemm_tma_kernel(x_desc, x_scale_ptr, w_desc, w_scale_ptr, out_ptr, part_ptr, count_ptr, M, N, NKB,
                               MN, PROGRAMS, ROUNDS: tl.constexpr, KB_PER_SPLIT: tl.constexpr, BM: tl.constexpr,
                               BN: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr, FLATTEN: tl.constexpr):
    """Output tiles ``pid + r·PROGRAMS`` (r < ``ROUNDS``; a persistent grid) — or, K split, tile ``pid // SPLIT``'s
    K blocks ``(pid % SPLIT)·KB_PER_SPLIT …`` — of ``out`` ``[M, N]`` (M ≤ BM), the activations quantized before.

    x_desc: E4M3 codes ``[M, K]`` in ``[BM, 128]`` boxes; x_scale: fp32 ``[NKB, M]``; w_desc: e4m3 ``[N, K]`` in
    ``[BN, 128]`` boxes; w_scale: fp32 ``[⌈N/128⌉, NKB]``; part / count as ``_block_fp8_gemm_kernel``'s. A round
    past the last tile loads only zeros (the copy engine fills boxes outside the tensor) and stores nothing.
    ``FLATTEN`` (``SPLIT`` 1): the rounds' K loops pipelined as one (the compiler does not take it with a split's
    epilogue)."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BM)
    row_ok = rows < M
    for r in tl.range(0, ROUNDS, flatten=FLATTEN):
        unit = pid + r * PROGRAMS
        tile = unit // SPLIT
        split = unit % SPLIT
        n0 = tile * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for i in tl.range(0, KB_PER_SPLIT, num_stages=STAGES):
            kb = split * KB_PER_SPLIT + i
            block = tl.dot(x_desc.load([0, kb * 128]), w_desc.load([n0, kb * 128]).T)
            x_scale = tl.load(x_scale_ptr + kb * M + rows, mask=row_ok & (kb < NKB), other=0.0)
            w_scale = tl.load(w_scale_ptr + (n0 // 128) * NKB + kb, mask=(kb < NKB) & (n0 < N), other=0.0)
            acc += block * (x_scale[:, None] * w_scale)
        cols = n0 + tl.arange(0, BN)
        _store_tile(acc, rows, cols, row_ok, cols < N, N, out_ptr, part_ptr, count_ptr, tile, split, MN, BM, BN,
                    SPLIT)


@functools.lru_cache(maxsize=None)
def _counters(device: torch.device) -> Tensor:
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)


def block_fp8_linear(x: Tensor, w: BlockFp8Weight, out_dtype: torch.dtype, config: GemmConfig,
                     workspace: Workspace | None = None, codes: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """``x @ wᵀ`` with the official FP8 quantization points (``formats.block_fp8.fp8_linear``'s math).

    Args:
        x: ``[M, K]`` BF16 activations, rows contiguous.
        w: ``[N, K]`` block-scaled FP8 weight (N, K need not be multiples of 128).
        out_dtype: the output's dtype (the numerics' activation dtype).
        config: the launch (``gemm_config(M, N, K, sms)``, made by the step's plan); a TMA launch takes
            ``M ≤ config.bm`` and K a multiple of 16 (``ValueError`` otherwise).
        workspace: where a split launch keeps its FP32 partials (``"gemm_partials"``) and tile counters
            (``"gemm_tile_counters"``, zero between launches) — the cache's, inside a step; without one, a fresh
            partial buffer and one counter buffer per device.
        codes: a TMA launch's activations already quantized — ``fp8_gemm.quantize_activations(x)``'s output,
            made by the launch that wrote ``x`` (``fp8_gemm.attached_codes``); ``None``: quantized here.
    Returns:
        ``[M, N]`` in ``out_dtype``.
    """
    M, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K or x.stride(1) != 1:
        raise ValueError(f"block_fp8_linear: x {list(x.shape)} (inner stride {x.stride(1)}) and weight "
                         f"{list(w.shape)} do not fit")
    if (WEIGHT_BLOCK % config.bn or (config.split > 1 and config.split * M * N >= 2**31)
            or (config.tma and (M > config.bm or K % 16))):
        raise ValueError(f"block_fp8_linear: {config} does not fit a [{M}, {K}] x [{N}, {K}] GEMM")
    nkb = triton.cdiv(K, ACT_BLOCK)
    if codes is not None and (tuple(codes[0].shape) != (M, K) or tuple(codes[1].shape) != (M, nkb)):
        raise ValueError(f"block_fp8_linear: codes {list(codes[0].shape)} and scales {list(codes[1].shape)} are not "
                         f"those of a [{M}, {K}] input")
    out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0:
        return out
    part, counters = out, out
    if config.split > 1:
        if workspace is None:
            part = torch.empty((config.split, M, N), dtype=torch.float32, device=x.device)
            counters = _counters(x.device)
        else:
            part = workspace.get("gemm_partials", (config.split, M, N), torch.float32)
            counters = workspace.get("gemm_tile_counters", (COUNTERS,), torch.int32, zero=True)
    grid = config.grid(M, N)
    kb_per_split = triton.cdiv(nkb, config.split)
    if config.tma:
        codes, x_scale = quantize_activations(x) if codes is None else codes
        units = triton.cdiv(N, config.bn) * config.split
        _block_fp8_gemm_tma_kernel[grid](
            TensorDescriptor.from_tensor(codes, [config.bm, ACT_BLOCK]), x_scale, _weight_descriptor(w, config.bn),
            w.scale, out, part, counters, M, N, nkb, M * N, grid[0], ROUNDS=triton.cdiv(units, grid[0]),
            KB_PER_SPLIT=kb_per_split, BM=config.bm, BN=config.bn, SPLIT=config.split, STAGES=config.num_stages,
            FLATTEN=config.split == 1, num_warps=config.num_warps)
    else:
        _block_fp8_gemm_kernel[grid](
            x, x.stride(0), w.data, w.scale, out, part, counters, M, N, K, nkb, M * N, KB_PER_SPLIT=kb_per_split,
            BM=config.bm, BN=config.bn, SPLIT=config.split, num_warps=config.num_warps,
            num_stages=config.num_stages)
    return out


def _weight_descriptor(w: BlockFp8Weight, bn: int) -> TensorDescriptor:
    """The weight's TMA descriptor for ``[bn, 128]`` boxes, made once per weight and box."""
    cached = getattr(w, "_tma_descriptors", None)
    if cached is None:
        cached = {}
        object.__setattr__(w, "_tma_descriptors", cached)
    if bn not in cached:
        cached[bn] = TensorDescriptor.from_tensor(w.data, [bn, WEIGHT_BLOCK])
    return cached[bn]
