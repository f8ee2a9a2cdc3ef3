"""The index of cached prefixes (``dsv4.cache.prefix``): one node per cached block, keyed by a hash chain over the
tokens, with the reference counts and the least-recently-used eviction of blocks and state snapshot rows.

Keys: block j of a token sequence has the chain key ``K_j = sha256(K_{j−1} ‖ tokens[j·bs : (j+1)·bs])`` (token ids
as little-endian int64), ``K_{−1}`` a digest of the cache geometry (config, layers, block size, numerics), so a key
names a whole prefix and its geometry. ``PrefixNode`` = one cached block: its key, parent, pool block, and maybe
the state snapshot at its end. A hit walks the keys of the prompt and stops at the deepest node with a snapshot,
at most ``(len − 1) // bs`` blocks (the last prompt token is always computed: its output starts the generation).

Reference counts: a node holds one reference to its block; every request whose table holds a node's block counts
as one of its ``users`` (``refcount(block) == users + 1``). Unreferenced nodes (``users == 0``) are evicted when
blocks are needed, least recently used first, leaves first, so evicting a block invalidates the longer prefixes
chained on it before it (never a half-usable prefix); snapshot rows are evicted LRU when a new one is needed.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from .prefix_states import PrefixStates
from .records import CacheGeometry

if TYPE_CHECKING:
    from .manager import HybridCache

__all__ = ["PrefixIndex", "PrefixNode"]


@dataclass
class PrefixNode:
    """One cached block of a prefix.

    Attributes:
        key: chain key of blocks ``0 … depth−1`` (32-byte sha256).
        parent: key of the node before (``None`` at depth 1).
        depth: blocks in the prefix (this node's block is block ``depth − 1``, positions
            ``(depth−1)·bs … depth·bs − 1``).
        block: the pool block (``None`` when the cache has no compressed layer, so no pool).
        uid: publication number (a snapshot of a request records it to re-share the block on restore).
        state_row: ``PrefixStates`` row holding the request state at position ``depth · bs``, or ``None``.
        children: cached nodes whose parent this is.
        users: active requests whose block table holds this node's block.
        last_used: LRU tick of the last publication, snapshot or hit.
    """

    key: bytes
    parent: bytes | None
    depth: int
    block: int | None
    uid: int
    state_row: int | None = None
    children: int = 0
    users: int = 0
    last_used: int = 0


class PrefixIndex:
    """The cached prefixes of one ``HybridCache``: nodes by chain key, their snapshot rows, lookup and eviction.
    ``PrefixCache`` builds on it with the per-request records that publish nodes (see the module doc).

    Args:
        cache: the owning cache (its allocator and pool are used, never replaced).
        num_states: snapshot rows; 0 turns prefix caching off.
    """

    def __init__(self, cache: HybridCache, num_states: int) -> None:
        self.cache = cache
        self.block_size = cache.block_size
        self.has_pool = cache.min_ratio > 0
        self.enabled = num_states > 0
        self.states = PrefixStates(cache.state, num_states, cache.device)
        self.geometry = CacheGeometry.of(cache)
        self.salt = hashlib.sha256(repr(self.geometry).encode()).digest()
        self.nodes: dict[bytes, PrefixNode] = {}
        self._tick = 0
        self._uid = 0
        self._fingerprints: dict[tuple[bytes, int], bytes] = {}  # (key, uid) -> digest of the block's pages

    # ================================================================ keys
    def chain_keys(self, token_ids: array, num_blocks: int, keys: list[bytes] | None = None) -> list[bytes]:
        """Chain keys of the first ``num_blocks`` blocks of ``token_ids``, extending ``keys`` (a prefix of them)."""
        keys = [] if keys is None else keys
        bs = self.block_size
        prev = keys[-1] if keys else self.salt
        for j in range(len(keys), num_blocks):
            prev = hashlib.sha256(prev + token_ids[j * bs : (j + 1) * bs].tobytes()).digest()
            keys.append(prev)
        return keys

    def touch(self) -> int:
        """The next LRU tick (a node's ``last_used``)."""
        self._tick += 1
        return self._tick

    # ================================================================ lookup
    def lookup(self, token_ids: array, whole: bool = False) -> list[PrefixNode]:
        """The nodes of the longest cached prefix of ``token_ids`` that ends in a state snapshot (empty: a miss);
        at most ``(len − 1) // block_size`` blocks (``whole``: ``len // block_size``). Changes nothing."""
        limit = (len(token_ids) - (0 if whole else 1)) // self.block_size
        if not self.enabled or limit <= 0:
            return []
        return self.lookup_keys(self.chain_keys(token_ids, limit))

    def lookup_keys(self, keys: Sequence[bytes]) -> list[PrefixNode]:
        """``lookup`` from precomputed chain keys (``chain_keys``; pass at most the blocks a hit may take)."""
        if not self.enabled:
            return []
        path: list[PrefixNode] = []
        best = 0
        for j, key in enumerate(keys):
            node = self.nodes.get(key)
            if node is None:
                break
            path.append(node)
            if node.state_row is not None:
                best = j + 1
        return path[:best]

    # ================================================================ nodes
    def add_node(self, key: bytes, parent: bytes | None, depth: int, block: int | None, tick: int) -> PrefixNode:
        """Insert a node without users under ``key`` (``parent`` must be cached); it takes over one reference to
        ``block`` that the caller holds for it."""
        self._uid += 1
        node = PrefixNode(key, parent, depth, block, self._uid, last_used=tick)
        if parent is not None:
            self.nodes[parent].children += 1
        self.nodes[key] = node
        return node

    def _removable(self, node: PrefixNode) -> bool:
        return node.users == 0 and node.children == 0

    def _remove(self, node: PrefixNode) -> None:
        del self.nodes[node.key]
        self._fingerprints.pop((node.key, node.uid), None)
        if node.state_row is not None:
            self.states.free_rows.append(node.state_row)
        if node.parent is not None:
            self.nodes[node.parent].children -= 1
        if node.block is not None:
            self.cache.allocator.decref([node.block])

    def collect(self, key: bytes | None) -> None:
        """Remove useless nodes from ``key`` up its chain: unused leaves without a state snapshot (nothing can hit
        them, and they would stop a later request from publishing the same prefix)."""
        while key is not None:
            node = self.nodes.get(key)
            if node is None or not self._removable(node) or node.state_row is not None:
                return
            key = node.parent
            self._remove(node)

    # ================================================================ eviction
    def num_evictable(self) -> int:
        """Blocks that eviction can free: those of nodes no active request uses."""
        return sum(1 for n in self.nodes.values() if n.users == 0 and n.block is not None)

    def evict_blocks(self, n: int) -> None:
        """Free at least ``n`` blocks by evicting unused nodes, leaves first, stateless then least recently used
        first. The caller checked that ``n <= num_evictable()``."""
        heap = [(n_.state_row is not None, n_.last_used, n_.depth, n_.key) for n_ in self.nodes.values()
                if self._removable(n_)]
        heapq.heapify(heap)
        freed = 0
        while freed < n:
            _, _, _, key = heapq.heappop(heap)
            node = self.nodes[key]
            parent = self.nodes.get(node.parent) if node.parent is not None else None
            self._remove(node)
            freed += node.block is not None
            if parent is not None and self._removable(parent):
                heapq.heappush(heap, (parent.state_row is not None, parent.last_used, parent.depth, parent.key))

    def evict_rows(self, n: int, keep: set[int]) -> None:
        """Free ``n`` snapshot rows, least recently used first (not the nodes in ``keep``)."""
        owners = sorted((node.last_used, node.depth, node.key) for node in self.nodes.values()
                        if node.state_row is not None and id(node) not in keep)
        for _, _, key in owners[:n]:
            node = self.nodes[key]
            self.states.free_rows.append(node.state_row)  # type: ignore[arg-type]
            node.state_row = None
            self.collect(key)

    def ensure_free_blocks(self, n: int) -> None:
        """Evict until ``n`` blocks are free (the caller checked ``n <= free + num_evictable()``)."""
        short = n - self.cache.allocator.num_free
        if short > 0:
            self.evict_blocks(short)

    def clear(self) -> int:
        """Evict every node no active request uses; returns the blocks freed."""
        before = self.cache.allocator.num_free
        self.evict_blocks(self.num_evictable())
        for node in sorted(self.nodes.values(), key=lambda n: -n.depth):  # block-less nodes (no pool), leaves first
            if self._removable(node):
                self._remove(node)
        return self.cache.allocator.num_free - before

    # ================================================================ introspection
    def cached_blocks(self) -> set[int]:
        return {n.block for n in self.nodes.values() if n.block is not None}

    def held_bytes(self) -> int:
        """Memory only the prefix cache keeps alive: blocks of unused nodes plus the snapshot rows in use."""
        unused = sum(1 for n in self.nodes.values() if n.users == 0 and n.block is not None)
        rows = self.states.num_rows - len(self.states.free_rows)
        return unused * self.cache.pool.bytes_per_block + rows * self.states.bytes_per_row

    def stats(self) -> dict[str, int]:
        rows = self.states.num_rows - len(self.states.free_rows)
        return {
            "nodes": len(self.nodes),
            "cached_blocks": len(self.cached_blocks()),
            "unused_blocks": self.num_evictable(),
            "state_rows_used": rows,
            "state_rows": self.states.num_rows,
            "held_bytes": self.held_bytes(),
            "state_bytes_per_row": self.states.bytes_per_row,
        }

    # ================================================================ invariants
    def check_nodes(self) -> None:
        """Raise ``AssertionError`` on the first broken link between nodes: a key, parent, depth, child count,
        block or snapshot row that does not fit (the part of ``PrefixCache.check_invariants`` no request enters)."""
        children: dict[bytes, int] = {key: 0 for key in self.nodes}
        blocks: set[int] = set()
        rows: set[int] = set()
        for key, n in self.nodes.items():
            if n.key != key:
                raise AssertionError("prefix node stored under another key")
            if n.parent is None:
                if n.depth != 1:
                    raise AssertionError(f"prefix node at depth {n.depth} without a parent")
            else:
                p = self.nodes.get(n.parent)
                if p is None or p.depth != n.depth - 1:
                    raise AssertionError(f"prefix node at depth {n.depth}: parent missing or at another depth")
                children[n.parent] += 1
            if (n.block is None) == self.has_pool:
                raise AssertionError(f"prefix node at depth {n.depth}: block {n.block} but has_pool={self.has_pool}")
            if n.block is not None:
                if n.block in blocks:
                    raise AssertionError(f"block {n.block} cached by two prefix nodes")
                blocks.add(n.block)
            if n.state_row is not None:
                if n.state_row in rows or not 0 <= n.state_row < self.states.num_rows:
                    raise AssertionError(f"snapshot row {n.state_row} invalid or owned twice")
                rows.add(n.state_row)
        for key, n in self.nodes.items():
            if children[key] != n.children:
                raise AssertionError(f"prefix node at depth {n.depth}: {n.children} children recorded, {children[key]} found")

    def check_fingerprints(self) -> None:
        """Cached blocks are never written: the digest of each one's pages must stay what it was when first checked
        (host sync; for checks and tests)."""
        if not self.has_pool:
            return
        live = set()
        for n in self.nodes.values():
            h = hashlib.sha256()
            for d in self.cache.pool.tensors.values():
                for t in d.values():
                    h.update(t[n.block].cpu().numpy().tobytes())
            key = (n.key, n.uid)
            live.add(key)
            digest = h.digest()
            seen = self._fingerprints.setdefault(key, digest)
            if seen != digest:
                raise AssertionError(f"cached prefix block {n.block} (depth {n.depth}) was written after it was cached")
        for key in set(self._fingerprints) - live:
            del self._fingerprints[key]
