"""Inline-PTX texts and their constants, importable without triton (the kernels wrap them in ``tl.constexpr``).

Kept apart from the kernel modules so that ``tests/test_indexer_ptx.py`` can run the PTX through a small CPU
interpreter on installs without triton (CI).
"""

from __future__ import annotations

__all__ = ["DEQUANT_E4M3", "E4M3_TABLE_HI", "E4M3_TABLE_LO", "UNPACK_KEYS"]

#: E4M3 bytes of the E2M1 magnitudes 0, 0.5, 1, 1.5 (``E4M3_TABLE_LO``) and 2, 3, 4, 6 (``E4M3_TABLE_HI``) times
#: 2**-5, one per byte (magnitude code 0 in the lowest byte of ``E4M3_TABLE_LO``): the lookup table of the MXFP4 key
#: conversion at block shift 0. A block shift ``d`` adds ``8·d`` to every nonzero byte (its exponent field).
E4M3_TABLE_LO = 0x14100800
E4M3_TABLE_HI = 0x24201C18

#: Four packed E2M1 bytes → eight E4M3 bytes (``dsv4.kernels.indexer._unpack_keys_asm``): ``$0`` / ``$1`` out (the
#: low / high nibbles' bytes, in the input's byte order), ``$2`` the four packed bytes, ``$3`` / ``$7`` the block's
#: tables (the first of the four registers each int32 operand packs). For each nibble half the four 3-bit
#: magnitudes are compacted into one 16-bit ``prmt`` selector, looked up in the table, and the sign bits moved to
#: bit 7 of their bytes.
UNPACK_KEYS = """
        {
        .reg .b32 t, s, v;
        and.b32 t, $2, 0x07070707;
        shr.b32 s, t, 4;
        or.b32 s, s, t;
        prmt.b32 s, s, 0, 0x0020;
        prmt.b32 v, $3, $7, s;
        shl.b32 t, $2, 4;
        and.b32 t, t, 0x80808080;
        or.b32 $0, v, t;
        shr.b32 t, $2, 4;
        and.b32 t, t, 0x07070707;
        shr.b32 s, t, 4;
        or.b32 s, s, t;
        prmt.b32 s, s, 0, 0x0020;
        prmt.b32 v, $3, $7, s;
        and.b32 t, $2, 0x80808080;
        or.b32 $1, v, t;
        }
        """

#: Four E4M3 codes → four BF16 values ``code · 2**(e − 127)``, exact (``dsv4.kernels.sparse_attention_sm90``'s key
#: dequantization): ``$0`` / ``$1`` out (BF16 pairs of codes 0-1 / 2-3, in the input's byte order), ``$2`` the four
#: code bytes, ``$3`` the BF16 pair ``2**(min(e, 134) − 7)``, ``$5`` the pair ``2**(max(e, 134) − 134)`` (``$4`` /
#: ``$6`` repeat them: each BF16 operand packs four equal values). Per pair of codes ``b``: ``prmt`` spreads them to
#: the two 16-bit halves, ``(b & 0x80)·15 + b`` shifted left by 4 is ``(b & 0x7F) << 4 | (b & 0x80) << 8`` — the
#: BF16 with the code's exponent and mantissa fields in place, i.e. its value times ``2**-120`` (subnormal codes
#: land on BF16 subnormals, still exact) — and two multiplies by powers of two restore and scale it, rounding once
#: (the first is exact: at most ``448 · 2**7``). The second is ``× 1`` unless ``e > 134`` (values of 2**15 and up).
DEQUANT_E4M3 = """
        {
        .reg .b32 t, u;
        prmt.b32 t, $2, 0, 0x4140;
        and.b32 u, t, 0x00800080;
        mad.lo.u32 u, u, 15, t;
        shl.b32 u, u, 4;
        mul.rn.bf16x2 u, u, $3;
        mul.rn.bf16x2 $0, u, $5;
        prmt.b32 t, $2, 0, 0x4342;
        and.b32 u, t, 0x00800080;
        mad.lo.u32 u, u, 15, t;
        shl.b32 u, u, 4;
        mul.rn.bf16x2 u, u, $3;
        mul.rn.bf16x2 $1, u, $5;
        }
        """
