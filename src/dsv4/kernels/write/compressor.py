"""The compressors' writes of one layer step in one launch (SPEC §4): accumulate the step's projected tokens into
the tails, pool every window that closes, finish and store the entries in the paged pool — fused with the step's
window entries.

Inputs per compressor are the FP32 projections ``a = x W_kv^T`` and ``z_raw = x W_gate^T`` (``[T, width]``, rows
``AZ_STRIDE`` elements apart — column blocks of one GEMM output, see ``slots``; the position bias ``ape[p mod m]``
is added here, in the same FP32 add as ``reference.compressor.project``). Everything after the projections is
bit-exact with the torch backend's ``compress`` on CUDA: the pooling (``pool``), the entry's RMSNorm in torch's
summation order for the step's entry count (read on the device: ``num_emit_device``), RoPE, quantization and
encoding (``entry``).

Grid (program ids in this order; ``write.plan.WritePlan`` sizes it):

====================  ============================================================================================
``B`` main leads      request b: its first emitted entry (and, CSA, the second: the only entries that read the
                      tails / previous-window state), then — after a barrier — rotate the previous-window state
                      (CSA) and write the tokens of the still-open window into the tail
``Ecap`` main         one program per other emitted entry (``emit_pad_*``, padding rows exit at once); every
                      slot of such an entry is a token of the step
``⌈T/BT⌉`` window     the step's window entries (``window.window_entries_block``)
``B`` index leads     the same as the main leads for the CSA indexer's compressor (CSA layers only)
``Ecap`` index        likewise for the indexer's other entries
====================  ============================================================================================

HCA entries (``PARTS`` > 1) are pooled by ``PARTS`` programs, one channel slice each; the last to arrive at the
entry's counter (zero-kept) finishes it and, for a lead, writes the tail. A tail is read before it is written
because one program (the lead) does both with a barrier between. The entry programs are compiled in only when the
plan has them (``ENTRY_PROGRAMS``: decode steps do not). A long CSA step's entries run in ``csa_entries``' launch
first; this kernel then does the leads' state updates only (``STATE_ONLY``). Nothing branches on the host on
whether a window closed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .entry import compress_entry, finish_entry
from .pool import pool_entry
from .slots import load_slots
from .window import window_entries_block

__all__ = ["write_before_attention_kernel"]


@triton.jit
def lead_program(
    b,
    a_ptr, z_ptr, AZ_STRIDE: tl.constexpr,
    ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr, norm_ptr, inv_freq_ptr,
    pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, eps, num_emit_ptr, scratch_ptr,
    start_ptr, end_ptr, cu_ptr, slots_ptr,
    C: tl.constexpr, M: tl.constexpr, OVERLAP: tl.constexpr, KIND: tl.constexpr, NW: tl.constexpr,
    MAXT: tl.constexpr, ENTRIES: tl.constexpr = True,
):
    """Request ``b``: its first emitted entries (those that read the tail / state; not with ``ENTRIES`` False:
    ``csa_entries`` wrote them before this launch), then the state updates."""
    W: tl.constexpr = 2 * C if OVERLAP else C
    L: tl.constexpr = 2 if OVERLAP else 1
    start = tl.load(start_ptr + b)
    end = tl.load(end_ptr + b)
    cu = tl.load(cu_ptr + b).to(tl.int64)
    slot = tl.load(slots_ptr + b)
    num_emit = tl.load(num_emit_ptr)
    i0 = start // M
    i_end = end // M
    for k in range(0, L if ENTRIES else 0):
        i = i0 + k
        if i < i_end:
            compress_entry(a_ptr, z_ptr, AZ_STRIDE, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr,
                           norm_ptr, inv_freq_ptr, pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size,
                           eps, num_emit, scratch_ptr, b, i, start, cu, slot, C, M, OVERLAP, KIND, NW, MAXT)
    cols = tl.arange(0, C)[None, :]
    r = tl.arange(0, M)
    if OVERLAP:
        # The last closed window's first half becomes the next entry's previous window: the "previous" slots of
        # entry i_end (read here, before any write below).
        pz, pa = load_slots(0, M, True, a_ptr, z_ptr, AZ_STRIDE, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr,
                            prev_gate_ptr, i_end, start, cu, slot, C, M, OVERLAP, 0, C)
    tl.debug_barrier()
    if OVERLAP:
        emitted = i_end > i0
        prev_off = (slot * M + r).to(tl.int64)[:, None] * C + cols
        pm = emitted & (r[:, None] >= 0)
        tl.store(prev_kv_ptr + prev_off, pa, mask=pm)
        tl.store(prev_gate_ptr + prev_off, pz, mask=pm)
    write_open_window(a_ptr, z_ptr, AZ_STRIDE, ape_ptr, tail_kv_ptr, tail_gate_ptr, start, end, cu, slot, W, M)


@triton.jit
def write_open_window(a_ptr, z_ptr, AZ_STRIDE: tl.constexpr, ape_ptr, tail_kv_ptr, tail_gate_ptr, start, end, cu, slot,
                      W: tl.constexpr, M: tl.constexpr):
    """The tail of a request: its step tokens of the final, still open window (positions ≥ ⌊end/m⌋·m), all
    ``W`` columns, gate biased, at rows ``p mod m``."""
    first_open = tl.maximum(start, (end // M) * M)
    wcols = tl.arange(0, W)[None, :]
    RB: tl.constexpr = 4
    for k in range(0, (M - 1 + RB - 1) // RB):  # at most m − 1 open-window tokens
        p0 = first_open + k * RB
        if p0 < end:
            p = p0 + tl.arange(0, RB)
            pm = (p < end)[:, None]
            rr = p % M
            src = (cu + p - start).to(tl.int64)[:, None] * AZ_STRIDE + wcols
            dst = (slot * M + rr).to(tl.int64)[:, None] * W + wcols
            a = tl.load(a_ptr + src, mask=pm, other=0.0)
            z = tl.load(z_ptr + src, mask=pm, other=0.0) + tl.load(ape_ptr + rr[:, None] * W + wcols, mask=pm,
                                                                    other=0.0)
            tl.store(tail_kv_ptr + dst, a, mask=pm)
            tl.store(tail_gate_ptr + dst, z, mask=pm)


@triton.jit
def entry_program(
    e,
    a_ptr, z_ptr, AZ_STRIDE: tl.constexpr,
    ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr, norm_ptr, inv_freq_ptr,
    pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, eps, num_emit_ptr, scratch_ptr,
    start_ptr, cu_ptr, slots_ptr, emit_req_ptr, emit_entry_ptr,
    C: tl.constexpr, M: tl.constexpr, OVERLAP: tl.constexpr, KIND: tl.constexpr, NW: tl.constexpr,
    MAXT: tl.constexpr,
):
    """Emitted entry ``e`` of the padded list, unless it is padding or one its request's lead program takes."""
    L: tl.constexpr = 2 if OVERLAP else 1
    b = tl.load(emit_req_ptr + e)
    if b >= 0:
        i = tl.load(emit_entry_ptr + e)
        start = tl.load(start_ptr + b)
        if i >= start // M + L:  # past the lead's entries: every slot is a token of this step
            cu = tl.load(cu_ptr + b).to(tl.int64)
            slot = tl.load(slots_ptr + b)
            compress_entry(a_ptr, z_ptr, AZ_STRIDE, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr,
                           norm_ptr, inv_freq_ptr, pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size,
                           eps, tl.load(num_emit_ptr), scratch_ptr, b, i, start, cu, slot, C, M, OVERLAP, KIND, NW,
                           MAXT, OVERLAP and M == 4 and NW == 0)


