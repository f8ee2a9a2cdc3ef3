"""A long CSA step's writes except the state updates, one warp per program: every emitted entry (pool, RMSNorm,
RoPE, quantize, write; main entries and indexer keys) and the step's window entries.

``compressor.write_before_attention`` launches this kernel whenever a request of a CSA step can emit more entries
than its lead program takes (a prefill chunk: an 8K chunk emits 2,048 main entries and 2,048 indexer keys), then
its own launch with the lead programs' state updates only (previous-window rotation, open-window tails) — after
this one, which reads the old tails and state for each request's first two entries. Decode steps never emit that
many, so they keep their single fused launch.

Why its own launch (H100, V4-Flash CSA 8K chunk, 113.5 → 75.8 µs): in the fused kernel every role shares the
register allocation of the heaviest one (255 per thread at 2 warps: 4 programs per SM), an entry's RMSNorm went
through a shared-memory scratch row with barriers, and a request's two lead entries ran serially in its lead
program (20 µs for an 8K chunk). Here a program is one warp and holds its entry in the arrangement torch's RMSNorm
reduction reads (``add_chunk_squares``): thread l holds channels ``128k + 4l + q`` (k = 0…3, q = 0…3), so every partial
sum of squares is a register sum of the thread's own values followed by one 32-lane shuffle tree. The 512
channels are pooled as four 128-channel chunks in a loop (every channel pools on its own, so the bits are those of
the whole entry; one copy of the pooling code — unrolled, the kernel waited on instruction fetch); the FP8 blocks
(64 channels) are halves of a chunk, the RoPE pairs the upper half of the last one. Entries past a request's first
two pool from the step's rows (``pool_in_step``), the first two through the general slot sources
(``pool_entry``: tail, previous-window state). The bytes equal the fused kernel's and the torch backend's.

Grid, in this order: ``E_cap`` main-entry programs (``E_cap`` = ``emit_capacity[4]``, the padded emit list;
padding exits at once), ``E_cap`` indexer-key programs (with the indexer's compressor), ``⌈T/4⌉`` window-entry
programs of 4 tokens. Roles in blocks, not interleaved: interleaving measured 77 → 86 µs on an H100 (three code
paths competing for the instruction cache).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .compressor import (
    DATA_BYTES,
    CompressorArgs,
    page_row,
    pool_entry,
    pool_in_step,
    store_fp8_blocks,
    store_mxfp4_key,
)
from .quant import (
    bf16_round,
    rsqrtf,
    seq_sum4_last,
    shuffle_down_sum,
)
from .swa_write import rope_pairs, window_entries_block

__all__ = ["write_csa_entries"]

#: Tokens per window-entry program (one warp).
WINDOW_BT = 4


@triton.jit
def zero_square_sums():
    """The running sums of ``add_chunk_squares`` before the first chunk."""
    return (tl.zeros([32, 4], tl.float32), tl.zeros([32, 4], tl.float32), tl.zeros([32, 4], tl.float32),
            tl.zeros([32], tl.float32), tl.zeros([32], tl.float32))


@triton.jit
def add_chunk_squares(x, k, acc32, acc64_even, acc64_odd, p128_even, p128_odd):
    """Chunk ``k`` (0…3) of a 512-channel entry into the running sums of squares of torch's RMSNorm block reduction
    (see ``compressor.rms_norm_bf16``); returns the updated sums.

    ``x`` fp32 ``[128]``: channels ``128k … 128k+127`` (BF16 values); thread l of the warp holds ``128k + 4l + q``,
    i.e. the float4 vectors ``l + 32k`` torch's threads read. With ``BW`` threads per row thread t sums its vectors
    ``t, t + BW, …`` per vector lane, adds the four lanes in order, then the block halves its partials down to 32
    (offsets BW/2 … 32). So per lane l: BW = 32: ``seq4(((v0 + v1) + v2) + v3)`` (``acc32``); BW = 64:
    ``seq4(v0 + v2) + seq4(v1 + v3)`` (``acc64_*``); BW = 128: ``(P0 + P2) + (P1 + P3)`` with ``Pk = seq4(vk)``
    (``p128_*``) — all sums of this thread's own values, accumulated chunk by chunk in those orders (a leading
    ``0 +`` is exact: squares are ≥ +0).
    """
    v = tl.reshape(x * x, (32, 4))
    odd = (k % 2) == 1
    pk = seq_sum4_last(v)
    return (acc32 + v, tl.where(odd, acc64_even, acc64_even + v), tl.where(odd, acc64_odd + v, acc64_odd),
            tl.where(odd, p128_even, p128_even + pk), tl.where(odd, p128_odd + pk, p128_odd))


@triton.jit
def entry_rms_scale(acc32, acc64_even, acc64_odd, p128_even, p128_odd, num_emit, eps):
    """``rsqrt(mean(x²) + eps)`` of a 512-channel entry from ``add_chunk_squares``' sums: ``Σ x²`` in the order
    torch uses for a step emitting ``num_emit`` entries (BW = 32 threads per row from 16 entries, 64 from 8, else
    128: chosen on the device), finished by the warp's shuffle-down tree. ``[1]`` fp32."""
    bw32 = seq_sum4_last(acc32)
    bw64 = seq_sum4_last(acc64_even) + seq_sum4_last(acc64_odd)
    bw128 = p128_even + p128_odd
    part = tl.where(num_emit >= 16, bw32, tl.where(num_emit >= 8, bw64, bw128))
    return rsqrtf(shuffle_down_sum(part, 32, 5) * (1.0 / 512) + eps)


