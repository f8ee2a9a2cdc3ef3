"""The Triton write path under the Triton interpreter on the CPU (tiny config): same bytes as the torch backend.

Checks the kernels' logic (slot sources, tails, previous-window rotation, page addressing, byte layouts, the
quantizers' bit arithmetic) without a GPU. The kernels reproduce torch's *CUDA* reduction orders; on the CPU
torch sums in other orders, which could in principle differ in the last bit — these small cases agree exactly.
Skipped when triton is not installed. The GPU tests (test_write_path_gpu.py) check bit-exactness on CUDA.
"""

from __future__ import annotations

import importlib.util

import pytest

from support.interpreter import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

_SCRIPT = r"""
import sys, torch, dsv4
from dsv4.layer import Attention
from dsv4.ops import torch_ops, triton_ops
from support.write_path import differences, make_cache, write_step
cfg = dsv4.ModelConfig.preset("tiny")
li = int(sys.argv[1])
launch = {}
if len(sys.argv) > 2 and sys.argv[2] == "fused":  # CSA entries as entry programs of the fused launch (m != 4)
    launch = {"separate_entries": False}
elif len(sys.argv) > 2 and sys.argv[2] == "stacked":
    # both backends take the projections as on CUDA: one GEMM over the stacked matrices, column views of its output
    from dsv4.compressor_stack import compressor_stack, compressors, head_rows
    from dsv4.ops import projections

    def stacked(step, x):
        widths = [c.wkv.shape[0] for c in compressors(step.weights)]
        rows = head_rows(step.weights)  # CSA: the indexer's weights_proj, the stack's last rows
        out, _ = projections.stacked_compressor_projections(x.to(torch.bfloat16), compressor_stack(step.weights),
                                                            widths, rows)
        assert all(a.stride(0) == 2 * sum(widths) + rows > a.shape[1] for a, _ in out)
        return out

    projections.layer_compressor_projections = stacked
elif len(sys.argv) > 2:  # split HCA entries over this many programs (the rule splits from m = 64)
    launch = {"parts": int(sys.argv[2])}
lay = Attention(dsv4.AttentionWeights.random(cfg, li, seed=1), cfg, li, backend="torch")
ca, cb = make_cache(cfg, [li], "cpu", 4), make_cache(cfg, [li], "cpu", 4)
for r in "abc":
    ca.add_request(r); cb.add_request(r)
g = torch.Generator().manual_seed(li)
plans = [{"a": 37, "b": 5}, {"a": 3, "b": 1, "c": 18}, {"a": 1, "b": 1, "c": 1}, {"b": 11, "c": 2}]
for step, plan in enumerate(plans):
    ba, bb = ca.prepare_forward(plan), cb.prepare_forward(plan)
    x = torch.randn(ba.num_tokens, cfg.hidden_size, generator=g)
    k1, k2 = write_step(torch_ops, lay, ca, ba, x), write_step(triton_ops, lay, cb, bb, x, **launch)
    nk = int((k1.view(torch.int16) != k2.view(torch.int16)).sum())
    d = differences(ca, cb, li)
    assert nk == 0 and not d, (li, step, nk, d)
print("ok")
"""


@pytest.mark.parametrize("li,parts", [(0, None), (1, None), (1, "fused"), (1, "stacked"), (2, None), (2, 4),
                                     (2, "stacked")],
                         ids=["swa", "csa", "csa-fused", "csa-stacked", "hca16", "hca16-split4", "hca16-stacked"])
def test_interpreted_write_path_matches_torch(li: int, parts: int | str | None) -> None:
    """``csa``: every entry and the window entries of a long step through ``csa_entries`` (their own launch);
    ``csa-fused``: as entry programs of the fused launch. ``hca16-split4``: every HCA entry pooled by 4 programs
    (channel slices), the last to arrive finishing it. ``*-stacked``: the projections are column blocks of one GEMM
    over the stacked compressor matrices (``ops.projections.stacked_compressor_projections``, as on CUDA), so the
    kernels read ``a`` / ``z_raw`` with a row stride wider than a compressor."""
    args = [str(li)] + ([] if parts is None else [str(parts)])
    run_interpreted(_SCRIPT, *args)


_ROWS_SCRIPT = r"""
import sys, numpy as np, torch, triton, triton.language as tl
from dsv4.kernels.quant import seq_accumulate_rows

@triton.jit
def _rows_kernel(t_ptr, acc_ptr, out_ptr, N: tl.constexpr, C: tl.constexpr):
    t = tl.load(t_ptr + tl.arange(0, N)[:, None] * C + tl.arange(0, C)[None, :])
    tl.store(out_ptr + tl.arange(0, C), seq_accumulate_rows(tl.load(acc_ptr + tl.arange(0, C)), t, N))

rng = np.random.default_rng(int(sys.argv[1]))
C = 64
for N in (4, 8, 16):
    # magnitudes spread over many binades so that the summation order changes the rounded result
    t = (rng.standard_normal((N, C)) * 2.0 ** rng.integers(-20, 20, (N, C))).astype(np.float32)
    acc = (rng.standard_normal(C) * 1e3).astype(np.float32)
    want = acc.copy()
    for r in range(N):
        want = (want + t[r]).astype(np.float32)
    out = torch.empty(C)
    _rows_kernel[(1,)](torch.from_numpy(t), torch.from_numpy(acc), out, N=N, C=C)
    assert np.array_equal(out.numpy().view(np.int32), want.view(np.int32)), N
    # the tile summed first, then added (another order) differs somewhere: the check above can fail
    other = (acc + t.sum(0, dtype=np.float32)).astype(np.float32)
    assert not np.array_equal(other, want) or N == 4
print("ok")
"""


