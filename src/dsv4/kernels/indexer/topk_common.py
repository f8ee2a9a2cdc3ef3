"""Device helpers shared by the top-k kernels: order-preserving keys of the scores, key prefixes of the radix passes,
register blocks of columns, and the scan that places a selection (scattered stores as inline PTX).

Triton notes: the layout pass duplicates inline-asm ops even when they are marked impure, so the PTX ops here are
idempotent loads and stores (appends are plain scans and atomics); and a ``tl.store`` / ``tl.load`` through a block
of scattered addresses gets its own layout, into which Triton first converts the 64-bit pointer block through shared
memory — the PTX versions form each address from a 32-bit slot in place.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["address_operand", "block_columns", "emit_selected", "empty_prefix", "gather_keys", "largest_key",
           "list_slots", "load_keys", "pick_bin", "push_digit", "search_start", "sortable_key", "store_columns"]


@triton.jit
def sortable_key(bits, KEY_BITS: tl.constexpr):
    """Order-preserving unsigned key of IEEE bits (int32 holding 16 or 32 bits)."""
    if KEY_BITS == 16:
        u = bits & 0xFFFF
        return tl.where(u >= 0x8000, u ^ 0xFFFF, u | 0x8000)
    else:
        u = bits.to(tl.uint32, bitcast=True)
        neg = (u >> 31) != 0
        return tl.where(neg, u ^ 0xFFFFFFFF, u | 0x80000000)


@triton.jit
def load_keys(row_ptr, offs, mask, KEY_BITS: tl.constexpr):
    if KEY_BITS == 16:
        bits = tl.load(row_ptr + offs, mask=mask, other=0).to(tl.int32)
    else:
        bits = tl.load(row_ptr + offs, mask=mask, other=0)
    return sortable_key(bits, KEY_BITS)


@triton.jit
def address_operand(ptr, like):
    """The scalar pointer ``ptr`` as an int64 block shaped like ``like``: the address operand of the inline PTX
    loads and stores below (each element adds its own 32-bit slot)."""
    return ptr.to(tl.int64, bitcast=True) + tl.zeros_like(like).to(tl.int64)


@triton.jit
def gather_keys(row_ptr, cols, mask, KEY_BITS: tl.constexpr, PTX: tl.constexpr):
    """``load_keys`` of scattered columns. With ``PTX`` the loads are inline PTX in the columns' own register layout
    (``tl.load`` would first move the block's 64-bit pointers to another layout through shared memory)."""
    if PTX:
        if KEY_BITS == 16:
            asm: tl.constexpr = """{ .reg .pred p; .reg .b64 a; .reg .b16 h;
            setp.ne.b32 p, $3, 0;
            mad.wide.s32 a, $2, 2, $1;
            mov.b32 $0, 0;
            @p ld.global.b16 h, [a];
            @p cvt.u32.u16 $0, h; }"""
        else:
            asm: tl.constexpr = """{ .reg .pred p; .reg .b64 a;
            setp.ne.b32 p, $3, 0;
            mad.wide.s32 a, $2, 4, $1;
            mov.b32 $0, 0;
            @p ld.global.b32 $0, [a]; }"""
        bits = tl.inline_asm_elementwise(
            asm=asm, constraints="=r,l,r,r",
            args=[address_operand(row_ptr, cols), cols, mask.to(tl.int32)],
            dtype=tl.int32, is_pure=True, pack=1)
        return sortable_key(bits, KEY_BITS)
    else:
        return load_keys(row_ptr, cols, mask, KEY_BITS)


@triton.jit
def largest_key(KEY_BITS: tl.constexpr):
    """The largest key (0xFFFF / 0xFFFFFFFF, of the same type as ``sortable_key``'s): the neutral element of a
    minimum over keys."""
    if KEY_BITS == 16:
        return tl.full((), 0xFFFF, tl.int32)
    else:
        return tl.full((), 0xFFFFFFFF, tl.uint32)


@triton.jit
def empty_prefix(KEY_BITS: tl.constexpr):
    """A key prefix of no digits yet (uint32 for 32-bit keys, int32 for 16-bit ones)."""
    if KEY_BITS == 32:
        return tl.zeros((), tl.int32).to(tl.uint32)
    else:
        return tl.zeros((), tl.int32)


@triton.jit
def push_digit(prefix, b, RADIX: tl.constexpr, KEY_BITS: tl.constexpr):
    """``prefix`` with the ``RADIX``-bit digit ``b`` (int32) appended."""
    if KEY_BITS == 32:
        return (prefix << RADIX) | b.to(tl.uint32)
    else:
        return (prefix << RADIX) | b


@triton.jit
def pick_bin(hist, remaining, bins):
    """Highest bin whose suffix count reaches ``remaining``, and what is still to choose inside it."""
    suffix = tl.sum(hist) - tl.cumsum(hist, 0) + hist  # elements in bins >= i
    b = tl.max(tl.where(suffix >= remaining, bins, 0))
    return b, remaining - tl.sum(tl.where(bins > b, hist, 0))


@triton.jit
def block_columns(start, R: tl.constexpr, C: tl.constexpr):
    """Columns ``start + r·C + c`` of a ``[R, C]`` register block (rows of C columns: scans along a row stay inside
    a few threads of one warp)."""
    return start + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]


