"""A layer's two FP8 projections of its input ``x`` — ``W_qa`` (the query latent) and ``W_kv`` (the window KV) —
stacked into one block-scaled FP8 matrix, so that one GEMM computes both (``ops.triton_write.input_projections``).

Both read the attention input ``x`` ``[T, d]``. Stacked as ``[W_qa; W_kv]`` they are one ``[q_lora_rank + D, d]``
``BlockFp8Weight`` (V4-Flash: 1,024 + 512 = 1,536 rows): the E4M3 values one after the other, and the 128 × 128 block
scales too — which needs ``q_lora_rank`` to be a multiple of 128, so that no scale block straddles the two. Each
output column of ``x Sᵀ`` is the same dot product either way: the stacked GEMM's columns are the separate
projections.

``stack_input_projections`` makes ``wq_a`` / ``wkv`` row views of the stack and records it (``dsv4.weight_stack``);
``Attention`` and the engine's weights do this once, with the compressors' stack. ``input_stack`` returns it while
the weights still hold those views.
"""

from __future__ import annotations

import torch

from .formats.block_fp8 import WEIGHT_BLOCK, BlockFp8Weight
from .weight_stack import current_stack, record_stack, replace_keeping_stacks, stacked_rows
from .weights import AttentionWeights

__all__ = ["input_stack", "stack_input_projections"]

#: the instance attribute of ``AttentionWeights`` recording its stack (``weight_stack``)
_ATTR = "_input_stack"


def _stackable(w: AttentionWeights) -> bool:
    a, b = w.wq_a, w.wkv
    return (isinstance(a, BlockFp8Weight) and isinstance(b, BlockFp8Weight) and a.shape[1] == b.shape[1]
            and a.shape[0] % WEIGHT_BLOCK == 0 and a.device == b.device)


def stack_input_projections(w: AttentionWeights) -> AttentionWeights:
    """A copy of ``w`` (the same tensors) whose ``wq_a`` and ``wkv`` are row views of one ``BlockFp8Weight``
    ``[q_lora_rank + D, d]``, recorded for ``input_stack``. The stack is the weights' own memory when they already
    lie stacked (as after an earlier call), else one copy of them. Weights that cannot be stacked — not block-scaled
    FP8 (the exact numerics), or a ``q_lora_rank`` that is not a multiple of 128 — come back unchanged."""
    if not _stackable(w):
        return w
    a, b = w.wq_a, w.wkv
    data = stacked_rows([a.data, b.data])
    scale = stacked_rows([a.scale, b.scale])
    if data is None or scale is None:
        data, scale = torch.cat([a.data, b.data]), torch.cat([a.scale, b.scale])
    stack = BlockFp8Weight(data, scale)
    n, s = a.shape[0], a.shape[0] // WEIGHT_BLOCK
    views = (BlockFp8Weight(data[:n], scale[:s]), BlockFp8Weight(data[n:], scale[s:]))
    out = replace_keeping_stacks(w, wq_a=views[0], wkv=views[1])  # the compressors' stack, if any, stays
    record_stack(out, _ATTR, stack, views)
    return out


def input_stack(w: AttentionWeights) -> BlockFp8Weight | None:
    """The stacked ``[W_qa; W_kv]`` of ``w`` (made by ``stack_input_projections``), or ``None`` when ``w`` has none
    or its ``wq_a`` / ``wkv`` are no longer the stack's views."""
    return current_stack(w, _ATTR, [w.wq_a, w.wkv])
