"""Independent scalar model of binary floating-point rounding in exact rationals (no torch casts).

Shared by the formats tests and the division fast path's: the arithmetic under test is compared against these
definitions bit for bit.
"""

from __future__ import annotations

import math
from fractions import Fraction as Fr


def floor_log2(a: Fr) -> int:
    """Exact floor(log2(a)) for a > 0."""
    e = a.numerator.bit_length() - a.denominator.bit_length()
    return e - 1 if Fr(2) ** e > a else e


def rne(v: Fr, man_bits: int, emin: int) -> Fr:
    """Round v to the nearest binary float with ``man_bits`` fraction bits and minimum normal exponent ``emin``
    (subnormals below it), ties to even. No upper exponent bound (callers stay in range)."""
    if v == 0:
        return Fr(0)
    a = abs(v)
    e = max(floor_log2(a), emin)
    ulp = Fr(2) ** (e - man_bits)
    r = round(a / ulp) * ulp  # Fraction.__round__ rounds half to even
    return r if v > 0 else -r


def fp32(v: Fr) -> Fr:
    return rne(v, 23, -126)


FLT_MAX = float(Fr(2) ** 127 * (2 - Fr(2) ** -23))


def to_float32(v: Fr) -> float:
    """v rounded to fp32 as a Python float, overflowing to +-inf like IEEE fp32 arithmetic."""
    r = fp32(v)
    return float(r) if abs(r) <= FLT_MAX else math.copysign(math.inf, r)


def ceil_log2(a: Fr) -> int:
    e = floor_log2(a)
    return e if Fr(2) ** e == a else e + 1


def neg(x: float) -> bool:
    return math.copysign(1.0, x) < 0
