"""Top-k ``"filter"`` (``topk`` describes the algorithms): one launch, a row over up to one program per
multiprocessor, all resident and meeting at per-row barriers; a lower bound of the threshold, a candidate list, a
bisection over the candidates."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .topk_common import (block_columns, emit_selected, empty_prefix, gather_keys, list_slots, load_keys, pick_bin,
                          push_digit, search_start, store_columns)
from .topk_plan import FILTER_CANDIDATES_PER_ROW, TopkPlan


#: polls of a row barrier before a program gives up waiting (~seconds): the launcher keeps every program resident, so
#: this never triggers unless that assumption breaks (e.g. another process holds SMs); a stuck GPU would be worse
_MAX_POLLS: tl.constexpr = tl.constexpr(1 << 24)


@triton.jit
def _wait_arrivals(arrive_ptr, target):
    """Poll the int32 counter ``arrive_ptr`` (acquire) until it reaches ``target``."""
    seen = tl.atomic_add(arrive_ptr, 0, sem="acquire", scope="gpu")
    polls = 0
    while (seen < target) & (polls < _MAX_POLLS):
        seen = tl.atomic_add(arrive_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    tl.debug_barrier()


@triton.jit
def _row_barrier(arrive_ptr, target):
    """Arrive at the int32 counter ``arrive_ptr`` and wait until it reaches ``target``.

    Every thread's earlier global writes are ordered before the arrival (CTA barrier, then a release atomic); the
    acquiring poll orders the caller's later reads after the other programs' arrivals. Only safe when all programs
    that arrive are resident at once (the launcher keeps the grid within one program per multiprocessor)."""
    tl.debug_barrier()
    tl.atomic_add(arrive_ptr, 1, sem="release", scope="gpu")
    _wait_arrivals(arrive_ptr, target)


@triton.jit
def _half_key(key, KEY_BITS: tl.constexpr):
    """The key halved as a non-negative int32 (16-bit keys are already)."""
    if KEY_BITS == 32:
        return (key >> 1).to(tl.int32, bitcast=True)
    else:
        return key


@triton.jit
def _row_maxima(key, valid, KEY_BITS: tl.constexpr):
    """``[R]`` maxima of the halved keys of each row of a ``[R, C]`` block (−1 for a row without a valid element)."""
    return tl.max(tl.where(valid, _half_key(key, KEY_BITS), -1), axis=1)


@triton.jit
def _smallest_maximum(row_max):
    """The smallest of the nonempty groups' maxima (``INT32_MAX`` when every group is empty)."""
    return tl.min(tl.where(row_max >= 0, row_max, 2147483647), axis=0)


@triton.jit
def _append_candidates(key, valid, cols, bound, n_cand, cand, KEY_BITS: tl.constexpr, PTX: tl.constexpr):
    """Append the block's columns whose halved key reaches ``bound`` to the row's candidate list (one atomic)."""
    take = (valid & (_half_key(key, KEY_BITS) >= bound)).to(tl.int32)
    c = tl.sum(tl.sum(take, axis=1), axis=0)
    if c > 0:
        base = tl.atomic_add(n_cand, c, sem="relaxed", scope="gpu")
        store_columns(cand, tl.where(take != 0, list_slots(take, base), -1), cols, PTX)


@triton.jit
def _block_histogram(digit, live, NB: tl.constexpr):
    """``[NB]`` counts of the live elements' digits of a ``[R, C]`` block. The dead ones are counted in bin 0 and
    taken off again: the block is flattened for ``tl.histogram`` and no mask needs to follow it."""
    hist = tl.histogram(tl.reshape(tl.where(live, digit, 0), (digit.numel,)), NB)
    dead = digit.numel - tl.sum(tl.sum(live.to(tl.int32), axis=1), axis=0)
    return hist - tl.where(tl.arange(0, NB) == 0, dead, 0)


@triton.jit
def _bisect_threshold(key, valid, k_eff, lo_key, hi_key, KEY_BITS: tl.constexpr):
    """The ``k_eff``-th largest of the valid keys of a register block, found bit by bit (the largest ``t`` with at
    least ``k_eff`` keys ``>= t``), and how many keys equal to it are still to take. ``lo_key`` / ``hi_key``: a lower
    bound of the valid keys and their maximum; the bits above their highest differing bit are the threshold's too,
    so only the rest costs a count (a block-wide reduction) each."""
    thr, width = search_start(lo_key, hi_key, KEY_BITS)
    for i in tl.static_range(KEY_BITS):
        b = KEY_BITS - 1 - i
        if b < width:
            t = thr | (tl.full((), 1, thr.dtype) << b)
            if tl.sum(tl.sum((valid & (key >= t)).to(tl.int32), axis=1), axis=0) >= k_eff:
                thr = t
    n_gt = tl.sum(tl.sum((valid & (key > thr)).to(tl.int32), axis=1), axis=0)
    return thr, k_eff - n_gt


