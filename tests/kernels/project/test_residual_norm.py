"""``residual_rms_norm`` (the engine's residual add and the next layer's input norm in one launch) against an FP64
computation and against the engine's torch glue (``h + y.float()``, ``reference.primitives.rms_norm``).

The sum must be torch's bit for bit; the norm within one step of the activation dtype (the mean sums in another
order), in BF16 nearly always equal. Every variant: add + norm, norm only (no ``y``), add only; new outputs and in
place; bf16 and fp32 activations; widths that are not powers of two and rows that are not contiguous with each
other. On the CPU the kernel runs in the Triton interpreter, in a subprocess (``TRITON_INTERPRET=1`` must be set
before any kernel is decorated and would leak into other modules); the ``gpu`` tests run the same checks on CUDA
at the models' widths, and inside a CUDA graph.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.bf16 import bf16_step
from support.interpreter import interpreted, module_in_the_interpreter

EPS = 1e-6
VARIANTS = ("add_norm", "norm", "add")
ACTS = (torch.bfloat16, torch.float32)


def _inputs(T: int, d: int, act: torch.dtype, device: str, seed: int, row_gap: int = 0):
    """fp32 ``h [T, d]`` (rows ``d + row_gap`` apart, each row scaled by e^N(0,1), one zero row when T > 2) and
    ``y [T, d]`` in ``act``."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(T, 1, generator=g))
    h = torch.randn(T, d + row_gap, generator=g) * scale
    if T > 2:
        h[1] = 0.0
    y = (0.5 * torch.randn(T, d, generator=g) * scale).to(act)
    if T > 2:
        y[1] = 0.0  # the zero row stays zero: x = 0 · rsqrt(eps)
    h = h.to(device)[:, :d]
    return h, y.to(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def _check_x(x: torch.Tensor, h_sum: torch.Tensor, act: torch.dtype) -> None:
    """``x`` (act ``[T, d]``) vs the FP64 norm of the fp32 ``h_sum`` and vs the torch glue's ``x``."""
    from dsv4.reference.primitives import rms_norm

    assert x.dtype == act and x.shape == h_sum.shape and torch.isfinite(x).all()
    h64 = h_sum.double()
    x64 = h64 * torch.rsqrt(h64.square().mean(-1, keepdim=True) + EPS)
    glue = rms_norm(h_sum, None, EPS).to(act)
    got = x.double()
    if act == torch.bfloat16:
        assert ((got - x64).abs() <= bf16_step(x64.float()).double()).all(), "x is more than one BF16 step from FP64"
        assert ((got - glue.double()).abs() <= bf16_step(glue.float()).double()).all(), "x vs torch: > one step"
        if x.numel() >= 4096:
            assert (x != glue).float().mean() <= 0.01, "more than 1% of x differs from the torch glue"
    else:  # fp32: a few ulps (the mean's summation order, rsqrt's rounding)
        tol = 4e-6 * x64.abs() + 1e-30
        assert ((got - x64).abs() <= tol).all(), float(((got - x64).abs() / x64.abs().clamp_min(1e-30)).max())
        assert ((got - glue.double()).abs() <= tol).all()


def _check_case(T: int, d: int, act: torch.dtype, variant: str, in_place: bool, device: str, seed: int,
                row_gap: int = 0) -> None:
    from dsv4.kernels.project.residual_norm import residual_rms_norm

    h, y = _inputs(T, d, act, device, seed, row_gap)
    h0, y0 = h.clone(), y.clone()
    if variant == "norm":
        h_out, x = residual_rms_norm(h, eps=EPS, act_dtype=act)
        assert h_out is h
        want_h = h0
    else:
        h_out, x = residual_rms_norm(h, y, eps=EPS, act_dtype=act, norm=variant == "add_norm",
                                     h_out=h if in_place else None)
        assert (h_out is h) == in_place
        want_h = h0 + y0.float()
        assert torch.equal(_bits(h_out), _bits(want_h)), "h_out is not h + y.float() bit for bit"
    if not (in_place and variant != "norm"):
        assert torch.equal(_bits(h), _bits(h0)), "h was written"
    assert torch.equal(_bits(y), _bits(y0)), "y was written"
    if variant == "add":
        assert x is None
    else:
        _check_x(x, want_h, act)


# ----------------------------------------------------------------------------------------- CPU: the interpreter
test_residual_norm_in_the_interpreter = module_in_the_interpreter(Path(__file__))


@interpreted
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("act", ACTS, ids=("bf16", "fp32"))
@pytest.mark.parametrize("in_place", (False, True), ids=("new", "in_place"))
def test_variants_interpreted(variant: str, act: torch.dtype, in_place: bool) -> None:
    if variant == "norm" and in_place:
        pytest.skip("no sum to write without y")
    for i, (T, d, gap) in enumerate(((1, 1, 0), (3, 5, 0), (4, 128, 3), (5, 1000, 0), (2, 4096, 0))):
        _check_case(T, d, act, variant, in_place, "cpu", seed=100 * i + len(variant), row_gap=gap)


@interpreted
def test_given_outputs_and_no_rows_interpreted() -> None:
    """``x_out`` / ``h_out`` given: written and returned; zero rows: nothing launched, shapes kept."""
    from dsv4.kernels.project.residual_norm import residual_rms_norm

    h, y = _inputs(6, 300, torch.bfloat16, "cpu", seed=9)
    h_out, x_out = torch.full_like(h, float("nan")), torch.full((6, 300), float("nan"), dtype=torch.bfloat16)
    got_h, got_x = residual_rms_norm(h, y, eps=EPS, h_out=h_out, x_out=x_out)
    assert got_h is h_out and got_x is x_out
    assert torch.equal(h_out, h + y.float())
    _check_x(x_out, h + y.float(), torch.bfloat16)
    e_h, e_x = residual_rms_norm(torch.zeros(0, 64), torch.zeros(0, 64, dtype=torch.bfloat16), eps=EPS)
    assert e_h.shape == (0, 64) and e_x.shape == (0, 64) and e_x.dtype == torch.bfloat16


def _check_codes(T: int, d: int, device: str, seed: int) -> None:
    """``quantize=True``: the same ``h_out`` and ``x`` as without, and ``x``'s attached FP8 codes and scales are
    ``quantize_activations(x)``'s bit for bit (a view of ``x`` has none)."""
    from dsv4.kernels.project.fp8_gemm import attached_codes, quantize_activations
    from dsv4.kernels.project.residual_norm import residual_rms_norm

    h, y = _inputs(T, d, torch.bfloat16, device, seed)
    h_q, x_q = residual_rms_norm(h, y, eps=EPS, quantize=True)
    h_p, x_p = residual_rms_norm(h, y, eps=EPS)
    assert torch.equal(_bits(h_q), _bits(h_p)) and torch.equal(_bits(x_q), _bits(x_p))
    codes, scales = attached_codes(x_q)
    want_codes, want_scales = quantize_activations(x_q)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)), (T, d)
    assert torch.equal(scales, want_scales) and scales.stride() == want_scales.stride(), (T, d)
    assert attached_codes(x_q[:1]) is None and attached_codes(x_p) is None


