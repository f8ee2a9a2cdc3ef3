"""Bad input to dsv4.Attention raises a clear error and leaves the cache byte-for-byte unchanged."""

import pytest
import torch

import dsv4
from dsv4.cache import HybridCache
from dsv4.layer import Attention

TINY = dsv4.ModelConfig.preset("tiny")


@pytest.fixture(params=[0, 1, 2], ids=["swa", "csa", "hca"])
def setup(request):
    li = request.param
    w = dsv4.AttentionWeights.random(TINY, li, seed=1)
    layer = Attention(w, TINY, li)
    cache = HybridCache(TINY, layers=[li], max_requests=2, num_blocks=16, block_size=16)
    cache.add_request("a")
    layer(torch.randn(21, TINY.hidden_size), cache.prepare_forward({"a": 21}), cache)  # some state to protect
    batch = cache.prepare_forward({"a": 3})
    return li, w, layer, cache, batch


def _bad_inputs(batch):
    T, d = batch.num_tokens, TINY.hidden_size
    nan = torch.randn(T, d)
    nan[1, 5] = float("nan")
    inf = torch.randn(T, d)
    inf[0, 0] = float("inf")
    return {
        "too few tokens": (torch.randn(T - 1, d), ValueError, "num_tokens"),
        "wrong hidden size": (torch.randn(T, d + 1), ValueError, "hidden"),
        "3-d input": (torch.randn(1, T, d), ValueError, "num_tokens"),
        "integer dtype": (torch.ones(T, d, dtype=torch.int32), TypeError, "float32"),
        "float64": (torch.randn(T, d, dtype=torch.float64), TypeError, "float32"),
        "other device": (torch.randn(T, d, device="meta"), ValueError, "device|cache is on"),
        "NaN": (nan, ValueError, "NaN"),
        "Inf": (inf, ValueError, "Inf"),
        "not a tensor": (nan.tolist(), TypeError, "torch.Tensor"),
    }


CASES = ["too few tokens", "wrong hidden size", "3-d input", "integer dtype", "float64", "other device", "NaN", "Inf", "not a tensor"]


@pytest.mark.parametrize("case", CASES)
def test_bad_x_leaves_cache_unchanged(setup, case: str) -> None:
    _, _, layer, cache, batch = setup
    x, exc, msg = _bad_inputs(batch)[case]
    snap = cache.snapshot()
    with pytest.raises(exc, match=msg):
        layer(x, batch, cache)
    cache.assert_same(snap)


def test_layer_not_in_cache(setup) -> None:
    li, _, _, cache, batch = setup
    other = (li + 1) % 3
    layer = Attention(dsv4.AttentionWeights.random(TINY, other, seed=0), TINY, other)
    snap = cache.snapshot()
    with pytest.raises(KeyError, match="not held by this cache"):
        layer(torch.randn(batch.num_tokens, TINY.hidden_size), batch, cache)
    cache.assert_same(snap)


def test_cache_of_another_config(setup) -> None:
    li, w, _, cache, batch = setup
    cfg2 = TINY.replace(name="tiny-2", index_topk=4)
    snap = cache.snapshot()
    with pytest.raises(ValueError, match="config"):
        Attention(w, cfg2, li)(torch.randn(batch.num_tokens, TINY.hidden_size), batch, cache)
    cache.assert_same(snap)


def test_not_a_batch(setup) -> None:
    _, _, layer, cache, batch = setup
    with pytest.raises(TypeError, match="StepBatch"):
        layer(torch.randn(batch.num_tokens, TINY.hidden_size), {"a": 3}, cache)


def test_weights_of_another_config_or_layer() -> None:
    w_csa = dsv4.AttentionWeights.random(TINY, 1, seed=0)
    with pytest.raises(ValueError, match="unexpected tensors"):
        Attention(w_csa, TINY, 0)  # CSA weights for an SWA layer
    with pytest.raises(ValueError, match="compressor.ape has shape"):
        Attention(w_csa, TINY.replace(name="other", csa_ratio=8, compress_ratios=(0, 8, 16, 8, 0)), 1)
    flash = dsv4.ModelConfig.preset("v4-flash")
    with pytest.raises(ValueError, match="wq_a has shape"):
        Attention(dsv4.AttentionWeights.random(TINY, 0, seed=0), flash, 0)
    bad = dsv4.AttentionWeights.random(TINY, 0, seed=0)
    bad.attn_sink[0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        Attention(bad, TINY, 0)
    with pytest.raises(ValueError, match="backend"):
        Attention(dsv4.AttentionWeights.random(TINY, 0, seed=0), TINY, 0, backend="cuda-magic")


def test_triton_backend_needs_cuda_tensors(setup) -> None:
    li, w, _, cache, batch = setup
    layer = Attention(w, TINY, li, backend="triton")
    snap = cache.snapshot()
    with pytest.raises(ValueError, match="triton backend needs CUDA"):
        layer(torch.randn(batch.num_tokens, TINY.hidden_size), batch, cache)
    cache.assert_same(snap)


def test_auto_backend_on_cpu_is_torch() -> None:
    layer = Attention(dsv4.AttentionWeights.random(TINY, 0, seed=0), TINY, 0)
    assert layer.backend == "auto" and layer.backend_for(torch.device("cpu")) == "torch"
    assert not layer.graph_safe(torch.device("cpu"))  # the torch backend syncs with the host
