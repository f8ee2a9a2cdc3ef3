"""Whole-cache snapshots: a deep copy of a ``HybridCache``'s host records and device tensors, and the byte-exact
comparison of a cache with one. Tests and error handling use them to show that a refused call changed nothing
(``HybridCache.snapshot`` / ``differences`` / ``assert_same`` delegate here). Expensive; not for the hot path.

(Saving one request to restore it later is ``dsv4.cache.preempt``; these snapshots cover the whole cache.)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .records import RequestRecord

if TYPE_CHECKING:
    from .manager import HybridCache

__all__ = ["CacheSnapshot", "cache_tensors", "same_bits", "snapshot_differences", "take_snapshot"]

#: a cache tensor's key: ``("state" | "pool" | "prefix", layer, name)``, or ``("flags", -1, "nonfinite")``
TensorKey = tuple[str, int, str]


@dataclass(frozen=True)
class CacheSnapshot:
    """Deep copy of a ``HybridCache``'s host records and device tensors (see ``HybridCache.snapshot``)."""

    requests: dict[str, RequestRecord]
    allocator: tuple[tuple[int, ...], tuple[int, ...]]
    free_slots: tuple[int, ...]
    tensors: dict[TensorKey, Tensor]
    steps: tuple = ()
    prefix: tuple = ()


def same_bits(a: Tensor, b: Tensor) -> bool:
    """Bitwise tensor equality (NaN == NaN, −0 ≠ +0)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def cache_tensors(cache: HybridCache) -> dict[TensorKey, Tensor]:
    """Every tensor of ``cache`` (live, not copied) by ``("state" | "pool" | "prefix", layer, name)``, and the NaN
    flags (int32 ``[max_requests]``) as ``("flags", -1, "nonfinite")``."""
    out = {("state", layer, name): t for layer, d in cache.state.tensors.items() for name, t in d.items()}
    out.update({("pool", layer, name): t for layer, d in cache.pool.tensors.items() for name, t in d.items()})
    out[("flags", -1, "nonfinite")] = cache.nonfinite
    out.update({("prefix", layer, name): t for layer, d in cache.prefix.states.tensors.items() for name, t in d.items()})
    return out


def take_snapshot(cache: HybridCache) -> CacheSnapshot:
    """Deep copy of all of ``cache``'s host records and device tensors."""
    tensors = {key: t.clone() for key, t in cache_tensors(cache).items()}
    return CacheSnapshot(
        requests=copy.deepcopy(cache._requests),
        allocator=cache.allocator.state(),
        free_slots=cache.state.free_slots,
        tensors=tensors,
        steps=cache.steps.state(),
        prefix=cache.prefix.host_state(),
    )


def snapshot_differences(cache: HybridCache, snap: CacheSnapshot) -> list[str]:
    """What differs between ``cache`` now and ``snap`` (empty list: identical, byte for byte)."""
    diffs = []
    if cache._requests != snap.requests:
        diffs.append(f"request records: {snap.requests} -> {cache._requests}")
    if cache.allocator.state() != snap.allocator:
        diffs.append("allocator refcounts / free list")
    if cache.state.free_slots != snap.free_slots:
        diffs.append(f"free slots: {list(snap.free_slots)} -> {list(cache.state.free_slots)}")
    if cache.steps.state() != snap.steps:
        diffs.append(f"step accounting (generation, steps, open step): {snap.steps} -> {cache.steps.state()}")
    if cache.prefix.host_state() != snap.prefix:
        diffs.append("prefix cache records")
    now = cache_tensors(cache)  # live tensors, no copy
    for key, t in snap.tensors.items():
        if key not in now or not same_bits(now[key], t):
            diffs.append(f"tensor {key}")
    diffs += [f"new tensor {k}" for k in now.keys() - snap.tensors.keys()]
    return diffs
