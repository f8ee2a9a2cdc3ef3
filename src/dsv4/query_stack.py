"""A CSA layer's two FP8 projections of its query latent — ``W_qb`` (the attention queries) and the lightning
indexer's ``W_Iq`` — stacked into one block-scaled FP8 matrix, so that one GEMM computes both
(``ops.triton_write.queries``).

Both read ``c^Q`` ``[T, q_lora_rank]`` (SPEC §3 step 2, §5). Stacked as ``[W_qb; W_Iq]`` they are one
``[H·D + H_I·c_I, q_lora_rank]`` ``BlockFp8Weight`` (V4-Flash: 32,768 + 8,192 = 40,960 rows): the E4M3 values one
after the other, and the 128 × 128 block scales too — which needs ``H·D`` to be a multiple of 128 (it is: D = 512),
so that no scale block straddles the two. Each output column of ``c^Q Sᵀ`` is the same dot product either way: the
stacked GEMM's columns are the separate projections, the heads' queries first, then the indexer's.

``stack_query_projections`` makes ``wq_b`` / ``indexer.wq_b`` row views of the stack and records it
(``dsv4.weight_stack``); ``Attention`` and the engine's weights do this once, with the other stacks
(``dsv4.layer_stacks``). ``query_stack`` returns it while the weights still hold those views. SWA and HCA layers
(no indexer) have no such stack.
"""

from __future__ import annotations

import dataclasses

from .formats.block_fp8 import BlockFp8Weight
from .weight_stack import current_stack, record_stack, replace_keeping_stacks, stack_fp8_rows
from .weights import AttentionWeights

__all__ = ["query_stack", "stack_query_projections"]

#: the instance attribute of ``AttentionWeights`` recording its stack (``weight_stack``)
_ATTR = "_query_stack"


def stack_query_projections(w: AttentionWeights) -> AttentionWeights:
    """A copy of ``w`` (the same tensors) whose ``wq_b`` and ``indexer.wq_b`` are row views of one
    ``BlockFp8Weight`` ``[H·D + H_I·c_I, q_lora_rank]``, recorded for ``query_stack``. The stack is the weights' own
    memory when they already lie stacked (as after an earlier call), else one copy of them. Weights that cannot be
    stacked — no indexer (SWA, HCA), not block-scaled FP8 (the exact numerics), an ``H·D`` that is not a multiple
    of 128 — come back unchanged."""
    if w.indexer is None:
        return w
    made = stack_fp8_rows([w.wq_b, w.indexer.wq_b])
    if made is None:
        return w
    stack, views = made
    indexer = dataclasses.replace(w.indexer, wq_b=views[1])  # its compressor (the compressors' stack) unchanged
    out = replace_keeping_stacks(w, wq_b=views[0], indexer=indexer)  # the other stacks, if any, stay
    record_stack(out, _ATTR, stack, views)
    return out


def query_stack(w: AttentionWeights) -> BlockFp8Weight | None:
    """The stacked ``[W_qb; W_Iq]`` of ``w`` (made by ``stack_query_projections``), or ``None`` when ``w`` has none
    or its ``wq_b`` / ``indexer.wq_b`` are no longer the stack's views."""
    if w.indexer is None:
        return None
    return current_stack(w, _ATTR, [w.wq_b, w.indexer.wq_b])
