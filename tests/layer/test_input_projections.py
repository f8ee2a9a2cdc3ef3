"""The layer's input projections ``W_qa x`` and ``W_kv x`` as one FP8 GEMM over their stack (``dsv4.input_stack``,
the Triton backend's ``input_projections``).

CPU: the stacked ``BlockFp8Weight`` holds both weights' E4M3 values and block scales unchanged (its dequantized
rows are theirs, bit for bit: the stacked GEMM forms the same products); ``wq_a`` / ``wkv`` are views of it, made
once, never stale; weights that cannot stack (a ``q_lora_rank`` off the 128-row scale blocks, BF16 weights) are left
alone. GPU (marked ``gpu``): on V4-Flash weights at 1 … 256 rows (the Triton block GEMM up to 64, cuBLAS
beyond) each column block of the one GEMM is the reference's FP8 GEMM of its weight up to the tensor cores'
accumulation precision, and the norms read their blocks in place: the torch backend's norms of the same values.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dsv4
from dsv4.formats.block_fp8 import BlockFp8Weight
from dsv4.compressor_stack import compressor_stack, stack_compressor_weights
from dsv4.input_stack import input_stack, stack_input_projections
from dsv4.numerics import resolve_numerics
from dsv4.weight_stack import replace_keeping_stacks
from support.stacks import TINY, TINY_128, assert_stack_of, cuda_decode_step, fp8_weights


def test_stack_holds_both_weights_and_they_are_its_views() -> None:
    w = fp8_weights(TINY_128, 0)
    assert isinstance(w.wq_a, BlockFp8Weight) and input_stack(w) is None
    s = stack_input_projections(w)
    stack = input_stack(s)
    assert stack.shape == (TINY_128.q_lora_rank + TINY_128.head_dim, TINY_128.hidden_size)
    assert_stack_of(stack, [w.wq_a, w.wkv], [s.wq_a, s.wkv])
    assert input_stack(w) is None  # the input is left as it was
    again = stack_input_projections(s)  # already stacked: the same memory, nothing copied
    assert input_stack(again).data.data_ptr() == stack.data.data_ptr()


def test_stack_is_never_stale() -> None:
    s = stack_input_projections(fp8_weights(TINY_128, 0))
    other = BlockFp8Weight(s.wkv.data.clone(), s.wkv.scale.clone())
    assert input_stack(dataclasses.replace(s, wkv=other)) is None  # a replaced weight: one GEMM per projection
    assert input_stack(s.to("cpu")) is None  # a copy drops the record (``to`` makes new weight objects)
    s.wq_a.data.view(torch.uint8)[0, 0] ^= 1  # an in-place change reaches the stack: it is the same memory
    assert torch.equal(input_stack(s).data[0, 0].view(torch.uint8), s.wq_a.data[0, 0].view(torch.uint8))


def test_weights_that_cannot_stack_are_left_alone() -> None:
    off_blocks = fp8_weights(TINY, 0)  # q_lora_rank 64: a scale block would straddle wq_a and wkv
    assert TINY.q_lora_rank % 128 and stack_input_projections(off_blocks) is off_blocks
    bf16 = dsv4.AttentionWeights.random(TINY_128, 0, seed=3).for_numerics(resolve_numerics("exact"))
    assert not isinstance(bf16.wq_a, BlockFp8Weight) and stack_input_projections(bf16) is bf16


@pytest.mark.parametrize("li", [1, 2], ids=["csa", "hca"])
def test_layer_device_weights_hold_both_stacks(li: int) -> None:
    """The input projections' stack and the compressors' stack survive each other, in either order (each
    stacking copies the weights: the other's record must come along), and a layer's device weights hold both."""
    w = fp8_weights(TINY_128, li)
    for both in (stack_input_projections(stack_compressor_weights(w)),
                 stack_compressor_weights(stack_input_projections(w))):
        assert input_stack(both) is not None and compressor_stack(both) is not None
    layer = dsv4.Attention(dsv4.AttentionWeights.random(TINY_128, li, seed=3), TINY_128, li, backend="torch")
    dev, _ = layer._weights_on(torch.device("cpu"), resolve_numerics("official"))
    assert input_stack(dev) is not None and compressor_stack(dev) is not None
    assert input_stack(dataclasses.replace(dev)) is None  # a plain copy drops the records
    stale = replace_keeping_stacks(dev, compressor=dataclasses.replace(dev.compressor, wkv=dev.compressor.wkv.clone()))
    assert compressor_stack(stale) is None and input_stack(stale) is not None  # records kept, checked per stack


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 64, 256])
def test_gpu_stacked_input_projections_match_torch_backend(rows: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from support.bf16 import bf16_step, check_close

    from dsv4.formats.block_fp8 import fp8_linear, qdq_activations
    from dsv4.ops import triton_ops
    from dsv4.ops.triton_project import projector
    from dsv4.reference.primitives import rms_norm

    cfg = dsv4.ModelConfig.preset("v4-flash")
    step = cuda_decode_step(cfg, 2, rows)  # a CSA layer
    stack = input_stack(step.weights)
    assert stack is not None and compressor_stack(step.weights) is not None
    # decode rows take the Triton block GEMM, more rows cuBLAS over the quantized values (the plan's rule)
    assert (step.plan.projection.launch(*stack.shape) is not None) == (rows <= 64)
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = (torch.randn(rows, cfg.hidden_size, generator=g, device="cuda")
         * torch.exp(torch.randn(rows, 1, generator=g, device="cuda"))).bfloat16()
    # the one GEMM: each column block the reference's FP8 GEMM of its weight (formats.block_fp8: the same
    # products, summed in FP32) up to the tensor cores' accumulation — Hopper's FP8 MMA keeps about 14 bits within a
    # 128-wide K block (why the block GEMM adds each block into FP32), cuBLAS's BF16 GEMM may reduce split-K
    # partials in reduced precision: within one BF16 step + 2⁻¹⁰·Σ|x_k w_k|, and 4e-3 relative overall
    y = projector(step)(x, stack, step.numerics)
    n = cfg.q_lora_rank
    for got, weight in ((y[:, :n], step.weights.wq_a), (y[:, n:], step.weights.wkv)):
        want = fp8_linear(x, weight, torch.float32)
        bound = bf16_step(want) + 2.0**-10 * (qdq_activations(x).abs() @ weight.dequantize().abs().T)
        assert bool(((got.float() - want).abs() <= bound).all())
        assert float((got.float() - want).norm() / want.norm()) < 4e-3
    # then the norms, each over its column block of that output read in place: the torch backend's norm of the
    # same values (the 512-wide one bit for bit, torch's summation order; c^Q in Triton's: one BF16 step)
    q_latent, kv = triton_ops.input_projections(step, x)
    w, eps = step.weights, cfg.norm_eps
    assert torch.equal(kv, rms_norm(y[:, n:].contiguous(), w.kv_norm, eps))
    check_close(q_latent, rms_norm(y[:, :n].contiguous(), w.q_norm, eps))
