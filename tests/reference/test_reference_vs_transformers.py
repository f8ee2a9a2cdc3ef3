"""dsv4.reference (numerics="exact", FP32) against transformers' DeepseekV4Attention (FP32, eager, no cache)."""

import pytest
import torch

import dsv4

transformers = pytest.importorskip("transformers")
from support.hf import random_hf_attention, run_hf_attention  # noqa: E402

TINY = dsv4.ModelConfig.preset("tiny")  # window 16, CSA ratio 4, HCA ratio 16, top-k 8


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# Lengths crossing the window (16), the CSA ratio (4) and the HCA ratio (16), up to > 2x HCA ratio; with
# top-k 8, CSA has fewer entries than k below S = 36 and more above.
LENGTHS = [1, 3, 4, 7, 16, 17, 31, 33, 40, 53, 70]


@pytest.mark.parametrize("layer_idx", [0, 1, 2], ids=["swa", "csa", "hca"])
@pytest.mark.parametrize("S", LENGTHS)
def test_exact_matches_transformers(layer_idx: int, S: int) -> None:
    module = random_hf_attention(TINY, layer_idx, seed=100 + S + layer_idx)
    w = dsv4.AttentionWeights.from_hf_module(module)
    w.check(TINY, layer_idx)
    x = torch.randn(S, TINY.hidden_size, generator=torch.Generator().manual_seed(S))
    want = run_hf_attention(module, TINY, x)
    got = dsv4.reference.attention(w, TINY, layer_idx, x, numerics="exact")
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("topk", [2, 64])
def test_csa_topk_below_and_above_entry_count(topk: int) -> None:
    cfg = TINY.replace(index_topk=topk)
    S = 45  # 11 compressed entries: top-2 selects, top-64 takes every visible entry
    module = random_hf_attention(cfg, 1, seed=7 + topk)
    w = dsv4.AttentionWeights.from_hf_module(module)
    x = torch.randn(S, cfg.hidden_size, generator=torch.Generator().manual_seed(topk))
    res = dsv4.reference.forward(w, cfg, 1, x, numerics="exact")
    assert rel_err(res.y, run_hf_attention(module, cfg, x)) <= 1e-5
    n_valid = (res.entry_idx >= 0).sum(-1)
    visible = (torch.arange(S) + 1) // cfg.csa_ratio
    assert torch.equal(n_valid, visible.clamp(max=topk))


def test_longer_window_config() -> None:
    """A config whose window (128) exceeds the HCA ratio (64): long sequences, all kinds interleaved."""
    cfg = TINY.replace(name="tiny-w128", window=128, hca_ratio=64, compress_ratios=(0, 4, 64, 4, 0), index_topk=16)
    S = 200
    for layer_idx in (0, 1, 2):
        module = random_hf_attention(cfg, layer_idx, seed=layer_idx)
        w = dsv4.AttentionWeights.from_hf_module(module)
        x = torch.randn(S, cfg.hidden_size, generator=torch.Generator().manual_seed(layer_idx))
        assert rel_err(dsv4.reference.attention(w, cfg, layer_idx, x, "exact"), run_hf_attention(module, cfg, x)) <= 1e-5
