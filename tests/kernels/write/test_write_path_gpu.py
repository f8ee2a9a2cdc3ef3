"""Triton write path == torch backend, byte for byte, on the GPU (marked gpu; skipped without CUDA).

Every step runs the write ops (``window_entries`` / ``compress`` / ``append_swa``) of one layer on two caches
holding the same random garbage in their pools: one through ``dsv4.ops.torch_ops``, one through
``dsv4.ops.triton_ops``. After each step the window entries and every byte of the layer's state (ring,
positions, tails, previous-window state) and pool (KV pages, indexer pages) must be identical. V4-Flash layer
geometry (window 128, ratios 4 / 128); fresh random inputs each step.
"""

from __future__ import annotations

import random

import pytest
import torch

import dsv4
from dsv4.layer import Attention
from dsv4.ops import torch_ops

from support.write_path import differences, make_cache, write_step

pytestmark = pytest.mark.gpu
triton_ops = pytest.importorskip("dsv4.ops.triton_ops")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from dsv4.kernels import torch_order  # noqa: E402  (needs triton)
from dsv4.kernels.quant import bf16_round  # noqa: E402
from dsv4.kernels.write import pool as write_pool  # noqa: E402
from dsv4.kernels.write.plan import HCA_POOL_PARTS  # noqa: E402
from dsv4.kernels import quant  # noqa: E402
from dsv4.reference.compressor import overlap_slots, pool_windows  # noqa: E402
from dsv4.reference.primitives import rms_norm  # noqa: E402
CFG = dsv4.ModelConfig.preset("v4-flash")
LAYERS = {"swa": 0, "csa": 2, "hca": 3}


def _layer(li: int) -> Attention:
    return Attention(dsv4.AttentionWeights.random(CFG, li, seed=7, device="cuda"), CFG, li, backend="torch")