@triton.jit
def last_arrival(count_ptr, parts):
    """Arrive at the int32 counter ``count_ptr`` after this program's writes; True for the ``parts``-th (last)
    arrival, which also resets the counter to zero for the next launch. Nobody waits: the last arriver reads what
    the others wrote (release / acquire through the counter)."""
    tl.debug_barrier()
    last = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == parts - 1
    if last:
        tl.store(count_ptr, 0)
    tl.debug_barrier()
    return last


@triton.jit
def pool_slice(
    part, a_ptr, z_ptr, AZ_STRIDE: tl.constexpr, ape_ptr, tail_kv_ptr, tail_gate_ptr, scratch_ptr, i, start, cu, slot,
    C: tl.constexpr, M: tl.constexpr, NW: tl.constexpr, PARTS: tl.constexpr, IN_STEP: tl.constexpr = False,
):
    """Pool channel slice ``part`` of ``PARTS`` of HCA entry ``i`` into its place in the entry's scratch row
    (``IN_STEP``: every slot is a token of the step, see ``pool_entry``)."""
    CS: tl.constexpr = C // PARTS
    c0 = part * CS
    pooled = pool_entry(a_ptr, z_ptr, AZ_STRIDE, ape_ptr, tail_kv_ptr, tail_gate_ptr, tail_kv_ptr, tail_gate_ptr,
                        i, start, cu, slot, C, M, False, NW, c0, CS, IN_STEP)
    tl.store(scratch_ptr + c0 + tl.arange(0, CS), pooled)


