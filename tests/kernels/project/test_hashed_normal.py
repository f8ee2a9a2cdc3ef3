"""``hashed_normal`` (the engine's counter-based hidden states in one launch) against the torch ops it replaces
(``engine.hidden._standard_normal``) and against an FP64 Box–Muller of the same hashes.

On a GPU the kernel must equal the torch ops on that GPU bit for bit (both call the CUDA math library's ``logf`` /
``cosf``; the integer hash is exact); through ``TokenHidden`` / ``HashHidden`` too, inside a CUDA graph as well. On
the CPU the kernel runs in the Triton interpreter (in a subprocess: ``TRITON_INTERPRET=1`` must be set before any
kernel is decorated), whose numpy ``log`` / ``cos`` stand in for libdevice: there the integer part is checked
exactly (through the uniforms recovered from ``cos``-free channels) and the values within float32 rounding.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from support.interpreter import interpreted, module_in_the_interpreter
#: (rows, hidden size): a decode bucket, a prefill chunk's rows, widths that are and are not powers of two
SHAPES_CPU = ((1, 8), (5, 96), (9, 300), (4, 1024))
SHAPES_GPU = ((1, 4096), (65, 4096), (2000, 7168), (37, 300), (8192, 4096))


def _keys(T: int, seed: int, device: str) -> torch.Tensor:
    """int64 ``[T]`` hashed keys in ``[0, 2³²)`` as ``TokenHidden`` makes them (random token ids, large ones too)."""
    from dsv4.engine.hidden import hash32

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1 << 40, (T,), generator=g, dtype=torch.int64)
    return hash32(hash32(ids * 0x2545F491 + 7) ^ ((ids >> 32) & 0xFFFFFFFF)).to(device)


def _chan(d: int, device: str) -> torch.Tensor:
    from dsv4.engine.hidden import _channel_keys

    return _channel_keys({}, d, torch.device(device))


def _fp64_box_muller(keys: torch.Tensor, chan: torch.Tensor, d: int) -> torch.Tensor:
    """FP64 ``sqrt(−2 ln u1) cos(2π u2)`` of the same hashes' uniforms (float64 ``[T, d]``). The uniforms are the
    definition's fp32 ones (``(bits >> 8) + 0.5`` rounds to even above 2²³): only ``log``, ``cos``, ``sqrt`` and
    the products are taken in FP64."""
    from dsv4.engine.hidden import hash32

    bits = hash32(keys.cpu()[:, None] ^ chan.cpu()[None, :])
    u = (((bits >> 8).float() + 0.5) * (1.0 / 16777216.0)).double()
    return torch.sqrt(-2.0 * torch.log(u[:, :d])) * torch.cos(2.0 * math.pi * u[:, d:])


def _check(T: int, d: int, device: str, seed: int, exact: bool) -> None:
    from dsv4.engine.hidden import _standard_normal
    from dsv4.kernels.project.hashed_normal import hashed_normal

    keys, chan = _keys(T, seed, device), _chan(d, device)
    got = hashed_normal(keys, chan, d)
    want = _standard_normal(keys, chan, d)
    assert got.shape == (T, d) and got.dtype == torch.float32 and got.device == keys.device
    if exact:
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), \
            f"{int((got != want).sum())} of {got.numel()} values differ from the torch ops"
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    # against FP64 of the same uniforms: fp32 log / cos / sqrt / products (|z| ≤ 5.9; the cosine's argument
    # carries ≤ 4.1e-7 of fp32 rounding and of fp32(2π))
    ref = _fp64_box_muller(keys, chan, d)
    err = (got.cpu().double() - ref).abs()
    assert (err <= 1e-5 * ref.abs() + 5e-6).all(), float(err.max())


# ----------------------------------------------------------------------------------------- CPU: the interpreter
test_hashed_normal_in_the_interpreter = module_in_the_interpreter(Path(__file__))


@interpreted
def test_matches_the_torch_ops_interpreted() -> None:
    for i, (T, d) in enumerate(SHAPES_CPU):
        _check(T, d, "cpu", seed=i, exact=False)


@interpreted
def test_no_rows_and_bad_input_interpreted() -> None:
    from dsv4.kernels.project.hashed_normal import hashed_normal

    assert hashed_normal(torch.zeros(0, dtype=torch.int64), _chan(64, "cpu"), 64).shape == (0, 64)
    with pytest.raises(ValueError, match=r"chan int64 \[128\]"):
        hashed_normal(torch.zeros(3, dtype=torch.int64), _chan(32, "cpu"), 64)
    with pytest.raises(ValueError, match="keys int64"):
        hashed_normal(torch.zeros(3, dtype=torch.int32), _chan(64, "cpu"), 64)


# ----------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_equals_the_torch_ops_bit_for_bit() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for i, (T, d) in enumerate(SHAPES_GPU):
        _check(T, d, "cuda", seed=10 + i, exact=True)


@pytest.mark.gpu
def test_gpu_sources_equal_their_torch_ops_in_a_cuda_graph() -> None:
    """``TokenHidden`` / ``HashHidden`` on CUDA (the kernel) equal their torch ops, eagerly and replayed from a
    CUDA graph on fresh ids."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from dsv4.engine.hidden import HashHidden, TokenHidden, _channel_keys, _standard_normal, hash32

    src = TokenHidden(4096, seed=5)
    ids = torch.randint(0, 1 << 17, (65,), device="cuda")
    keys = hash32(hash32(ids * 0x2545F491 + 5) ^ ((ids >> 32) & 0xFFFFFFFF))
    chan = _channel_keys({}, 4096, ids.device)
    assert torch.equal(src(ids), _standard_normal(keys, chan, 4096))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = src(ids)
    ids.copy_(torch.randint(0, 1 << 17, (65,), device="cuda"))
    graph.replay()
    keys = hash32(hash32(ids * 0x2545F491 + 5) ^ ((ids >> 32) & 0xFFFFFFFF))
    assert torch.equal(out, _standard_normal(keys, chan, 4096))
    nums, pos = torch.arange(9, device="cuda"), torch.arange(100, 109, device="cuda")
    hh = HashHidden(300, seed=2)
    want_keys = hash32(hash32(nums * 0x632BE5AB + 2) ^ (pos & 0xFFFFFFFF))
    assert torch.equal(hh(nums, pos), _standard_normal(want_keys, _channel_keys({}, 300, nums.device), 300))
