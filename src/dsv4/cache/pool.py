"""Compressed pool: the paged block cache of CSA / HCA layers.

Per compressed layer (``LayerCacheSchema.tensor_specs``, scope ``"block"``):

* ``kv_pages``     uint8 ``[num_blocks, kv_page_bytes]`` — main KV entries, ``block_size // m`` per block, in the
  layer's KV format page layout (entry i of a request lives in block ``table[(i·m) // block_size]``,
  slot ``((i·m) % block_size) // m``);
* ``index_pages``  uint8 ``[num_blocks, index_page_bytes]`` — CSA only: indexer keys, same addressing.

A block id addresses the same position range in every layer, so one block table serves all layers.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .schema import PER_BLOCK, LayerCacheSchema

__all__ = ["CompressedPool"]


class CompressedPool:
    """Pool pages of every compressed layer, allocated once (zero-filled) on ``device``.

    Attributes:
        num_blocks: blocks per layer (shared ids across layers).
        tensors: ``{layer_idx: {"kv_pages": …, "index_pages": … (CSA)}}``; SWA layers are absent.
    """

    def __init__(self, schemas: Sequence[LayerCacheSchema], num_blocks: int, device: torch.device | str = "cpu"):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = int(num_blocks)
        self.device = torch.device(device)
        self.tensors: dict[int, dict[str, Tensor]] = {}
        for s in schemas:
            specs = [t for t in s.tensor_specs() if t.scope == PER_BLOCK]
            if specs:
                self.tensors[s.layer_idx] = {
                    t.name: torch.full((self.num_blocks, *t.shape), t.fill, dtype=t.dtype, device=self.device)
                    for t in specs
                }
        self._bytes_per_block = sum(t.shape[1] * t.element_size() for d in self.tensors.values() for t in d.values())

    def kv_pages(self, layer_idx: int) -> Tensor:
        return self.tensors[layer_idx]["kv_pages"]

    def index_pages(self, layer_idx: int) -> Tensor | None:
        return self.tensors[layer_idx].get("index_pages")

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over every layer (fixed at construction)."""
        return self._bytes_per_block

    def nbytes(self) -> int:
        """Bytes of all pool pages."""
        return sum(t.numel() * t.element_size() for d in self.tensors.values() for t in d.values())