@interpreted
def test_codes_for_the_next_gemm_interpreted() -> None:
    for i, (T, d) in enumerate(((3, 256), (5, 1000), (2, 4096))):
        _check_codes(T, d, "cpu", seed=40 + i)


# ----------------------------------------------------------------------------------------- CPU: bad input
def test_residual_norm_rejects_bad_input() -> None:
    pytest.importorskip("triton")
    from dsv4.kernels.project.residual_norm import residual_rms_norm

    h, y = torch.zeros(4, 64), torch.zeros(4, 64, dtype=torch.bfloat16)
    bad = [
        (dict(h=torch.zeros(4, 64, dtype=torch.bfloat16), y=y), r"h must be torch.float32"),
        (dict(h=torch.zeros(64), y=None), r"h must be an fp32 \[T, d\]"),
        (dict(h=torch.zeros(4, 0), y=None), r"d >= 1"),
        (dict(h=h, y=torch.zeros(4, 63, dtype=torch.bfloat16)), r"y must be \[4, 64\]"),
        (dict(h=h, y=torch.zeros(4, 64, dtype=torch.float16)), r"y must be torch.bfloat16 or torch.float32"),
        (dict(h=h, y=torch.zeros(4, 64, dtype=torch.bfloat16, device="meta")), r"y is on meta"),
        (dict(h=h, y=y, act_dtype=torch.float16), r"act_dtype"),
        (dict(h=h, y=y, eps=-1.0), r"eps must be"),
        (dict(h=h, y=None, norm=False), r"nothing to compute"),
        (dict(h=h, y=None, h_out=torch.zeros(4, 64)), r"h_out is only written with y"),
        (dict(h=h, y=y, norm=False, x_out=torch.zeros(4, 64, dtype=torch.bfloat16)), r"x_out given with norm=False"),
        (dict(h=h, y=y, h_out=torch.zeros(4, 64, dtype=torch.float64)), r"h_out must be torch.float32"),
        (dict(h=h, y=y, x_out=torch.zeros(4, 64)), r"x_out must be torch.bfloat16"),
        (dict(h=torch.zeros(64, 4).t(), y=y), r"rows must be contiguous"),
        (dict(h=h, y=y, x_out=h.view(torch.bfloat16)[:, :64]), r"x_out overlaps"),
        (dict(h=h, y=y, act_dtype=torch.float32, quantize=True), r"quantize needs"),
        (dict(h=h, y=y, norm=False, quantize=True), r"quantize needs"),
    ]
    buf = torch.zeros(5, 64)
    bad.append((dict(h=buf[:4], y=y, h_out=buf[1:]), r"h_out overlaps h"))
    for kwargs, match in bad:
        kwargs.setdefault("eps", EPS)
        with pytest.raises(ValueError, match=match):
            residual_rms_norm(**kwargs)