def _compare_run(kind: str, plans: list[dict[str, int]], seed: int, max_requests: int) -> None:
    li = LAYERS[kind]
    lay = _layer(li)
    nblocks = 8 + sum(sum(p.values()) for p in plans) // 256 + 3 * max_requests
    ca = make_cache(CFG, [li], "cuda", max_requests, num_blocks=nblocks, block_size=256)
    cb = make_cache(CFG, [li], "cuda", max_requests, num_blocks=nblocks, block_size=256)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for step, plan in enumerate(plans):
        for rid in plan:
            if rid not in ca:
                ca.add_request(rid)
                cb.add_request(rid)
        ba, bb = ca.prepare_forward(plan), cb.prepare_forward(plan)
        x = torch.randn(ba.num_tokens, CFG.hidden_size, generator=g, device="cuda")
        k1 = write_step(torch_ops, lay, ca, ba, x)
        k2 = write_step(triton_ops, lay, cb, bb, x)
        nk = int((k1.view(torch.int16) != k2.view(torch.int16)).sum())
        diffs = differences(ca, cb, li)
        assert nk == 0 and not diffs, f"{kind} step {step} ({len(plan)} requests, emit {ba.num_emit}): kv_new {nk} values, {diffs}"


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_decode_steps_match_torch(kind: str, batch: int) -> None:
    rng = random.Random(batch)
    ids = [f"r{i}" for i in range(batch)]
    # a short random prefill per request (windows partly filled), then decode steps crossing window closes
    plans = [{r: rng.randint(1, 300) for r in ids}] + [{r: 1 for r in ids} for _ in range(5)]
    if kind == "hca":  # make some requests close a 128-window during the decode steps
        plans[0] = {r: 128 * rng.randint(0, 2) + 125 + rng.randint(0, 2) for r in ids}
    _compare_run(kind, plans, seed=batch, max_requests=batch)


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("batch", [1, 3, 16])
def test_prefill_chunks_match_torch(kind: str, batch: int) -> None:
    rng = random.Random(100 + batch)
    ids = [f"r{i}" for i in range(batch)]
    plans = []
    for _ in range(4):
        chosen = rng.sample(ids, k=max(1, batch - rng.randint(0, batch // 2)))
        plans.append({r: rng.choice([1, 2, 3, 4, 7, rng.randint(1, 300), rng.randint(100, 900)]) for r in chosen})
    _compare_run(kind, plans, seed=1000 + batch, max_requests=batch)


def test_mixed_prefill_and_spec_decode_match_torch() -> None:
    rng = random.Random(5)
    ids = [f"r{i}" for i in range(12)]
    plans = [{r: rng.randint(1, 700) for r in ids}] + [{r: rng.randint(1, 4) for r in ids} for _ in range(5)]
    plans.append({"r0": 1024, **{r: 1 for r in ids[1:]}})
    for kind in LAYERS:
        _compare_run(kind, plans, seed=5, max_requests=12)


@pytest.mark.parametrize("kind", ["csa", "hca", "swa"])
def test_cuda_graph_replay_matches_eager(kind: str) -> None:
    """Capture one decode step of the write ops on a static batch; replay it over steps where windows close and
    where they do not; the cache bytes equal an eager Triton run of the same steps."""
    li = LAYERS[kind]
    lay = _layer(li)
    B, maxb = 8, 4
    ce = make_cache(CFG, [li], "cuda", B, num_blocks=2 * B * maxb, block_size=256)  # eager
    cg = make_cache(CFG, [li], "cuda", B, num_blocks=2 * B * maxb, block_size=256)  # graph
    ids = [f"r{i}" for i in range(B)]
    g = torch.Generator(device="cuda").manual_seed(11)
    pre = {r: 120 + 3 * i for i, r in enumerate(ids)}  # HCA requests reach their 128-window close at different steps
    for c in (ce, cg):
        for r in ids:
            c.add_request(r)
    x0 = torch.randn(sum(pre.values()), CFG.hidden_size, generator=g, device="cuda")
    for c in (ce, cg):
        write_step(triton_ops, lay, c, c.prepare_forward(pre, max_blocks=maxb), x0)
    plan = {r: 1 for r in ids}
    # warm-up step (eager) on the static batch, then capture
    static = cg.prepare_forward(plan, max_blocks=maxb)
    x_static = torch.randn(B, CFG.hidden_size, generator=g, device="cuda")
    write_step(triton_ops, lay, ce, ce.prepare_forward(plan, max_blocks=maxb), x_static)
    write_step(triton_ops, lay, cg, static, x_static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_step(triton_ops, lay, cg, static, x_static)
    for step in range(12):
        x = torch.randn(B, CFG.hidden_size, generator=g, device="cuda")
        be = ce.prepare_forward(plan, max_blocks=maxb)
        k_e = write_step(triton_ops, lay, ce, be, x)
        static.copy_(cg.prepare_forward(plan, max_blocks=maxb))
        x_static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        diffs = differences(ce, cg, li)
        assert not diffs, f"{kind} replay step {step} (emit {be.num_emit}): {diffs}"


# ------------------------------------------------------------------------------------------ reduction orders
# The byte comparisons above see a wrong summation order only when a 1-ulp change flips a stored rounding (a few
# bytes in 10^5 entries). These compare the order-sensitive fp32 intermediates themselves, row by row: a wrong
# order differs in about a third of the rows.
@triton.jit
def _rms_rows_kernel(x_ptr, w_ptr, y_ptr, scratch_ptr, num_emit, eps, C: tl.constexpr, MAXT: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, C)
    y = torch_order.rms_norm_bf16(tl.load(x_ptr + e * C + cols), tl.load(w_ptr + cols), eps, num_emit, scratch_ptr + e * C,
                         C, MAXT)
    tl.store(y_ptr + e * C + cols, y)


@triton.jit
def _pool_rows_kernel(a_ptr, z_ptr, ape_ptr, out_ptr, C: tl.constexpr, M: tl.constexpr, OVERLAP: tl.constexpr,
                      NW: tl.constexpr, PARTS: tl.constexpr, IN_STEP: tl.constexpr, AZ: tl.constexpr):
    i = tl.program_id(0) + 1  # entries 1 … n−1 of a sequence starting at 0: every slot comes from the step's rows
    CS: tl.constexpr = C // PARTS  # channel slice of this program (axis 1)
    c0 = tl.program_id(1) * CS
    if IN_STEP and OVERLAP:
        pooled = write_pool.pool_in_step(a_ptr, z_ptr, AZ, ape_ptr, i, 0, 0, C, M, c0, CS)
    elif IN_STEP:  # HCA: pool_entry's step-rows path (the fused launch's entry programs)
        pooled = write_pool.pool_entry(a_ptr, z_ptr, AZ, ape_ptr, a_ptr, z_ptr, a_ptr, z_ptr, i, 0, 0, 0, C, M, False,
                                       NW, c0, CS, True)
    else:
        pooled = write_pool.pool_entry(a_ptr, z_ptr, AZ, ape_ptr, a_ptr, z_ptr, a_ptr, z_ptr, i, 0, 0, 0, C, M, OVERLAP,
                                       NW, c0, CS)
    tl.store(out_ptr + (i - 1).to(tl.int64) * C + c0 + tl.arange(0, CS), pooled)


@pytest.mark.parametrize("C", [512, 128])
@pytest.mark.parametrize("rows", [1, 5, 8, 12, 16, 59, 300, 9438])
def test_rms_norm_order_matches_torch(C: int, rows: int) -> None:
    """``rms_norm_bf16`` (told the step emits ``rows`` entries) == ``reference.rms_norm`` of all rows at once."""
    g = torch.Generator(device="cuda").manual_seed(rows * C)
    x = torch.randn(rows, C, generator=g, device="cuda") * torch.exp(torch.randn(rows, 1, generator=g, device="cuda"))
    w = 1 + 0.1 * torch.randn(C, generator=g, device="cuda")
    y = torch.empty_like(x)
    _rms_rows_kernel[(rows,)](x, w, y, torch.empty_like(x), rows, CFG.norm_eps, C=C,
                              MAXT=torch_order.TORCH_REDUCE_MAX_THREADS, num_warps=4, enable_fp_fusion=False)
    ref = rms_norm(x.bfloat16(), w, CFG.norm_eps).float()
    bad = (y != ref).any(1)
    assert not bad.any(), f"{int(bad.sum())} of {rows} rows differ (first {bad.nonzero().flatten()[:5].tolist()})"


@triton.jit
def _rms_rows_lanes_kernel(x_ptr, w_ptr, y_ptr, num_emit, eps, C: tl.constexpr):
    """``csa_entries``' RMSNorm of row ``e`` (one warp), as its entry programs run it: four 128-channel chunks
    through ``add_chunk_squares`` / ``entry_rms_scale`` (C = 512), or ``rms_norm_128`` (C = 128)."""
    row = x_ptr + tl.program_id(0).to(tl.int64) * C
    out = y_ptr + tl.program_id(0).to(tl.int64) * C
    cols = tl.arange(0, 128)
    if C == 512:
        sums = torch_order.zero_square_sums()
        for k in range(4):
            sums = torch_order.add_chunk_squares(bf16_round(tl.load(row + k * 128 + cols)), k, *sums)
        r = torch_order.entry_rms_scale(*sums, num_emit, eps)
        for k in range(4):
            x = bf16_round(tl.load(row + k * 128 + cols))
            tl.store(out + k * 128 + cols, bf16_round(tl.load(w_ptr + k * 128 + cols) * (x * r)))
    else:
        tl.store(out + cols, torch_order.rms_norm_128(bf16_round(tl.load(row + cols)), w_ptr, eps))


@pytest.mark.parametrize("C", [512, 128])
@pytest.mark.parametrize("rows", [1, 5, 8, 12, 16, 59, 300, 9438])
def test_rms_norm_lanes_order_matches_torch(C: int, rows: int) -> None:
    """``csa_entries``' register-only RMSNorm (one warp per row, told the step emits ``rows`` entries: all three of
    torch's reduction orders for 512 channels) == ``reference.rms_norm`` of all rows at once."""
    g = torch.Generator(device="cuda").manual_seed(rows * C + 1)
    x = torch.randn(rows, C, generator=g, device="cuda") * torch.exp(torch.randn(rows, 1, generator=g, device="cuda"))
    w = 1 + 0.1 * torch.randn(C, generator=g, device="cuda")
    y = torch.empty_like(x)
    _rms_rows_lanes_kernel[(rows,)](x, w, y, rows, CFG.norm_eps, C=C, num_warps=1, enable_fp_fusion=False)
    ref = rms_norm(x.bfloat16(), w, CFG.norm_eps).float()
    bad = (y != ref).any(1)
    assert not bad.any(), f"{int(bad.sum())} of {rows} rows differ (first {bad.nonzero().flatten()[:5].tolist()})"


def _pool_rows(m: int, c: int, overlap: bool, parts: int, in_step: bool, spread: float, warps: int,
               stacked_at: int | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """``_pool_rows_kernel`` over 63 entries of random projections, and ``reference.pool_windows`` of them:
    ``(out, (ref, biased gate slots))``. ``stacked_at``: ``a`` / ``z`` are the column blocks at that column of one
    wider NaN-filled buffer (the layout of the stacked compressor GEMM's output, row stride > width), else contiguous."""
    n, width = 64, 2 * c if overlap else c
    g = torch.Generator(device="cuda").manual_seed(m + c)
    a = torch.randn(n * m, width, generator=g, device="cuda") * 3
    z = torch.randn(n * m, width, generator=g, device="cuda") * spread
    ape = torch.randn(m, width, generator=g, device="cuda") * min(spread, 1.0)  # spread < 1: a flat softmax
    zb = z + ape[torch.arange(n * m, device="cuda") % m]
    kv, gate = overlap_slots(a, zb, m) if overlap else (a.unflatten(0, (n, m)), zb.unflatten(0, (n, m)))
    ref = pool_windows(kv, gate)[1:]
    if stacked_at is not None:
        buf = torch.full((n * m, stacked_at + 2 * width + 256), float("nan"), device="cuda")
        buf[:, stacked_at : stacked_at + width] = a
        buf[:, stacked_at + width : stacked_at + 2 * width] = z
        a, z = buf[:, stacked_at : stacked_at + width], buf[:, stacked_at + width : stacked_at + 2 * width]
    out = torch.empty(n - 1, c, device="cuda")
    nw = torch_order.pool_warps(2 * m if overlap else m, torch_order.TORCH_REDUCE_MAX_THREADS)
    _pool_rows_kernel[(n - 1, parts)](a, z, ape, out, C=c, M=m, OVERLAP=overlap, NW=nw, PARTS=parts,
                                      IN_STEP=in_step, AZ=a.stride(0), num_warps=warps, enable_fp_fusion=False)
    return out, (ref, gate)


@pytest.mark.parametrize("m, c, overlap, parts, in_step, spread", [
    (4, 512, True, 1, False, 2), (4, 128, True, 1, False, 2), (4, 512, True, 1, True, 2), (4, 128, True, 1, True, 2),
    (128, 512, False, 1, False, 2), (128, 512, False, HCA_POOL_PARTS, False, 2),
    (4, 512, True, 1, True, 100), (128, 512, False, HCA_POOL_PARTS, False, 100),
    (4, 512, True, 4, True, 2), (128, 512, False, 8, True, 2), (128, 512, False, 8, True, 5.5),
    (128, 512, False, 8, True, 100), (128, 512, False, 8, True, 0.01)],
    ids=["csa", "csa-index", "csa-in-step", "csa-index-in-step", "hca", "hca-parts", "csa-in-step-wide",
         "hca-parts-wide", "csa-in-step-chunks", "hca-in-step", "hca-in-step-mixed", "hca-in-step-wide",
         "hca-in-step-flat"])
@pytest.mark.parametrize("warps", [1, 2, 4])
def test_pooling_order_matches_torch(m: int, c: int, overlap: bool, parts: int, in_step: bool, spread: float,
                                     warps: int) -> None:
    """``pool_entry`` (``in_step``: ``pool_in_step`` for CSA, ``pool_entry``'s step-rows path for HCA) ==
    ``reference.pool_windows`` (torch's softmax + reduce kernels) for every channel of 63 entries, bit for bit;
    ``parts``: each entry pooled in that many channel slices, one program each; ``warps`` per program
    (``pool_program_warps`` picks 2 or 4; the order may not depend on it); ``spread``: the gates' standard deviation
    (100: most ``exp(z − max)`` underflow to 0, ``softmax_weight``'s shortcut; HCA in-step: 2 takes the reciprocal
    division, 100 the general one, 5.5 both, slice by slice, 0.01 — position bias scaled down too — denominators
    near 128)."""
    out, (ref, gate) = _pool_rows(m, c, overlap, parts, in_step, spread, warps)
    if spread > 10:  # the shortcut's case must occur
        assert (torch.exp(gate - gate.amax(1, keepdim=True)) == 0).float().mean() > 0.3
    if in_step and not overlap and spread == 5.5:  # slices of both kinds: within EXP_FAST_GAP or not
        gap = (gate.amin(1) - gate.amax(1))[1:].unflatten(1, (parts, -1)).amin(2)
        assert bool((gap >= -40).any()) and bool((gap < -40).any())
    if spread < 1:  # softmax denominators near the slot count (the reciprocal division's largest divisors)
        assert bool((torch.exp(gate - gate.amax(1, keepdim=True)).sum(1) > 0.9 * gate.shape[1]).all())
    bad = (out != ref).any(1)
    assert not bad.any(), f"{int(bad.sum())} of {len(bad)} entries differ (first {bad.nonzero().flatten()[:5].tolist()})"


@pytest.mark.parametrize("m, c, overlap, parts, in_step, stacked_at", [
    (4, 512, True, 1, False, 0), (4, 128, True, 1, False, 2048), (4, 512, True, 1, True, 0),
    (4, 128, True, 1, True, 2048), (128, 512, False, HCA_POOL_PARTS, False, 0), (128, 512, False, 8, True, 0)],
    ids=["csa", "csa-index", "csa-in-step", "csa-index-in-step", "hca-parts", "hca-in-step"])
def test_pooling_reads_stacked_projections(m: int, c: int, overlap: bool, parts: int, in_step: bool,
                                           stacked_at: int) -> None:
    """The pooling reads ``a`` / ``z_raw`` as column blocks of one wider buffer (the stacked compressor GEMM's
    output: row stride ``AZ`` > width, the other columns NaN) and gives the bits of ``reference.pool_windows``."""
    out, (ref, _) = _pool_rows(m, c, overlap, parts, in_step, 2.0, 4, stacked_at=stacked_at)
    bad = (out != ref).any(1)
    assert not bad.any(), f"{int(bad.sum())} of {len(bad)} entries differ (first {bad.nonzero().flatten()[:5].tolist()})"


@triton.jit
def _e4m3_paths_kernel(count_ptr, first_ptr, BLOCK: tl.constexpr, ROUNDS: tl.constexpr):
    """Every fp32 bit pattern of this program's range through both E4M3 roundings (``quant.e4m3_round_cvt``, the
    GPU's, and ``quant.e4m3_round_bits``, the interpreter's): counts the non-NaN patterns whose codes or values
    differ, and keeps the smallest such pattern."""
    base = tl.program_id(0).to(tl.int64) * (BLOCK * ROUNDS)
    for r in range(ROUNDS):
        idx = base + r * BLOCK + tl.arange(0, BLOCK)
        y = idx.to(tl.int32).to(tl.float32, bitcast=True)  # patterns ≥ 2**31 wrap to the negative int32s
        c1, v1 = quant.e4m3_round_cvt(y)
        c2, v2 = quant.e4m3_round_bits(y)
        bad = ((c1 != c2) | (v1.to(tl.int32, bitcast=True) != v2.to(tl.int32, bitcast=True))) & (y == y)
        n = tl.sum(bad.to(tl.int32))
        if n > 0:
            tl.atomic_add(count_ptr, n)
            tl.atomic_min(first_ptr, tl.min(tl.where(bad, idx, 1 << 40)))


@triton.jit
def _e4m3_codes_kernel(y_ptr, code_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    code, _ = quant.e4m3_round(tl.load(y_ptr + i, mask=i < N))
    tl.store(code_ptr + i, code.to(tl.uint8), mask=i < N)


def test_e4m3_conversion_is_the_bit_arithmetic() -> None:
    """The kernels' E4M3 rounding on the GPU (the hardware conversion) == the bit arithmetic the interpreter runs,
    on all 2**32 fp32 bit patterns but NaN (codes and values, -0.0 and ±inf included); and == torch's float8 cast
    (what the torch backend runs) on the values the quantizer feeds it: clamped to ±448, every E4M3 rounding
    boundary ± 1 ulp and fresh random values."""
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    first = torch.full((1,), 1 << 40, dtype=torch.int64, device="cuda")
    block, rounds = 1024, 64
    _e4m3_paths_kernel[((1 << 32) // (block * rounds),)](count, first, BLOCK=block, ROUNDS=rounds)
    assert int(count) == 0, f"{int(count)} fp32 patterns differ, the first {int(first):#010x}"

    e4m3 = torch.arange(256, device="cuda", dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[torch.isfinite(e4m3)].unique()
    mids = (e4m3[1:] + e4m3[:-1]) / 2  # the rounding boundaries (exact in fp32)
    around = torch.cat([mids, e4m3]).view(torch.int32)
    around = torch.cat([around - 1, around, around + 1]).view(torch.float32)
    g = torch.Generator(device="cuda").manual_seed(4)
    rand = torch.randn(1 << 20, generator=g, device="cuda") * torch.exp2(torch.randint(-12, 10, (1 << 20,), generator=g, device="cuda").float())
    y = torch.cat([around, -around, rand])
    y = y[~y.isnan()].clamp(-448.0, 448.0)  # (0.0's bits − 1 are a NaN)
    codes = torch.empty(y.shape, dtype=torch.uint8, device="cuda")
    _e4m3_codes_kernel[(triton.cdiv(y.numel(), 1024),)](y, codes, y.numel(), BLOCK=1024)
    want = y.to(torch.float8_e4m3fn).view(torch.uint8)
    bad = codes != want
    assert not bad.any(), f"{int(bad.sum())} codes differ from torch's cast, e.g. {y[bad][:4].tolist()}"
