"""The indexer's inline PTX, executed on the CPU by a small interpreter of the instructions it uses.

``dsv4.kernels.ptx.UNPACK_KEYS`` (the PTX of ``dsv4.kernels.indexer.fp8_operands.unpack_keys_asm``) turns four
packed E2M1 bytes into eight E4M3 bytes on the GPU; the Triton interpreter cannot run PTX, so the CPU tests of the
scores kernel take its plain-integer twin. Here the PTX text itself runs, instruction by instruction (no triton needed), on every
byte value and every block shift, against E4M3 bytes formed by torch's own float8 cast of the exact values
``±e2m1 · 2**(d − 5)``.
"""

from __future__ import annotations

import re

import pytest
import torch

from dsv4.kernels.ptx import E4M3_TABLE_HI, E4M3_TABLE_LO, UNPACK_KEYS

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MASK32 = 0xFFFFFFFF


def _prmt(a: int, b: int, c: int) -> int:
    """PTX ``prmt.b32`` in its default mode: byte i of the result is byte ``c[4i+2:4i]`` of ``{b, a}``, or that
    byte's sign replicated when ``c[4i+3]`` is set."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = pool[sel & 7]
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """PTX ``lop3.b32``: bit i of the result is bit ``4·a_i + 2·b_i + c_i`` of ``lut`` (``lut`` evaluated on
    a = 0xF0, b = 0xCC, c = 0xAA is the function's truth table)."""
    out = 0
    for i in range(32):
        j = ((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | ((c >> i) & 1)
        out |= ((lut >> j) & 1) << i
    return out


def _mul_bf16x2(a: int, b: int) -> int:
    """PTX ``mul.rn.bf16x2``: each 16-bit half of ``a`` times that of ``b`` as BF16, rounded once to nearest even
    (subnormals kept). The FP32 product of two BF16 values is exact (8-bit significands, exponents in range), so
    torch's FP32 multiply and one cast model it."""
    halves = torch.tensor([a & 0xFFFF, a >> 16, b & 0xFFFF, b >> 16], dtype=torch.int32).to(torch.int16)
    x = halves.view(torch.bfloat16).float()
    r = (x[:2] * x[2:]).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return int(r[0]) | int(r[1]) << 16


def run_ptx(text: str, operands: dict[str, int]) -> dict[str, int]:
    """Execute the instructions ``and or shl shr prmt lop3 mov`` (``.b32``), ``add sub`` (``.s32``), ``mad.lo.u32`` and ``mul.rn.bf16x2`` of
    ``text`` over 32-bit registers."""
    regs = dict(operands)

    def value(tok: str) -> int:
        tok = tok.strip()
        if re.fullmatch(r"0x[0-9a-fA-F]+|\d+", tok):
            return int(tok, 0) & MASK32
        return regs[tok]

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *src = [t.strip() for t in rest.split(",")]
        v = [value(t) for t in src]
        if op == "and.b32":
            r = v[0] & v[1]
        elif op == "or.b32":
            r = v[0] | v[1]
        elif op == "shl.b32":
            r = (v[0] << v[1]) & MASK32
        elif op == "shr.b32":
            r = v[0] >> v[1]
        elif op == "lop3.b32":
            r = _lop3(*v)
        elif op == "prmt.b32":
            r = _prmt(*v)
        elif op == "sub.s32":
            r = (v[0] - v[1]) & MASK32
        elif op == "add.s32":
            r = (v[0] + v[1]) & MASK32
        elif op == "mov.b32":
            r = v[0]
        elif op == "mad.lo.u32":
            r = (v[0] * v[1] + v[2]) & MASK32
        elif op == "mul.rn.bf16x2":
            r = _mul_bf16x2(v[0], v[1])
        else:
            raise NotImplementedError(f"PTX instruction {op!r} is not modelled here")
        regs[dst] = r
    return regs


def _e4m3_byte(x: float) -> int:
    return int(torch.tensor([x], dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)[0])


def _oracle(nibble: int, d: int) -> int:
    """E4M3 byte of E2M1 code ``nibble`` times ``2**(d − 5)``; zeros (a zero magnitude, or any code of a flushed
    block) keep the code's sign (−0 is 0x80: torch's cast of ``-0.0``)."""
    mag = 0.0 if d < 0 else E2M1_MAGNITUDES[nibble & 7] * 2.0 ** (d - 5)
    return _e4m3_byte(-mag if nibble & 8 else mag)


def _tables(d: int) -> tuple[int, int]:
    """The lookup tables as ``_block_tables`` specifies them, built from the oracle: byte j = magnitude code j
    (``lo``) / j + 4 (``hi``)."""
    lo = sum(_oracle(j, d) << (8 * j) for j in range(4))
    hi = sum(_oracle(j + 4, d) << (8 * j) for j in range(4))
    return lo, hi


@pytest.mark.parametrize("d", list(range(-1, 12)))
def test_unpack_keys_ptx_every_byte(d: int) -> None:
    """Every packed byte value in every byte position and every sign pattern of a word's eight nibbles, every block
    shift (and a flushed block): ``$0`` holds the word's nibbles 0–3 and ``$1`` its nibbles 4–7, in order (nibble
    ``2i`` / ``2i + 1`` = low / high of byte i)."""
    import random

    lo, hi = _tables(d)
    words = []
    for base in range(0, 256, 4):
        word = sum(((base + i) & 0xFF) << (8 * i) for i in range(4))
        words += [word, ((word << 8) | (word >> 24)) & MASK32]  # each value also in the next byte position
    # every sign pattern of the eight nibbles over random magnitudes (the bytes above share their sign bits)
    rng = random.Random(d)
    words += [sum(((signs >> j & 1) << 3 | rng.randrange(8)) << (4 * j) for j in range(8)) for signs in range(256)]
    for w in words:
        regs = run_ptx(UNPACK_KEYS, {"$2": w, "$3": lo, "$7": hi})
        for j in range(8):
            out = regs["$0"] if j < 4 else regs["$1"]
            assert (out >> (8 * (j % 4))) & 0xFF == _oracle((w >> (4 * j)) & 15, d), (hex(w), j)


def test_lop3_model() -> None:
    """The interpreter's ``lop3`` against the functions whose truth tables the PTX spells."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        a, b, c = (rng.getrandbits(32) for _ in range(3))
        assert _lop3(a, b, c, 0xF8) == a | (b & c)
        assert _lop3(a, b, c, 0x80) == a & b & c
        assert _lop3(a, b, c, 0x96) == a ^ b ^ c


def test_unpack_keys_ptx_tables_match_block_tables_formula() -> None:
    """The tables ``_block_tables`` forms arithmetically (base table plus ``8·d`` per nonzero byte) are the
    oracle's tables at every shift, so the kernel's tables and the PTX agree on their meaning."""
    for d in range(12):
        assert _tables(d) == (E4M3_TABLE_LO + d * 8 * 0x01010100, E4M3_TABLE_HI + d * 8 * 0x01010101)
    assert _tables(-1) == (0, 0)
