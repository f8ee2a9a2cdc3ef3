"""``kernels.indexer.score_weights``: the indexer's per-head score weights in one launch, bit for bit the torch ops it
replaces (``(p.float() · s)``, zero-padded to the queries' head width, times the queries' per-head scales), for the
BF16 projection with its scale, for its FP32 sums rounded to BF16 first (``round_bf16``: the stacked compressor GEMM's
columns, ``p.bfloat16().float() · s``) and for weights already scaled (``s`` = 1) — Triton interpreter on the CPU,
and the GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from support.interpreter import run_interpreted

_SCRIPT = r"""
import torch
from dsv4.kernels.indexer.score_weights import score_weights
g = torch.Generator().manual_seed(4)
for T, H, HP in ((1, 64, 64), (5, 6, 8), (3, 20, 32)):
    p = (torch.randn(T, H, generator=g) * 4).bfloat16()
    qs = torch.exp2(torch.randint(-20, 5, (T, HP), generator=g).float())
    qs[:, H:] = 0
    s = (128 ** -0.5) * (H ** -0.5)
    want = torch.zeros(T, HP)
    want[:, :H] = p.float() * s
    want.mul_(qs)
    assert torch.equal(score_weights(p, s, qs), want), (T, H)
    scaled = p.float() * s  # already scaled: s = 1 changes no bit
    assert torch.equal(score_weights(scaled, 1.0, qs), want), (T, H)
    wide = torch.randn(T, H + 3, generator=g).bfloat16()[:, :H]  # rows with a stride
    want2 = torch.zeros(T, HP); want2[:, :H] = wide.float() * s; want2.mul_(qs)
    assert torch.equal(score_weights(wide, s, qs), want2)
    # FP32 sums with a row stride (a column block of a wider GEMM output), rounded to BF16 in the launch; values
    # on and next to BF16 rounding ties, so a truncation or a missing rounding shows
    sums = torch.randn(T, H + 40, generator=g) * 4
    ties = sums.view(torch.int32) & ~0xFFFF | 0x8000
    sums[:, ::3] = ties[:, ::3].view(torch.float32)
    sums = sums[:, 5 : 5 + H]
    want3 = torch.zeros(T, HP); want3[:, :H] = sums.bfloat16().float() * s; want3.mul_(qs)
    assert torch.equal(score_weights(sums, s, qs, round_bf16=True), want3), (T, H)
    assert not torch.equal(score_weights(sums, s, qs), want3)  # unrounded: another result
for bad in (lambda: score_weights(torch.zeros(2, 9).bfloat16(), 1.0, torch.zeros(2, 8)),
            lambda: score_weights(torch.zeros(2, 8).bfloat16(), 1.0, torch.zeros(2, 8), round_bf16=True)):
    try:
        bad()
        raise SystemExit("bad arguments accepted")
    except ValueError as e:
        assert "do not fit" in str(e)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_score_weights_in_interpreter() -> None:
    run_interpreted(_SCRIPT)


@pytest.mark.gpu
def test_gpu_score_weights_match_torch() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from dsv4.kernels.indexer.score_weights import score_weights

    g = torch.Generator(device="cuda").manual_seed(1)
    T, H, HP = 64, 64, 64
    p = (torch.randn(T, H, generator=g, device="cuda") * 4).bfloat16()
    qs = torch.exp2(torch.randint(-20, 5, (T, HP), generator=g, device="cuda").float())
    s = (128**-0.5) * (H**-0.5)
    want = torch.zeros(T, HP, device="cuda")
    want[:, :H] = p.float() * s
    want.mul_(qs)
    assert torch.equal(score_weights(p, s, qs), want)
    sums = (torch.randn(T, H + 64, generator=g, device="cuda") * 4)[:, 64:]
    want = torch.zeros(T, HP, device="cuda")
    want[:, :H] = sums.bfloat16().float() * s
    want.mul_(qs)
    assert torch.equal(score_weights(sums, s, qs, round_bf16=True), want)