@triton.jit
def finish_from_scratch(
    scratch_ptr, norm_ptr, inv_freq_ptr, pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, eps,
    num_emit, b, i, C: tl.constexpr, M: tl.constexpr, MAXT: tl.constexpr,
):
    """The last part's work: ``finish_entry`` of the pooled row the parts wrote (read past L1)."""
    full = tl.load(scratch_ptr + tl.arange(0, C), cache_modifier=".cg")
    tl.debug_barrier()  # every thread has read the row before the RMSNorm reuses it
    finish_entry(full, norm_ptr, inv_freq_ptr, pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, eps,
                 num_emit, scratch_ptr, b, i, C, M, 0, MAXT)


@triton.jit
def lead_part_program(
    b, part,
    a_ptr, z_ptr, AZ_STRIDE: tl.constexpr, ape_ptr, tail_kv_ptr, tail_gate_ptr, norm_ptr, inv_freq_ptr,
    pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, eps, num_emit_ptr, scratch_ptr, count_ptr,
    start_ptr, end_ptr, cu_ptr, slots_ptr,
    C: tl.constexpr, M: tl.constexpr, NW: tl.constexpr, PARTS: tl.constexpr, MAXT: tl.constexpr,
):
    """``lead_program`` of an HCA request split over ``PARTS`` programs: each pools a channel slice of the first
    emitted entry; the last to arrive finishes it, then writes the tail (after every part has read it)."""
    start = tl.load(start_ptr + b)
    end = tl.load(end_ptr + b)
    cu = tl.load(cu_ptr + b).to(tl.int64)
    slot = tl.load(slots_ptr + b)
    i0 = start // M
    emits = i0 < end // M
    if emits:
        pool_slice(part, a_ptr, z_ptr, AZ_STRIDE, ape_ptr, tail_kv_ptr, tail_gate_ptr, scratch_ptr, i0, start, cu,
                   slot, C, M, NW, PARTS)
    if last_arrival(count_ptr, PARTS):
        if emits:
            finish_from_scratch(scratch_ptr, norm_ptr, inv_freq_ptr, pages_ptr, page_bytes, block_tables_ptr,
                                bt_stride, block_size, eps, tl.load(num_emit_ptr), b, i0, C, M, MAXT)
        write_open_window(a_ptr, z_ptr, AZ_STRIDE, ape_ptr, tail_kv_ptr, tail_gate_ptr, start, end, cu, slot, C, M)


