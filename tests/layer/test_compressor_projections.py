"""The compressors' projections as one GEMM over the stacked matrices (``dsv4.compressor_stack``,
``ops.projections.layer_compressor_projections``).

CPU: ``stacked_compressor_projections`` of BF16 operands against an FP64 product of the same operands (and against
separate GEMMs), within the bound of FP32 summation; the stacked weights are views of one tensor, made once, never
stale; a layer's device weights are stacked under BF16 activations and its CPU projections are still the separate FP32
GEMMs, bit for bit. GPU (marked ``gpu``): the same bound for cuBLAS's stacked and separate BF16 GEMMs at V4-Flash
shapes, and a CUDA layer step runs the one GEMM.

The bound: the products of BF16 values are exact in FP32 (8 + 8 significant bits; no underflow at these scales), so
only the K − 1 additions of a dot product round, each by a relative error of at most eps32 = 2⁻²³ (one ulp:
round-to-nearest or truncation alike). In any order of the additions (split-K partials included) that gives
``|fp32 − exact| ≤ γ_K · Σ_k |x_k| |w_k|``, ``γ_K = K·eps32 / (1 − K·eps32)`` (Higham, Accuracy and Stability of
Numerical Algorithms, §4.2). The FP64 reference's own error is ~10⁹ times smaller.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dsv4
from dsv4.compressor_stack import compressor_stack, compressors, head_rows, stack_compressor_weights
from dsv4.ops import projections

TINY = dsv4.ModelConfig.preset("tiny")
FLASH = dsv4.ModelConfig.preset("v4-flash")
EPS32 = 2.0**-23


def _fp64_and_bound(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x wᵀ`` of the BF16 operands in FP64 and the FP32-summation bound ``γ_K·|x||w|ᵀ`` (module docstring)."""
    k_eps = x.shape[1] * EPS32
    return x.double() @ w.double().T, k_eps / (1 - k_eps) * (x.double().abs() @ w.double().abs().T)


def _assert_within(got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), f"{what}: error {float((err - bound).max()):.3g} above the bound"


# ------------------------------------------------------------------------------------------------ CPU
@pytest.mark.parametrize("rows", [1, 7])
def test_stacked_projections_within_fp64_bound(rows: int) -> None:
    """Each compressor's ``(a, z_raw)`` from the one GEMM is ``x W_kvᵀ`` / ``x W_gateᵀ`` of the BF16 operands (FP64)
    within the FP32-summation bound, as are separate GEMMs of the same operands; a neighbouring block is not (the
    bound tells the columns apart). The outputs are column views of one ``[T, N]`` tensor."""
    g = torch.Generator().manual_seed(rows)
    d, widths = 1024, (256, 64)
    x = torch.randn(rows, d, generator=g).bfloat16()
    mats = [(torch.randn(n, d, generator=g) * d**-0.5).bfloat16() for n in widths for _ in range(2)]
    stack = torch.cat(mats)
    out, head = projections.stacked_compressor_projections(x, stack, widths)
    assert len(out) == 2 and head is None
    base = out[0][0].data_ptr()
    col = 0
    for i, (a, z) in enumerate(out):
        for got, w in ((a, mats[2 * i]), (z, mats[2 * i + 1])):
            assert got.dtype == torch.float32 and got.shape == (rows, w.shape[0])
            assert got.stride() == (stack.shape[0], 1) and got.data_ptr() == base + 4 * col
            exact, bound = _fp64_and_bound(x, w)
            _assert_within(got, exact, bound, "stacked")
            _assert_within(x.float() @ w.float().T, exact, bound, "separate")
            col += w.shape[0]
    with pytest.raises(AssertionError):  # main's a against main's gate: far outside the bound
        _assert_within(out[0][0], *_fp64_and_bound(x, mats[1]), "another block")
    # the indexer's weights_proj as the stack's last rows: its sums are the last column block
    wp = (torch.randn(16, d, generator=g) * d**-0.5).bfloat16()
    out2, head = projections.stacked_compressor_projections(x, torch.cat(mats + [wp]), widths, head_rows=16)
    assert head.shape == (rows, 16) and head.stride() == (stack.shape[0] + 16, 1)
    assert head.data_ptr() == out2[0][0].data_ptr() + 4 * stack.shape[0]
    _assert_within(head, *_fp64_and_bound(x, wp), "head rows")
    assert all(torch.equal(a, a2) and torch.equal(z, z2) for (a, z), (a2, z2) in zip(out, out2))


