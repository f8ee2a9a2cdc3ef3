"""A CSA layer's query projections ``W_qb c^Q`` and ``W_Iq c^Q`` as one FP8 GEMM over their stack
(``dsv4.query_stack``, the Triton backend's ``queries``), and every stack of a layer's weights together
(``dsv4.layer_stacks``).

CPU: the stacked ``BlockFp8Weight`` holds both weights' E4M3 values and block scales unchanged; ``wq_b`` /
``indexer.wq_b`` are views of it, made once, never stale; layers without an indexer and BF16 weights are left alone;
the three stacks (compressors', input projections', query projections') survive each other in every order. Under
the Triton interpreter: the Triton backend's ``queries`` runs one GEMM over the stack and its consumers read the two
column blocks in place. GPU (marked ``gpu``): on V4-Flash weights at 1 … 256 rows (the Triton block GEMM up to 64,
cuBLAS beyond) each column block of the one GEMM is the reference's FP8 GEMM of its weight up to the tensor cores'
accumulation precision (the heads' block: the bits of ``W_qb``'s own Triton GEMM where both take the same
launch), the queries and the indexer queries read their blocks in place; a CSA layer step runs one FP8 GEMM fewer
than without the stack, with the same outputs up to the indexer GEMM's summation order.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools

import pytest
import torch

import dsv4
from dsv4.compressor_stack import compressor_stack, stack_compressor_weights
from dsv4.engine.weights import engine_weights
from dsv4.formats.block_fp8 import BlockFp8Weight
from dsv4.input_stack import input_stack, stack_input_projections
from dsv4.numerics import resolve_numerics
from dsv4.query_stack import query_stack, stack_query_projections
from dsv4.weight_stack import replace_keeping_stacks, stack_fp8_rows
from support.interpreter import run_interpreted
from support.stacks import TINY, TINY_128, assert_stack_of, cuda_decode_step, fp8_weights

CSA, HCA, SWA = 1, 2, 0  # the tiny preset's layers


def test_stack_holds_both_weights_and_they_are_its_views() -> None:
    w = fp8_weights(TINY, CSA)
    assert isinstance(w.wq_b, BlockFp8Weight) and query_stack(w) is None
    s = stack_query_projections(w)
    stack = query_stack(s)
    n = TINY.num_heads * TINY.head_dim
    assert stack.shape == (n + TINY.index_n_heads * TINY.index_head_dim, TINY.q_lora_rank)
    assert_stack_of(stack, [w.wq_b, w.indexer.wq_b], [s.wq_b, s.indexer.wq_b])
    assert s.indexer.compressor is w.indexer.compressor and s.indexer.weights_proj is w.indexer.weights_proj
    assert query_stack(w) is None  # the input is left as it was
    again = stack_query_projections(s)  # already stacked: the same memory, nothing copied
    assert query_stack(again).data.data_ptr() == stack.data.data_ptr()


def test_stack_is_never_stale() -> None:
    s = stack_query_projections(fp8_weights(TINY, CSA))
    other = BlockFp8Weight(s.indexer.wq_b.data.clone(), s.indexer.wq_b.scale.clone())
    assert query_stack(dataclasses.replace(s, indexer=dataclasses.replace(s.indexer, wq_b=other))) is None
    assert query_stack(dataclasses.replace(s, wq_b=BlockFp8Weight(s.wq_b.data.clone(), s.wq_b.scale.clone()))) is None
    assert query_stack(s.to("cpu")) is None  # a copy drops the record (``to`` makes new weight objects)
    s.indexer.wq_b.data.view(torch.uint8)[0, 0] ^= 1  # an in-place change reaches the stack: it is the same memory
    n = TINY.num_heads * TINY.head_dim
    assert torch.equal(query_stack(s).data[n, 0].view(torch.uint8), s.indexer.wq_b.data[0, 0].view(torch.uint8))


def test_weights_that_cannot_stack_are_left_alone() -> None:
    for li in (SWA, HCA):  # no indexer
        w = fp8_weights(TINY, li)
        assert w.indexer is None and stack_query_projections(w) is w and query_stack(w) is None
    bf16 = dsv4.AttentionWeights.random(TINY, CSA, seed=3).for_numerics(resolve_numerics("exact"))
    assert not isinstance(bf16.wq_b, BlockFp8Weight) and stack_query_projections(bf16) is bf16


def test_stack_fp8_rows_keeps_every_scale_block_whole() -> None:
    """``stack_fp8_rows`` (both FP8 stacks): any rows for the last weight, 128-row multiples before it; no stack
    where a scale block would straddle two weights, K or the kind of weight differs."""
    g = torch.Generator().manual_seed(0)

    def fp8(rows: int, k: int = 200) -> BlockFp8Weight:
        return BlockFp8Weight.quantize(torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g))

    ws = [fp8(256), fp8(128), fp8(70)]
    stack, views = stack_fp8_rows(ws)
    assert stack.shape == (454, 200) and stack.scale.shape == (4, 2)
    for v, w in zip(views, ws):
        assert torch.equal(v.dequantize(), w.dequantize()) and v.shape == w.shape
    assert stack_fp8_rows([fp8(70), fp8(128)]) is None  # the first weight's last scale block would hold both
    assert stack_fp8_rows([fp8(128), fp8(128, k=256)]) is None
    assert stack_fp8_rows([fp8(128), torch.zeros(128, 200)]) is None


@pytest.mark.parametrize("li", [CSA, HCA], ids=["csa", "hca"])
def test_every_stacking_order_keeps_every_stack(li: int) -> None:
    """Each stacking copies the weights, keeping the others' records: in every order the weights end with all of a
    layer's stacks (HCA: no query stack); a layer's device weights and an engine's weights hold them all."""
    w = fp8_weights(TINY_128, li)
    stackers = (stack_compressor_weights, stack_input_projections, stack_query_projections)
    for order in itertools.permutations(stackers):
        s = w
        for stack in order:
            s = stack(s)
        assert compressor_stack(s) is not None and input_stack(s) is not None, order
        assert (query_stack(s) is not None) == (li == CSA), order
    layer = dsv4.Attention(dsv4.AttentionWeights.random(TINY_128, li, seed=3), TINY_128, li, backend="torch")
    dev, _ = layer._weights_on(torch.device("cpu"), resolve_numerics("official"))
    held = engine_weights(w, torch.bfloat16, torch.device("cpu"))
    for s in (dev, held):
        assert compressor_stack(s) is not None and input_stack(s) is not None
        assert (query_stack(s) is not None) == (li == CSA)
    if li == CSA:  # a stale stack is found per stack: the others stay
        stale = replace_keeping_stacks(dev, wq_a=BlockFp8Weight(dev.wq_a.data.clone(), dev.wq_a.scale.clone()))
        assert input_stack(stale) is None and query_stack(stale) is not None and compressor_stack(stale) is not None


