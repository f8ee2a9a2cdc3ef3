"""State cache: fixed-size per-request tensors of every cached layer, one row per state slot.

Per layer (see ``LayerCacheSchema.tensor_specs``, scope ``"request"``):

* ``ring``            uint8 ``[max_requests, ring_page_bytes]`` — the SWA ring: ``window`` KV entries stored as
  one page of the layer's KV format (entry of token p at ring slot ``p mod window``); reset to 0;
* ``ring_positions``  int32 ``[max_requests, window]`` — absolute position held by each ring slot, −1 = empty;
* CSA: ``tail_kv, tail_gate`` fp32 ``[max_requests, m, 2c]``, ``prev_kv, prev_gate`` fp32 ``[max_requests, m, c]``
  and the indexer compressor's ``index_tail_*`` / ``index_prev_*`` (c = index_head_dim);
* HCA: ``tail_kv, tail_gate`` fp32 ``[max_requests, m', c]``.

Compressor kv tensors reset to 0 and gate tensors to −inf (a slot with gate −inf gets softmax weight 0).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .errors import CacheFullError
from .schema import PER_REQUEST, LayerCacheSchema, TensorSpec

__all__ = ["StateCache"]


class StateCache:
    """Per-slot state tensors of every cached layer, allocated once on ``device``, plus the slot free list.

    Attributes:
        max_requests: number of slots.
        tensors: ``{layer_idx: {name: tensor [max_requests, *spec.shape]}}``.
        specs: ``{layer_idx: [TensorSpec]}`` (the per-request specs, with their reset values).
    """

    def __init__(self, schemas: Sequence[LayerCacheSchema], max_requests: int, device: torch.device | str = "cpu"):
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self.max_requests = int(max_requests)
        self.device = torch.device(device)
        self.specs: dict[int, list[TensorSpec]] = {
            s.layer_idx: [t for t in s.tensor_specs() if t.scope == PER_REQUEST] for s in schemas
        }
        self.tensors: dict[int, dict[str, Tensor]] = {
            layer: {
                t.name: torch.full((self.max_requests, *t.shape), t.fill, dtype=t.dtype, device=self.device)
                for t in specs
            }
            for layer, specs in self.specs.items()
        }
        self._free_slots: list[int] = list(range(self.max_requests - 1, -1, -1))  # LIFO, slot 0 first
        self._bytes_per_slot = sum(spec.nbytes for specs in self.specs.values() for spec in specs)

    # ---------------------------------------------------------------- slots
    @property
    def num_free(self) -> int:
        return len(self._free_slots)

    @property
    def free_slots(self) -> tuple[int, ...]:
        return tuple(self._free_slots)

    def allocate_slot(self) -> int:
        """Take a free slot and reset it. Raises ``CacheFullError`` if none is free."""
        if not self._free_slots:
            raise CacheFullError(f"no free state slot: all {self.max_requests} slots are in use")
        slot = self._free_slots.pop()
        self.reset(slot)
        return slot

    def free_slot(self, slot: int) -> None:
        """Return ``slot`` to the free list, reset (so free slots always hold initial values)."""
        self._check_slot(slot)
        if slot in self._free_slots:
            raise ValueError(f"state slot {slot} is already free")
        self.reset(slot)
        self._free_slots.append(slot)

    def reset(self, slot: int) -> None:
        """Restore slot ``slot`` of every layer to its initial values (ring bytes 0, positions −1, kv 0, gates −inf)."""
        self._check_slot(slot)
        by_fill: dict[tuple[float, torch.dtype], list[Tensor]] = {}
        for layer, specs in self.specs.items():
            for spec in specs:
                view = self.tensors[layer][spec.name][slot]
                by_fill.setdefault((spec.fill, view.dtype), []).append(view)
        # a few multi-tensor launches instead of one fill per tensor (V4-Flash: 294): zero, then add the fill
        # (0 + v is exactly v, −inf included)
        for (fill, _), views in by_fill.items():
            torch._foreach_zero_(views)
            if fill != 0:
                torch._foreach_add_(views, fill)

    def is_reset(self, slot: int) -> bool:
        """Whether every tensor of ``slot`` holds its initial value (host sync; for checks and tests)."""
        self._check_slot(slot)
        for layer, specs in self.specs.items():
            for spec in specs:
                if not bool((self.tensors[layer][spec.name][slot] == spec.fill).all()):
                    return False
        return True

    # ---------------------------------------------------------------- bytes
    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one slot's state over every layer (fixed at construction: read once per engine step)."""
        return self._bytes_per_slot

    def nbytes(self) -> int:
        """Bytes of all state tensors."""
        return sum(t.numel() * t.element_size() for d in self.tensors.values() for t in d.values())

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_requests:
            raise ValueError(f"state slot {slot} out of range [0, {self.max_requests})")
