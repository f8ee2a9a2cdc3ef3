"""Merging a token's split partials (``_combine_kernel``): one launch after a split step's attention grid.

A step splits each token's key chunks over several programs when its tokens alone would leave most of the GPU idle
(decode of few requests); each split writes an FP32 partial — its output ``o_s`` normalised by its own sum, and
its log-sum-exp ``lse_s`` (base 2) — and this kernel merges them with the sink:
``o = Σ_s 2^{lse_s − M} o_s / (Σ_s 2^{lse_s − M} + 2^{sink − M})``, ``M`` the largest of the ``lse_s`` and the sink,
then the inverse RoPE of the rope dims, as the unsplit kernels store. (The serial Gluon kernel can instead merge in
clusters: ``sm90_output._cluster_combine``.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..device import interpreting
from .args import AttentionArgs
from .plan import AttentionPlan
from .triton_kernel import NOPE_DIM, _store_rope

__all__ = ["launch"]


@triton.jit
def _split_block(po_ptr, plse_ptr, t, s0, num_splits, H, heads, head_ok, BLOCK_S: tl.constexpr):
    """Splits ``s0 … s0 + BLOCK_S − 1`` of token ``t``'s partials for ``heads`` in one load each: their log-sum-exps
    fp32 ``[BLOCK_S, BLOCK_H]`` (−inf where absent), nope rows ``[BLOCK_S, BLOCK_H, 512]`` (dims 448… and absent rows
    zero) and rope rows ``[BLOCK_S, BLOCK_H, 64]``."""
    split = tl.arange(0, BLOCK_S)
    rows = (t * num_splits + s0 + split[:, None]) * H + heads[None, :]
    ok = (s0 + split[:, None] < num_splits) & head_ok[None, :]
    d = tl.arange(0, 512)
    plse = tl.load(plse_ptr + rows, mask=ok, other=float("-inf"))
    part = po_ptr + rows[:, :, None] * 512
    po_nope = tl.load(part + d[None, None, :], mask=ok[:, :, None] & (d < NOPE_DIM)[None, None, :], other=0.0)
    po_rope = tl.load(part + NOPE_DIM + tl.arange(0, 64)[None, None, :], mask=ok[:, :, None], other=0.0)
    return plse, po_nope, po_rope


@triton.jit
def _combine_kernel(
    po_ptr, plse_ptr,  # fp32 [T, S, H, 512], [T, S, H]
    positions_ptr, sink_ptr, inv_freq_ptr,
    o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt,
    H, num_splits,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Merge the splits of one token and head block (grid ``(ceil(H / BLOCK_H), T)``):
    ``o = Σ_s 2^{lse_s − M} o_s / (Σ_s 2^{lse_s − M} + 2^{sink − M})`` with ``M`` the largest of the ``lse_s`` and
    the sink, then the inverse RoPE.

    The partials are read ``BLOCK_S`` splits at a time, each block's partial rows and log-sum-exps in one load
    (``[BLOCK_S, BLOCK_H, 512]``): one straight-line pass when every split fits one load (decode), else blocks
    merged with a running max (the sums so far rescaled when it grows). The sink, position and RoPE frequencies
    (not written by the attention grid) are requested first: a decode step's combine is a chain of dependent memory
    round trips.
    """
    hb = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < H
    d = tl.arange(0, 512)
    r = tl.arange(0, 64)
    sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0) * 1.4426950408889634
    pos = tl.load(positions_ptr + t)
    inv_freq = tl.load(inv_freq_ptr + tl.arange(0, 32))
    # Straight-line for decode: the loop form takes more registers (fewer programs per multiprocessor).
    if num_splits <= BLOCK_S:
        plse, po_nope, po_rope = _split_block(po_ptr, plse_ptr, t, 0, num_splits, H, heads, head_ok, BLOCK_S)
        m = tl.max(plse, 0)
        w = tl.exp2(plse - tl.where(m == float("-inf"), 0.0, m)[None, :])  # 0 where absent
        nope = tl.sum(w[:, :, None] * po_nope, 0)  # dims 448… unused
        rope = tl.sum(w[:, :, None] * po_rope, 0)
        weight = tl.sum(w, 0)
    else:  # blocks of splits merged with a running max (the sums so far rescaled when it grows)
        m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        nope = tl.zeros((BLOCK_H, 512), tl.float32)
        rope = tl.zeros((BLOCK_H, 64), tl.float32)
        weight = tl.zeros((BLOCK_H,), tl.float32)
        for s0 in range(0, num_splits, BLOCK_S):
            plse, po_nope, po_rope = _split_block(po_ptr, plse_ptr, t, s0, num_splits, H, heads, head_ok, BLOCK_S)
            m_new = tl.maximum(m, tl.max(plse, 0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # 0 while no split has a key
            grown = tl.exp2(m - m_use)  # rescales the sums so far: ≤ 1, and 0 before the first key
            w = tl.exp2(plse - m_use[None, :])
            nope = nope * grown[:, None] + tl.sum(w[:, :, None] * po_nope, 0)
            rope = rope * grown[:, None] + tl.sum(w[:, :, None] * po_rope, 0)
            weight = weight * grown + tl.sum(w, 0)
            m = m_new
    # The sink joins the max (the sums are relative to m): neither 2^(sink − M) nor the rescale 2^(m − M) can
    # overflow, and the denominator is at least 1, however far every key's score lies below the sink. (The reference
    # kernel's max takes the real keys only, SPEC §3 step 5, as the unsplit kernels do: the same o and lse wherever
    # its 2^(sink − max) is finite; where that overflows, the reference gives lse = +inf (o = 0), this merge a finite
    # lse.)
    top = tl.maximum(m, sink)
    kept = tl.exp2(m - top)  # 1 where m ≥ sink; 0 where no split has a key
    denom = weight * kept + tl.exp2(sink - top)
    tl.store(lse_ptr + t * stride_lt + heads, (top + tl.log2(denom)) * 0.6931471805599453, mask=head_ok)
    scaled = denom / kept  # denom itself where m ≥ sink (exactly: kept is 1); inf where kept is 0
    out = o_ptr + t * stride_ot + heads[:, None] * stride_oh
    tl.store(out + d[None, :], (nope / scaled[:, None]).to(o_ptr.dtype.element_ty),
             mask=head_ok[:, None] & (d[None, :] < NOPE_DIM))
    _store_rope(rope / scaled[:, None], pos, inv_freq, out + NOPE_DIM + r[None, :], head_ok[:, None], INTERPRET)


def launch(plan: AttentionPlan, args: AttentionArgs) -> None:
    """Merge the partials of a step planned with ``merge="combine_kernel"`` (``args.partial_o`` / ``partial_lse``)
    into ``args.out`` / ``args.lse``: grid ``(ceil(heads / BLOCK_H), tokens)``."""
    block_s, block_h = plan.combine_blocks
    _combine_kernel[(triton.cdiv(plan.heads, block_h), plan.tokens)](
        args.partial_o, args.partial_lse, args.positions, args.sink, args.inv_freq,
        args.out, args.out.stride(0), args.out.stride(1), args.lse, args.lse.stride(0),
        plan.heads, plan.splits,
        BLOCK_H=block_h, BLOCK_S=block_s, INTERPRET=interpreting(), num_warps=4,
    )
