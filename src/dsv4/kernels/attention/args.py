"""The arguments the four attention kernels share, built once per step on the host (``AttentionArgs``).

The Triton kernel and the three Gluon kernels take the same first 35 positional parameters (tensors, their
strides, the head count, the planned split and the softmax scale); ``AttentionArgs.positional`` lays them out in
that order, so a launcher writes ``kernel[grid](*args.positional(), …its own…)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..device import KV_DIM
from .plan import AttentionPlan

__all__ = ["AttentionArgs", "rows_are_words"]

LOG2E = 1.4426950408889634


def rows_are_words(q: Tensor, kv_new: Tensor) -> bool:
    """Whether every query row (``q`` ``[T, H, 512]``) and new-entry row (``kv_new`` ``[T, 512]``) starts 16-byte
    aligned, so the warp-specialized and pipelined kernels can read them as 16-byte words: strides in multiples of
    8 BF16 elements and base addresses multiples of 16."""
    return (q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0 and kv_new.stride(0) % 8 == 0
            and q.data_ptr() % 16 == 0 and kv_new.data_ptr() % 16 == 0)


@dataclass(frozen=True)
class AttentionArgs:
    """One step's attention arguments (the kernels' signature, in its order).

    Tensors: ``q`` ``[T, H, 512]`` bf16 queries; ``kv_new`` ``[T, 512]`` bf16 this step's window entries;
    ``ring`` uint8 ``[slots, ring_page_bytes]`` SWA ring pages and ``ring_positions`` int32 ``[slots, W]``;
    ``pages`` uint8 ``[num_blocks, page_bytes]`` compressed-entry pages (the ring when the layer has none: not
    read); ``block_tables`` int32 ``[B, max_blocks]``; ``entry_idx`` int ``[T, K]`` entry lists (mode ``"list"``;
    else ``positions``, not read); ``visible`` int64 ``[T]`` visible entries per token (mode ``"all"``; else
    ``positions``, not read); the ``StepBatch`` fields ``token_request`` / ``positions`` / ``cu_seqlens`` /
    ``start_pos`` / ``token_slots``; ``sink`` fp32 ``[H]``, ``inv_freq`` fp32 ``[32]``; outputs ``out``
    ``[T, H, 512]`` and ``lse`` fp32 ``[T, H]``; split partials ``partial_o`` fp32 ``[T, S, H, 512]`` and
    ``partial_lse`` fp32 ``[T, S, H]`` (``lse`` when the plan has no splits: not read).

    Scalars: ``heads``, ``num_compressed`` (list width / entries bound), ``chunks_per_split``, ``splits`` (the
    plan's) and ``qk_scale`` (softmax scale · log2 e).
    """

    q: Tensor
    kv_new: Tensor
    ring: Tensor
    ring_positions: Tensor
    pages: Tensor
    block_tables: Tensor
    entry_idx: Tensor
    visible: Tensor
    token_request: Tensor
    positions: Tensor
    cu_seqlens: Tensor
    start_pos: Tensor
    token_slots: Tensor
    sink: Tensor
    inv_freq: Tensor
    out: Tensor
    lse: Tensor
    partial_o: Tensor
    partial_lse: Tensor
    heads: int
    num_compressed: int
    chunks_per_split: int
    splits: int
    qk_scale: float

    @classmethod
    def build(cls, plan: AttentionPlan, q: Tensor, kv_new: Tensor, ring: Tensor, ring_positions: Tensor,
              pool: Tensor | None, block_tables: Tensor, token_request: Tensor, positions: Tensor,
              cu_seqlens: Tensor, start_pos: Tensor, token_slots: Tensor, sink: Tensor, inv_freq: Tensor,
              scale: float, entry_idx: Tensor | None, visible: Tensor | None, out: Tensor, lse: Tensor,
              workspace=None) -> AttentionArgs:
        """The arguments of ``plan`` over these tensors (``sparse_attention_fwd``'s); the split partials come from
        ``workspace`` (a ``dsv4.cache.Workspace``) or are allocated."""
        T, H = plan.tokens, plan.heads
        if plan.splits > 1:
            shapes = {"partial_o": (T, plan.splits, H, KV_DIM), "partial_lse": (T, plan.splits, H)}
            if workspace is not None:
                po, plse = (workspace.get(f"sparse_attention.{name}", shape, torch.float32)
                            for name, shape in shapes.items())
            else:
                po, plse = (torch.empty(shape, dtype=torch.float32, device=q.device) for shape in shapes.values())
        else:
            po = plse = lse
        return cls(
            q=q, kv_new=kv_new, ring=ring, ring_positions=ring_positions, pages=pool if pool is not None else ring,
            block_tables=block_tables, entry_idx=entry_idx if plan.mode == "list" else positions,
            visible=visible if plan.mode == "all" else positions, token_request=token_request, positions=positions,
            cu_seqlens=cu_seqlens, start_pos=start_pos, token_slots=token_slots, sink=sink, inv_freq=inv_freq,
            out=out, lse=lse, partial_o=po, partial_lse=plse, heads=H, num_compressed=plan.num_compressed,
            chunks_per_split=plan.chunks_per_split, splits=plan.splits, qk_scale=float(scale) * LOG2E)

    def positional(self) -> tuple:
        """The kernels' first 35 positional arguments, in their order."""
        def stride0(t: Tensor) -> int:  # a 2-D table's row stride; 0 for a 1-D stand-in
            return t.stride(0) if t.dim() == 2 else 0

        return (
            self.q, self.q.stride(0), self.q.stride(1),
            self.kv_new, self.kv_new.stride(0),
            self.ring, self.ring.stride(0),
            self.ring_positions, self.ring_positions.stride(0),
            self.pages, self.pages.stride(0),
            self.block_tables, stride0(self.block_tables),
            self.entry_idx, stride0(self.entry_idx),
            self.visible,
            self.token_request, self.positions, self.cu_seqlens, self.start_pos, self.token_slots,
            self.sink, self.inv_freq,
            self.out, self.out.stride(0), self.out.stride(1),
            self.lse, self.lse.stride(0),
            self.partial_o, self.partial_lse,
            self.heads, self.num_compressed, self.chunks_per_split, self.splits, self.qk_scale,
        )
