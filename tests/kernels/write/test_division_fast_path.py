"""The FMA sequence of ``quant.reciprocal_rn`` / ``divide_by_reciprocal`` (``div.rn.f32``'s fast path, the
reciprocal computed once per divisor) against exact rational arithmetic: for every dividend in ``[2⁻⁶⁴, 1]`` and
divisor in ``[1, DIV_FAST_DEN_MAX]`` — the range the kernels send down that path (softmax weights ``exp(z − max) /
den``) — it must give the correctly rounded quotient, whatever the hardware reciprocal's last bit.

The model: ``rcp.approx.ftz.f32`` is within 1 ulp of ``1/den`` (PTX ISA), so every fp32 value within 1 ulp is
tried; each FMA is the exact ``a·b + c`` rounded once to fp32 (``support.rounding.fp32``). The GPU tests check the same
bits against torch on the device (``test_write_path_gpu.py::test_pooling_order_matches_torch``).
"""

from __future__ import annotations

import random
from fractions import Fraction as Fr

import pytest

from dsv4.kernels.quant import DIV_FAST_DEN_MAX, DIV_FAST_MIN

from support.rounding import floor_log2, fp32


def _fma(a: Fr, b: Fr, c: Fr) -> Fr:
    return fp32(a * b + c)


def _ulp(x: Fr) -> Fr:
    return Fr(2) ** (floor_log2(abs(x)) - 23)


def _reciprocal_candidates(den: Fr) -> list[Fr]:
    """fp32 values within 1 ulp of 1/den: what ``rcp.approx`` may return."""
    exact = 1 / den
    near = fp32(exact)
    step = _ulp(near)
    return [y for y in (near - 2 * step, near - step, near, near + step, near + 2 * step)
            if abs(y - exact) <= _ulp(exact)]


def _divide_by_reciprocal(e: Fr, den: Fr, y0: Fr) -> Fr:
    y = _fma(y0, _fma(-den, y0, Fr(1)), y0)  # reciprocal_rn: one Newton step
    q0 = _fma(e, y, Fr(0))
    return _fma(y, _fma(-den, q0, e), q0)  # divide_by_reciprocal: one residual step


def _random_fp32(rng: random.Random, lo_exp: int, hi_exp: int) -> Fr:
    """A random fp32 in [2**lo_exp, 2**hi_exp): random exponent, random 23-bit mantissa."""
    return Fr(2) ** rng.randrange(lo_exp, hi_exp) * (1 + Fr(rng.getrandbits(23), 2**23))


def test_fast_path_range_constants() -> None:
    """The ranges tested here are the kernels' (``divide_rn``'s test and ``pool_entry``'s ``EXP_FAST_GAP``)."""
    value = lambda c: float(getattr(c, "value", c))  # noqa: E731 (tl.constexpr or a number)
    assert value(DIV_FAST_MIN) == 2.0**-64 and value(DIV_FAST_DEN_MAX) == 256.0


@pytest.mark.parametrize("seed", range(4))
def test_divide_by_reciprocal_is_correctly_rounded(seed: int) -> None:
    rng = random.Random(seed)
    cases = [(Fr(1), Fr(1)), (Fr(1), Fr(256)), (Fr(2) ** -64, Fr(256)), (Fr(2) ** -64, Fr(1)), (Fr(1), Fr(3)),
             (Fr(1), Fr(255) + Fr(255, 256))]
    cases += [(_random_fp32(rng, -64, 0), _random_fp32(rng, 0, 8)) for _ in range(1500)]
    cases += [(Fr(1), _random_fp32(rng, 0, 8)) for _ in range(200)]  # the max slot's weight: e = exp(0) = 1
    for e, den in cases:
        want = fp32(e / den)
        for y0 in _reciprocal_candidates(den):
            got = _divide_by_reciprocal(e, den, y0)
            assert got == want, (float(e), float(den), float(y0), float(got), float(want))


def test_model_can_fail_without_the_residual_step() -> None:
    """The oracle is sharp: the quotient without its residual correction (``e · y`` alone) is wrong somewhere."""
    rng = random.Random(7)
    wrong = 0
    for _ in range(500):
        e, den = _random_fp32(rng, -64, 0), _random_fp32(rng, 0, 8)
        y0 = fp32(1 / den)
        y = _fma(y0, _fma(-den, y0, Fr(1)), y0)
        wrong += _fma(e, y, Fr(0)) != fp32(e / den)
    assert wrong > 0
