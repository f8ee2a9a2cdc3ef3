"""A layer's compressor projection matrices — and the indexer's head-weight matrix, which reads the same input —
stacked into one, so that one GEMM computes every compressor's ``a = x W_kvᵀ`` and ``z_raw = x W_gateᵀ`` and the
indexer's ``W_w x`` (``ops.projections.layer_compressor_projections``).

Every compressor of a layer reads the same attention input ``x`` ``[T, d]``: a CSA layer has two — the main one
(width 2c) and the indexer's (width 2c_I) —, an HCA layer one (width c), each with a kv and a gate matrix
``[width, d]``. A CSA layer's indexer also multiplies ``x`` by its BF16 ``weights_proj`` ``[H_I, d]`` (the per-head
score weights). Stacked in the order ``[main.wkv; main.wgate; indexer.wkv; indexer.wgate; indexer.weights_proj]``
they are one ``[N, d]`` matrix, ``N = Σ 2·width (+ H_I)`` (V4-Flash: CSA 2·1024 + 2·256 + 64 = 2,624 rows, HCA
2·512 = 1,024), and ``x Sᵀ`` ``[T, N]`` holds each projection as a block of columns. ``weights_proj`` joins the
stack only where it has the compressor matrices' dtype, device and input width.

``stack_compressor_weights`` makes the weights' stacked matrices row views of one stacked tensor and records the
stack with the returned weights (``dsv4.weight_stack``); ``Attention`` does this once when it makes its device copy
of the weights (``Attention._weights_on``). ``compressor_stack`` returns the stack only while the weights' matrices
are still exactly those views (else their projections run as one GEMM per matrix), so a stack is never stale.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .weight_stack import current_stack, record_stack, replace_keeping_stacks, stacked_rows
from .weights import AttentionWeights, CompressorWeights

__all__ = ["compressor_stack", "compressors", "head_rows", "stack_compressor_weights"]

#: the instance attribute of ``AttentionWeights`` recording its stack (``weight_stack``)
_ATTR = "_compressor_stack"


def compressors(w: AttentionWeights) -> list[CompressorWeights]:
    """The layer's compressors in stacking order: the main one, then (CSA) the indexer's; none for an SWA layer."""
    out = [] if w.compressor is None else [w.compressor]
    if w.indexer is not None:
        out.append(w.indexer.compressor)
    return out


def _stacks_head_weights(w: AttentionWeights) -> bool:
    """Whether the indexer's ``weights_proj`` joins the stack: a CSA layer whose ``weights_proj`` is a 2-D matrix of
    the main compressor's ``wkv``'s dtype, device and input width."""
    if w.indexer is None or w.compressor is None:
        return False
    wp, first = w.indexer.weights_proj, w.compressor.wkv
    return (wp.dim() == 2 and first.dim() == 2 and wp.shape[1] == first.shape[1] and wp.dtype == first.dtype
            and wp.device == first.device)


def head_rows(w: AttentionWeights) -> int:
    """The rows of the indexer's ``weights_proj`` at the end of ``w``'s stack (``H_I``), 0 where it does not join."""
    return w.indexer.weights_proj.shape[0] if _stacks_head_weights(w) else 0


def _matrices(w: AttentionWeights) -> list[Tensor]:
    """``[main.wkv, main.wgate, indexer.wkv, indexer.wgate, indexer.weights_proj]`` (those the layer has and that
    join the stack), the stacking order."""
    mats = [m for c in compressors(w) for m in (c.wkv, c.wgate)]
    return mats + [w.indexer.weights_proj] if _stacks_head_weights(w) else mats


def stack_compressor_weights(w: AttentionWeights) -> AttentionWeights:
    """A copy of ``w`` (the same tensors) whose stacked matrices are row views of one stacked tensor ``[N, d]``
    (see the module docstring), recorded for ``compressor_stack``. The stack is made by one copy of the matrices,
    or is the matrices' own memory when they already lie stacked (then nothing is copied). ``w`` itself is left
    as it is; an SWA layer's weights (no compressor) come back unchanged.

    Raises ``ValueError`` when the matrices differ in dtype or device, are not 2-D or differ in input width."""
    mats = _matrices(w)
    if not mats:
        return w
    first = mats[0]
    if any(m.dim() != 2 or m.shape[1] != first.shape[1] or m.dtype != first.dtype or m.device != first.device
           for m in mats):
        raise ValueError("the compressor matrices (wkv, wgate of each compressor) must be 2-D [width, d] tensors of "
                         "one dtype and device to be stacked, got "
                         + ", ".join(f"{m.dtype} {list(m.shape)} on {m.device}" for m in mats))
    stacked = stacked_rows(mats)
    if stacked is None:
        stacked = torch.cat(mats)
    views, row = [], 0
    for m in mats:
        views.append(stacked[row : row + m.shape[0]])
        row += m.shape[0]
    comps = [dataclasses.replace(c, wkv=views[2 * i], wgate=views[2 * i + 1]) for i, c in enumerate(compressors(w))]
    indexer = None
    if w.indexer is not None:
        head = views[-1] if _stacks_head_weights(w) else w.indexer.weights_proj
        indexer = dataclasses.replace(w.indexer, compressor=comps[1], weights_proj=head)
    out = replace_keeping_stacks(w, compressor=comps[0], indexer=indexer)
    record_stack(out, _ATTR, stacked, views)
    return out


def compressor_stack(w: AttentionWeights) -> Tensor | None:
    """The stacked matrix ``[N, d]`` of ``w`` (made by ``stack_compressor_weights``; its last ``head_rows(w)`` rows
    the indexer's ``weights_proj``), or ``None`` when ``w`` has none or its stacked matrices are no longer the stack's
    row views (checked on every call: a few identity and address comparisons on the host, no device work)."""
    return current_stack(w, _ATTR, _matrices(w))