def test_head_sums_are_taken_once_and_only_with_their_matrix() -> None:
    """``attach_head_sums`` keeps the indexer's sums with the exact input tensor; ``take_head_sums`` gives them once,
    and only to the ``weights_proj`` object they were made with (never another layer's, never twice)."""
    x, sums, wp = torch.zeros(4, 8), torch.randn(4, 2), torch.zeros(2, 8)
    projections.attach_head_sums(x, sums, wp)
    assert projections.take_head_sums(x.view(4, 8), wp) is None  # a view: not the tensor they were kept with
    assert projections.take_head_sums(x, wp) is sums
    assert projections.take_head_sums(x, wp) is None  # taken
    projections.attach_head_sums(x, sums, wp)
    assert projections.take_head_sums(x, wp.clone()) is None  # another matrix: refused, and dropped
    assert projections.take_head_sums(x, wp) is None


def test_stacked_projections_reject_a_stack_of_other_widths() -> None:
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(ValueError, match="2 \\* sum\\(widths\\)"):
        projections.stacked_compressor_projections(x, torch.randn(100, 64).bfloat16(), [32, 16])


@pytest.mark.parametrize("li", [1, 2], ids=["csa", "hca"])
def test_stacked_weights_are_views_of_one_tensor(li: int) -> None:
    """``stack_compressor_weights``: every compressor matrix (main, then the indexer's; kv, then gate) a row view of
    one ``[N, d]`` tensor holding the same values; the input left as it was; stacking stacked weights (or a copy
    holding the same tensors, e.g. a tensor-parallel shard) copies nothing."""
    w = dsv4.AttentionWeights.random(TINY, li, seed=5, dtype=torch.bfloat16, fp8=False)
    sw = stack_compressor_weights(w)
    stack = compressor_stack(sw)
    mats = [m for c in compressors(sw) for m in (c.wkv, c.wgate)]
    want = [m for c in compressors(w) for m in (c.wkv, c.wgate)]
    if li == 1:  # CSA: the indexer's weights_proj last
        mats.append(sw.indexer.weights_proj)
        want.append(w.indexer.weights_proj)
    assert len(mats) == (5 if li == 1 else 2)
    assert head_rows(sw) == (TINY.index_n_heads if li == 1 else 0)
    assert stack is not None and stack.is_contiguous()
    assert stack.shape == (sum(m.shape[0] for m in want), TINY.hidden_size)
    row = 0
    for m, orig in zip(mats, want):
        assert torch.equal(m, orig) and m.is_contiguous()
        assert m.data_ptr() == stack.data_ptr() + row * stack.stride(0) * stack.element_size()
        row += m.shape[0]
    assert compressor_stack(w) is None and w.compressor.wkv is want[0]  # the input is untouched
    assert sw.wq_a is w.wq_a and sw.compressor.ape is w.compressor.ape  # everything else: the same tensors
    again = stack_compressor_weights(sw)
    assert compressor_stack(again).data_ptr() == stack.data_ptr()
    shard = sw.shard(1, 2)
    assert compressor_stack(shard) is None  # a copy: no stack until stacked again, without a copy
    assert compressor_stack(stack_compressor_weights(shard)).data_ptr() == stack.data_ptr()


def test_a_stack_is_never_stale() -> None:
    """Weights whose compressor matrices no longer are the stack's views report no stack (their projections then
    run one GEMM per matrix): a replaced matrix, a matrix given new memory, a moved copy. SWA weights have none."""
    sw = stack_compressor_weights(dsv4.AttentionWeights.random(TINY, 1, seed=5).for_numerics(dsv4.Numerics.official()))
    assert compressor_stack(sw) is not None
    replaced = dataclasses.replace(sw)
    assert compressor_stack(replaced) is None
    assert compressor_stack(sw.to("cpu")) is None
    sw.indexer.compressor.wgate = sw.indexer.compressor.wgate.clone()
    assert compressor_stack(sw) is None
    sw2 = stack_compressor_weights(sw)
    sw2.compressor.wkv.data = torch.zeros_like(sw2.compressor.wkv)
    assert compressor_stack(sw2) is None
    swa = dsv4.AttentionWeights.random(TINY, 0, seed=5)
    assert stack_compressor_weights(swa) is swa and compressor_stack(swa) is None


def test_stacking_rejects_mixed_dtypes() -> None:
    w = dsv4.AttentionWeights.random(TINY, 2, seed=5)
    w.compressor.wgate = w.compressor.wgate.bfloat16()
    with pytest.raises(ValueError, match="one dtype and device"):
        stack_compressor_weights(w)


