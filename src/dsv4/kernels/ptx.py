"""Inline-PTX texts and their constants, importable without triton (the kernels wrap them in ``tl.constexpr``).

Kept apart from the kernel modules so that ``tests/kernels/indexer/test_indexer_ptx.py`` can run the PTX through a
small CPU interpreter on installs without triton (CI).
"""

from __future__ import annotations

__all__ = ["DEQUANT_E4M3", "DEQUANT_E4M3_WORDS", "E4M3_TABLE_HI", "E4M3_TABLE_LO", "UNPACK_KEYS", "dequant_e4m3_ptx",
           "unpack_keys_ptx"]

#: E4M3 bytes of the E2M1 magnitudes 0, 0.5, 1, 1.5 (``E4M3_TABLE_LO``) and 2, 3, 4, 6 (``E4M3_TABLE_HI``) times
#: 2**-5, one per byte (magnitude code 0 in the lowest byte of ``E4M3_TABLE_LO``): the lookup table of the MXFP4 key
#: conversion at block shift 0. A block shift ``d`` adds ``8·d`` to every nonzero byte (its exponent field).
E4M3_TABLE_LO = 0x14100800
E4M3_TABLE_HI = 0x24201C18

#: Four packed E2M1 bytes → eight E4M3 bytes (``dsv4.kernels.indexer._unpack_keys_asm``). The word's eight nibbles
#: are eight consecutive channels (``2i`` in the low and ``2i + 1`` in the high nibble of byte ``i``); ``$0`` gets
#: the first four (the word's low half), ``$1`` the last four, each in channel order. ``$2`` the four packed bytes,
#: ``$3`` / ``$7`` the block's tables (the first of the four registers each int32 operand packs). Per half:
#:
#: * ``v``: a ``prmt`` selector nibble *is* an E2M1 code once its sign bit is cleared (``m``), so one ``prmt`` looks
#:   the four magnitudes up in the table (E4M3 bytes, top bit clear);
#: * ``s``: a second ``prmt`` gathers, for output byte ``i``, a byte holding nibble ``i``'s sign bit in its top bit:
#:   an odd nibble's sign already is the top bit of its packed byte, an even nibble's is four bits lower, the top
#:   bit of that byte of ``u = word << 4`` (selectors ``0x5140`` for nibbles 0–3, ``0x7362`` for 4–7);
#: * one ``lop3`` (``v | s & 0x80808080``) sets the signs.
#:
#: 9 instructions per four packed bytes (``u`` serves both halves), no constants held in registers. A zero
#: magnitude keeps its sign: −0 (0x80) for a negative code, which the MMA multiplies to a zero like +0 (and the
#: scores' ``relu`` as ``x + |x|`` maps a −0 sum to +0), so the scores are those of +0 operands bit for bit.
#: One half of the conversion: ``{out}`` from the four nibbles whose magnitude selectors are in ``{mag}`` (a
#: register's low 16 bits) and whose sign bytes ``prmt`` selects from ``u`` / the word by ``{sel}``, tables
#: ``{lo}`` / ``{hi}``.
_UNPACK_HALF = """
        prmt.b32 v, {lo}, {hi}, {mag};
        prmt.b32 s, u, $2, {sel};
        lop3.b32 {out}, v, s, 0x80808080, 0xF8;"""


def unpack_keys_ptx(lo: str = "$3", hi: str = "$7") -> str:
    """``UNPACK_KEYS`` with the tables in operands ``lo`` / ``hi`` (``$0`` / ``$1`` out, ``$2`` the packed word):
    ``$3`` / ``$7`` when the word is four packed uint8 elements (Triton), ``$6`` / ``$10`` when it is four copies of
    one int32 word (the Gluon kernel's operands)."""
    return ("""
        {
        .reg .b32 m, u, s, v;
        and.b32 m, $2, 0x77777777;
        shl.b32 u, $2, 4;"""
            + _UNPACK_HALF.format(lo=lo, hi=hi, mag="m", sel="0x5140", out="$0") + """
        shr.b32 m, m, 16;"""
            + _UNPACK_HALF.format(lo=lo, hi=hi, mag="m", sel="0x7362", out="$1") + """
        }
        """)


UNPACK_KEYS = unpack_keys_ptx()

def dequant_e4m3_ptx(s1: str, s2: str) -> str:
    """Four E4M3 codes → four BF16 values ``code · 2**(e − 127)``, exact (the Gluon attention kernels' key
    dequantization): ``$0`` / ``$1`` out (BF16 pairs of codes 0-1 / 2-3, in the input's byte order), ``$2`` the
    four code bytes, ``s1`` the BF16 pair ``2**(min(e, 134) − 7)``, ``s2`` the pair ``2**(max(e, 134) − 134)``.

    Per pair of codes ``b``: ``prmt`` spreads them to the two 16-bit halves, ``(b & 0x80)·15 + b`` shifted left by
    4 is ``(b & 0x7F) << 4 | (b & 0x80) << 8`` — the BF16 with the code's exponent and mantissa fields in place,
    i.e. its value times ``2**-120`` (subnormal codes land on BF16 subnormals, still exact) — and two multiplies by
    powers of two restore and scale it, rounding once (the first is exact: at most ``448 · 2**7``). The second is
    ``× 1`` unless ``e > 134`` (values of 2**15 and up)."""
    half = """
        and.b32 u, t, 0x00800080;
        mad.lo.u32 u, u, 15, t;
        shl.b32 u, u, 4;
        mul.rn.bf16x2 u, u, {s1};
        mul.rn.bf16x2 {out}, u, {s2};"""
    return ("""
        {
        .reg .b32 t, u;
        prmt.b32 t, $2, 0, 0x4140;""" + half.format(s1=s1, s2=s2, out="$0") + """
        prmt.b32 t, $2, 0, 0x4342;""" + half.format(s1=s1, s2=s2, out="$1") + """
        }
        """)


#: ``dequant_e4m3_ptx`` for four uint8 elements (Triton's ``pack=4``: each BF16 scale operand packs four equal
#: values into two registers, ``$3``/``$4`` and ``$5``/``$6``; ``sparse_attention_sm90``).
DEQUANT_E4M3 = dequant_e4m3_ptx("$3", "$5")
#: ``dequant_e4m3_ptx`` for one int32 word of four codes and int32 scale pairs (``sparse_attention_sm90_ws``).
DEQUANT_E4M3_WORDS = dequant_e4m3_ptx("$3", "$4")
