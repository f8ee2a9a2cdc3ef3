"""Weights stacked for one GEMM: several of a layer's matrices as row views of one stacked matrix, recorded with the
weights, and found again only while the weights still hold exactly those views.

Matrices that multiply the same input can run as one GEMM over their stack (``dsv4.compressor_stack``: the
compressors' BF16 matrices; ``dsv4.input_stack``: the FP8 ``wq_a`` and ``wkv``). The weights then hold row views of
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

from torch import Tensor

from .formats.block_fp8 import BlockFp8Weight

__all__ = ["current_stack", "record_stack", "replace_keeping_stacks", "stacked_rows"]


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
