"""The attention queries from their projection in one launch (SPEC §3 step 2): per-head RMSNorm, then RoPE.

``q = RoPE(RMSNorm(q_proj))`` per head — the unweighted RMSNorm over the head's 512 dims in fp32, rounded to BF16,
then the last 64 dims rotated at the token's position in fp32 and rounded once more (``torch_ops.queries``, i.e.
``reference.primitives.rms_norm`` + ``reference.rope.apply_rope``). The torch backend runs that as about twenty
elementwise and reduction kernels, each a full pass over ``q``; here one program reads one token's block of heads
(``heads_per_program``) once, writes it once, and computes the token's rotation angles once for all of them.

Numerics: the same operations as the torch backend in the same precision (libdevice ``rsqrtf`` / ``cosf`` /
``sinf``, no FMA contraction), except the order of the 512-term sum of squares, which is Triton's tree instead of
torch's reduce kernel's: a query may differ from the torch backend's in the last BF16 bit where the two sums round
apart, and a rotated pair by as much at its norm (tests/kernels/project/test_queries.py: within one BF16 step on the
nope dims, two at the pair's norm on the rope dims, 99% of the elements equal).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..quant import bf16_pair_words, bf16_pairs, bf16_round, rsqrtf
from ..rope import rope_pairs

__all__ = ["queries"]

HEAD_DIM = 512
ROPE_DIM = 64


def heads_per_program(tokens: int, heads: int) -> int:
    """Heads each program normalizes and rotates (one token's): 16 where the step has many tokens (a prefill
    chunk: each token's 32 angles and their cosines and sines computed once for 16 heads, few programs per
    token), 4 for a decode step's few tokens (more programs to spread over the SMs)."""
    return min(triton.next_power_of_2(heads), 16 if tokens > 256 else 4)


@triton.jit
def _queries_kernel(q_ptr, stride_t, pos_ptr, inv_freq_ptr, out_ptr, H, eps, HEADS: tl.constexpr):
    """Token ``pid0``, heads ``pid1·HEADS …`` of ``q``.

    Args:
        q_ptr: bf16 ``[T, H, 512]``, the query projection: heads 512 apart, tokens ``stride_t`` apart (even: the
            rope dims are read as int32 words).
        pos_ptr: int64 ``[T]`` positions. inv_freq_ptr: fp32 ``[32]``.
        out_ptr: bf16 ``[T, H, 512]`` contiguous: the queries.
        H: heads per token; eps: the RMSNorm epsilon.
    """
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    ok = head < H
    src = t * stride_t + head.to(tl.int64) * 512  # each head's first element in q
    dst = (t * H + head) * 512
    # Every load first. The rope dims again as [HEADS, 32] int32 words, one (re, im) BF16 pair each
    # (quant.bf16_pairs): the pair stays in one thread for the rotation.
    pair = tl.arange(0, 32)
    words = 224 + pair[None, :]
    rope = tl.load(q_ptr.to(tl.pointer_type(tl.int32)) + src[:, None] // 2 + words, mask=ok[:, None], other=0)
    pos_f = tl.load(pos_ptr + t).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + pair)[None, :]
    blk = tl.arange(0, 8)
    col = tl.arange(0, 64)
    cols = blk[None, :, None] * 64 + col[None, None, :]
    x = tl.load(q_ptr + src[:, None, None] + cols, mask=ok[:, None, None], other=0.0).to(tl.float32)
    # RMSNorm: mean of squares (× 1/512: exact), rsqrt, scale, round to BF16 (torch: y.to(x.dtype))
    r = rsqrtf(tl.sum(tl.sum(x * x, axis=2), axis=1) * (1.0 / 512.0) + eps)
    y = bf16_round(x * r[:, None, None])
    tl.store(out_ptr + dst[:, None, None] + cols, y.to(tl.bfloat16), mask=ok[:, None, None] & (blk[None, :, None] < 7))
    re, im = bf16_pairs(rope)
    re2, im2 = rope_pairs(bf16_round(re * r[:, None]), bf16_round(im * r[:, None]), pos_f, inv_freq)
    tl.store(out_ptr.to(tl.pointer_type(tl.int32)) + dst[:, None] // 2 + words,
             bf16_pair_words(bf16_round(re2), bf16_round(im2)), mask=ok[:, None])


def queries(q: Tensor, positions: Tensor, inv_freq: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """The attention queries (one launch): per-head RMSNorm over the 512 dims, then RoPE on the last 64.

    Args:
        q: bf16 ``[T, H, 512]``, the query projection ``W_qb c^Q`` per head: channels contiguous, heads 512 apart,
            tokens any even number of elements apart (a column block of a wider GEMM output is read in place),
            4-byte aligned.
        positions: int64 ``[T]``. inv_freq: fp32 ``[32]`` contiguous. eps: the RMSNorm epsilon.
        out: optional bf16 ``[T, H, 512]`` contiguous output (may not alias ``q``).
    Returns:
        bf16 ``[T, H, 512]``, contiguous.
    Raises:
        ValueError: ``q`` not a bf16 ``[T, H, 512]`` of that layout, or ``out`` of another shape / dtype.
    """
    if q.dim() != 3 or q.shape[-1] != HEAD_DIM or q.dtype != torch.bfloat16 or not _fits(q):
        raise ValueError(f"queries takes a bf16 [T, H, {HEAD_DIM}] tensor, channels contiguous, heads {HEAD_DIM} "
                         f"apart, tokens an even number of elements apart, got {q.dtype} {list(q.shape)} (strides "
                         f"{tuple(q.stride())})")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {q.dtype} {list(q.shape)} tensor, got {out.dtype} "
                         f"{list(out.shape)}")
    T, H, _ = q.shape
    if T * H:
        heads = heads_per_program(T, H)
        _queries_kernel[(T, triton.cdiv(H, heads))](
            q, q.stride(0), positions, inv_freq, out, H, float(eps), HEADS=heads, num_warps=4 if heads <= 4 else 8,
            enable_fp_fusion=False,
        )
    return out


def _fits(q: Tensor) -> bool:
    """Whether the kernel reads ``q`` ``[T, H, 512]`` in place: channels contiguous, heads 512 apart, tokens an
    even number of elements apart, 4-byte aligned (the rope dims are read as int32 words)."""
    T, H, _ = q.shape
    return (q.stride(2) == 1 and (H <= 1 or q.stride(1) == HEAD_DIM) and (T <= 1 or q.stride(0) % 2 == 0)
            and q.data_ptr() % 4 == 0)
