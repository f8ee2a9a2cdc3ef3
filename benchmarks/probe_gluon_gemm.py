"""Probe: a warp-specialized Gluon block-FP8 GEMM for decode rows, against the Triton TMA block GEMM.

Why (2026-11-29 afternoon, NVIDIA H200): ncu shows the Triton TMA launch of ``kernels.project.block_gemm`` at 46–56%
of DRAM bandwidth with one warp per scheduler and an eligible warp in a quarter of the cycles: one warpgroup per
program issues the loop in series (await the block's MMA, three CTA barriers, promote, issue the next copy). This
probe divides the work instead: one producer warp streams a [64, 128] activation box and two [64, 128] weight
boxes per K block into a ``STAGES``-deep ring (TMA, mbarriers, no CTA barrier in the loop); two consumer
warpgroups each own 64 columns of a 128-column tile, issue the block's MMA asynchronously, promote the previous
block (FP32, times both scales, read from global one block ahead) while it runs, then await it and release the
slot. Persistent (one program per SM walks tiles ``pid, pid + P, …``), unsplit: N a multiple of 128, M ≤ 64.

Result (the archive of ``benchmarks/RESULTS.md``, "Norms that quantize for the next GEMM; wide TMA tiles and an FP8
``wo_a`` tried"): the same bits as the Triton kernel at 64 rows; faster at 17 and 32 rows (query stack 19.9 → 16.9
and 20.8 → 18.1 µs), slower at 64 (18.0 → 19.6). Not wired into any rule. The guess then — every program reading
the activation box from L2 — did not hold: a stream-K form of this kernel with wider tiles and a rotated K order was
still slower at 64 rows, its consumers stalled on the named barriers around each slot and on the scales
(``docs/perf/2026-11-29-stream-k-gemm.md``).

    python benchmarks/probe_gluon_gemm.py          (CUDA, Hopper)
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from dsv4.bench.roofline import measure_copy_bandwidth, time_cuda
from dsv4.formats.block_fp8 import BlockFp8Weight, fp8_linear as reference_fp8_linear
from dsv4.kernels.device import sm_count
from dsv4.kernels.project.block_gemm import block_fp8_linear, gemm_config
from dsv4.kernels.project.fp8_gemm import quantize_activations

REQUIRES_CUDA = True

BM = gl.constexpr(64)
HALF = gl.constexpr(64)
BK = gl.constexpr(128)


@gluon.jit
def _producer(x_desc, w_desc, x_s, w0_s, w1_s, ready, empty, n_tiles, NKB, STAGES: gl.constexpr):
    """One warp: per tile of this program and K block, wait for the ring slot to be free (``empty``: both
    consumers released it), then copy the activation box and the tile's two weight halves into it (``ready``)."""
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    nbytes: gl.constexpr = x_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes
    c = 0
    for tile in range(pid, n_tiles, P):
        n0 = tile * 2 * HALF
        for kb in range(NKB):
            s = c % STAGES
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(x_desc, [0, kb * BK], ready.index(s), x_s.index(s))
            tma.async_copy_global_to_shared(w_desc, [n0, kb * BK], ready.index(s), w0_s.index(s))
            tma.async_copy_global_to_shared(w_desc, [n0 + HALF, kb * BK], ready.index(s), w1_s.index(s))
            c += 1


