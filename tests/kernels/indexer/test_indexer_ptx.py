"""The indexer's inline PTX, executed on the CPU by a small interpreter of the instructions it uses.

``dsv4.kernels.ptx.UNPACK_KEYS`` (the PTX of ``dsv4.kernels.indexer.fp8_operands.unpack_keys_asm``) turns four
packed E2M1 bytes into eight E4M3 bytes on the GPU; the Triton interpreter cannot run PTX, so the CPU tests of the
scores kernel take its plain-integer twin. Here the PTX text itself runs, instruction by instruction (no triton needed), on every
byte value and every block shift, against E4M3 bytes formed by torch's own float8 cast of the exact values
``±e2m1 · 2**(d − 5)``.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.kernels.ptx import E4M3_TABLE_HI, E4M3_TABLE_LO, UNPACK_KEYS

from support.ptx import MASK32, lop3, run_ptx

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


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
    """The PTX interpreter's ``lop3`` (``support.ptx``) against the functions whose truth tables the PTX spells."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        a, b, c = (rng.getrandbits(32) for _ in range(3))
        assert lop3(a, b, c, 0xF8) == a | (b & c)
        assert lop3(a, b, c, 0x80) == a & b & c
        assert lop3(a, b, c, 0x96) == a ^ b ^ c


def test_unpack_keys_ptx_tables_match_block_tables_formula() -> None:
    """The tables ``_block_tables`` forms arithmetically (base table plus ``8·d`` per nonzero byte) are the
    oracle's tables at every shift, so the kernel's tables and the PTX agree on their meaning."""
    for d in range(12):
        assert _tables(d) == (E4M3_TABLE_LO + d * 8 * 0x01010100, E4M3_TABLE_HI + d * 8 * 0x01010101)
    assert _tables(-1) == (0, 0)
