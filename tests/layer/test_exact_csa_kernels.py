"""Exact numerics of a CSA layer on a Hopper GPU, checked on the CPU: what the Triton backend's step plan runs, and
that its indexer (the FP32 scores kernel and the radix top-k, here in Triton's interpreter) selects what the torch
backend selects on the layer of ``tests/layer/test_torch_backend_cuda.py`` — up to exact ties, whose order SPEC §5
leaves open (there: one row, three entries of score exactly 0 for the last of 8 slots)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import dsv4
from dsv4.config import LayerKind
from dsv4.kernels.device import DeviceFacts

from support.interpreter import run_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

H200 = DeviceFacts(kernels=True, sm_count=132, sm90=True, resident_clusters=lambda n: 132 // n)
TINY = dsv4.ModelConfig.preset("tiny")


def test_exact_csa_plan_on_h200_runs_torch_but_the_fp32_indexer() -> None:
    """Exact numerics (FP32 activations and storage) on an H200: norms, projections, writes and attention run the
    torch ops; the indexer runs the Triton scores kernel on FP32 keys (IEEE FP32 products, FP32 scores, never the
    Gluon MXFP4 kernel) and a top-k over 32-bit keys (no BF16 rounding of the scores)."""
    from dsv4.ops import triton_ops

    cache = dsv4.HybridCache(TINY, layers=[1], max_requests=2, num_blocks=64, block_size=32, device="cpu",
                             numerics="exact")
    cache.add_request("r")
    for n, algorithm in ((37, "bisect"), (5, "split"), (60, "bisect"), (1, "split")):
        lp = triton_ops.plan_step(cache.prepare_forward({"r": n}), cache, H200).layer(LayerKind.CSA)
        assert not lp.kernels and lp.projection is None and lp.write is None and lp.attention is None
        assert lp.indexer.scores.kernel == "triton" and lp.indexer.scores.key_format == "fp32"
        assert lp.indexer.topk.key_bits == 32 and lp.indexer.topk.algorithm == algorithm


_SCENARIO = r"""
import torch, dsv4
from dsv4.cache import HybridCache
from dsv4.kernels.device import DeviceFacts
from dsv4.layer import Attention
from dsv4.ops import torch_ops, triton_indexer
from dsv4.reference.indexer import index_scores, topk_differences

cfg = dsv4.ModelConfig.preset("tiny")
chunks = [37, 5, 60, 1, 1, 3, 4]
x = torch.randn(sum(chunks), cfg.hidden_size, generator=torch.Generator().manual_seed(1))
facts = DeviceFacts(kernels=True, sm_count=132, sm90=False)  # an H200's plans, minus Gluon (MXFP4 only)
plain = torch_ops.indexer_topk
log = []

def kernel_topk(step, q_idx, head_weights):
    # the torch backend's selection and scores, then the Triton backend's (interpreted) selection, which the step uses
    own = plain(step, q_idx, head_weights)
    m, k = step.ratio, step.cfg.index_topk
    plan = triton_indexer.indexer_plan(step.cache, step.batch, m, k, step.cfg.index_n_heads, torch.float32, facts)
    got = triton_indexer.topk_layer(step.cache, step.batch, m, q_idx, head_weights, k, torch.float32, plan=plan)
    assert (got[:, own.shape[1]:] == -1).all()
    got = got[:, : own.shape[1]]
    (rows, keys), = torch_ops.request_index_keys(step.cache, step.batch, m)
    scores = index_scores(q_idx[rows], head_weights[rows], keys, torch.float32)
    differs, ties = topk_differences(scores, own, got, rel=0.0)
    log.append((differs, ties, scores, own, got))
    return got if FOLLOW else own

def run(follow):
    global FOLLOW
    FOLLOW = follow
    w = dsv4.AttentionWeights.random(cfg, 1, seed=2)
    cache = HybridCache(cfg, layers=[1], max_requests=2, num_blocks=64, block_size=32, device="cpu", numerics="exact")
    layer = Attention(w, cfg, 1, backend="torch")
    cache.add_request("r")
    out, at = [], 0
    for n in chunks:
        out.append(layer(x[at : at + n], cache.prepare_forward({"r": n}), cache))
        at += n
    return torch.cat(out).double()

torch_ops.indexer_topk = kernel_topk
own = run(False)
kernel = run(True)
differs = torch.cat([d for d, *_ in log[:7]])
ties = torch.cat([t for _, t, *_ in log[:7]])
assert torch.equal(differs, ties), "a selection differs by more than an exact tie"
assert int(differs.sum()) == 1, int(differs.sum())  # step 2, row 49: entries 0, 6, 16 all score exactly 0
d, t, scores, a, b = log[2]
row = int(d.nonzero())
assert row == 49 and float(scores[row, a[row]].min()) == 0.0 and float(scores[row, b[row]].min()) == 0.0
err = ((kernel - own).norm() / own.norm()).item()
assert 1e-2 < err < 5e-2, err  # the tie alone moves the layer's output by about 2.4e-2 (the GPU test's failure)
print("ok")
"""


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="runs its own interpreter process")
def test_exact_csa_indexer_kernels_differ_from_torch_only_by_exact_ties() -> None:
    """The test layer's steps with the torch backend choosing its own top-k, then the Triton indexer's (interpreted):
    every selection difference is an exact tie (the same FP32 scores taken), there is exactly one (step 2, row 49,
    three entries of score 0 for the last slot; the kernels take the lowest entry, ``torch.topk`` another), and that
    one tie alone accounts for the GPU test's 2.4e-2."""
    run_script(_SCENARIO, timeout=300)
