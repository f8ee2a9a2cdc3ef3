"""``LayerCache``: the view of one cached layer that the ops consume (``HybridCache.layer``), and
``resolve_device``, which makes the cache's device compare equal to its tensors' ``.device``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import Tensor

from ..validate import require_device
from .schema import LayerCacheSchema
from .workspace import Workspace

__all__ = ["LayerCache", "resolve_device"]


def resolve_device(device: torch.device | str) -> torch.device:
    """A device with its index filled in (``"cuda"`` → ``cuda:<current>``), so tensors' ``.device`` compare equal.
    ``TypeError`` / ``ValueError`` naming ``device`` when it is not a device or does not exist here."""
    return require_device("device", device)


@dataclass(frozen=True)
class LayerCache:
    """What the ops of one layer consume.

    Attributes:
        schema: the layer's geometry and storage codecs.
        kv_pages: uint8 ``[num_blocks, kv_page_bytes]`` main KV pool pages (``None`` for SWA).
        index_pages: uint8 ``[num_blocks, index_page_bytes]`` indexer key pages (CSA only, else ``None``).
        state: per-slot tensors by name (``ring``, ``ring_positions``, ``tail_kv`` …; see ``dsv4.cache.state``).
        workspace: the cache's scratch buffers for kernels (shared by all layers; see ``dsv4.cache.workspace``).
        prefix_states: the layer's prefix-cache state snapshot rows by name (``dsv4.cache.prefix_states``; empty
            without prefix caching).
    """

    schema: LayerCacheSchema
    kv_pages: Tensor | None
    index_pages: Tensor | None
    state: Mapping[str, Tensor]
    workspace: Workspace
    prefix_states: Mapping[str, Tensor] = field(default_factory=dict)

    @property
    def ring(self) -> Tensor:
        """uint8 ``[max_requests, ring_page_bytes]``: the SWA ring of each slot (one page of ``window`` entries)."""
        return self.state["ring"]

    @property
    def ring_positions(self) -> Tensor:
        """int32 ``[max_requests, window]``: position held by each ring slot, −1 = empty."""
        return self.state["ring_positions"]
