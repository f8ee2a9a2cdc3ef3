"""``benchmarks/bench_weight_streaming.py``: its streaming kernel reads every byte of the weight once (the XOR of its
programs' words equals the XOR of all words, for word counts that do and do not fill the last block), and the
weights it times are the decode step's (shapes, dtypes and counts per layer kind)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest

from support.interpreter import run_interpreted

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

_STREAM_SCRIPT = f"""
import functools, sys, torch
sys.path.insert(0, {str(BENCH)!r})
import bench_weight_streaming as b
g = torch.Generator().manual_seed(3)
for n, programs in ((b.STREAM_BLOCK * 5, 2), (b.STREAM_BLOCK * 3 + 17, 4), (100, 3)):
    words = torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int32)
    out = torch.zeros(programs, dtype=torch.int32)
    b.stream_read(words, out, programs)
    xor = lambda v: functools.reduce(lambda a, c: a ^ c, v, 0)
    assert xor(out.tolist()) == xor(words.tolist()), (n, programs)
    words[n // 2] ^= 1 << 7  # one bit anywhere changes the result
    b.stream_read(words, out, programs)
    assert xor(out.tolist()) == xor(words.tolist())
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_streaming_kernel_reads_every_word_once() -> None:
    run_interpreted(_STREAM_SCRIPT)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_the_weights_timed_are_the_decode_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import dsv4
    from dsv4.config import LayerKind
    from dsv4.formats.block_fp8 import BlockFp8Weight

    monkeypatch.syspath_prepend(str(BENCH))
    b = importlib.import_module("bench_weight_streaming")
    monkeypatch.setattr(dsv4.AttentionWeights, "random",
                        functools.partial(_on_cpu, dsv4.AttentionWeights.random.__func__, dsv4.AttentionWeights))
    cfg = dsv4.ModelConfig.preset("v4-flash")
    weights = b.decode_weights(cfg)
    layers = {k: sum(cfg.layer_kind(li) is k for li in range(cfg.num_layers)) for k in LayerKind}
    count = {name: sum(layers[k] * n for k, n in per.items()) for name, (_, per) in weights.items()}
    L = cfg.num_layers
    assert count == {"wq_a+wkv": L, "wq_b+indexer.wq_b": layers[LayerKind.CSA],
                     "wq_b": L - layers[LayerKind.CSA], "wo_b": L, "wo_a (bf16, grouped)": L,
                     "compressors CSA (bf16)": layers[LayerKind.CSA], "compressors HCA (bf16)": layers[LayerKind.HCA]}
    H, D = cfg.num_heads, cfg.head_dim
    assert weights["wq_b"][0].shape == (H * D, cfg.q_lora_rank)
    assert weights["wq_b+indexer.wq_b"][0].shape == (H * D + cfg.index_n_heads * cfg.index_head_dim,
                                                     cfg.q_lora_rank)
    assert weights["wq_a+wkv"][0].shape == (cfg.q_lora_rank + D, cfg.hidden_size)
    assert weights["wo_b"][0].shape == (cfg.hidden_size, cfg.o_groups * cfg.o_lora_rank)
    for name in ("wq_a+wkv", "wq_b", "wq_b+indexer.wq_b", "wo_b"):
        assert isinstance(weights[name][0], BlockFp8Weight)
    wo_a = weights["wo_a (bf16, grouped)"][0]
    assert wo_a.dtype == torch.bfloat16 and wo_a.shape == (cfg.o_groups, cfg.o_lora_rank, H * D // cfg.o_groups)
    for name in ("compressors CSA (bf16)", "compressors HCA (bf16)"):
        w = weights[name][0]
        assert w.dtype == torch.bfloat16 and w.shape[1] == cfg.hidden_size
        assert b._words(w).numel() * 4 == w.numel() * 2  # the streamed words are the weight's bytes


def _on_cpu(random, cls, *args, device=None, **kwargs):
    return random(cls, *args, **kwargs)