@triton.jit
def _select_in_registers(row_ptr, cand, nc, k_eff, lo_key, out_row, CB: tl.constexpr, CC: tl.constexpr,
                         KEY_BITS: tl.constexpr, PTX: tl.constexpr):
    """Top ``k_eff`` of the ``nc <= CB`` listed candidates, held in one ``[CB // CC, CC]`` register block."""
    ci = block_columns(0, CB // CC, CC)
    cvalid = ci < nc
    col = tl.load(cand + ci, mask=cvalid, other=0, cache_modifier=".cg")
    ckey = gather_keys(row_ptr, col, cvalid, KEY_BITS, PTX)
    hi_key = tl.max(tl.max(tl.where(cvalid, ckey, lo_key), axis=1), axis=0)
    thr, remaining = _bisect_threshold(ckey, cvalid, k_eff, lo_key, hi_key, KEY_BITS)
    emit_selected(ckey, cvalid, col, thr, k_eff - remaining, remaining, 0, 0, out_row, PTX)


@triton.jit
def _filter_topk_kernel(
    s_ptr, s_stride,            # int16 / int32 [T, s_stride]: score bits (BF16 / FP32)
    n_ptr,                      # int64 [T]: candidates of each row (the first n_t columns)
    hdr_ptr, hdr_stride,        # int32 [T, 4]: bound, arrivals, candidate count, pad; zero on entry and on exit
    cand_ptr, cand_stride,      # int32 [T, cand_stride >= columns]: the candidates' columns (scratch)
    out_ptr, out_stride,        # int64 [T, K] out
    chunk,                      # columns per program; the last program of a row may get fewer, or none
    splits,                     # programs per row (grid axis 1)
    K: tl.constexpr, KEY_BITS: tl.constexpr, RADIX: tl.constexpr,
    BLOCK: tl.constexpr,        # columns per register block; chunk <= BLOCK: one load per column
    C: tl.constexpr,            # columns per register-block row = per group of the bound (a power of two)
    CBLOCK: tl.constexpr,       # candidates per register block of the selection (up to CBLOCK / 2: a half block)
    CC: tl.constexpr,           # candidates per row of those blocks
    FILL: tl.constexpr,
    SPLIT: tl.constexpr,        # splits > 1: group maxima exchanged through hdr, one row barrier
    PTX: tl.constexpr,          # scattered stores as inline PTX (``store_columns``; not in the interpreter)
    HOST_BOUND: tl.constexpr, CHUNK_HINT: tl.constexpr,  # interpreter: loop bound (one program per row there)
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    n = tl.load(n_ptr + row).to(tl.int32)
    k_eff = tl.minimum(n, K)
    out_row = out_ptr + row * out_stride
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n)
    R: tl.constexpr = BLOCK // C
    CR: tl.constexpr = CBLOCK // CC
    if split == 0:
        for start in tl.static_range(0, K, FILL):
            o = start + tl.arange(0, FILL)
            tl.store(out_row + o, tl.full(o.shape, -1, tl.int64), mask=(o >= k_eff) & (o < K))
    if n <= K:  # every candidate is selected (row-uniform: no program of this row reaches a barrier)
        for start in range(0, CHUNK_HINT if HOST_BOUND else hi - lo, BLOCK):
            cols = block_columns(lo + start, R, C)
            tl.store(out_row + cols, cols.to(tl.int64), mask=cols < hi)
    else:
        row_ptr = s_ptr + row * s_stride
        hdr = hdr_ptr + row * hdr_stride
        bound_c = hdr          # INT32_MAX − (the smallest group maximum seen so far): atomic max, zero = none yet
        arrive = hdr + 1       # row barrier arrivals
        n_cand = hdr + 2       # candidates appended so far
        cand = cand_ptr + row * cand_stride
        # 1. A lower bound of the k-th largest: groups of columns, at least K of them nonempty; the smallest group
        #    maximum is <= the k-th largest (the maxima are >= K distinct elements >= it). A group is a row of C
        #    consecutive columns of a register block.
        #    Keys are compared halved (non-negative int32 also for 32-bit keys); halving keeps the bound a bound.
        # 2. Append the columns whose key reaches the bound to the row's candidate list.
        bound = 0
        # enough nonempty groups for a bound (row-uniform: every program of the row waits at the barrier or none)
        use_bound = tl.cdiv(n, C) >= K
        if chunk <= BLOCK:  # the program's columns stay in registers from 1 to 2
            cols = block_columns(lo, R, C)
            valid = cols < hi
            key = load_keys(row_ptr, cols, valid, KEY_BITS)
            if use_bound:
                bound = _smallest_maximum(_row_maxima(key, valid, KEY_BITS))
                if SPLIT:
                    tl.atomic_max(bound_c, 2147483647 - bound, sem="relaxed", scope="gpu")
                    _row_barrier(arrive, splits)
                    bound = 2147483647 - tl.load(bound_c, volatile=True)
            _append_candidates(key, valid, cols, bound, n_cand, cand, KEY_BITS, PTX)
        else:
            if use_bound:
                bound = 2147483647
                for start in range(0, CHUNK_HINT if HOST_BOUND else hi - lo, BLOCK):
                    cols = block_columns(lo + start, R, C)
                    valid = cols < hi
                    key = load_keys(row_ptr, cols, valid, KEY_BITS)
                    bound = tl.minimum(bound, _smallest_maximum(_row_maxima(key, valid, KEY_BITS)))
                if SPLIT:
                    tl.atomic_max(bound_c, 2147483647 - bound, sem="relaxed", scope="gpu")
                    _row_barrier(arrive, splits)
                    bound = 2147483647 - tl.load(bound_c, volatile=True)
            for start in range(0, CHUNK_HINT if HOST_BOUND else hi - lo, BLOCK):
                cols = block_columns(lo + start, R, C)
                valid = cols < hi
                key = load_keys(row_ptr, cols, valid, KEY_BITS)
                _append_candidates(key, valid, cols, bound, n_cand, cand, KEY_BITS, PTX)
        # 3. The row's first program selects among the candidates; the others only arrive.
        if SPLIT:
            tl.debug_barrier()
            tl.atomic_add(arrive, 1, sem="release", scope="gpu")
        if split == 0:
            if SPLIT:  # every program's appends are done: splits arrivals here, plus splits at the bound's barrier
                _wait_arrivals(arrive, splits * (1 + use_bound.to(tl.int32)))
            tl.debug_barrier()
            nc = tl.load(n_cand, volatile=True)
            lo_key = bound
            if KEY_BITS == 32:
                lo_key = (bound << 1).to(tl.uint32, bitcast=True)  # every candidate's key is >= this
            if nc <= CBLOCK // 2:  # usual: all candidates in registers
                _select_in_registers(row_ptr, cand, nc, k_eff, lo_key, out_row, CBLOCK // 2, CC, KEY_BITS, PTX)
            elif nc <= CBLOCK:
                _select_in_registers(row_ptr, cand, nc, k_eff, lo_key, out_row, CBLOCK, CC, KEY_BITS, PTX)
            else:  # a weak bound (e.g. rows sorted by column): radix passes over the list in blocks
                NB: tl.constexpr = 1 << RADIX
                bins = tl.arange(0, NB)
                remaining = k_eff
                thr = empty_prefix(KEY_BITS)
                for p in tl.static_range(KEY_BITS // RADIX):
                    shift = KEY_BITS - RADIX * (p + 1)
                    hist = tl.zeros((NB,), tl.int32)
                    for start in range(0, CHUNK_HINT if HOST_BOUND else nc, CBLOCK):
                        ci = block_columns(start, CR, CC)
                        live = ci < nc
                        col = tl.load(cand + ci, mask=live, other=0, cache_modifier=".cg")
                        ckey = gather_keys(row_ptr, col, live, KEY_BITS, PTX)
                        if p > 0:
                            live = live & ((ckey >> (shift + RADIX)) == thr)
                        hist += _block_histogram(((ckey >> shift) & (NB - 1)).to(tl.int32), live, NB)
                    b, remaining = pick_bin(hist, remaining, bins)
                    thr = push_digit(thr, b, RADIX, KEY_BITS)
                taken_above = 0
                tied = 0
                for start in range(0, CHUNK_HINT if HOST_BOUND else nc, CBLOCK):
                    ci = block_columns(start, CR, CC)
                    cvalid = ci < nc
                    col = tl.load(cand + ci, mask=cvalid, other=0, cache_modifier=".cg")
                    ckey = gather_keys(row_ptr, col, cvalid, KEY_BITS, PTX)
                    taken_above, tied = emit_selected(ckey, cvalid, col, thr, k_eff - remaining, remaining,
                                                       taken_above, tied, out_row, PTX)
            # leave the header zero for the next call (every other program of the row has arrived: none reads it)
            tl.debug_barrier()
            tl.store(hdr + tl.arange(0, 4), tl.zeros((4,), tl.int32))


def launch(bits: Tensor, counts: Tensor, out: Tensor, header: Tensor, candidates: Tensor, plan: TopkPlan) -> Tensor:
    """``"filter"`` over ``bits`` (int16 / int32 ``[rows, columns]`` score bits) as ``plan`` says, in one launch of
    ``programs_per_row`` programs per row, all resident at once. ``header``: int32 ``[rows, 4]``, zero, left zero;
    ``candidates``: int32 ``[rows, columns]`` scratch. Returns ``out`` (int64 ``[rows, k]``)."""
    splits = plan.programs_per_row
    _filter_topk_kernel[(plan.rows, splits)](
        bits, bits.stride(0), counts, header, header.stride(0), candidates, candidates.stride(0), out, out.stride(0),
        plan.chunk, splits, K=plan.k, KEY_BITS=plan.key_bits, RADIX=plan.radix_bits, BLOCK=plan.block, C=plan.group,
        CBLOCK=plan.candidate_block, CC=FILTER_CANDIDATES_PER_ROW, FILL=plan.fill, SPLIT=splits > 1,
        PTX=not plan.interpreted, HOST_BOUND=plan.interpreted, CHUNK_HINT=plan.chunk if plan.interpreted else 0,
        num_warps=plan.num_warps)
    return out
