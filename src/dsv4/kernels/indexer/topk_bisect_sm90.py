"""Top-k by bisection in Gluon for Hopper (sm_90): ``"bisect"`` (``topk_bisect``) with an explicit register layout.

Same semantics, arguments and outputs as ``topk_bisect._bisect_topk_kernel`` over BF16 scores: one program per row
holding the whole row, a lower bound of the threshold (the smallest maximum of groups of ``C`` columns), the threshold
found bit by bit, then one scan that places the selection. The slots are the same (the scan runs in column order), so
the outputs are that kernel's bits (GPU test).

What differs is the layout. Triton gives the Triton kernel's ``[rows, C]`` register block (C ≤ 64 columns per row)
eight contiguous columns per thread, so every row-wise reduction and scan crosses lanes. Here each thread holds
``BLOCK / threads`` contiguous columns (8 to 32: ``topk_plan.bisect_sm90_fits``; at 64 it spills): a group's maximum,
a count and the scan are in-thread work plus one warp-level and one block-level step; a count is two instructions per
key (``_count_below``); the row is read in 16-byte loads (masked by whole 8-column vectors, so rows and their stride
must be multiples of 8 columns).

Differs from the Triton kernel in one place that does not change the outputs: columns past the row's count are told
from real scores by their key 0 alone, and a real score whose key is 0 (the NaN bits 0xFFFF) is found by a count where
the lower bound needs it (GPU test: a row whose selection needs 507 such scores).

Why it exists: see benchmarks/RESULTS.md, "Top-k "bisect" in Gluon for BF16 rows of 1K–16K columns".
"""

from __future__ import annotations

import torch

from ..device import has_gluon
from .topk_plan import BISECT_SM90_VECTOR, TopkPlan

__all__ = ["launch"]

