"""Sliding-window writes (SPEC §3 step 3, §7.2): the step's window entries and the SWA ring commit.

Two pieces, both bit-exact with the torch backend (the torch backend's ``window_entries`` / ``append_swa``):

* ``window_entries_block`` (device function, also launched alone by ``window_entries``): for a block of
  ``BT`` tokens, RoPE on the last 64 dims at each token's position (fp32, rounded once to BF16), then the
  official FP8 quantize→dequantize of the 448 nope dims (block 64, power-of-two scales). Writes the entries
  *as stored* (BF16 ``[T, 512]``), which the attention of the same step reads. The compressor's fused launch
  (``write.compressor``) calls the same device function for its window programs.
* ``append_swa`` (its own launch, after attention): encodes each kept token's entry into the 584-B
  ``fp8_ds_mla`` format and writes it, with its position, into ring slot ``p mod window`` of the request's ring
  page. Encoding the stored values again is what the torch backend does (``storage.write(kv_new)``); it equals
  the first encoding except where a block's re-quantization picks a smaller scale, so it is done the same way.

Ring page layout (one page per state slot, ``window`` entries): ``[window × 576 data | window × 8 scales | pad]``;
entry j's data at ``j·576`` (448 E4M3 codes, 64 BF16 rope values), its scales at ``window·576 + j·8`` (7 UE8M0
bytes + a zero pad byte).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ..constants import KV_DATA_BYTES, KV_DIM, KV_NOPE_DIM, KV_SCALE_BYTES
from ..quant import bf16_pair_words, bf16_round, bf16_pairs, fp8_block_qdq
from ..rope import rope_pairs

__all__ = ["append_swa", "window_entries", "window_entries_block"]

#: tokens per program of the window-entry and ring-commit launches (one warp-group each)
TOKENS_PER_PROGRAM = 4


@triton.jit
def window_entries_block(kv_ptr, pos_ptr, inv_freq_ptr, out_ptr, t0, T, BT: tl.constexpr):
    """Window entries of tokens ``t0 … t0+BT−1`` (masked to ``< T``).

    Args:
        kv_ptr: bf16 ``[T, 512]`` contiguous, ``RMSNorm(W_kv x)`` of the step's tokens.
        pos_ptr: int64 ``[T]`` positions. inv_freq_ptr: fp32 ``[32]``.
        out_ptr: bf16 ``[T, 512]`` contiguous: RoPE'd, FP8-rounded entries (values exactly as stored).
    """
    tok = t0 + tl.arange(0, BT)
    tmask = tok < T
    tok64 = tok.to(tl.int64)
    # Every load first (one memory round trip per program). The rope dims as [BT, 32] int32 words, one (re, im)
    # BF16 pair each (quant.bf16_pairs).
    pair = tl.arange(0, 32)
    rwords = tok64[:, None] * 256 + 224 + pair[None, :]
    rmask = tmask[:, None]
    rope = tl.load(kv_ptr.to(tl.pointer_type(tl.int32)) + rwords, mask=rmask, other=0)
    pos_f = tl.load(pos_ptr + tok64, mask=tmask, other=0).to(tl.float32)[:, None]
    inv_freq = tl.load(inv_freq_ptr + pair)[None, :]
    # nope dims as [BT, 8 blocks, 64] (block 7 holds the rope dims here and is ignored)
    blk = tl.arange(0, 8)
    col = tl.arange(0, 64)
    offs = tok64[:, None, None] * KV_DIM + blk[None, :, None] * 64 + col[None, None, :]
    nmask = tmask[:, None, None] & (blk[None, :, None] < 7)
    nope = tl.load(kv_ptr + offs, mask=nmask, other=0.0).to(tl.float32)
    _, val, _ = fp8_block_qdq(nope, 2)
    tl.store(out_ptr + offs, val.to(tl.bfloat16), mask=nmask)
    re, im = bf16_pairs(rope)
    re2, im2 = rope_pairs(re, im, pos_f, inv_freq)
    tl.store(out_ptr.to(tl.pointer_type(tl.int32)) + rwords, bf16_pair_words(bf16_round(re2), bf16_round(im2)),
             mask=rmask)


@triton.jit
def _window_entries_kernel(kv_ptr, pos_ptr, inv_freq_ptr, out_ptr, T, BT: tl.constexpr):
    window_entries_block(kv_ptr, pos_ptr, inv_freq_ptr, out_ptr, tl.program_id(0) * BT, T, BT)


@triton.jit
def encode_kv_entries_store(
    vals_ptr, rows, rmask, page_ptr, data_off, scale_off,
    BT: tl.constexpr,
):
    """Encode BF16 entries ``vals[rows]`` (``[BT]`` int64 rows of a bf16 ``[*, 512]`` tensor) into the 584-B format
    and store them: data (448 codes + 128 rope bytes) at ``page_ptr + data_off`` and the 8 scale bytes at
    ``page_ptr + scale_off`` (both int64 ``[BT]`` byte offsets). ``rmask`` bool ``[BT]`` selects the rows written.
    """
    blk = tl.arange(0, 8)
    col = tl.arange(0, 64)
    offs = rows[:, None, None] * KV_DIM + blk[None, :, None] * 64 + col[None, None, :]
    nmask = rmask[:, None, None] & (blk[None, :, None] < 7)
    nope = tl.load(vals_ptr + offs, mask=nmask, other=0.0).to(tl.float32)
    code, _, ebyte = fp8_block_qdq(nope, 2)
    dst = data_off[:, None, None] + blk[None, :, None] * 64 + col[None, None, :]
    tl.store(page_ptr + dst, code.to(tl.uint8), mask=nmask)
    # rope: the 64 BF16 values copied bit for bit (two bytes each, little endian)
    r = tl.arange(0, 64)
    rope = tl.load(vals_ptr + rows[:, None] * KV_DIM + KV_NOPE_DIM + r[None, :], mask=rmask[:, None], other=0.0)
    rdst = (page_ptr + data_off[:, None] + KV_NOPE_DIM + 2 * r[None, :]).to(tl.pointer_type(tl.bfloat16))
    tl.store(rdst, rope, mask=rmask[:, None])
    # scales: 7 UE8M0 bytes and a zero pad byte
    sbyte = tl.where(blk[None, :] < 7, ebyte, 0)
    tl.store(page_ptr + scale_off[:, None] + blk[None, :], sbyte.to(tl.uint8), mask=rmask[:, None])


@triton.jit
def _append_swa_kernel(
    kvn_ptr, ring_ptr, ring_pos_ptr, token_slots_ptr, ring_slots_ptr, rows_ptr, pos_ptr,
    K, ring_page_bytes, WINDOW: tl.constexpr, BT: tl.constexpr,
):
    k = tl.program_id(0) * BT + tl.arange(0, BT)
    m = k < K
    tok64 = tl.load(rows_ptr + k, mask=m, other=0)
    slot = tl.load(token_slots_ptr + tok64, mask=m, other=0)
    j = tl.load(ring_slots_ptr + tok64, mask=m, other=0)
    page = slot * ring_page_bytes
    encode_kv_entries_store(
        kvn_ptr, tok64, m, ring_ptr, page + j * KV_DATA_BYTES, page + WINDOW * KV_DATA_BYTES + j * KV_SCALE_BYTES, BT,
    )
    pos = tl.load(pos_ptr + tok64, mask=m, other=0)
    tl.store(ring_pos_ptr + slot * WINDOW + j, pos.to(tl.int32), mask=m)


def window_entries(kv: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
    """The step's window entries as stored (one launch).

    Args:
        kv: bf16 ``[T, 512]`` (made contiguous), ``RMSNorm(W_kv x)``.
        positions: int64 ``[T]``. inv_freq: fp32 ``[32]``.
    Returns:
        bf16 ``[T, 512]``.
    """
    kv = kv.contiguous()
    out = kv.new_empty(kv.shape)
    T = kv.shape[0]
    if T:
        _window_entries_kernel[(triton.cdiv(T, TOKENS_PER_PROGRAM),)](
            kv, positions, inv_freq, out, T, BT=TOKENS_PER_PROGRAM, num_warps=4, enable_fp_fusion=False
        )
    return out


def append_swa(
    kv_new: Tensor, ring: Tensor, ring_positions: Tensor, token_slots: Tensor, ring_slots: Tensor,
    ring_rows: Tensor, positions: Tensor, window: int,
) -> None:
    """Commit the kept tokens' entries into their rings (one launch over the kept tokens only).

    Args:
        kv_new: bf16 ``[T, 512]`` contiguous, the entries as stored (``window_entries``' output).
        ring: uint8 ``[R, ring_page_bytes]``; ring_positions: int32 ``[R, window]`` (both written in place).
        token_slots, ring_slots: int64 ``[T]``; positions: int64 ``[T]``.
        ring_rows: int64 ``[K]``, the tokens to write (``StepBatch.ring_rows``: each request's last ``window``
            tokens of the step, so no two write the same ring slot).
    """
    K = ring_rows.shape[0]
    if K == 0:
        return
    _append_swa_kernel[(triton.cdiv(K, TOKENS_PER_PROGRAM),)](
        kv_new, ring, ring_positions, token_slots, ring_slots, ring_rows,
        positions, K, ring.shape[1], WINDOW=window, BT=TOKENS_PER_PROGRAM, num_warps=4, enable_fp_fusion=False,
    )
