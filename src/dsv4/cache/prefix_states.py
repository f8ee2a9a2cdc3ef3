"""Snapshot rows of the request state at block boundaries, for prefix caching (``dsv4.cache.prefix``).

At a block boundary every compression window is closed (``block_size`` is a multiple of every ratio), so of a
request's state only the SWA ring with its positions and CSA's previous-window first halves are live; a snapshot
row holds exactly those tensors of every cached layer (``PREFIX_STATE_NAMES``), a quarter of a whole state slot on
V4-Flash (3.50 of 14.32 MiB: the HCA tails, empty at a boundary, are the rest).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import Tensor

from .schema import PER_REQUEST, LayerCacheSchema
from .state import StateCache
from .transfer import index_tensor

__all__ = ["PREFIX_STATE_NAMES", "PrefixStates", "prefix_state_bytes"]

#: State tensors live at a block boundary (a snapshot row holds these of every layer; the tails are not live).
PREFIX_STATE_NAMES = ("ring", "ring_positions", "prev_kv", "prev_gate", "index_prev_kv", "index_prev_gate")


def prefix_state_bytes(schemas: Iterable[LayerCacheSchema]) -> int:
    """Bytes of one prefix state snapshot: the ``PREFIX_STATE_NAMES`` tensors of every layer in ``schemas``."""
    return sum(t.nbytes for s in schemas for t in s.tensor_specs() if t.scope == PER_REQUEST and t.name in PREFIX_STATE_NAMES)


class PrefixStates:
    """Snapshot rows of the live request state at a block boundary, on the cache's device.

    ``tensors[layer][name]`` is ``[num_rows, *shape]`` for every ``name`` of ``PREFIX_STATE_NAMES`` the layer's state
    has, shaped and typed like one row of ``StateCache.tensors[layer][name]``: ``ring`` uint8 ``[ring_page_bytes]``,
    ``ring_positions`` int32 ``[window]``, CSA ``prev_kv / prev_gate`` fp32 ``[m, c]`` and
    ``index_prev_kv / index_prev_gate`` fp32 ``[m, c_I]``.
    """

    def __init__(self, state: StateCache, num_rows: int, device: torch.device) -> None:
        self.num_rows = int(num_rows)
        self.device = device
        self.tensors: dict[int, dict[str, Tensor]] = {
            layer: {
                s.name: torch.full((self.num_rows, *s.shape), s.fill, dtype=s.dtype, device=device)
                for s in specs
                if s.name in PREFIX_STATE_NAMES
            }
            for layer, specs in state.specs.items()
        }
        self.free_rows: list[int] = list(range(self.num_rows - 1, -1, -1))  # LIFO, row 0 first

    @property
    def bytes_per_row(self) -> int:
        return sum(t[0].numel() * t.element_size() for d in self.tensors.values() for t in d.values()) if self.num_rows else 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self.tensors.values() for t in d.values())

    def capture(self, state: StateCache, slots: Sequence[int], rows: Sequence[int]) -> None:
        """Copy the live state of ``slots`` into snapshot ``rows`` (one gather + scatter per tensor, no sync)."""
        if not rows:
            return
        src, dst = index_tensor(slots, self.device), index_tensor(rows, self.device)
        for layer, d in self.tensors.items():
            for name, t in d.items():
                t.index_copy_(0, dst, state.tensors[layer][name].index_select(0, src))

    def restore(self, state: StateCache, row: int, slot: int) -> None:
        """Copy snapshot ``row`` into state ``slot`` (the slot's other tensors keep their reset values): one
        multi-tensor copy (a few launches on CUDA, not one per layer and tensor)."""
        pairs = [(state.tensors[layer][name][slot], t[row]) for layer, d in self.tensors.items() for name, t in d.items()]
        if pairs:
            torch._foreach_copy_([dst for dst, _ in pairs], [src for _, src in pairs])
