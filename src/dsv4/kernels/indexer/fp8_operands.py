"""MXFP4 values as exact FP8 (E4M3) operands of the tensor cores: the conversion the indexer's scores and queries
share.

An E2M1 value times a power of two is an E4M3 value (one mantissa bit fits into three), so every key is turned into
E4M3 bytes *exactly* in registers and one FP8 MMA (K = 128) does all heads. The four block scales of a vector are
folded into its bytes relative to its largest block: block ``j`` holds ``e2m1 · 2**(e_j − e_max + 6)`` (largest
magnitude 6 · 64 = 384 ≤ 448) and the vector keeps one scale ``2**(e_max − 127 − 6)`` (``pow2_from_byte``), applied
after the head reduction for keys (``relu(c·x) = c·relu(x)`` for ``c > 0``) and multiplied into the head weight for
queries. This is exact whenever a vector's four block exponents span at most 11 binades (always, in practice: the
Hadamard rotation evens the blocks out); a block more than 2**11 below its vector's largest is flushed to zero (its
contribution is below 2**-11 of the largest block's).

The conversion of packed key bytes is one inline-PTX function (``unpack_keys_asm``, ``ptx.UNPACK_KEYS``): each
block's shift is added once to an 8-entry table of E4M3 bytes (``block_lookup_tables``), and ``prmt`` looks four
magnitudes up at a time (9 instructions per four packed bytes). Under the Triton interpreter the same bytes come
from plain integer arithmetic (``unpack_keys_int``); ``tests/kernels/indexer/test_indexer_ptx.py`` executes the PTX
itself on the CPU.

Channel order. Packed E2M1 nibbles put channel ``2i`` in the low and ``2i + 1`` in the high nibble of byte ``i``;
four packed bytes are eight consecutive channels. The conversion turns each four bytes into two E4M3 words, the
first four channels and the last four (a ``prmt`` selector nibble is an E2M1 code: no nibble shuffling), so a key's
operands ``ka`` / ``kb`` hold channels ``8k + r`` / ``8k + 4 + r`` at ``4k + r``. The sum over channels does not care
about their order, and the query operand is stored in the same one (``q8[t, 0]`` / ``q8[t, 1]``,
``ops.triton_indexer.mxfp4_operand_channels``), so nothing is interleaved at run time.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import ptx

__all__ = ["E4M3_HI", "E4M3_LO", "UNPACK_KEYS_PTX", "block_lookup_tables", "e4m3_from_e2m1", "e4m3_from_table",
           "pow2_from_byte", "unpack_keys_asm", "unpack_keys_int"]


@triton.jit
def e4m3_from_e2m1(mag, d):
    """E4M3 byte (no sign) of ``e2m1(mag) · 2**(d − 5)``; 0 when ``mag == 0`` or ``d < 0`` (flushed block).

    ``mag``: int32 E2M1 magnitude code 0…7; ``d``: int32 shift 0…11 (or negative = flush).
    The table ``e2m1 · 2**-5`` in E4M3 is 0x00, 0x08, 0x10, 0x14, 0x18, 0x1C, 0x20, 0x24; adding ``d`` to the
    exponent field (``+ 8·d``) stays a normal number up to 0x7C = 384.
    """
    base = tl.where(mag == 1, 8, (mag + 2) * 4)
    return tl.where((mag == 0) | (d < 0), 0, base + d * 8)


#: The key conversion's lookup table at shift 0 (see ``dsv4.kernels.ptx``).
E4M3_LO: tl.constexpr = tl.constexpr(ptx.E4M3_TABLE_LO)
E4M3_HI: tl.constexpr = tl.constexpr(ptx.E4M3_TABLE_HI)


@triton.jit
def block_lookup_tables(e, e_max):
    """Per-block lookup tables of the key conversion: the E4M3 bytes of ``e2m1 · 2**(e − e_max + 6)``.

    ``e``: int32 ``[..., 4]`` UE8M0 block exponents of a key; ``e_max``: int32 ``[...]`` their maximum. Returns
    int32 ``(lo, hi)``, ``[..., 4]``: byte ``j`` of ``lo`` / ``hi`` is the E4M3 byte of magnitude code ``j`` /
    ``j + 4``. The block's shift ``d = e − e_max + 11`` (0…11) is added to every nonzero entry's exponent field
    (``+ 8·d`` per byte; the largest, 0x24 + 88 = 0x7C = 384, stays normal); a block more than 11 binades below the
    key's largest (``d < 0``) gets all-zero tables (flushed).
    """
    d = e - e_max[:, None] + 11
    lo = tl.where(d < 0, 0, E4M3_LO + (d * 8) * 0x01010100)  # byte 0 (magnitude 0) stays 0
    hi = tl.where(d < 0, 0, E4M3_HI + (d * 8) * 0x01010101)
    return lo, hi


@triton.jit
def e4m3_from_table(c, lo, hi):
    """E4M3 byte of the E2M1 code ``c`` (int32 0…15, sign in bit 3) by the block's tables ``lo`` / ``hi`` (the sign
    kept on zeros: −0 for a negative code, as the PTX gives it)."""
    mag = c & 7
    table = tl.where(mag < 4, lo, hi)
    byte = (table >> ((mag & 3) * 8)) & 0xFF
    return (byte | ((c & 8) << 4)).to(tl.uint8)


@triton.jit
def unpack_keys_int(x, lo, hi, BLOCK_N: tl.constexpr):
    """Plain-integer twin of ``unpack_keys_asm`` (interpreter path): same arguments, same bytes.

    ``x``: uint8 ``[BLOCK_N, 4, 16]``. Bytes ``4k … 4k + 3`` of a block hold its channels ``8k … 8k + 7`` (two per
    byte, low nibble first); the first four become bytes ``4k … 4k + 3`` of the first result, the last four those of
    the second.
    """
    xi = x.to(tl.int32)
    nibbles = tl.join(e4m3_from_table(xi & 15, lo, hi), e4m3_from_table(xi >> 4, lo, hi))  # [BLOCK_N, 4, 16, 2]
    groups = tl.reshape(nibbles, (BLOCK_N, 4, 4, 2, 4))  # [key, block, k, half, r]: channel 8k + 4·half + r
    first, last = tl.split(tl.permute(groups, (0, 1, 2, 4, 3)))
    return tl.reshape(first, (BLOCK_N, 4, 16)), tl.reshape(last, (BLOCK_N, 4, 16))


#: PTX of ``unpack_keys_asm`` (``dsv4.kernels.ptx.UNPACK_KEYS``, a triton-free module so that
#: ``tests/kernels/indexer/test_indexer_ptx.py`` can execute it on any CPU install).
UNPACK_KEYS_PTX: tl.constexpr = tl.constexpr(ptx.UNPACK_KEYS)


@triton.jit
def unpack_keys_asm(x, lo, hi):
    """Packed E2M1 bytes → two E4M3 byte tensors, the block's shift applied, signs kept.

    Args:
        x: uint8 packed E2M1 bytes (channel ``2i`` in the low, ``2i + 1`` in the high nibble of byte ``i``).
        lo, hi: int32, the block's lookup tables (``block_lookup_tables``), broadcast over its bytes.
    Returns:
        ``(first, last)`` uint8: of every four packed bytes (eight channels), byte ``r`` of ``first`` is channel
        ``r`` and byte ``r`` of ``last`` channel ``4 + r`` (``ptx.UNPACK_KEYS``: 9 instructions per four bytes;
        a zero keeps its code's sign).
        The query operand is stored in the same channel order (``q8[t, 0]`` / ``q8[t, 1]``).
    """
    return tl.inline_asm_elementwise(
        asm=UNPACK_KEYS_PTX,
        constraints="=r,=r,r,r,r,r,r,r,r,r,r",
        args=[x, lo, hi],
        dtype=(tl.uint8, tl.uint8),
        is_pure=True,
        pack=4,
    )


@triton.jit
def pow2_from_byte(e):
    """fp32 ``2**(e − 127)`` of an int32 biased exponent ``e`` (0 below the normal range)."""
    return tl.where(e >= 1, (tl.maximum(e, 1) << 23).to(tl.float32, bitcast=True), 0.0)