if has_gluon():  # Gluon ships with Triton >= 3.4; the plan picks this kernel only where it runs (``device.is_sm90``)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    VEC = gl.constexpr(BISECT_SM90_VECTOR)

    @gluon.jit
    def _sortable_key16(bits):
        """Order-preserving unsigned key of BF16 bits (int32 holding 16 bits), as ``topk_common.sortable_key``."""
        u = bits & 0xFFFF
        return gl.where(u >= 0x8000, u ^ 0xFFFF, u | 0x8000)

    @gluon.jit
    def _count_below(key, t):
        """How many keys are below ``t`` (int32 scalar): the sign bits of ``key − t`` summed (keys below 2¹⁶, ``t``
        at most 2¹⁶), two instructions per key (``IADD`` + ``LEA.HI``) instead of a compare, a select and an add."""
        return gl.sum(((key - t).to(gl.uint32, bitcast=True) >> 31).to(gl.int32), axis=0)

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _bisect_topk_sm90_kernel(
        s_ptr, s_stride,            # int16 [T, s_stride]: BF16 score bits
        n_ptr,                      # int64 [T]: candidates of each row (the first n_t columns)
        out_ptr, out_stride,        # int64 [T, K] out
        K: gl.constexpr,
        BLOCK: gl.constexpr,        # columns held: a power of two >= every n_t
        C: gl.constexpr,            # columns per group of the lower bound
        FILL: gl.constexpr,         # slots written per step of the −1 fill
        NW: gl.constexpr,           # warps
    ):
        """One program per row (``topk_bisect._bisect_topk_kernel``'s steps), thread ``i`` holding columns
        ``i · PER … i · PER + PER − 1``."""
        PER: gl.constexpr = BLOCK // (32 * NW)
        L: gl.constexpr = gl.BlockedLayout([PER], [32], [NW], [0])
        FL: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        row = gl.program_id(0).to(gl.int64)
        n = gl.load(n_ptr + row).to(gl.int32)
        k_eff = gl.minimum(n, K)
        out_row = out_ptr + row * out_stride
        for start in gl.static_range(0, K, FILL):
            o = start + gl.arange(0, FILL, layout=FL)
            gl.store(out_row + o, gl.full([FILL], -1, gl.int64, FL), mask=(o >= k_eff) & (o < K))
        if n <= K:  # every candidate is selected
            every = gl.arange(0, BLOCK, layout=L)
            gl.store(out_row + every, every.to(gl.int64), mask=every < n)
        else:
            cols = gl.arange(0, BLOCK, layout=L)
            # Whole 8-column vectors are read (the row width is a multiple of 8); columns past n get key 0, the
            # smallest: every threshold tried below is >= 1, so they never count.
            vec_in = (cols // VEC) * VEC < n
            bits = gl.load(s_ptr + row * s_stride + cols, mask=vec_in, other=-1).to(gl.int32)
            key = gl.where(cols < n, _sortable_key16(bits), 0)
            g_max = gl.max(gl.reshape(key, [BLOCK // C, C]), axis=1)  # of each group of C columns
            hi_key = gl.max(g_max, axis=0)
            groups = gl.cdiv(n, C)
            if groups >= K:  # at least K nonempty groups: their smallest maximum is <= the k-th largest
                g = gl.arange(0, BLOCK // C, layout=g_max.type.layout)
                lo_key = gl.min(gl.where(g < groups, g_max, 0xFFFF), axis=0)
            else:
                # the smallest valid key: 0 if a score has the NaN bits 0xFFFF (key 0, like the BLOCK − n columns
                # past n), else the smallest key above 0
                lo_key = gl.where(_count_below(key, 1) > BLOCK - n, 0,
                                  gl.min(gl.where(key > 0, key, 0xFFFF), axis=0))
            # The bits above the highest one where lo_key and hi_key differ are the threshold's too.
            diff = lo_key ^ hi_key
            width = 0
            for b in gl.static_range(16):
                width += ((diff >> b) != 0).to(gl.int32)
            thr = hi_key & ~((1 << width) - 1)
            for i in range(width):  # the largest thr with at least k_eff keys >= thr, one bit at a time
                t = thr | (1 << (width - 1 - i))
                thr = gl.where(BLOCK - _count_below(key, t) >= k_eff, t, thr)
            n_gt = BLOCK - _count_below(key, thr + 1)
            remaining = k_eff - n_gt
            # One inclusive scan in column order places both: the count above in the low 16 bits, the tied count
            # in the high ones (rows of at most 32,768 columns). The columns again, from an arange the compiler
            # does not merge with the first (plus n >> 31, a zero it cannot see: n >= 0): kept alive from the load
            # to here, they and their mask spilled at 32 columns per thread.
            cols = gl.arange(0, BLOCK, layout=L) + (n >> 31)
            flags = (key > thr).to(gl.int32) | (((cols < n) & (key == thr)).to(gl.int32) << 16)
            seen = gl.associative_scan(flags, 0, _add)
            gt = (flags & 1) != 0
            eq = flags > 1
            rank = ((seen >> 16) & 0xFFFF) - 1
            slot = gl.where(gt, (seen & 0xFFFF) - 1, gl.where(eq & (rank < remaining), n_gt + rank, -1))
            gl.store(out_row + slot, cols.to(gl.int64), mask=slot >= 0)


def launch(bits: torch.Tensor, counts: torch.Tensor, out: torch.Tensor, plan: TopkPlan) -> torch.Tensor:
    """Launch the kernel over ``bits`` (int16 ``[rows, columns]``, BF16 score bits) as ``plan`` says (a ``"bisect"``
    plan with ``gluon``; ``topk.radix_topk`` checked it). Returns ``out`` (int64 ``[rows, k]``)."""
    _bisect_topk_sm90_kernel[(plan.rows,)](bits, bits.stride(0), counts, out, out.stride(0), K=plan.k, BLOCK=plan.block,
                                           C=plan.group, FILL=plan.fill, NW=plan.num_warps, num_warps=plan.num_warps)
    return out