@triton.jit
def sum_sq_128(x):
    """``Σ x²`` over a 128-channel indexer key ``x`` fp32 ``[128]`` (thread l: channels ``4l + q``) in the order of
    torch's reduction: 32 threads per row, one float4 vector each, then the shuffle-down tree. ``[1]`` fp32."""
    return shuffle_down_sum(seq_sum4_last(tl.reshape(x * x, (32, 4))), 32, 5)


@triton.jit
def rms_norm_128(x, norm_ptr, eps):
    """``reference.rms_norm`` of a 128-channel indexer key ``x`` (BF16-valued fp32 ``[128]``): BF16-valued fp32."""
    return bf16_round(tl.load(norm_ptr + tl.arange(0, 128)) * (x * rsqrtf(sum_sq_128(x) * (1.0 / 128) + eps)))


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
    a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr, i, start, cu, slot,
    C: tl.constexpr, c0,
):
    """Channels ``c0 … c0+127`` of CSA entry ``i`` (of ``C``) pooled: fp32 ``[128]``. Entries past the request's
    first two pool from the step's rows only (``pool_in_step``); the first two may read the tail and the
    previous-window state (``pool_entry``, one thread per channel — the lead program's path in the fused launch,
    here before the state launch overwrites them)."""
    if i >= start // 4 + 2:
        x = pool_in_step(a_ptr, z_ptr, ape_ptr, i, start, cu, C, 4, c0, 128)
    else:
        x = pool_entry(a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr, i, start, cu,
                       slot, C, 4, True, 0, c0, 128)
    return x


@triton.jit
def main_entry(
    a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr, norm_ptr, inv_freq_ptr, pages_ptr,
    page_bytes, block_tables_ptr, bt_stride, block_size, eps, num_emit, scratch_ptr, b, i, start, cu, slot,
):
    """Main entry ``i`` of request ``b`` (512 channels) → its 584-B ``fp8_ds_mla`` row and scale bytes.

    The four 128-channel chunks are pooled in a loop (one copy of the pooling code: the kernel is bound by its
    instruction fetch when unrolled); each chunk's BF16-rounded values go to this program's fp32 ``[512]``
    ``scratch_ptr`` row and into the running sums of squares of torch's three reduction orders
    (``add_chunk_squares``), then come back for the normalization."""
    cols = tl.arange(0, 128)
    sums = zero_square_sums()
    for k in range(4):
        x = bf16_round(pooled_chunk(a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr,
                                    i, start, cu, slot, 512, k * 128))
        tl.store(scratch_ptr + k * 128 + cols, x)
        sums = add_chunk_squares(x, k, *sums)
    r = entry_rms_scale(*sums, num_emit, eps)
    tl.debug_barrier()  # the scratch row is read back below
    page, j, n_per_page = page_row(pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, b, i, 4)
    data = page + j * DATA_BYTES
    scales = page + n_per_page * DATA_BYTES + j * 8
    for k in range(3):
        y = bf16_round(tl.load(norm_ptr + k * 128 + cols) * (tl.load(scratch_ptr + k * 128 + cols) * r))
        store_fp8_blocks(y, data + k * 128, scales + 2 * k, 2)
    y3 = bf16_round(tl.load(norm_ptr + 384 + cols) * (tl.load(scratch_ptr + 384 + cols) * r))
    store_fp8_blocks(y3, data + 384, scales + 6, 1)  # block 7 holds the rope dims: scale byte 7 is the zero pad
    re, im, is_rope = rope_upper_pairs(y3, (i * 4).to(tl.float32), inv_freq_ptr)
    p = tl.arange(0, 64)
    rope = (data + 448).to(tl.pointer_type(tl.bfloat16)) + 2 * (p - 32)[:, None] + tl.arange(0, 2)[None, :]
    tl.store(rope, tl.join(re, im).to(tl.bfloat16), mask=is_rope[:, None])