def test_seq_accumulate_rows_is_row_by_row() -> None:
    """``quant.seq_accumulate_rows`` (the compressors' softmax denominator over a tile of slots) adds the rows one
    by one in order: bit-identical to a row loop in FP32 on values whose sum depends on the order."""
    run_interpreted(_ROWS_SCRIPT, "7", timeout=300)


_SUM_SQ_SCRIPT = r"""
import sys, numpy as np, torch, triton, triton.language as tl
from dsv4.kernels.torch_order import torch_sum_sq

@triton.jit
def _sum_sq_kernel(x_ptr, out_ptr, C: tl.constexpr, BW: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, 1), torch_sum_sq(x_ptr, C, BW))

def model(x, BW, warp="halves"):
    # torch's block reduction of x.pow(2) over one row (measured on an H200, torch 2.11; tools/diag_reduce_order.py):
    # float4 loads, thread l takes vectors l, l + BW, ... into 4 accumulators; shared-memory halving down to 32
    # lanes; then the warp's shuffle-down tree, offsets 16 ... 1 (halves first). Every add rounded to fp32.
    f = np.float32
    sq = (x * x).astype(f)
    C = len(x)
    p = []
    for l in range(BW):
        acc = [f(0)] * 4
        for k in range(C // (4 * BW)):
            for j in range(4):
                acc[j] = f(acc[j] + sq[4 * (l + k * BW) + j])
        p.append(f(f(f(acc[0] + acc[1]) + acc[2]) + acc[3]))
    off = BW // 2
    while off >= 32:
        p = [f(p[l] + p[l + off]) for l in range(off)]
        off //= 2
    while len(p) > 1:
        h = len(p) // 2
        p = [f(p[i] + p[i + h]) for i in range(h)] if warp == "halves" else [f(p[2 * i] + p[2 * i + 1]) for i in range(h)]
    return p[0]

rng = np.random.default_rng(int(sys.argv[1]))
for C, widths in ((512, (32, 64, 128)), (128, (32,))):
    orders_differ = 0
    for trial in range(6):
        x = (rng.standard_normal(C) * 3.0).astype(np.float32)  # similar magnitudes: the order shows in the last bits
        got = {float(model(x, 32, warp="adjacent"))}
        for BW in widths:
            out = torch.empty(1)
            _sum_sq_kernel[(1,)](torch.from_numpy(x), out, C=C, BW=BW)
            want = model(x, BW)
            assert out.numpy().view(np.int32)[0] == np.array([want]).view(np.int32)[0], (C, BW, out.item(), want)
            got.add(float(want))
        orders_differ += len(got) > 1
    # the orders disagree on some of these rows, so the bitwise comparison above is order-sensitive
    assert orders_differ > 0, C
print("ok")
"""


@pytest.mark.parametrize("seed", [3, 11])
def test_torch_sum_sq_matches_reduction_model(seed: int) -> None:
    """``torch_order.torch_sum_sq`` (the compressors' RMSNorm sum of squares, read back from a scratch row) equals a
    plain-Python model of torch's block reduction: 32 / 64 / 128 threads per row for rows of 512, 32 for rows of 128."""
    run_interpreted(_SUM_SQ_SCRIPT, str(seed), timeout=300)


_WEIGHT_SCRIPT = r"""
import torch, triton, triton.language as tl
from dsv4.kernels.write.pool import softmax_weight

@triton.jit
def _weight_kernel(e_ptr, d_ptr, out_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(out_ptr + o, softmax_weight(tl.load(e_ptr + o), tl.load(d_ptr + o)))

inf, nan, tiny = float("inf"), float("nan"), 1e-40  # tiny: a subnormal numerator
e = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.25, tiny, 0.5, 0.0, 3.0, 1.0, 0.0, 0.75, 0.0, 1e-30])
d = torch.tensor([1.0, 7.5, inf, 0.0, nan, 3.0, 1.0, 2.0, 0.0, -2.0, 3.0, nan, 1e30, 8.0, 128.0, 3.0])
want = e / d  # IEEE division, every case
out = torch.empty_like(e)
_weight_kernel[(1,)](e, d, out, N=e.numel())
same = (out.view(torch.int32) == want.view(torch.int32)) | (out.isnan() & want.isnan())
assert bool(same.all()), (out.tolist(), want.tolist())
print("ok")
"""


def test_softmax_weight_is_ieee_division() -> None:
    """``write.pool.softmax_weight``'s zero shortcut returns exactly what the division returns (bit for bit, signed
    zeros included) for zero numerators over positive, infinite, zero, negative and NaN denominators."""
    run_interpreted(_WEIGHT_SCRIPT, timeout=300)
