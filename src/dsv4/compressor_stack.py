"""A layer's compressor projection matrices stacked into one, so that one GEMM computes every compressor's
``a = x W_kvᵀ`` and ``z_raw = x W_gateᵀ`` (``ops.projections.layer_compressor_projections``).

Every compressor of a layer reads the same attention input ``x`` ``[T, d]``: a CSA layer has two — the main one
(width 2c) and the indexer's (width 2c_I) —, an HCA layer one (width c), each with a kv and a gate matrix
``[width, d]``. Stacked in the order ``[main.wkv; main.wgate; indexer.wkv; indexer.wgate]`` they are one ``[N, d]``
matrix, ``N = Σ 2·width`` (V4-Flash: CSA 2·1024 + 2·256 = 2560 rows, HCA 2·512 = 1024), and ``x Sᵀ`` ``[T, N]``
holds each projection as a block of columns.

``stack_compressor_weights`` makes the weights' compressor matrices row views of one stacked tensor (no memory beyond
the matrices themselves: the separate ones are views of it) and records the stack with the returned weights;
``Attention`` does this once when it makes its device copy of the weights (``Attention._weights_on``).
``compressor_stack`` returns the stack only while the weights' matrices are still exactly those views, at their
addresses — weights whose matrices were replaced, or a copy made by ``dataclasses.replace`` / ``to`` /
``for_numerics`` / ``shard``, have none, and their projections run as one GEMM per matrix — so a stack is never
stale.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from .weights import AttentionWeights, CompressorWeights

__all__ = ["compressor_stack", "compressors", "stack_compressor_weights"]

#: the instance attribute of ``AttentionWeights`` holding its ``_Stack`` (not a dataclass field: copies drop it)
_ATTR = "_compressor_stack"


@dataclass(frozen=True)
class _Stack:
    """The stacked matrix ``weight`` ``[N, d]`` and the row views the weights held when it was made (``views``) with
    their data addresses (``ptrs``): the weights still compute with the stack iff they hold these very tensors."""

    weight: Tensor
    views: tuple[Tensor, ...]
    ptrs: tuple[int, ...]


def compressors(w: AttentionWeights) -> list[CompressorWeights]:
    """The layer's compressors in stacking order: the main one, then (CSA) the indexer's; none for an SWA layer."""
    out = [] if w.compressor is None else [w.compressor]
    if w.indexer is not None:
        out.append(w.indexer.compressor)
    return out


def _matrices(w: AttentionWeights) -> list[Tensor]:
    """``[main.wkv, main.wgate, indexer.wkv, indexer.wgate]`` (those the layer has), the stacking order."""
    return [m for c in compressors(w) for m in (c.wkv, c.wgate)]


def _already_stacked(mats: list[Tensor]) -> Tensor | None:
    """The ``[N, d]`` tensor over ``mats`` when they already lie one after another, contiguous, in one storage (as
    ``stack_compressor_weights`` leaves them); else ``None``."""
    first = mats[0]
    offset = first.storage_offset()
    for m in mats:
        if (not m.is_contiguous() or m.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or m.storage_offset() != offset):
            return None
        offset += m.numel()
    rows = sum(m.shape[0] for m in mats)
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1))


def stack_compressor_weights(w: AttentionWeights) -> AttentionWeights:
    """A copy of ``w`` (the same tensors) whose compressor matrices are row views of one stacked tensor ``[N, d]``
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
    stacked = _already_stacked(mats)
    if stacked is None:
        stacked = torch.cat(mats)
    views, row = [], 0
    for m in mats:
        views.append(stacked[row : row + m.shape[0]])
        row += m.shape[0]
    comps = [dataclasses.replace(c, wkv=views[2 * i], wgate=views[2 * i + 1]) for i, c in enumerate(compressors(w))]
    indexer = None if w.indexer is None else dataclasses.replace(w.indexer, compressor=comps[1])
    out = dataclasses.replace(w, compressor=comps[0], indexer=indexer)
    setattr(out, _ATTR, _Stack(stacked, tuple(views), tuple(v.data_ptr() for v in views)))
    return out


def compressor_stack(w: AttentionWeights) -> Tensor | None:
    """The stacked compressor matrix ``[N, d]`` of ``w`` (made by ``stack_compressor_weights``), or ``None`` when
    ``w`` has none or its compressor matrices are no longer the stack's row views (checked on every call: a few
    identity and address comparisons on the host, no device work)."""
    stack = w.__dict__.get(_ATTR)
    if stack is None:
        return None
    mats = _matrices(w)
    if len(mats) != len(stack.views):
        return None
    if any(m is not v or m.data_ptr() != p for m, v, p in zip(mats, stack.views, stack.ptrs)):
        return None
    return stack.weight
