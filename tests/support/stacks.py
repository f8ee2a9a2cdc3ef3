"""Checks and setups shared by the tests of the block-scaled FP8 stacks (``dsv4.input_stack``,
``dsv4.query_stack``)."""

from __future__ import annotations

import dataclasses

import torch

import dsv4
from dsv4.formats.block_fp8 import WEIGHT_BLOCK, BlockFp8Weight
from dsv4.numerics import resolve_numerics

TINY = dsv4.ModelConfig.preset("tiny")
#: the tiny model with a query latent of one 128-row scale block, so that ``wq_a`` and ``wkv`` can stack
TINY_128 = dataclasses.replace(TINY, q_lora_rank=128)


def fp8_weights(cfg: dsv4.ModelConfig, li: int) -> dsv4.AttentionWeights:
    """Layer ``li``'s random weights (seed 3) as the official numerics hold them: block-scaled FP8 projections."""
    return dsv4.AttentionWeights.random(cfg, li, seed=3).for_numerics(resolve_numerics("official"))


def assert_stack_of(stack: BlockFp8Weight, originals: list[BlockFp8Weight], views: list[BlockFp8Weight]) -> None:
    """``stack`` holds ``originals``' values (E4M3 values and block scales, dequantized: bit for bit) one after the
    other, and ``views`` (what the stacked weights hold) are its row views at their places: no memory of their own."""
    assert stack.shape == (sum(w.shape[0] for w in originals), originals[0].shape[1])
    assert torch.equal(stack.dequantize(), torch.cat([w.dequantize() for w in originals]))
    row = 0
    for view, w in zip(views, originals, strict=True):
        assert view.shape == w.shape
        assert view.data.data_ptr() == stack.data[row:].data_ptr()
        assert view.scale.data_ptr() == stack.scale[row // WEIGHT_BLOCK :].data_ptr()
        row += w.shape[0]


def cuda_decode_step(cfg: dsv4.ModelConfig, li: int, rows: int):
    """The Triton backend's ``LayerStep`` of layer ``li`` (random weights, seed 1, on CUDA) for a decode step of
    ``rows`` fresh requests, one token each, planned as the engine plans a step."""
    from dsv4.ops import triton_ops

    layer = dsv4.Attention(dsv4.AttentionWeights.random(cfg, li, seed=1), cfg, li, backend="triton",
                           check_inputs=False, nan_policy="off")
    cache = dsv4.HybridCache(cfg, layers=[li], max_requests=rows, num_blocks=rows * 2 + 1, device="cuda")
    for r in range(rows):
        cache.add_request(f"r{r}")
    batch = cache.prepare_forward({f"r{r}": 1 for r in range(rows)})
    return layer.layer_step(batch, cache, triton_ops.plan_step(batch, cache))
