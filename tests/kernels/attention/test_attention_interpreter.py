"""The sparse-attention kernel's index and mask logic on the CPU, through the Triton interpreter.

Runs ``dsv4.ops.triton_attention.attend_layer`` with ``TRITON_INTERPRET=1`` (in a subprocess: the variable must be set
before Triton compiles anything) on the tiny config's SWA / CSA / HCA layers, with stale and empty ring slots,
−1 entries and forced key splits (requested, and forced into the plan with ``dataclasses.replace``), against the
torch backend, plus the exact key dequantization probe (``support.attention.dequant_probe``, FP32 paths). The
interpreter rounds FP32 → BF16 by truncation, so agreement is to ~5e-3 rather than BF16 rounding; numerics are
checked on the GPU (``test_attention_gpu.py``).
Skipped when Triton is not installed (CI).
"""

from __future__ import annotations

import textwrap

import pytest

from support.interpreter import run_interpreted

pytest.importorskip("triton")

# Triton 3.6's interpreter calls int() on 1-element arrays, which NumPy >= 2.4 refuses.
INTERPRETER_PATCH = textwrap.dedent(
    """
    import triton.runtime.interpreter as _it
    import numpy as np

    _orig = _it._patch_lang_tensor
    def _patched(tensor, scope):
        _orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
    _it._patch_lang_tensor = _patched
    """
)

SCRIPT = INTERPRETER_PATCH + textwrap.dedent(
    """
    import dataclasses
    import torch, dsv4
    from dsv4.config import LayerKind
    from dsv4.kernels.attention.launch import sparse_attention_fwd
    from support.attention import compare, dequant_probe, make_case, step_plan

    for wide in (False, True):  # every E4M3 code, exact (the FP32 paths: the interpreter's BF16 is wrong)
        got, expected = dequant_probe("cpu", {}, wide)
        assert torch.equal(got, expected), (wide, int((got != expected).sum()))

    tiny = dsv4.ModelConfig.preset("tiny")
    cases = [
        (LayerKind.SWA, [0, 5, 20], [1, 2, 3], None),
        (LayerKind.CSA, [3, 40, 200], [1, 1, 2], None),
        (LayerKind.CSA, [0, 300], [7, 1], 70),
        (LayerKind.HCA, [15, 100, 1200], [1, 2, 1], None),
    ]
    for i, (kind, prefix, step, topk) in enumerate(cases):
        layer, batch, args, ti, xi = make_case(tiny, kind, prefix, step, "cpu", seed=i, topk=topk, block_size=32)
        err_o, err_l, o, o_ref = compare(layer, batch, args, ti, xi)
        assert err_o < 1e-2 and err_l < 1e-4, (kind, err_o, err_l)
        m = args["m"]
        entries = dict(ratio=m, entry_idx=xi if xi is not None and xi.dim() == 2 else None,
                       visible=xi if xi is not None and xi.dim() == 1 else None,
                       max_entries=int(batch.visible_entries[m].max()) if kind is LayerKind.HCA else 0)
        calls = [dict(num_splits=splits, block_n=16) for splits in (2, 5)]
        plan = step_plan(layer, batch, args, block_n=16, **entries)
        per = -(-plan.max_chunks // 3)  # (up to) three splits forced into the plan
        splits = -(-plan.max_chunks // per)
        calls.append(dict(plan=dataclasses.replace(plan, splits=splits, chunks_per_split=per,
                                                   merge="combine_kernel" if splits > 1 else "none")))
        for call in calls:
            out, lse = sparse_attention_fwd(
                args["q"], args["kv_new"], layer.ring, layer.ring_positions, layer.kv_pages, batch.block_tables,
                batch.token_request, batch.positions, batch.cu_seqlens, batch.start_pos, batch.token_slots,
                args["sink"], args["inv_freq"], args["scale"], window=batch.window, block_size=batch.block_size,
                **entries, **call,
            )
            err = ((out.double() - o_ref.double()).norm() / o_ref.double().norm()).item()
            assert err < 1e-2, (kind, call, err)
    print("ok")
    """
)


def test_attend_logic_in_interpreter() -> None:
    run_interpreted(SCRIPT)


COMBINE_SCRIPT = INTERPRETER_PATCH + textwrap.dedent(
    """
    import math
    import torch
    from dsv4.kernels.attention.combine import _combine_kernel

    g = torch.Generator().manual_seed(0)
    T, H = 3, 4
    inv_freq = (10000.0 ** (-torch.arange(32) / 32)).float()
    for S, block_s, block_h in ((1, 16, 1), (5, 16, 1), (20, 16, 1), (37, 4, 4)):
        po = torch.randn(T, S, H, 512, generator=g)
        plse = torch.rand(T, S, H, generator=g) * 60 - 30
        plse[torch.rand(T, S, H, generator=g) < 0.3] = float("-inf")  # empty splits
        plse[1] = float("-inf")  # a token with no key in any split: sink only
        plse[2, :, 0] = plse[2, :, 0] - 200  # tiny weights: the running max must not overflow a rescale
        sink = torch.randn(H, generator=g)
        positions = torch.randint(0, 100000, (T,), generator=g)
        out = torch.empty(T, H, 512, dtype=torch.bfloat16)
        lse = torch.empty(T, H)
        _combine_kernel[(triton_cdiv(H, block_h), T)](
            po, plse, positions, sink, inv_freq, out, out.stride(0), out.stride(1), lse, lse.stride(0), H, S,
            BLOCK_H=block_h, BLOCK_S=block_s, INTERPRET=True)
        # the merge in float64: o = sum_s 2^(lse_s - M) o_s / (sum_s 2^(lse_s - M) + 2^(sink·log2 e - M))
        lse2 = plse.double()
        m = lse2.amax(1)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        w = torch.exp2(lse2 - m[:, None])
        den = w.sum(1) + torch.exp2(sink.double() / math.log(2) - m)
        o = (w[..., None] * po.double()).sum(1) / den[..., None]
        assert torch.allclose(lse.double(), (m + torch.log2(den)) * math.log(2), rtol=1e-5, atol=1e-5), S
        err = (out[..., :448].double() - o[..., :448]).abs().max().item()
        assert err <= 8e-3 * o[..., :448].abs().max().item(), (S, err)
        # rope dims: the output rotated back by -pos·w per pair (norms of the pairs are kept)
        pair = lambda x: x[..., 448:].reshape(T, H, 32, 2).norm(dim=-1)
        assert torch.allclose(pair(out.double()), pair(o), rtol=2e-2, atol=2e-2), S
        assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all(), S
    print("ok")
    """
).replace("triton_cdiv", "__import__('triton').cdiv")


def test_combine_in_interpreter() -> None:
    """``_combine_kernel`` against the merge formula in float64: 1 to 37 splits (one load, several blocks of splits
    with a running max), empty splits, a token with none (sink only), weights 2^-200 below the others."""
    run_interpreted(COMBINE_SCRIPT)