# ----------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("act", ACTS, ids=("bf16", "fp32"))
@pytest.mark.parametrize("in_place", (False, True), ids=("new", "in_place"))
def test_variants_on_gpu(variant: str, act: torch.dtype, in_place: bool) -> None:
    """The models' widths (V4-Flash 4096, V4-Pro 7168) and odd ones; a decode bucket's rows (65), a prefill's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if variant == "norm" and in_place:
        pytest.skip("no sum to write without y")
    for T in (1, 65, 2000):
        for d in (4096, 7168, 1000, 1):
            _check_case(T, d, act, variant, in_place, "cuda", seed=T * 7919 + d, row_gap=5 if T == 65 else 0)


@pytest.mark.gpu
def test_codes_for_the_next_gemm_on_gpu() -> None:
    """The attached FP8 codes on CUDA (the hardware's E4M3 conversion): ``quantize_activations``' bits, at the
    models' widths and decode / prefill row counts."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for T in (17, 64, 300):
        for d in (4096, 7168, 1000):
            _check_codes(T, d, "cuda", seed=T + d)


@pytest.mark.gpu
def test_in_place_chain_in_a_cuda_graph() -> None:
    """The engine's pattern (norm of the input, then per layer an add into a step-owned sum and the next norm, add
    only after the last), captured once and replayed on fresh inputs: the same bits as eager launches."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from dsv4.kernels.project.residual_norm import residual_rms_norm

    T, d, L = 65, 4096, 4
    g = torch.Generator(device="cuda").manual_seed(3)
    h_in = torch.empty(T, d, device="cuda")
    ys = [torch.empty(T, d, device="cuda", dtype=torch.bfloat16) for _ in range(L)]

    def chain() -> tuple[torch.Tensor, list[torch.Tensor]]:
        h, x = residual_rms_norm(h_in, eps=EPS)
        xs = [x]
        for i, y in enumerate(ys):
            h, x = residual_rms_norm(h, y, eps=EPS, norm=i < L - 1, h_out=h if i > 0 else None)
            if x is not None:
                xs.append(x)
        return h, xs

    def refill() -> None:
        h_in.copy_(torch.randn(T, d, generator=g, device="cuda"))
        for y in ys:
            y.copy_(torch.randn(T, d, generator=g, device="cuda"))

    refill()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h_static, xs_static = chain()
    for _ in range(3):
        refill()
        h0 = h_in.clone()
        graph.replay()
        h_eager, xs_eager = chain()
        torch.cuda.synchronize()
        assert torch.equal(h_in, h0), "the graph wrote its input"
        assert torch.equal(_bits(h_static), _bits(h_eager))
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(xs_static, xs_eager))
        want = h0
        for y in ys:
            want = want + y.float()
        assert torch.equal(_bits(h_static), _bits(want))