def _layer_step(layer: dsv4.Attention, numerics: str, tokens: int = 9):
    cache = dsv4.HybridCache(TINY, layers=[layer.layer_idx], max_requests=1, num_blocks=8, block_size=32,
                             device="cpu", numerics=numerics)
    cache.add_request("r")
    batch = cache.prepare_forward({"r": tokens})
    return layer.layer_step(batch, cache, layer.plan_step(batch, cache))


def test_layer_stacks_its_device_weights_once() -> None:
    """``Attention`` stacks the copy it computes with under BF16 activations (not under the exact numerics), once
    per device copy; ``reload_weights`` makes a new one from the weights as they are then. On the CPU the
    projections stay the separate FP32 GEMMs, bit for bit."""
    w = dsv4.AttentionWeights.random(TINY, 1, seed=6)
    layer = dsv4.Attention(w, TINY, 1, backend="torch")
    step = _layer_step(layer, "official")
    stack = compressor_stack(step.weights)
    assert stack is not None and stack.dtype == torch.bfloat16
    assert compressor_stack(_layer_step(layer, "official").weights) is stack  # made once
    assert compressor_stack(_layer_step(layer, "exact").weights) is None
    x = torch.randn(9, TINY.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = projections.layer_compressor_projections(step, x)
    for (a, z), c in zip(got, compressors(w)):
        assert torch.equal(a, x.float() @ c.wkv.bfloat16().float().T)
        assert torch.equal(z, x.float() @ c.wgate.bfloat16().float().T)
    w.indexer.compressor.wkv.mul_(2)  # changed in place: seen after reload_weights only
    assert torch.equal(compressor_stack(_layer_step(layer, "official").weights), stack)
    layer.reload_weights()
    fresh = compressor_stack(_layer_step(layer, "official").weights)
    rows = w.compressor.wkv.shape[0] * 2
    assert torch.equal(fresh[rows : rows + w.indexer.compressor.wkv.shape[0]], w.indexer.compressor.wkv.bfloat16())


def test_indexer_weights_take_the_stacked_sums_once() -> None:
    """Both backends' ``indexer_weights`` use the indexer's FP32 sums that the stacked GEMM kept with ``x``, rounded
    to BF16 as the official BF16 GEMM rounds its output, then scaled — and without them (taken, or made for another
    input) run their own GEMM, which the rounded sums equal up to the summation order."""
    from dsv4.ops import triton_indexer
    from dsv4.reference.indexer import indexer_head_weights

    layer = dsv4.Attention(dsv4.AttentionWeights.random(TINY, 1, seed=8), TINY, 1, backend="torch")
    step = _layer_step(layer, "official")
    wp = step.weights.indexer.weights_proj
    assert wp.data_ptr() == compressor_stack(step.weights)[-head_rows(step.weights):].data_ptr()  # in the stack
    x = torch.randn(9, TINY.hidden_size, generator=torch.Generator().manual_seed(2)).bfloat16()
    sums = x.float() @ wp.float().T  # FP32 sums of exact BF16 products
    scale = TINY.index_weight_scale
    own = indexer_head_weights(x, step.weights.indexer, TINY, step.numerics)
    assert ((sums.bfloat16().float() * scale - own).abs() <= own.abs() * 2.0**-7).all()  # one BF16 step at most
    kept = sums * 3  # what is kept is what is used (3x: tells it from the layer's own GEMM)
    projections.attach_head_sums(x, kept, wp)
    assert torch.equal(projections.indexer_weights(step, x), kept.bfloat16().float() * scale)
    assert torch.equal(projections.indexer_weights(step, x), own)  # taken: the layer's own GEMM
    projections.attach_head_sums(x, kept, wp.clone())  # made with another matrix: not used
    assert torch.equal(projections.indexer_weights(step, x), own)
    projections.attach_head_sums(x, sums, wp)
    hw = triton_indexer.head_weights(step, x)
    assert hw.projection is sums and not hw.rounded and hw.scale == scale
    assert torch.equal(hw.rounded_projection(), sums.bfloat16())
    again = triton_indexer.head_weights(step, x)
    assert again.rounded and again.projection.dtype == torch.bfloat16


def test_engine_weights_are_stacked_once_and_the_layer_reuses_them() -> None:
    """An engine's BF16 weights come stacked (``engine.weights.engine_weights``), and the layer's device copy is the
    same memory: no second copy of the compressor matrices on the device."""
    from dsv4.engine.weights import engine_weights

    w = engine_weights(dsv4.AttentionWeights.random(TINY, 1, seed=7), torch.bfloat16, torch.device("cpu"))
    stack = compressor_stack(w)
    assert stack is not None
    layer = dsv4.Attention(w, TINY, 1, backend="torch")
    assert compressor_stack(_layer_step(layer, "official").weights).data_ptr() == stack.data_ptr()
    exact = engine_weights(dsv4.AttentionWeights.random(TINY, 1, seed=7), torch.float32, torch.device("cpu"))
    assert compressor_stack(exact) is None


def test_launch_rejects_projections_without_one_row_stride() -> None:
    """The write kernels index ``a`` and ``z_raw`` with one row stride: arguments without one are refused, naming
    the compressor."""
    pytest.importorskip("triton")
    from dsv4.kernels.write.launch import CompressorArgs, _row_stride

    buf = torch.zeros(5, 96)
    args = CompressorArgs(buf[:, :32], buf[:, 32:64], *(torch.zeros(1),) * 4, None, None, torch.zeros(1))
    assert _row_stride(args, "main") == 96
    assert _row_stride(dataclasses.replace(args, a=buf[:1, :32], z_raw=torch.zeros(1, 32)), "main") == 32  # unused
    overlapping = torch.zeros(5, 32).as_strided((5, 32), (16, 1))
    for bad in (dict(z_raw=torch.zeros(5, 32)), dict(a=buf[:, :64:2]), dict(a=buf[:, :32].double()),
                dict(a=overlapping, z_raw=overlapping)):
        with pytest.raises(ValueError, match="indexer compressor"):
            _row_stride(dataclasses.replace(args, **bad), "indexer")


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 64, 256, 8192])
@pytest.mark.parametrize("li", [2, 3], ids=["csa", "hca"])
def test_cuda_stacked_gemm_within_fp64_bound(li: int, rows: int) -> None:
    """On CUDA, cuBLAS's one GEMM over the stacked V4-Flash matrices and the separate ``torch.mm(out_dtype=fp32)``
    GEMMs are both within the FP32-summation bound of the FP64 product of the same BF16 operands."""
    w = dsv4.AttentionWeights.random(FLASH, li, seed=3, device="cuda").for_numerics(dsv4.Numerics.official())
    sw = stack_compressor_weights(w)
    widths = [c.wkv.shape[0] for c in compressors(sw)]
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, FLASH.hidden_size, device="cuda", generator=g).bfloat16()
    got, head = projections.stacked_compressor_projections(x, compressor_stack(sw), widths, head_rows(sw))
    if li == 2:  # CSA: the indexer's head weights' sums
        exact, bound = _fp64_and_bound(x, sw.indexer.weights_proj)
        _assert_within(head, exact, bound, f"head sums, {rows} rows")
    for (a, z), c in zip(got, compressors(sw)):
        for fused, m in ((a, c.wkv), (z, c.wgate)):
            exact, bound = _fp64_and_bound(x, m)
            _assert_within(fused, exact, bound, f"stacked, {rows} rows")
            _assert_within(torch.mm(x, m.T, out_dtype=torch.float32), exact, bound, f"separate, {rows} rows")