@triton.jit
def index_entry(
    a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr, norm_ptr, inv_freq_ptr, pages_ptr,
    page_bytes, block_tables_ptr, bt_stride, block_size, eps, b, i, start, cu, slot,
):
    """Indexer key ``i`` of request ``b`` (128 channels) → Hadamard, MXFP4: its 64 packed bytes and 4 scale bytes."""
    x = bf16_round(pooled_chunk(a_ptr, z_ptr, ape_ptr, tail_kv_ptr, tail_gate_ptr, prev_kv_ptr, prev_gate_ptr,
                                i, start, cu, slot, 128, 0))
    y = rms_norm_128(x, norm_ptr, eps)
    re, im, _ = rope_upper_pairs(y, (i * 4).to(tl.float32), inv_freq_ptr)
    page, j, n_per_page = page_row(pages_ptr, page_bytes, block_tables_ptr, bt_stride, block_size, b, i, 4)
    store_mxfp4_key(tl.reshape(tl.join(re, im), (128,)), page + j * 64, page + n_per_page * 64 + j * 4)


@triton.jit
def _csa_entries_kernel(
    ma_ptr, mz_ptr, mape_ptr, mtkv_ptr, mtg_ptr, mpkv_ptr, mpg_ptr, mnorm_ptr, mpages_ptr, mpage_bytes,
    xa_ptr, xz_ptr, xape_ptr, xtkv_ptr, xtg_ptr, xpkv_ptr, xpg_ptr, xnorm_ptr, xpages_ptr, xpage_bytes,
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
                main_entry(ma_ptr, mz_ptr, mape_ptr, mtkv_ptr, mtg_ptr, mpkv_ptr, mpg_ptr, mnorm_ptr, inv_freq_ptr,
                           mpages_ptr, mpage_bytes, block_tables_ptr, bt_stride, block_size, eps,
                           tl.load(num_emit_ptr), scratch_ptr + e.to(tl.int64) * 512, b, i, start, cu, slot)
            else:
                index_entry(xa_ptr, xz_ptr, xape_ptr, xtkv_ptr, xtg_ptr, xpkv_ptr, xpg_ptr, xnorm_ptr, inv_freq_ptr,
                            xpages_ptr, xpage_bytes, block_tables_ptr, bt_stride, block_size, eps, b, i, start, cu,
                            slot)


def write_csa_entries(
    kv: Tensor, positions: Tensor, inv_freq: Tensor, kv_out: Tensor, batch, eps: float, main: CompressorArgs,
    index: CompressorArgs | None, n_entry: int, scratch: Tensor,
) -> None:
    """One launch: every CSA entry (m = 4) the step emits, main and (``index`` given) indexer, and the step's window
    entries. Launch it before ``write_before_attention``'s state updates (it reads the old tails and state).

    Args:
        kv: bf16 ``[T, 512]`` ``RMSNorm(W_kv x)``; positions: int64 ``[T]``; inv_freq: fp32 ``[32]`` RoPE inverse
            frequencies; kv_out: bf16 ``[T, 512]``, receives the window entries as stored.
        batch: the ``StepBatch`` (its fixed-shape device tensors only). eps: RMSNorm epsilon.
        main / index: the compressors' tensors (``main.norm`` ``[512]``, ``index.norm`` ``[128]``).
        n_entry: ``emit_capacity[4]`` (the padded emit list's length).
        scratch: fp32 ``[≥ n_entry, 512]``, contents undefined: a row per main entry.
    """
    T = kv.shape[0]
    n_index = n_entry if index is not None else 0
    x = index if index is not None else main
    grid = (n_entry + n_index + triton.cdiv(T, WINDOW_BT),)
    _csa_entries_kernel[grid](
        main.a, main.z_raw, main.ape, main.tail_kv, main.tail_gate, main.prev_kv, main.prev_gate, main.norm,
        main.pages, main.pages.shape[1],
        x.a, x.z_raw, x.ape, x.tail_kv, x.tail_gate, x.prev_kv, x.prev_gate, x.norm, x.pages, x.pages.shape[1],
        inv_freq, batch.block_tables, batch.block_tables.stride(0), batch.block_size, batch.start_pos,
        batch.cu_seqlens, batch.slots, batch.emit_pad_request[4], batch.emit_pad_entry[4], batch.num_emit_device[4], n_entry,
        n_index, eps, scratch, kv, positions, kv_out, T, BT=WINDOW_BT,
        num_warps=1, enable_fp_fusion=False,
    )