@triton.jit
def entry_part_program(
    e, part,
    a_ptr, z_ptr, AZ_STRIDE: tl.constexpr, ape_ptr, tail_kv_ptr, tail_gate_ptr, norm_ptr, inv_freq_ptr,
    pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, eps, num_emit_ptr, scratch_ptr, count_ptr,
    start_ptr, cu_ptr, slots_ptr, emit_req_ptr, emit_entry_ptr,
    C: tl.constexpr, M: tl.constexpr, NW: tl.constexpr, PARTS: tl.constexpr, MAXT: tl.constexpr,
):
    """``entry_program`` of an HCA entry split over ``PARTS`` programs (padding and the leads' entries: none).
    Such an entry's slots are all tokens of the step and pool as such (``pool_entry``'s ``IN_STEP``)."""
    b = tl.load(emit_req_ptr + e)
    if b >= 0:
        i = tl.load(emit_entry_ptr + e)
        start = tl.load(start_ptr + b)
        if i >= start // M + 1:
            pool_slice(part, a_ptr, z_ptr, AZ_STRIDE, ape_ptr, tail_kv_ptr, tail_gate_ptr, scratch_ptr, i, start,
                       tl.load(cu_ptr + b).to(tl.int64), tl.load(slots_ptr + b), C, M, NW, PARTS, True)
            if last_arrival(count_ptr, PARTS):
                finish_from_scratch(scratch_ptr, norm_ptr, inv_freq_ptr, pages_ptr, page_bytes, block_tables_ptr,
                                    bt_stride, block_size, eps, tl.load(num_emit_ptr), b, i, C, M, MAXT)


