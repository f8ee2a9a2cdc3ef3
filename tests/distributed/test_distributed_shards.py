"""Tensor-parallel shards of a layer's weights (no processes): which slices a rank holds, FP8 projections cut
along whole 128 × 128 blocks, the refusals, and the partial outputs of the ranks summing to one process's output.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

import dsv4
from dsv4.distributed import check_fp8_split, local_config
from dsv4.formats.block_fp8 import BlockFp8Weight
from dsv4.numerics import Numerics
from dsv4.reference.layer import grouped_output
from dsv4.reference.primitives import project
from support.distributed import tiny

TINY, TINY128 = tiny(), tiny(128)


def _dense(v) -> torch.Tensor:
    return v.dequantize() if isinstance(v, BlockFp8Weight) else v


@pytest.mark.parametrize("cfg,fp8", [(TINY, False), (TINY128, True)], ids=["tiny-plain", "tiny-o128-fp8"])
@pytest.mark.parametrize("layer", [0, 1, 2])
def test_shard_holds_its_heads_and_groups(cfg, fp8, layer):
    w = dsv4.AttentionWeights.random(cfg, layer, seed=layer + 3, fp8=fp8)
    H, D, G, o = cfg.num_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
    for r in range(2):
        s = w.shard(r, 2)
        assert s.tp_shard == (r, 2)
        s.check(local_config(cfg, 2), layer)
        h, g = slice(r * H // 2, (r + 1) * H // 2), slice(r * G // 2 * o, (r + 1) * G // 2 * o)
        assert torch.equal(_dense(s.wq_b), _dense(w.wq_b)[h.start * D: h.stop * D])
        assert torch.equal(s.attn_sink, w.attn_sink[h])
        assert torch.equal(s.wo_a, w.wo_a[g])
        assert torch.equal(_dense(s.wo_b), _dense(w.wo_b)[:, g])
        if fp8:  # the checkpoint's bytes and block scales, cut along whole blocks
            assert isinstance(s.wo_b, BlockFp8Weight) and s.wo_b.scale.shape == (1, 1)
            assert torch.equal(s.wo_b.scale, w.wo_b.scale[:, r:r + 1])
        head_independent = [n for n, _ in w.named_parameters() if n not in ("wq_b", "attn_sink", "wo_a", "wo_b")]
        shard_params = dict(s.named_parameters())
        assert all(shard_params[n] is v for n, v in w.named_parameters() if n in head_independent)
    with pytest.raises(ValueError, match="tensor-parallel shard 1 of 2"):
        w.shard(1, 2).check(cfg, layer)  # a shard is not the whole layer


def test_shard_refusals():
    w8 = dsv4.AttentionWeights.random(TINY, 1, seed=0)  # wo_b: 64 FP8 columns in one 128-block
    with pytest.raises(ValueError, match="not whole blocks"):
        w8.shard(0, 2)
    with pytest.raises(ValueError, match="divisible by 3"):
        dsv4.AttentionWeights.random(TINY, 1, seed=0, fp8=False).shard(0, 3)
    with pytest.raises(ValueError, match="already shard"):
        dsv4.AttentionWeights.random(TINY, 1, seed=0, fp8=False).shard(0, 2).shard(0, 2)
    with pytest.raises(ValueError, match="tp_rank"):
        w8.shard(2, 2)
    with pytest.raises(ValueError, match="not whole 128-blocks"):  # official numerics quantize wo_b's input per 128
        check_fp8_split(TINY, 2, Numerics.official())
    check_fp8_split(TINY, 2, Numerics.exact())
    check_fp8_split(TINY128, 2, Numerics.official())


@pytest.mark.parametrize("cfg,numerics,tol", [(TINY, "exact", 1e-6), (TINY128, "official", 2e-3)])
def test_partial_outputs_sum_to_one_process(cfg, numerics, tol):
    """The output projection of each rank's heads in FP32, summed, is the one-process projection (what the
    all-reduce of ``distributed.tp_ops`` adds up)."""
    nm = dsv4.numerics.resolve_numerics(numerics)
    w = dsv4.AttentionWeights.random(cfg, 1, seed=5, fp8=numerics == "official").for_numerics(nm)
    o = torch.randn(9, cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(6)).to(nm.act_dtype)
    want = grouped_output(w, cfg, o, nm)
    local, Hl = local_config(cfg, 2), cfg.num_heads // 2
    fp32 = lambda x, weight, n: project(x, weight, n, out_dtype=torch.float32)  # noqa: E731
    parts = [grouped_output(w.shard(r, 2), local, o[:, r * Hl:(r + 1) * Hl], nm, fp32) for r in range(2)]
    got = (parts[0] + parts[1]).to(nm.act_dtype)
    rel = float((got.double() - want.double()).norm() / want.double().norm())
    assert rel <= tol, rel


def test_from_checkpoint_reads_a_shard(tmp_path):
    w = dsv4.AttentionWeights.random(TINY128, 1, seed=7)
    tensors = {}
    for name, t in w.named_tensors():
        suffix = "" if name == "attn_sink" or name.endswith("ape") or name.endswith(".scale") else ".weight"
        tensors[f"layers.1.attn.{name}{suffix}"] = t.contiguous()
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    cfg_dict = dict(TINY128.to_hf_dict(), compress_ratios=list(TINY128.compress_ratios))
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(cfg_dict, f)
    whole = dsv4.AttentionWeights.from_checkpoint(tmp_path, 1, TINY128)
    for r in range(2):
        got = dsv4.AttentionWeights.from_checkpoint(tmp_path, 1, TINY128, tp_rank=r, tp_size=2)
        want = whole.shard(r, 2)
        assert got.tp_shard == (r, 2)
        for (n, a), (_, b) in zip(got.named_tensors(), want.named_tensors()):
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                               b.view(torch.uint8) if b.element_size() == 1 else b), n
