"""Weights stacked for one GEMM: several of a layer's matrices as row views of one stacked matrix, recorded with the
weights, and found again only while the weights still hold exactly those views.

Matrices that multiply the same input can run as one GEMM over their stack (``dsv4.compressor_stack``: the
compressors' BF16 matrices; ``dsv4.input_stack``: the FP8 ``wq_a`` and ``wkv``; ``dsv4.query_stack``: the FP8
``wq_b`` and the indexer's ``wq_b``; ``dsv4.layer_stacks`` applies them all). The weights then hold row views of
the stack — no memory beyond the matrices themselves — and the stack is recorded on the weights' instance (not a
dataclass field: ``dataclasses.replace`` / ``to`` / ``for_numerics`` / ``shard`` copies drop it). ``current_stack``
returns it only while the weights still hold those very views at their addresses, so a stack is never stale: a
weight replaced after stacking sends its projections back to one GEMM per matrix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .formats.block_fp8 import WEIGHT_BLOCK, BlockFp8Weight

__all__ = ["current_stack", "record_stack", "replace_keeping_stacks", "stack_fp8_rows", "stacked_rows"]


@dataclass(frozen=True)
class _Record:
    """The stacked matrix ``weight`` and the views the weights held when it was made (``views``) with their data
    addresses (``ptrs``)."""

    weight: Any
    views: tuple[Any, ...]
    ptrs: tuple[int, ...]


def _address(view: Tensor | BlockFp8Weight) -> int:
    return view.data.data_ptr() if isinstance(view, BlockFp8Weight) else view.data_ptr()


def stacked_rows(mats: Sequence[Tensor]) -> Tensor | None:
    """The ``[Σ rows, cols]`` tensor over 2-D ``mats`` when they already lie one after another, contiguous, in one
    storage (as a stack's row views do); else ``None``."""
    first = mats[0]
    offset = first.storage_offset()
    for m in mats:
        if (not m.is_contiguous() or m.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or m.storage_offset() != offset):
            return None
        offset += m.numel()
    rows = sum(m.shape[0] for m in mats)
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1))


def stack_fp8_rows(weights: Sequence[Any]) -> tuple[BlockFp8Weight, tuple[BlockFp8Weight, ...]] | None:
    """One block-scaled FP8 matrix ``[Σ rows, K]`` over ``weights`` (each ``[rows_i, K]``), and each of them as its
    row view: the E4M3 values one after the other, and their 128 × 128 block scales too. The stack is the weights'
    own memory when they already lie stacked (as after an earlier stacking), else one copy of them.

    ``None`` when they cannot stack: not all ``BlockFp8Weight`` (the exact numerics' BF16 matrices), K or device
    differing, or a weight before the last whose rows are not a multiple of 128 (a scale block would straddle two
    weights)."""
    if not all(isinstance(w, BlockFp8Weight) for w in weights):
        return None
    first = weights[0]
    if any(w.shape[1] != first.shape[1] or w.device != first.device for w in weights):
        return None
    if any(w.shape[0] % WEIGHT_BLOCK for w in weights[:-1]):
        return None
    data, scale = stacked_rows([w.data for w in weights]), stacked_rows([w.scale for w in weights])
    if data is None or scale is None:
        data, scale = torch.cat([w.data for w in weights]), torch.cat([w.scale for w in weights])
    views, row = [], 0
    for w in weights:
        n, s = w.shape[0], row // WEIGHT_BLOCK
        views.append(BlockFp8Weight(data[row : row + n], scale[s : s + w.scale.shape[0]]))
        row += n
    return BlockFp8Weight(data, scale), tuple(views)


def replace_keeping_stacks(weights: Any, **changes: Any) -> Any:
    """``dataclasses.replace(weights, **changes)`` that keeps the stacks recorded on ``weights`` (each is still
    checked against the views the copy holds: one whose views ``changes`` replaced is found stale)."""
    out = dataclasses.replace(weights, **changes)
    for attr, value in weights.__dict__.items():
        if isinstance(value, _Record):
            setattr(out, attr, value)
    return out


def record_stack(weights: Any, attr: str, stacked: Any, views: Sequence[Any]) -> None:
    """Record on ``weights`` (under the instance attribute ``attr``) that ``views`` are row views of ``stacked``."""
    setattr(weights, attr, _Record(stacked, tuple(views), tuple(_address(v) for v in views)))


def current_stack(weights: Any, attr: str, views: Sequence[Any]) -> Any | None:
    """The stack recorded on ``weights`` under ``attr``, or ``None`` when there is none or ``views`` (what the
    weights hold now, in stacking order) are no longer the recorded views at their addresses (a few identity and
    address comparisons on the host, no device work)."""
    record = weights.__dict__.get(attr)
    if record is None or len(views) != len(record.views):
        return None
    if any(v is not r or _address(v) != p for v, r, p in zip(views, record.views, record.ptrs)):
        return None
    return record.weight