def test_torch_backend_indexer_queries_from_a_projection() -> None:
    """The torch backend's ``indexer_queries`` from a given ``W_Iq c^Q`` (a column block, rows wider apart) are
    its queries from ``c^Q``: the reference's rounding of that projection."""
    from dsv4.ops import projections, torch_ops

    layer = dsv4.Attention(dsv4.AttentionWeights.random(TINY, CSA, seed=4), TINY, CSA, backend="torch")
    cache = dsv4.HybridCache(TINY, layers=[CSA], max_requests=1, num_blocks=4, block_size=16)
    cache.add_request("a")
    batch = cache.prepare_forward({"a": 9})
    step = layer.layer_step(batch, cache, layer.plan_step(batch, cache))
    g = torch.Generator().manual_seed(4)
    q_latent = torch.randn(9, TINY.q_lora_rank, generator=g).bfloat16()
    proj = projections.indexer_query_projection(step, q_latent)
    wide = torch.cat([torch.randn(9, 64, generator=g).bfloat16(), proj], dim=1)[:, 64:]
    want = torch_ops.indexer_queries(step, q_latent)
    assert torch.equal(torch_ops.indexer_queries(step, q_latent, wide), want)
    assert torch_ops.queries(step, q_latent)[1] is None  # the torch backend projects the indexer's itself


