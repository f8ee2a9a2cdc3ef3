"""The cache's plain host records, shared by the manager, preemption and the prefix cache.

``RequestRecord``: one active request's slot, cached tokens and block table. ``CacheGeometry``: what two caches
must share for a snapshot of one to be restored into the other. Kept apart from ``manager`` so that
``preempt`` and ``prefix`` (which ``manager`` imports) need not import ``manager`` back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config import ModelConfig
from ..numerics import Numerics

if TYPE_CHECKING:
    from .manager import HybridCache

__all__ = ["CacheGeometry", "RequestRecord"]


@dataclass
class RequestRecord:
    """Host record of one active request: its state ``slot``, ``num_tokens`` cached so far, its block table
    ``blocks`` (physical pool block of each logical block), and ``missing``: why its cache lacks the data of some
    of its tokens (a step no layer ran; see ``dsv4.cache.steps``), ``None`` when it is complete."""

    slot: int
    num_tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    missing: str | None = None


@dataclass(frozen=True)
class CacheGeometry:
    """What must match for a snapshot of one cache to be restored into another: the model config, the cached
    layers (in order), the block size, the numerics (storage formats) and the context-parallel share of the pool
    (``cp``: ``(cp_rank, cp_size)``; its pages hold that rank's entries only)."""

    cfg: ModelConfig
    layers: tuple[int, ...]
    block_size: int
    numerics: Numerics
    cp: tuple[int, int] = (0, 1)

    @classmethod
    def of(cls, cache: HybridCache) -> CacheGeometry:
        return cls(cache.cfg, tuple(cache.layer_indices), cache.block_size, cache.numerics,
                   (cache.cp_rank, cache.cp_size))

    def mismatch(self, other: CacheGeometry) -> list[str]:
        """Human-readable differences from ``other`` (empty: compatible)."""
        out = []
        if self.cfg != other.cfg:
            out.append(f"config {self.cfg.name!r} != {other.cfg.name!r}" + (" (same name, other values)" if self.cfg.name == other.cfg.name else ""))
        if self.layers != other.layers:
            out.append(f"layers {list(self.layers)} != {list(other.layers)}")
        if self.block_size != other.block_size:
            out.append(f"block_size {self.block_size} != {other.block_size}")
        if self.numerics != other.numerics:
            out.append(f"numerics {self.numerics.name!r} != {other.numerics.name!r}")
        if self.cp != other.cp:
            out.append(f"context-parallel share (rank, size) {self.cp} != {other.cp}")
        return out
