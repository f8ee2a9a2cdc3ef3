"""A layer's two FP8 projections of its input ``x`` — ``W_qa`` (the query latent) and ``W_kv`` (the window KV) —
stacked into one block-scaled FP8 matrix, so that one GEMM computes both (``ops.triton_write.input_projections``).

Both read the attention input ``x`` ``[T, d]``. Stacked as ``[W_qa; W_kv]`` they are one ``[q_lora_rank + D, d]``
``BlockFp8Weight`` (V4-Flash: 1,024 + 512 = 1,536 rows): the E4M3 values one after the other, and the 128 × 128 block
scales too — which needs ``q_lora_rank`` to be a multiple of 128, so that no scale block straddles the two. Each
output column of ``x Sᵀ`` is the same dot product either way: the stacked GEMM's columns are the separate
projections.

``stack_input_projections`` makes ``wq_a`` / ``wkv`` row views of the stack and records it (``dsv4.weight_stack``);
``Attention`` and the engine's weights do this once, with the other stacks (``dsv4.layer_stacks``). ``input_stack``
returns it while the weights still hold those views.
"""

from __future__ import annotations

from .formats.block_fp8 import BlockFp8Weight
from .weight_stack import current_stack, record_stack, replace_keeping_stacks, stack_fp8_rows
from .weights import AttentionWeights

__all__ = ["input_stack", "stack_input_projections"]

#: the instance attribute of ``AttentionWeights`` recording its stack (``weight_stack``)
_ATTR = "_input_stack"


def stack_input_projections(w: AttentionWeights) -> AttentionWeights:
    """A copy of ``w`` (the same tensors) whose ``wq_a`` and ``wkv`` are row views of one ``BlockFp8Weight``
    ``[q_lora_rank + D, d]``, recorded for ``input_stack``. The stack is the weights' own memory when they already
    lie stacked (as after an earlier call), else one copy of them. Weights that cannot be stacked — not block-scaled
    FP8 (the exact numerics), or a ``q_lora_rank`` that is not a multiple of 128 — come back unchanged."""
    made = stack_fp8_rows([w.wq_a, w.wkv])
    if made is None:
        return w
    stack, views = made
    out = replace_keeping_stacks(w, wq_a=views[0], wkv=views[1])  # the other stacks, if any, stay
    record_stack(out, _ATTR, stack, views)
    return out


def input_stack(w: AttentionWeights) -> BlockFp8Weight | None:
    """The stacked ``[W_qa; W_kv]`` of ``w`` (made by ``stack_input_projections``), or ``None`` when ``w`` has none
    or its ``wq_a`` / ``wkv`` are no longer the stack's views."""
    return current_stack(w, _ATTR, [w.wq_a, w.wkv])