_GLUE_SCRIPT = r"""
import dataclasses, torch, dsv4
from dsv4.kernels.device import DeviceFacts
from dsv4.kernels.project import fp8_gemm, queries as query_kernels
from dsv4.ops import projections, triton_indexer, triton_ops, triton_write
from dsv4.ops.triton_project import projector
from dsv4.query_stack import query_stack
from support.bf16 import check_close
cfg = dataclasses.replace(dsv4.ModelConfig.preset("tiny"), q_lora_rank=128)
li = 1  # CSA
layer = dsv4.Attention(dsv4.AttentionWeights.random(cfg, li, seed=2), cfg, li, backend="triton")
cache = dsv4.HybridCache(cfg, layers=[li], max_requests=2, num_blocks=8, block_size=16)
for r in "ab":
    cache.add_request(r)
batch = cache.prepare_forward({"a": 5, "b": 2})
# FP8 projections as a GPU without the Triton GEMM runs them (cuBLAS over the quantized values: here torch's CPU GEMM)
facts = DeviceFacts(kernels=True, sm_count=4, sm90=False, fp8_gemm="bf16")
step = layer.layer_step(batch, cache, triton_ops.plan_step(batch, cache, device=facts))
stack = query_stack(step.weights)
assert stack is not None and step.plan.projection is not None and step.plan.kernels
gemms = []
real = fp8_gemm.fp8_linear
fp8_gemm.fp8_linear = lambda x, w, *a: gemms.append(tuple(w.shape)) or real(x, w, *a)
g = torch.Generator().manual_seed(2)
q_latent = (torch.randn(7, cfg.q_lora_rank, generator=g) * torch.exp(torch.randn(7, 1, generator=g))).bfloat16()
H, D, n = cfg.num_heads, cfg.head_dim, cfg.num_heads * cfg.head_dim
heads, index = triton_write.query_projections(step, q_latent)
assert gemms == [tuple(stack.shape)], gemms  # one GEMM for both
assert heads.shape == (7, H, D) and index.shape == (7, stack.shape[0] - n)
assert heads.stride(0) == index.stride(0) == stack.shape[0]  # column views of its output: no copy
assert index.data_ptr() == heads.data_ptr() + 2 * n
alone = dataclasses.replace(step, weights=dataclasses.replace(step.weights))  # a copy: no stack, two GEMMs
gemms.clear()
h2, none = triton_write.query_projections(alone, q_latent)
i2 = projections.indexer_query_projection(alone, q_latent, projector(alone))
assert none is None and gemms == [tuple(step.weights.wq_b.shape), tuple(step.weights.indexer.wq_b.shape)], gemms
check_close(heads, h2)  # the same products; the CPU GEMM may sum them in another order for another width
check_close(index, i2)
triton_indexer.indexer_queries(alone, q_latent)  # no projection given: its own GEMM
assert len(gemms) == 3
gemms.clear()
q, q_index = triton_write.queries(step, q_latent)  # the op: the one GEMM, then the kernel reading heads in place
assert len(gemms) == 1 and q_index.stride(0) == stack.shape[0]
pos, inv = step.positions, step.inv_freq.float().contiguous()
assert torch.equal(q, query_kernels.queries(heads.contiguous(), pos, inv, cfg.norm_eps))
got = triton_indexer.indexer_queries(step, q_latent, q_index)
assert len(gemms) == 1  # the indexer ran no GEMM of its own
want = triton_indexer.queries_from_projection(q_index.contiguous(), pos, step.inv_freq, cfg, step.numerics)
assert torch.equal(got.q, want.q) and torch.equal(got.scale, want.scale)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_queries_run_one_gemm_in_the_interpreter() -> None:
    run_interpreted(_GLUE_SCRIPT)


# ------------------------------------------------------------------------------------------------ GPU
FLASH = dsv4.ModelConfig.preset("v4-flash")
FLASH_CSA = 2  # a CSA layer of V4-Flash


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 64, 256])
def test_gpu_stacked_query_projections_match_separate(rows: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from support.bf16 import bf16_step, check_queries

    from dsv4.formats.block_fp8 import fp8_linear, qdq_activations
    from dsv4.kernels.project import queries as query_kernels
    from dsv4.ops import triton_indexer, triton_write
    from dsv4.ops.triton_project import projector
    from dsv4.reference.primitives import rms_norm
    from dsv4.reference.rope import apply_rope

    step = cuda_decode_step(FLASH, FLASH_CSA, rows)
    w = step.weights
    stack = query_stack(w)
    assert stack is not None and input_stack(w) is not None and compressor_stack(w) is not None
    n = FLASH.num_heads * FLASH.head_dim
    assert stack.shape == (n + FLASH.index_n_heads * FLASH.index_head_dim, FLASH.q_lora_rank)
    plan = step.plan.projection
    # decode rows take the Triton block GEMM, more rows cuBLAS over the quantized values (the plan's rule)
    assert (plan.launch(*stack.shape) is not None) == (rows <= 64)
    g = torch.Generator(device="cuda").manual_seed(rows)
    q_latent = (torch.randn(rows, FLASH.q_lora_rank, generator=g, device="cuda")
                * torch.exp(torch.randn(rows, 1, generator=g, device="cuda"))).bfloat16()
    # the one GEMM: each column block the reference's FP8 GEMM of its weight up to the tensor cores' accumulation
    # (as tests/layer/test_input_projections.py bounds it: within one BF16 step + 2⁻¹⁰·Σ|x_k w_k|, 4e-3 overall)
    project = projector(step)
    y = project(q_latent, stack, step.numerics)
    for got, weight in ((y[:, :n], w.wq_b), (y[:, n:], w.indexer.wq_b)):
        want = fp8_linear(q_latent, weight, torch.float32)
        bound = bf16_step(want) + 2.0**-10 * (qdq_activations(q_latent).abs() @ weight.dequantize().abs().T)
        assert bool(((got.float() - want).abs() <= bound).all())
        assert float((got.float() - want).norm() / want.norm()) < 4e-3
        separate = project(q_latent, weight, step.numerics)  # the unstacked computation: its own GEMM
        assert bool(((separate.float() - want).abs() <= bound).all())
    if plan.launch(*stack.shape) is not None and plan.launch(*stack.shape) == plan.launch(*w.wq_b.shape):
        # the same launch over the heads' columns: each output tile the same arithmetic, the same bits
        assert torch.equal(y[:, :n], project(q_latent, w.wq_b, step.numerics))
    # the ops: the queries' kernel reads the heads' block in place, the indexer's kernel its block — or, where the
    # plan runs the stack as its parts (a prefill chunk where torch._scaled_mm works), each part its own GEMM: the
    # heads' in the queries' op, the indexer's in indexer_queries
    stacked = plan.stacked(*stack.shape)
    y_heads, y_index = ((y[:, :n], y[:, n:]) if stacked else
                        (project(q_latent, w.wq_b, step.numerics), project(q_latent, w.indexer.wq_b, step.numerics)))
    heads, index = triton_write.query_projections(step, q_latent)
    assert torch.equal(heads.flatten(1), y_heads)
    if stacked:
        assert index is not None and (rows == 1 or heads.stride(0) == index.stride(0) == stack.shape[0])
        assert torch.equal(index, y_index)
    q, q_index = triton_write.queries(step, q_latent)
    assert (q_index is not None) == stacked and (rows == 1 or not stacked or q_index.stride(0) == stack.shape[0])
    pos, inv = step.positions, step.inv_freq.float().contiguous()
    contiguous = y_heads.contiguous().unflatten(-1, (FLASH.num_heads, FLASH.head_dim))
    assert torch.equal(q, query_kernels.queries(contiguous, pos, inv, FLASH.norm_eps))
    check_queries(q, apply_rope(rms_norm(contiguous, None, FLASH.norm_eps), pos, step.inv_freq))
    got = triton_indexer.indexer_queries(step, q_latent, q_index)
    want = triton_indexer.queries_from_projection(y_index.contiguous(), pos, step.inv_freq, FLASH, step.numerics)
    assert torch.equal(got.q, want.q) and torch.equal(got.scale, want.scale)


@pytest.mark.gpu
def test_gpu_csa_layer_step_runs_one_fewer_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CSA layer step (a prefill chunk, then decode steps) with the query stack runs one FP8 GEMM fewer than the
    same layer without it (3: ``wq_a+wkv``, ``wq_b+indexer.wq_b``, ``wo_b``; against 4), writes the same cache bytes
    and outputs the same up to the indexer GEMM's summation order (the contexts are shorter than top-k, so every
    entry is selected either way)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import dsv4.layer
    from dsv4.kernels.project import block_gemm, fp8_gemm
    from dsv4.kernels.project.plan import ProjectionPlan

    li = FLASH_CSA
    w = dsv4.AttentionWeights.random(FLASH, li, seed=3, device="cuda")
    stacked = dsv4.Attention(w, FLASH, li, backend="triton")
    alone = dsv4.Attention(w, FLASH, li, backend="triton")
    caches = [dsv4.HybridCache(FLASH, layers=[li], max_requests=2, num_blocks=16, block_size=256, device="cuda")
              for _ in range(2)]
    for cache in caches:
        for r in "ab":
            cache.add_request(r)
    gemms: list[tuple[int, int]] = []

    def counted(fn):
        return lambda x, weight, *a, **k: gemms.append(tuple(weight.shape)) or fn(x, weight, *a, **k)

    monkeypatch.setattr(block_gemm, "block_fp8_linear", counted(block_gemm.block_fp8_linear))
    monkeypatch.setattr(fp8_gemm, "fp8_linear", counted(fp8_gemm.fp8_linear))
    # the prefill chunk's projections summed exactly in both layers (the plan would run the lone wq_b on FP8 tensor
    # cores where the device has them, and the stack exactly): the layers then differ only in the indexer GEMM
    monkeypatch.setattr(ProjectionPlan, "way", lambda self, n, k: "bf16")
    g = torch.Generator(device="cuda").manual_seed(3)
    for i, new in enumerate(({"a": 70, "b": 9}, {"a": 1, "b": 1}, {"a": 1, "b": 1})):
        batches = [cache.prepare_forward(new) for cache in caches]
        plans = [layer.plan_step(b, c) for layer, b, c in zip((stacked, alone), batches, caches)]  # device facts
        if i == 0:
            assert query_stack(stacked.layer_step(batches[0], caches[0], plans[0]).weights) is not None
            with monkeypatch.context() as m:  # the other layer's device weights: every stack but the queries'
                m.setattr(dsv4.layer, "stack_layer_weights",
                          lambda v: stack_input_projections(stack_compressor_weights(v)))
                held = alone.layer_step(batches[1], caches[1], plans[1]).weights
            assert query_stack(held) is None and input_stack(held) is not None
        x = torch.randn(batches[0].num_tokens, FLASH.hidden_size, generator=g, device="cuda").bfloat16()
        counts, outs = [], []
        for layer, batch, cache, plan in zip((stacked, alone), batches, caches, plans):
            gemms.clear()
            outs.append(layer.forward_with_aux(x, batch, cache, plan))
            counts.append(len(gemms))
        assert counts == [3, 4], (new, counts)
        a, b = outs
        assert torch.equal(a.entry_idx.sort(dim=1).values, b.entry_idx.sort(dim=1).values)
        assert float((a.y.float() - b.y.float()).norm() / b.y.float().norm()) < 4e-3
        for name in caches[0].state.tensors[li]:  # the writes do not read the queries: the same bytes
            assert torch.equal(caches[0].state.tensors[li][name], caches[1].state.tensors[li][name]), name
        for name in caches[0].pool.tensors[li]:
            assert torch.equal(caches[0].pool.tensors[li][name], caches[1].pool.tensors[li][name]), name


@pytest.mark.gpu
def test_gpu_csa_prefill_runs_the_query_stack_as_its_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the device runs ``torch._scaled_mm``, a CSA prefill chunk's plan runs the query stack as its parts —
    ``wq_b`` on FP8 tensor cores, the indexer's ``wq_b`` exactly (``ProjectionPlan.unstacked``) —: the same GEMMs,
    ways and bits as a layer whose weights were never stacked."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import dsv4.layer
    from dsv4.kernels.project import fp8_gemm

    if not fp8_gemm.scaled_mm_works(torch.device("cuda")):
        pytest.skip("torch._scaled_mm does not take the blockwise recipe here (every prefill GEMM is exact)")
    li = FLASH_CSA
    w = dsv4.AttentionWeights.random(FLASH, li, seed=4, device="cuda")
    stacked = dsv4.Attention(w, FLASH, li, backend="triton")
    with monkeypatch.context() as m:  # every stack but the queries'
        m.setattr(dsv4.layer, "stack_layer_weights", lambda v: stack_input_projections(stack_compressor_weights(v)))
        alone = dsv4.Attention(w, FLASH, li, backend="triton")
        caches = [dsv4.HybridCache(FLASH, layers=[li], max_requests=1, num_blocks=8, block_size=256, device="cuda")
                  for _ in range(2)]
        for cache in caches:
            cache.add_request("a")
        batches = [cache.prepare_forward({"a": 300}) for cache in caches]
        plans = [layer.plan_step(b, c) for layer, b, c in zip((stacked, alone), batches, caches)]
        assert query_stack(alone.layer_step(batches[1], caches[1], plans[1]).weights) is None
    assert query_stack(stacked.layer_step(batches[0], caches[0], plans[0]).weights) is not None
    gemms: list[tuple[tuple[int, int], str]] = []
    real = fp8_gemm.fp8_linear
    monkeypatch.setattr(fp8_gemm, "fp8_linear", lambda x, weight, dtype, way: gemms.append((tuple(weight.shape), way))
                        or real(x, weight, dtype, way))
    x = torch.randn(300, FLASH.hidden_size, generator=torch.Generator(device="cuda").manual_seed(4),
                    device="cuda").bfloat16()
    ys, ways = [], []
    for layer, batch, cache, plan in zip((stacked, alone), batches, caches, plans):
        gemms.clear()
        ys.append(layer(x, batch, cache, plan))
        ways.append(sorted(gemms))
    H, D, hi = FLASH.num_heads, FLASH.head_dim, FLASH.index_n_heads * FLASH.index_head_dim
    assert ((H * D, FLASH.q_lora_rank), "scaled_mm") in ways[0] and ((hi, FLASH.q_lora_rank), "bf16") in ways[0]
    assert ways[0] == ways[1]
    assert torch.equal(ys[0], ys[1])