@triton.jit
def list_slots(take, base):
    """Slots ``base, base + 1, …`` of the taken elements of a ``[R, C]`` block in row-major order (undefined
    elsewhere): a scan along each row plus a scan over the row totals."""
    in_row = tl.cumsum(take, axis=1)
    totals = tl.sum(take, axis=1)
    before = tl.cumsum(totals, axis=0) - totals
    return base + before[:, None] + in_row - 1


@triton.jit
def store_columns(base, slot, col, PTX: tl.constexpr):
    """``base[slot] = col`` where ``slot >= 0``; ``base``: int32 or int64 elements (``col``: int32 block).

    With ``PTX`` the store is inline PTX that runs in the operands' own register layout and forms each address
    itself: ``tl.store`` of a scattered block first moves its 64-bit pointers to another layout through shared
    memory (as the TTGIR of these kernels shows). Triton may replicate the impure op; a replicated store writes
    the same value again."""
    if PTX:
        if base.dtype.element_ty == tl.int64:
            asm: tl.constexpr = """{ .reg .pred p; .reg .b64 a, v;
            setp.ge.s32 p, $2, 0;
            mad.wide.s32 a, $2, 8, $1;
            cvt.s64.s32 v, $3;
            @p st.global.b64 [a], v;
            mov.b32 $0, 0; }"""
        else:
            asm: tl.constexpr = """{ .reg .pred p; .reg .b64 a;
            setp.ge.s32 p, $2, 0;
            mad.wide.s32 a, $2, 4, $1;
            @p st.global.b32 [a], $3;
            mov.b32 $0, 0; }"""
        tl.inline_asm_elementwise(asm=asm, constraints="=r,l,r,r",
                                  args=[address_operand(base, slot), slot, col],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(base + slot, col.to(base.dtype.element_ty), mask=slot >= 0)


@triton.jit
def search_start(lo_key, hi_key, KEY_BITS: tl.constexpr):
    """Where the bisection starts: ``hi_key`` with its bits below the highest one where ``lo_key`` and ``hi_key``
    differ cleared (the bits above it are the threshold's too), and the number of those searched bits."""
    diff = lo_key ^ hi_key
    width = 0  # bit length of diff
    for b in tl.static_range(KEY_BITS):
        width += ((diff >> b) != 0).to(tl.int32)
    thr = hi_key
    for b in tl.static_range(KEY_BITS):
        if b < width:
            thr = thr ^ (thr & (tl.full((), 1, thr.dtype) << b))
    return thr, width


@triton.jit
def emit_selected(key, valid, col, thr, n_gt, remaining, n_above, n_tied, out_row, PTX: tl.constexpr):
    """Write a block's columns above the threshold (slots from ``n_above``) and its tied ones (slots ``n_gt + n_tied
    + rank`` below ``n_gt + remaining``) to the output row; returns the updated ``(n_above, n_tied)``.

    One scan places both: the count above in the low 16 bits, the tied count in the high ones (blocks of at most
    32,768 elements)."""
    gt = valid & (key > thr)
    eq = valid & (key == thr)
    seen = list_slots(gt.to(tl.int32) | (eq.to(tl.int32) << 16), 0) + 1  # inclusive counts
    rank = n_tied + (seen >> 16) - 1
    slot = tl.where(gt, n_above + (seen & 0xFFFF) - 1, tl.where(eq & (rank < remaining), n_gt + rank, -1))
    store_columns(out_row, slot, col, PTX)
    total = tl.max(tl.max(seen, axis=1), axis=0)  # the last element's counts: both fields only grow
    return n_above + (total & 0xFFFF), n_tied + (total >> 16)
