"""A cached prefix moved between caches (``dsv4.cache.prefix``): ``HybridCache.export_prefix`` copies one to the
host as a ``PrefixSnapshot`` (its blocks' pages, the state snapshot at its end, its token ids), ``import_prefix``
checks it against a cache of the same geometry and publishes it there in fresh blocks and a fresh snapshot row.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .errors import CacheFullError, IncompatibleSnapshotError, InvalidPlanError
from .records import CacheGeometry
from .token_ids import as_token_ids

if TYPE_CHECKING:
    from .prefix import PrefixCache

__all__ = ["PrefixSnapshot", "check_prefix_snapshot", "export_prefix", "import_prefix"]


@dataclass(frozen=True, eq=False)
class PrefixSnapshot:
    """Host copy of one cached prefix (``HybridCache.export_prefix``), to move it into another cache of the same
    geometry (``import_prefix``) or keep it on disk.

    Attributes:
        token_ids: the prefix's ``num_blocks · block_size`` token ids.
        num_blocks: blocks of the prefix.
        geometry: the cache it was taken from.
        state: ``{(layer, name): CPU tensor}`` the snapshot row (``PrefixStates`` shapes) at the prefix end.
        pages: ``{(layer, name): CPU uint8 tensor [num_blocks, page_bytes]}`` of every pool tensor, row j = block j.
    """

    token_ids: tuple[int, ...]
    num_blocks: int
    geometry: CacheGeometry
    state: dict[tuple[int, str], Tensor]
    pages: dict[tuple[int, str], Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.state, self.pages) for t in d.values())

    def __repr__(self) -> str:
        return f"PrefixSnapshot({len(self.token_ids)} tokens, {self.num_blocks} blocks, {self.nbytes} B)"


def export_prefix(prefix: PrefixCache, token_ids: array) -> PrefixSnapshot | None:
    """CPU copy of the longest cached prefix of ``token_ids`` (whole blocks) that ends in a state snapshot, or
    ``None``; nothing changes."""
    path = prefix.lookup(token_ids, whole=True)
    if not path:
        return None
    k = len(path)
    dev = prefix.cache.device
    pages = {}
    if prefix.has_pool:
        idx = torch.tensor([n.block for n in path], dtype=torch.int64, device=dev)
        pages = {(layer, name): t.index_select(0, idx).to("cpu", copy=True)
                 for layer, d in prefix.cache.pool.tensors.items() for name, t in d.items()}
    row = path[-1].state_row
    state = {(layer, name): t[row].to("cpu", copy=True) for layer, d in prefix.states.tensors.items()
             for name, t in d.items()}
    return PrefixSnapshot(tuple(token_ids[: k * prefix.block_size]), k, prefix.geometry, state, pages)


def check_prefix_snapshot(prefix: PrefixCache, snap: object) -> array:
    """``IncompatibleSnapshotError`` unless ``snap`` fits the cache of ``prefix``; returns its token ids."""
    if not isinstance(snap, PrefixSnapshot):
        raise IncompatibleSnapshotError(f"expected a PrefixSnapshot from export_prefix, got {type(snap).__name__}")
    geometry = prefix.geometry
    diffs = snap.geometry.mismatch(geometry) if isinstance(snap.geometry, type(geometry)) else ["no geometry"]
    if diffs:
        raise IncompatibleSnapshotError("prefix snapshot comes from a cache of another geometry: " + "; ".join(diffs))
    try:
        ids = as_token_ids(snap.token_ids, "prefix snapshot token_ids")
    except (TypeError, ValueError) as e:
        raise IncompatibleSnapshotError(str(e)) from None
    k = snap.num_blocks
    if not isinstance(k, int) or k < 1 or len(ids) != k * prefix.block_size:
        raise IncompatibleSnapshotError(
            f"prefix snapshot: {len(ids)} token ids for {k} blocks of {prefix.block_size} positions"
        )
    want = {("state", layer, name): (tuple(t.shape[1:]), t.dtype) for layer, d in prefix.states.tensors.items()
            for name, t in d.items()}
    if prefix.has_pool:
        want |= {("pages", layer, name): ((k, *t.shape[1:]), t.dtype) for layer, d in prefix.cache.pool.tensors.items()
                 for name, t in d.items()}
    have = {("state", *key): t for key, t in snap.state.items()} | {("pages", *key): t for key, t in snap.pages.items()}
    problems = [f"{key[0]} {key[1:]} missing" for key in want.keys() - have.keys()]
    problems += [f"unexpected {key[0]} {key[1:]}" for key in have.keys() - want.keys()]
    for key in want.keys() & have.keys():
        t = have[key]
        if not isinstance(t, Tensor) or (tuple(t.shape), t.dtype) != want[key]:
            problems.append(f"{key[0]} {key[1:]} has the wrong shape or dtype")
    if problems:
        raise IncompatibleSnapshotError("prefix snapshot does not fit this cache: " + "; ".join(sorted(problems)))
    if not prefix.enabled:
        raise InvalidPlanError("cannot import a prefix: prefix caching is off (prefix_states=0)")
    return ids


def import_prefix(prefix: PrefixCache, snap: PrefixSnapshot, ids: array) -> int:
    """Publish a checked ``PrefixSnapshot`` (``check_prefix_snapshot``'s ``ids``) in fresh blocks and a snapshot
    row; returns the tokens it makes available (see ``HybridCache.import_prefix``)."""
    keys = prefix.chain_keys(ids, snap.num_blocks)
    if any(key in prefix.nodes for key in keys):
        return 0
    allocator = prefix.cache.allocator
    need = snap.num_blocks if prefix.has_pool else 0
    if need > allocator.num_free + prefix.num_evictable():
        raise CacheFullError(
            f"cannot import a prefix of {snap.num_blocks} blocks: {allocator.num_free} free and "
            f"{prefix.num_evictable()} evictable of {allocator.num_blocks}"
        )
    prefix.apply_pending()
    if any(key in prefix.nodes for key in keys):  # the pending publication computed the same prefix
        return 0
    prefix.ensure_free_blocks(need)
    blocks = allocator.allocate(need)
    dev = prefix.cache.device
    if blocks:
        idx = torch.tensor(blocks, dtype=torch.int64, device=dev)
        for (layer, name), pages in snap.pages.items():
            prefix.cache.pool.tensors[layer][name].index_copy_(0, idx, pages.to(dev))
    tick = prefix.touch()
    for j, key in enumerate(keys):
        prefix.add_node(key, keys[j - 1] if j else None, j + 1, blocks[j] if blocks else None, tick)
    last = prefix.nodes[keys[-1]]
    if not prefix.states.free_rows:
        prefix.evict_rows(1, {id(last)})
    last.state_row = prefix.states.free_rows.pop()
    for (layer, name), t in snap.state.items():
        prefix.states.tensors[layer][name][last.state_row].copy_(t.to(dev))
    return snap.num_blocks * prefix.block_size