@gluon.jit
def _consumer(x_s, w_s, ready, empty, x_scale_ptr, w_scale_ptr, out_ptr, M, N, n_tiles, NKB, HALF_IDX: gl.constexpr,
              STAGES: gl.constexpr):
    """One warpgroup: columns ``HALF_IDX·64 …`` of each tile. Per K block: the block's MMA issued, the previous
    block promoted while it runs (times its activation and weight scales, loaded one block ahead), the MMA awaited,
    the slot released; the tile's columns stored in BF16."""
    MMA_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 32])
    ROW_L: gl.constexpr = gl.SliceLayout(1, MMA_L)
    COL_L: gl.constexpr = gl.SliceLayout(0, MMA_L)
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    rows = gl.arange(0, BM, layout=ROW_L)
    row_ok = rows < M
    zero = gl.zeros([BM, HALF], gl.float32, MMA_L)
    c = 0
    for tile in range(pid, n_tiles, P):
        n0 = tile * 2 * HALF
        w_srow = w_scale_ptr + (n0 // 128) * NKB
        xs_next = gl.load(x_scale_ptr + rows, mask=row_ok, other=0.0)
        ws_next = gl.load(w_srow)
        acc = zero
        prev = zero
        prev_s = gl.zeros([BM], gl.float32, ROW_L)
        for kb in range(NKB):
            s = c % STAGES
            xs = xs_next
            ws = ws_next
            more = kb + 1 < NKB
            xs_next = gl.load(x_scale_ptr + (kb + 1) * M + rows, mask=row_ok & more, other=0.0)
            ws_next = gl.load(w_srow + kb + 1, mask=more, other=0.0)
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            cur = warpgroup_mma(x_s.index(s), w_s.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
            acc = acc + prev * gl.expand_dims(prev_s, 1)
            cur = warpgroup_mma_wait(0, deps=[cur])
            mbarrier.arrive(empty.index(s))
            prev = cur
            prev_s = xs * ws
            c += 1
        acc = acc + prev * gl.expand_dims(prev_s, 1)
        cols = n0 + HALF_IDX * HALF + gl.arange(0, HALF, layout=COL_L)
        offs = gl.expand_dims(rows.to(gl.int64), 1) * N + gl.expand_dims(cols, 0)
        ok = gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < N, 0)
        gl.store(out_ptr + offs, acc.to(gl.bfloat16), mask=ok)


@gluon.jit
def _gemm_kernel(x_desc, x_scale_ptr, w_desc, w_scale_ptr, out_ptr, M, N, n_tiles, NKB, STAGES: gl.constexpr,
                 CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """Grid ``(programs,)``: the ring and its barriers, then the two consumers and the producer."""
    x_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, BK], x_desc.layout)
    w0_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, HALF, BK], w_desc.layout)
    w1_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, HALF, BK], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both consumer warpgroups
    gl.warp_specialize([
        (_consumer, (x_s, w0_s, ready, empty, x_scale_ptr, w_scale_ptr, out_ptr, M, N, n_tiles, NKB, 0, STAGES)),
        (_consumer, (x_s, w1_s, ready, empty, x_scale_ptr, w_scale_ptr, out_ptr, M, N, n_tiles, NKB, 1, STAGES)),
        (_producer, (x_desc, w_desc, x_s, w0_s, w1_s, ready, empty, n_tiles, NKB, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def gluon_block_fp8_linear(codes: torch.Tensor, x_scale: torch.Tensor, w: BlockFp8Weight, programs: int,
                           stages: int = 6, consumer_regs: int = 152, producer_regs: int = 40) -> torch.Tensor:
    """``x @ wᵀ`` from pre-quantized activations: codes float8_e4m3fn ``[M, K]`` (M ≤ 64), x_scale fp32
    ``[⌈K/128⌉, M]`` contiguous, w ``[N, K]`` (N a multiple of 128) → bf16 ``[M, N]``, on at most ``programs``
    persistent programs."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    M, K = codes.shape
    N = w.shape[0]
    layout = gl.NVMMASharedLayout.get_default_for([64, 128], gl.float8e4nv)
    x_desc = TensorDescriptor.from_tensor(codes, [64, 128], layout)
    w_desc = TensorDescriptor.from_tensor(w.data, [64, 128], layout)
    out = torch.empty((M, N), dtype=torch.bfloat16, device=codes.device)
    n_tiles = N // 128
    _gemm_kernel[(min(programs, n_tiles),)](x_desc, x_scale, w_desc, w.scale, out, M, N, n_tiles, triton.cdiv(K, 128),
                                            STAGES=stages, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
                                            num_warps=4)
    return out


def _timed(calls: list) -> float:
    """Seconds per call of a CUDA graph of ``calls`` (each over another copy of the weight: none in L2)."""
    return time_cuda(lambda: [f() for f in calls], warmup=3, iters=20, graph=True) / len(calls)


def main() -> None:
    """The probe against the rule's Triton launch at 64, 32 and 17 rows, cold weights, both fed the same
    pre-quantized activations; its error against the reference and whether its bits are the Triton kernel's."""
    bw, sms = measure_copy_bandwidth("cuda"), sm_count("cuda")
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s")
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda")

    for name, (N, K) in (("q stack", (40960, 1024)), ("wq_b", (32768, 1024)), ("wo_b", (4096, 8192))):
        w = BlockFp8Weight.quantize(randn(N, K) * K**-0.5 * torch.exp(randn(N, 1)))
        copies = [w] + [BlockFp8Weight(w.data.clone(), w.scale.clone())
                        for _ in range(max(1, -(-(150 << 20) // w.nbytes)) - 1)]
        for M in (64, 32, 17):
            x = (randn(M, K) * torch.exp(randn(M, 1))).bfloat16()
            want = reference_fp8_linear(x, w, torch.float32)
            codes, x_scale = quantize_activations(x)
            x_scale_rows = x_scale.t().contiguous()  # [K/128, M]
            config = gemm_config(M, N, K, sms)
            triton_out = block_fp8_linear(x, w, torch.bfloat16, config, codes=(codes, x_scale))
            t = _timed([lambda c=c: block_fp8_linear(x, c, torch.bfloat16, config, codes=(codes, x_scale))
                        for c in copies])
            line = f"{name} M={M}: Triton {config.describe()} {t * 1e6:.1f} us (roofline {w.nbytes / bw * 1e6:.1f})"
            for stages in (4, 6):
                got = gluon_block_fp8_linear(codes, x_scale_rows, w, sms, stages=stages)
                rel = ((got.float() - want).norm() / want.norm()).item()
                t = _timed([lambda c=c: gluon_block_fp8_linear(codes, x_scale_rows, c, sms, stages=stages)
                            for c in copies])
                line += (f" | Gluon {stages} stages {t * 1e6:.1f} us, rel err {rel:.1e}, "
                         f"Triton's bits {torch.equal(got, triton_out)}")
            print(line, flush=True)


if __name__ == "__main__":
    main()