@pytest.mark.gpu
@pytest.mark.parametrize("li", [2, 3], ids=["csa", "hca"])
def test_cuda_layer_step_runs_one_gemm(li: int) -> None:
    """A CUDA layer step's compressor projections are column views of one output (the stacked GEMM ran), equal to
    ``stacked_compressor_projections`` of the step's stack."""
    layer = dsv4.Attention(dsv4.AttentionWeights.random(FLASH, li, seed=3, device="cuda"), FLASH, li)
    cache = dsv4.HybridCache(FLASH, layers=[li], max_requests=2, num_blocks=16, block_size=256, device="cuda")
    for r in "ab":
        cache.add_request(r)
    batch = cache.prepare_forward({"a": 37, "b": 5})
    step = layer.layer_step(batch, cache, layer.plan_step(batch, cache))
    x = torch.randn(42, FLASH.hidden_size, device="cuda").bfloat16()
    got = projections.layer_compressor_projections(step, x)
    storages = {t.untyped_storage().data_ptr() for pair in got for t in pair}
    assert len(storages) == 1 and len(got) == (2 if li == 2 else 1)
    stack = compressor_stack(step.weights)
    widths = [c.wkv.shape[0] for c in compressors(step.weights)]
    want, head = projections.stacked_compressor_projections(x, stack, widths, head_rows(step.weights))
    for (a, z), (wa, wz) in zip(got, want):
        assert torch.equal(a, wa) and torch.equal(z, wz)
    sums = projections.take_head_sums(x, step.weights.indexer.weights_proj) if li == 2 else None
    assert (sums is not None) == (li == 2)  # CSA: the indexer's sums kept with x, from the same GEMM
    if sums is not None:
        assert torch.equal(sums, head) and sums.untyped_storage().data_ptr() in storages
