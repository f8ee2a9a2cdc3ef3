"""A long CSA step's entries in a launch of their own, one warp per program: every emitted entry (pool, RMSNorm,
RoPE, quantize, write; main entries and indexer keys) and the step's window entries.

``write.launch.write_before_attention`` runs it when a request of a CSA step can emit more entries than its lead
program takes (a prefill chunk: an 8K chunk emits 2,048 main entries and 2,048 indexer keys), before the fused
launch's lead programs update the state (previous-window rotation, open-window tails) — so it still reads the old
tails and state for each request's first two entries. Why a launch of its own: in the fused kernel every role
shares the register allocation of the heaviest one (see benchmarks/RESULTS.md, "write path").

A program holds its entry in the arrangement torch's RMSNorm reduction reads (``torch_order.add_chunk_squares``):
thread l holds channels ``128k + 4l + q`` (k = 0…3, q = 0…3), so every partial sum of squares is a register sum of
the thread's own values followed by one 32-lane shuffle tree. The 512 channels are pooled as four 128-channel
chunks in a loop (every channel pools on its own, so the bits are those of the whole entry); the FP8 blocks (64
channels) are halves of a chunk, the RoPE pairs the upper half of the last one. Entries past a request's first two
pool from the step's rows (``pool_in_step``), the first two through the general slot sources (``pool_entry``).
The bytes equal the fused kernel's and the torch backend's.

Grid, in this order: ``E_cap`` main-entry programs (``E_cap`` = ``emit_capacity[4]``, the padded emit list;
padding exits at once), ``E_cap`` indexer-key programs (with the indexer's compressor), ``⌈T/4⌉`` window-entry
programs of 4 tokens — roles in blocks, not interleaved (three code paths would compete for the instruction cache).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..constants import KV_DATA_BYTES, KV_NOPE_DIM, KV_SCALE_BYTES
from ..quant import bf16_round
from ..rope import rope_pairs
from ..torch_order import add_chunk_squares, entry_rms_scale, rms_norm_128, zero_square_sums
from .entry import page_row, store_fp8_blocks, store_mxfp4_key
from .pool import pool_entry, pool_in_step
from .window import window_entries_block

__all__ = ["csa_entries_kernel"]


@triton.jit
def rope_upper_pairs(y, pos_f, inv_freq_ptr):
    """The 64 pairs ``(y[2p], y[2p+1])`` of a ``[128]`` chunk, pairs 32 … 63 rotated by ``pos·ω_{p−32}`` and
    rounded to BF16 (the entry's rope dims), pairs 0 … 31 as they are: ``(re, im, is_rope)``, each ``[64]``."""
    re, im = tl.split(tl.reshape(y, (64, 2)))
    p = tl.arange(0, 64)
    is_rope = p >= 32
    re2, im2 = rope_pairs(re, im, pos_f, tl.load(inv_freq_ptr + tl.where(is_rope, p - 32, 0)))
    return tl.where(is_rope, bf16_round(re2), re), tl.where(is_rope, bf16_round(im2), im), is_rope


@triton.jit
def pooled_chunk(
    a_ptr, z_ptr, AZ_STRIDE: tl.constexpr,
    ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr, i, start, cu, slot,
    C: tl.constexpr, c0,
):
    """Channels ``c0 … c0+127`` of CSA entry ``i`` (of ``C``) pooled: fp32 ``[128]``. Entries past the request's
    first two pool from the step's rows only (``pool_in_step``); the first two may read the tail and the
    previous-window state (``pool_entry``, one thread per channel — the lead program's path in the fused launch,
    here before the state launch overwrites them)."""
    if i >= start // 4 + 2:
        x = pool_in_step(a_ptr, z_ptr, AZ_STRIDE, ape_ptr, i, start, cu, C, 4, c0, 128)
    else:
        x = pool_entry(a_ptr, z_ptr, AZ_STRIDE, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr, i,
                       start, cu, slot, C, 4, True, 0, c0, 128)
    return x


@triton.jit
def main_entry(
    a_ptr, z_ptr, AZ_STRIDE: tl.constexpr,
    ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr, norm_ptr, inv_freq_ptr,
    pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, eps, num_emit, scratch_ptr, b, i, start, cu, slot,
):
    """Main entry ``i`` of request ``b`` (512 channels) → its 584-B ``fp8_ds_mla`` row and scale bytes.

    The four 128-channel chunks are pooled in a loop (one copy of the pooling code: the kernel is bound by its
    instruction fetch when unrolled); each chunk's BF16-rounded values go to this program's fp32 ``[512]``
    ``scratch_ptr`` row and into the running sums of squares of torch's three reduction orders
    (``add_chunk_squares``), then come back for the normalization."""
    cols = tl.arange(0, 128)
    sums = zero_square_sums()
    for k in range(4):
        x = bf16_round(pooled_chunk(a_ptr, z_ptr, AZ_STRIDE, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr,
                                    prev_gate_ptr, i, start, cu, slot, 512, k * 128))
        tl.store(scratch_ptr + k * 128 + cols, x)
        sums = add_chunk_squares(x, k, *sums)
    r = entry_rms_scale(*sums, num_emit, eps)
    tl.debug_barrier()  # the scratch row is read back below
    page, j, n_per_page = page_row(pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, b, i, 4)
    data = page + j * KV_DATA_BYTES
    scales = page + n_per_page * KV_DATA_BYTES + j * KV_SCALE_BYTES
    for k in range(3):
        y = bf16_round(tl.load(norm_ptr + k * 128 + cols) * (tl.load(scratch_ptr + k * 128 + cols) * r))
        store_fp8_blocks(y, data + k * 128, scales + 2 * k, 2)
    y3 = bf16_round(tl.load(norm_ptr + 384 + cols) * (tl.load(scratch_ptr + 384 + cols) * r))
    store_fp8_blocks(y3, data + 384, scales + 6, 1)  # block 7 holds the rope dims: scale byte 7 is the zero pad
    re, im, is_rope = rope_upper_pairs(y3, (i * 4).to(tl.float32), inv_freq_ptr)
    p = tl.arange(0, 64)
    rope = (data + KV_NOPE_DIM).to(tl.pointer_type(tl.bfloat16)) + 2 * (p - 32)[:, None] + tl.arange(0, 2)[None, :]
    tl.store(rope, tl.join(re, im).to(tl.bfloat16), mask=is_rope[:, None])


@triton.jit
def index_entry(
    a_ptr, z_ptr, AZ_STRIDE: tl.constexpr,
    ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr, norm_ptr, inv_freq_ptr,
    pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, eps, b, i, start, cu, slot,
):
    """Indexer key ``i`` of request ``b`` (128 channels) → Hadamard, MXFP4: its 64 packed bytes and 4 scale bytes."""
    x = bf16_round(pooled_chunk(a_ptr, z_ptr, AZ_STRIDE, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr,
                                prev_gate_ptr, i, start, cu, slot, 128, 0))
    y = rms_norm_128(x, norm_ptr, eps)
    re, im, _ = rope_upper_pairs(y, (i * 4).to(tl.float32), inv_freq_ptr)
    page, j, n_per_page = page_row(pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, b, i, 4)
    store_mxfp4_key(tl.reshape(tl.join(re, im), (128,)), page + j * 64, page + n_per_page * 64 + j * 4)


@triton.jit
def csa_entries_kernel(
    ma_ptr, mz_ptr, MAZ_STRIDE: tl.constexpr,
    mape_ptr, mtkv_ptr, mtg_ptr, mpkv_ptr, mpg_ptr, mnorm_ptr, mpages_ptr, mpage_bytes,
    xa_ptr, xz_ptr, XAZ_STRIDE: tl.constexpr,
    xape_ptr, xtkv_ptr, xtg_ptr, xpkv_ptr, xpg_ptr, xnorm_ptr, xpages_ptr, xpage_bytes,
    inv_freq_ptr, block_tables_ptr, bt_stride, block_size, start_ptr, cu_ptr, slots_ptr,
    emit_req_ptr, emit_entry_ptr, num_emit_ptr, n_entry, n_index, eps, scratch_ptr,
    kv_ptr, pos_ptr, kv_out_ptr, T, BT: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid >= n_entry + n_index:  # the step's window entries, BT tokens per program
        window_entries_block(kv_ptr, pos_ptr, inv_freq_ptr, kv_out_ptr, (pid - n_entry - n_index) * BT, T, BT)
    else:
        is_main = pid < n_entry
        e = tl.where(is_main, pid, pid - n_entry)
        b = tl.load(emit_req_ptr + e)
        if b >= 0:  # not padding
            i = tl.load(emit_entry_ptr + e)
            start = tl.load(start_ptr + b)
            cu = tl.load(cu_ptr + b).to(tl.int64)
            slot = tl.load(slots_ptr + b)
            if is_main:
                main_entry(ma_ptr, mz_ptr, MAZ_STRIDE, mape_ptr, mtkv_ptr, mtg_ptr, mpkv_ptr, mpg_ptr, mnorm_ptr,
                           inv_freq_ptr, mpages_ptr, mpage_bytes, block_tables_ptr, bt_stride, block_size, eps,
                           tl.load(num_emit_ptr), scratch_ptr + e.to(tl.int64) * 512, b, i, start, cu, slot)
            else:
                index_entry(xa_ptr, xz_ptr, XAZ_STRIDE, xape_ptr, xtkv_ptr, xtg_ptr, xpkv_ptr, xpg_ptr, xnorm_ptr,
                            inv_freq_ptr, xpages_ptr, xpage_bytes, block_tables_ptr, bt_stride, block_size, eps, b, i,
                            start, cu, slot)