@triton.jit
def write_before_attention_kernel(
    kv_ptr, pos_ptr, inv_freq_ptr, kv_out_ptr, T,
    start_ptr, end_ptr, cu_ptr, slots_ptr, block_tables_ptr, bt_stride, block_size, B,
    emit_req_ptr, emit_entry_ptr, num_emit_ptr, n_entry, eps, scratch_ptr, count_ptr,
    ma_ptr, mz_ptr, MAZ_STRIDE: tl.constexpr,
    mape_ptr, mtkv_ptr, mtg_ptr, mpkv_ptr, mpg_ptr, mnorm_ptr, mpages_ptr, mpage_bytes,
    xa_ptr, xz_ptr, XAZ_STRIDE: tl.constexpr,
    xape_ptr, xtkv_ptr, xtg_ptr, xpkv_ptr, xpg_ptr, xnorm_ptr, xpages_ptr, xpage_bytes,
    C: tl.constexpr, M: tl.constexpr, OVERLAP: tl.constexpr, HAS_INDEX: tl.constexpr, BT: tl.constexpr,
    NW: tl.constexpr, NW_INDEX: tl.constexpr, MAXT: tl.constexpr, PARTS: tl.constexpr,
    STATE_ONLY: tl.constexpr = False, ENTRY_PROGRAMS: tl.constexpr = True,
):
    # STATE_ONLY: the CSA launch of a long step after csa_entries (which wrote every entry and the window entries):
    # the lead programs' state updates only. ENTRY_PROGRAMS: the grid has entry programs (n_entry > 0); without, their
    # code is not compiled in (a smaller binary and allocation: the state-only launch 156 -> 108 registers)
    pid = tl.program_id(0)
    n_win = 0 if STATE_ONLY else tl.cdiv(T, BT)
    if PARTS > 1:  # HCA, every entry split over PARTS programs; scratch row and counter per entry slot
        q = pid // PARTS
        row = scratch_ptr + q.to(tl.int64) * 512
        if q < B:
            lead_part_program(q, pid % PARTS, ma_ptr, mz_ptr, MAZ_STRIDE, mape_ptr, mtkv_ptr, mtg_ptr, mnorm_ptr,
                              inv_freq_ptr, mpages_ptr, mpage_bytes, block_tables_ptr, bt_stride, block_size, eps,
                              num_emit_ptr, row, count_ptr + q, start_ptr, end_ptr, cu_ptr, slots_ptr, C, M, NW, PARTS,
                              MAXT)
        elif ENTRY_PROGRAMS and q < B + n_entry:
            entry_part_program(q - B, pid % PARTS, ma_ptr, mz_ptr, MAZ_STRIDE, mape_ptr, mtkv_ptr, mtg_ptr, mnorm_ptr,
                               inv_freq_ptr, mpages_ptr, mpage_bytes, block_tables_ptr, bt_stride, block_size, eps,
                               num_emit_ptr, row, count_ptr + q, start_ptr, cu_ptr, slots_ptr, emit_req_ptr,
                               emit_entry_ptr, C, M, NW, PARTS, MAXT)
        else:
            window_entries_block(kv_ptr, pos_ptr, inv_freq_ptr, kv_out_ptr, (pid - (B + n_entry) * PARTS) * BT, T, BT)
    else:
        # each compressor program's fp32 [512] scratch row (RMSNorm): main programs 0 … B+n_entry−1, then the index's
        main_scratch = scratch_ptr + pid.to(tl.int64) * 512
        index_scratch = scratch_ptr + (pid - n_win).to(tl.int64) * 512
        if pid < B:
            lead_program(pid, ma_ptr, mz_ptr, MAZ_STRIDE, mape_ptr, mtkv_ptr, mtg_ptr, mpkv_ptr, mpg_ptr, mnorm_ptr,
                         inv_freq_ptr, mpages_ptr, mpage_bytes, block_tables_ptr, bt_stride, block_size, eps,
                         num_emit_ptr, main_scratch, start_ptr, end_ptr, cu_ptr, slots_ptr, C, M, OVERLAP, 0, NW, MAXT,
                         not STATE_ONLY)
        elif ENTRY_PROGRAMS and pid < B + n_entry:
            entry_program(pid - B, ma_ptr, mz_ptr, MAZ_STRIDE, mape_ptr, mtkv_ptr, mtg_ptr, mpkv_ptr, mpg_ptr,
                          mnorm_ptr, inv_freq_ptr, mpages_ptr, mpage_bytes, block_tables_ptr, bt_stride, block_size,
                          eps, num_emit_ptr, main_scratch, start_ptr, cu_ptr, slots_ptr, emit_req_ptr, emit_entry_ptr,
                          C, M, OVERLAP, 0, NW, MAXT)
        elif pid < B + n_entry + n_win:
            window_entries_block(kv_ptr, pos_ptr, inv_freq_ptr, kv_out_ptr, (pid - B - n_entry) * BT, T, BT)
        else:
            if HAS_INDEX:  # the CSA indexer's compressor: leads, then entries
                q = pid - B - n_entry - n_win
                if q < B:
                    lead_program(q, xa_ptr, xz_ptr, XAZ_STRIDE, xape_ptr, xtkv_ptr, xtg_ptr, xpkv_ptr, xpg_ptr,
                                 xnorm_ptr, inv_freq_ptr, xpages_ptr, xpage_bytes, block_tables_ptr, bt_stride,
                                 block_size, eps, num_emit_ptr, index_scratch, start_ptr, end_ptr, cu_ptr, slots_ptr,
                                 128, M, True, 1, NW_INDEX, MAXT, not STATE_ONLY)
                elif ENTRY_PROGRAMS:
                    entry_program(q - B, xa_ptr, xz_ptr, XAZ_STRIDE, xape_ptr, xtkv_ptr, xtg_ptr, xpkv_ptr, xpg_ptr,
                                  xnorm_ptr, inv_freq_ptr, xpages_ptr, xpage_bytes, block_tables_ptr, bt_stride,
                                  block_size, eps, num_emit_ptr, index_scratch, start_ptr, cu_ptr, slots_ptr,
                                  emit_req_ptr, emit_entry_ptr, 128, M, True, 1, NW_INDEX, MAXT)
