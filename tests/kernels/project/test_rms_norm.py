"""``rms_norm`` (the layer's weighted RMSNorm of ``c^Q`` and of the window KV): the Triton kernel vs the torch backend.

512 channels (the window KV, which the cache stores) follow torch's CUDA summation order: on the GPU the same bits
as the torch backend for every row count (the order depends on it). Other widths (``c^Q``: 1,536 for V4-Flash) sum
in Triton's order: within one BF16 step, nearly all equal. On the CPU the Triton interpreter checks the logic
against torch's CPU result (whose sums run in yet another order).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from support.bf16 import check_close
from support.interpreter import run_interpreted

_SCRIPT = r"""
import torch
from dsv4.kernels.project.rms_norm import rms_norm
from dsv4.reference import primitives
from support.bf16 import check_close
g = torch.Generator().manual_seed(5)
for rows, C in ((3, 512), (20, 512), (5, 1536), (2, 96)):
    x = (torch.randn(rows, C, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))).bfloat16()
    w = 1 + 0.1 * torch.randn(C, generator=g)
    check_close(rms_norm(x, w, 1e-6), primitives.rms_norm(x, w, 1e-6))
# a column block of a wider output (the stacked input projections' [T, q_lora + D]) is read in place, same bits
wide = torch.randn(7, 1536 + 512, generator=g).bfloat16()
for cols in (slice(0, 1536), slice(1536, None)):
    block = wide[:, cols]
    w = 1 + 0.1 * torch.randn(block.shape[1], generator=g)
    got = rms_norm(block, w, 1e-6)
    assert got.is_contiguous() and torch.equal(got, rms_norm(block.contiguous(), w, 1e-6))
# quantize: the same result, with quantize_activations' codes and scales attached (a view has none)
from dsv4.kernels.project.fp8_gemm import attached_codes, quantize_activations
for rows, C in ((5, 1536), (3, 1024), (2, 200)):
    x = (torch.randn(rows, C, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))).bfloat16()
    w = 1 + 0.1 * torch.randn(C, generator=g)
    got, plain = rms_norm(x, w, 1e-6, quantize=True), rms_norm(x, w, 1e-6)
    assert torch.equal(got, plain) and attached_codes(plain) is None and attached_codes(got[:1]) is None
    codes, scales = attached_codes(got)
    want_codes, want_scales = quantize_activations(got)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)), (rows, C)
    assert torch.equal(scales, want_scales) and scales.stride() == want_scales.stride(), (rows, C)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_rms_norm_kernel_in_interpreter() -> None:
    run_interpreted(_SCRIPT)


def test_rms_norm_kernel_rejects_bad_input() -> None:
    pytest.importorskip("triton")
    from dsv4.kernels.project.rms_norm import rms_norm

    with pytest.raises(ValueError, match=r"bf16 \[rows, C\]"):
        rms_norm(torch.zeros(2, 512), torch.ones(512), 1e-6)
    with pytest.raises(ValueError, match=r"weight must be \[512\]"):
        rms_norm(torch.zeros(2, 512, dtype=torch.bfloat16), torch.ones(256), 1e-6)
    with pytest.raises(ValueError, match=r"quantize is not offered"):
        rms_norm(torch.zeros(2, 512, dtype=torch.bfloat16), torch.ones(512), 1e-6, quantize=True)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 8, 12, 16, 64, 300, 8192])
def test_rms_norm_512_is_the_torch_backend_bit_for_bit(rows: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    from dsv4.kernels.project.rms_norm import rms_norm
    from dsv4.reference import primitives

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 512, generator=g, device="cuda") * torch.exp(torch.randn(rows, 1, generator=g, device="cuda"))
    x = x.bfloat16()
    w = 1 + 0.1 * torch.randn(512, generator=g, device="cuda")
    got, want = rms_norm(x, w, 1e-6), primitives.rms_norm(x, w, 1e-6)
    bad = (got.view(torch.int16) != want.view(torch.int16)).any(1)
    assert not bad.any(), f"{int(bad.sum())} of {rows} rows differ (first {bad.nonzero().flatten()[:5].tolist()})"


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 8192])
def test_rms_norm_1536_within_one_step_on_gpu(rows: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    from dsv4.kernels.project.rms_norm import rms_norm
    from dsv4.reference import primitives

    g = torch.Generator(device="cuda").manual_seed(rows + 1)
    x = torch.randn(rows, 1536, generator=g, device="cuda") * torch.exp(torch.randn(rows, 1, generator=g,
                                                                                    device="cuda"))
    w = 1 + 0.1 * torch.randn(1536, generator=g, device="cuda")
    check_close(rms_norm(x.bfloat16(), w, 1e-6), primitives.rms_norm(x.bfloat16(), w, 1e-6))


@pytest.mark.gpu
def test_rms_norm_codes_on_gpu() -> None:
    """``quantize=True`` on CUDA (the hardware's E4M3 conversion): the same rows, with ``quantize_activations``'
    codes and scales attached, at ``c^Q``'s widths (V4-Flash 1,024, V4-Pro 1,536) and decode / prefill rows."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    from dsv4.kernels.project.fp8_gemm import attached_codes, quantize_activations
    from dsv4.kernels.project.rms_norm import rms_norm

    g = torch.Generator(device="cuda").manual_seed(11)
    for rows in (17, 64, 300):
        for C in (1024, 1536):
            x = (torch.randn(rows, C, generator=g, device="cuda")
                 * torch.exp(torch.randn(rows, 1, generator=g, device="cuda"))).bfloat16()
            w = 1 + 0.1 * torch.randn(C, generator=g, device="cuda")
            got = rms_norm(x, w, 1e-6, quantize=True)
            assert torch.equal(got, rms_norm(x, w, 1e-6))
            codes, scales = attached_codes(got)
            want_codes, want_scales = quantize_activations(got)
            assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
            assert torch.equal(scales, want_scales)
