"""``quant.e2m1_magnitude`` (the E2M1 magnitude code from fp32 bits) against the seven round-to-nearest-even
thresholds of ``formats.fp4.e2m1_encode``: on the GPU for every fp32 in ``[0, 6]``; on the CPU the kernel helper in
Triton's interpreter over the thresholds' and binades' neighbourhoods and random values, and the same integer
formula in numpy over every 7th fp32 of ``[0, 6]`` plus those neighbourhoods."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv4.formats import fp4

from support.interpreter import run_interpreted

#: the thresholds' and binades' fp32 neighbourhoods: ± this many ulps around each
_NEAR = 4096
_EDGES = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0)
_SIX = int(np.float32(6.0).view(np.int32))


def _thresholds(m: np.ndarray) -> np.ndarray:
    """The codes by the seven comparisons (``formats.fp4.e2m1_encode``'s rule, written out)."""
    return ((m > 0.25).astype(np.int32) + (m >= 0.75) + (m > 1.25) + (m >= 1.75) + (m > 2.5) + (m >= 3.5)
            + (m > 5.0)).astype(np.int32)


def _bit_formula(m: np.ndarray) -> np.ndarray:
    """``e2m1_magnitude``'s integer formula in numpy (fp32 arithmetic, int32 bits)."""
    b = m.view(np.int32)
    below_one = (m * np.float32(2.0) + np.float32(12582912.0)).view(np.int32) - 0x4B400000
    from_one = ((b + 0x1FFFFF + ((b >> 22) & 1)) >> 22) - 252
    return np.where(m < 1.0, below_one, from_one).astype(np.int32)


def _neighbourhoods() -> np.ndarray:
    """Bit patterns around 0, every threshold and every binade edge in ``[0, 6]``, as fp32."""
    bits = [np.arange(0, _NEAR, dtype=np.int64)]
    for edge in _EDGES:
        b = int(np.float32(edge).view(np.int32))
        bits.append(np.arange(b - _NEAR, min(b + _NEAR, _SIX) + 1, dtype=np.int64))
    return np.unique(np.concatenate(bits)).astype(np.int32).view(np.float32)


def test_thresholds_are_the_format_rule() -> None:
    """The written-out comparisons are ``formats.fp4.e2m1_encode``'s magnitude codes (the oracle here)."""
    m = _neighbourhoods()
    got = fp4.e2m1_encode(torch.from_numpy(m)).numpy().astype(np.int32) & 7
    assert np.array_equal(got, _thresholds(m))


def test_bit_formula_on_every_7th_fp32() -> None:
    m = np.concatenate([np.arange(0, _SIX + 1, 7, dtype=np.int32).view(np.float32), _neighbourhoods()])
    assert np.array_equal(_bit_formula(m), _thresholds(m))


_SCRIPT = r"""
import sys, numpy as np, torch, triton, triton.language as tl
from dsv4.formats import fp4
from dsv4.kernels.quant import e2m1_magnitude

@triton.jit
def codes(m_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, e2m1_magnitude(tl.load(m_ptr + i, mask=i < n, other=0.0)), mask=i < n)

m = torch.from_numpy(np.load(sys.argv[1]))
out = torch.empty(m.numel(), dtype=torch.int32)
codes[(triton.cdiv(m.numel(), 4096),)](m, out, m.numel(), BLOCK=4096)
assert torch.equal(out, fp4.e2m1_encode(m).to(torch.int32) & 7), "e2m1_magnitude differs from e2m1_encode"
print("ok")
"""


def test_kernel_helper_in_the_interpreter(tmp_path) -> None:
    rng = np.random.default_rng(0)
    m = np.concatenate([_neighbourhoods(), rng.uniform(0, 6, 200_000).astype(np.float32)])
    np.save(tmp_path / "m.npy", m)
    run_interpreted(_SCRIPT, str(tmp_path / "m.npy"), timeout=300)


@pytest.mark.gpu
def test_gpu_every_fp32_in_range() -> None:
    """The compiled helper equals the seven comparisons, compiled beside it, on all 1.09e9 fp32 in [0, 6]."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import triton
    import triton.language as tl

    from dsv4.kernels.quant import e2m1_magnitude

    @triton.jit
    def mismatches(lo, n, count_ptr, BLOCK: tl.constexpr):
        bits = lo + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = bits.to(tl.float32, bitcast=True)
        want = ((m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
                + (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32)
                + (m > 5.0).to(tl.int32))
        bad = (e2m1_magnitude(m) != want) & (bits - lo < n)
        tl.atomic_add(count_ptr, tl.sum(bad.to(tl.int32)))

    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    block, total = 1024, _SIX + 1
    mismatches[(triton.cdiv(total, block),)](0, total, count, BLOCK=block, enable_fp_fusion=False)
    assert int(count) == 0
