"""Prefix caching for ``HybridCache``: a prompt's leading full blocks are shared by reference count and the
request state at the prefix end is restored from a snapshot, so only the rest of the prompt is computed.

What a request holds at position P is its **pool blocks** (compressed entries and indexer keys of every
compressed layer, one block id per ``block_size`` positions for all layers) and its **state slot** (SWA ring and
ring positions of every layer, compressor tails). Prefixes are cached at block boundaries, ``P = k · block_size``:

* **blocks** ``0 … k−1`` are complete at P and never written again: every entry of block j closes by position
  ``(j+1)·block_size − 1`` (``block_size`` is a multiple of every compression ratio) and later entries land in later
  blocks. They are shared by reference count; a continuing request writes only blocks ``≥ k``, its own. Nothing is
  ever copied on write because no shared block is ever partly filled.
* **state** at P: every compression window is closed at a block boundary, so the compressor tails (the open
  window's rows) hold nothing a later step reads — every tail row is written before it is read. What is live is the
  SWA ring (``window`` entries) with its positions and, for CSA, the previous window's first half (``prev_*``,
  main and indexer compressors). A **state snapshot** (``PrefixStates``, one row of those tensors of every layer) is
  copied from the request's slot when one of its steps ends exactly at P, or written by the layers for a boundary
  P inside a step (``plan_captures`` gives each such P a row, ``StepBatch.prefix_captures`` hands it to the layers,
  ``dsv4.ops.prefix_capture`` fills it before the layer writes anything); on a hit it is copied into a fresh slot,
  whose tails keep their reset values.

Index: block j of a token sequence has the chain key ``K_j = sha256(K_{j−1} ‖ tokens[j·bs : (j+1)·bs])`` (token ids
as little-endian int64), ``K_{−1}`` a digest of the cache geometry (config, layers, block size, numerics), so a key
names a whole prefix and its geometry. ``PrefixNode`` = one cached block: its key, parent, pool block, and maybe
the state snapshot at its end. A hit walks the keys of the prompt and stops at the deepest node with a snapshot,
at most ``(len − 1) // bs`` blocks (the last prompt token is always computed: its output starts the generation).

Lineage: the blocks and snapshot a hit uses must come from one computation (two cold runs of the same prompt with
other chunking may differ in the last bits). A request publishes a node only while every node of its chain so far
holds the request's own block; once it meets a node with another block (the same prefix computed independently)
it publishes nothing further (``PrefixRequest.diverged``).

Publication is deferred: ``prepare_forward`` records where each request's step ends (``pending``, and the rows the
layers fill inside it, ``in_flight``), and the next
mutating call into the cache (``add_request``, ``prepare_forward``, ``release``, ``preempt_request``,
``restore_request``, ``import_prefix``) publishes — by then the layers have run the step (the cache's contract:
one ``prepare_forward`` per step, the layers run before the next call). Device copies are stream-ordered, so a
snapshot or a hit needs no host synchronisation.

Reference counts: a node holds one reference to its block; every request whose table holds a node's block counts
as one of its ``users`` (``refcount(block) == users + 1``). Unreferenced nodes (``users == 0``) are evicted when
blocks are needed, least recently used first, leaves first, so evicting a block invalidates the longer prefixes
chained on it before it (never a half-usable prefix); snapshot rows are evicted LRU when a new one is needed.
"""

from __future__ import annotations

import hashlib
import heapq
import numbers
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from .errors import CacheFullError, IncompatibleSnapshotError, InvalidPlanError
from .prefix_states import PREFIX_STATE_NAMES, PrefixStates, prefix_state_bytes
from .records import CacheGeometry, RequestRecord

if TYPE_CHECKING:
    from .manager import HybridCache

__all__ = [
    "PREFIX_STATE_NAMES",
    "PrefixCache",
    "PrefixNode",
    "PrefixRequest",
    "PrefixSnapshot",
    "PrefixStates",
    "as_token_ids",
    "prefix_state_bytes",
]

_MAX_TOKEN_ID = 2**63


def as_token_ids(token_ids: object, what: str = "token_ids") -> array:
    """Validate token ids (a sequence of ints or a 1-D integer tensor, each in ``[0, 2⁶³)``) → ``array('q')``.

    Raises:
        TypeError: not a sequence / tensor of ints.
        InvalidPlanError: a negative or too large id.
    """
    if isinstance(token_ids, Tensor):
        if token_ids.dim() != 1 or token_ids.dtype.is_floating_point or token_ids.dtype.is_complex \
                or token_ids.dtype == torch.bool:
            raise TypeError(f"{what} must be a 1-D integer tensor, got {token_ids.dtype} {list(token_ids.shape)}")
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= _MAX_TOKEN_ID):
            bad = int(token_ids.min()) if int(token_ids.min()) < 0 else int(token_ids.max())
            raise InvalidPlanError(f"{what}: token id {bad} out of range [0, 2**63)")
        return array("q", token_ids.tolist())
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise TypeError(f"{what} must be a sequence of ints, got {type(token_ids).__name__}")
    ids = list(token_ids)
    if all(issubclass(t, int) and t is not bool for t in set(map(type, ids))):  # plain ints: checked in C
        try:
            arr = array("q", ids)
        except OverflowError:  # ≥ 2⁶³ (or < −2⁶³): the loop below names it
            arr = None
        if arr is not None and (not arr or min(arr) >= 0):
            return arr
    for t in ids:
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise TypeError(f"{what} must be a sequence of ints, got an element {t!r} ({type(t).__name__})")
        if not 0 <= t < _MAX_TOKEN_ID:
            raise InvalidPlanError(f"{what}: token id {t} out of range [0, 2**63)")
    return array("q", ids)


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


@dataclass
class PrefixRequest:
    """What the prefix cache knows of one active request.

    Attributes:
        token_ids: known token ids, positions ``0 … len−1`` (the prompt, extended by ``prepare_forward``'s ids).
        keys: chain keys of its complete known blocks (computed as needed).
        published: leading blocks whose node holds this request's block and counts it as a user.
        diverged: a node of its chain holds another block: it publishes nothing further.
        cached_tokens: tokens restored from the prefix cache when it was added (0: a miss).
    """

    token_ids: array
    keys: list[bytes] = field(default_factory=list)
    published: int = 0
    diverged: bool = False
    cached_tokens: int = 0


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


class PrefixCache:
    """The prefix index, snapshot rows and per-request prefix records of one ``HybridCache`` (see the module doc).

    Args:
        cache: the owning cache (its allocator, pool, state and records are used, never replaced).
        num_states: snapshot rows; 0 turns prefix caching off (token ids are still checked).
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
        self.requests: dict[str, PrefixRequest] = {}
        self.pending: dict[str, int] = {}
        self.in_flight: dict[str, list[tuple[int, int]]] = {}  # request -> [(P, row)] captured inside its last step
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

    def _touch(self) -> int:
        self._tick += 1
        return self._tick

    # ================================================================ requests
    def register(self, request_id: str, token_ids: array | None) -> PrefixRequest | None:
        """Start tracking an added request (``None`` ids: nothing to track)."""
        if token_ids is None:
            return None
        pr = PrefixRequest(token_ids)
        self.requests[request_id] = pr
        return pr

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

    def attach_hit(self, rec: RequestRecord, pr: PrefixRequest, path: list[PrefixNode]) -> None:
        """Give a freshly added request the prefix ``path`` (from ``lookup``): its blocks (one more reference
        each), its token count and the state snapshot at its end (copied into the request's slot)."""
        if not path:
            return
        tick = self._touch()
        blocks = [n.block for n in path]
        if self.has_pool:
            self.cache.allocator.incref(blocks)
        for n in path:
            n.users += 1
            n.last_used = tick
        last = path[-1]
        assert last.state_row is not None
        self.states.restore(self.cache.state, last.state_row, rec.slot)
        rec.blocks = list(blocks) if self.has_pool else []
        rec.num_tokens = last.depth * self.block_size
        pr.keys = [n.key for n in path]
        pr.published = len(path)
        pr.cached_tokens = rec.num_tokens

    def check_step_ids(
        self, items: Sequence[tuple[str, int]], token_ids: Mapping[str, object] | None
    ) -> dict[str, array]:
        """Validate ``prepare_forward``'s ``token_ids`` (the ids of each listed request's new tokens) against the
        plan and the ids known so far; returns them as arrays. Changes nothing.

        Raises:
            InvalidPlanError: not a mapping, an id not in the plan, a count other than the plan's, ids that disagree
                with the known ones, or a gap (ids for positions after unknown ones).
            TypeError: ids that are not ints.
        """
        if token_ids is None:
            return {}
        if not isinstance(token_ids, Mapping):
            raise InvalidPlanError(f"token_ids must map request ids to the step's token ids, got {type(token_ids).__name__}")
        counts = dict(items)
        out: dict[str, array] = {}
        for rid, ids in token_ids.items():
            if rid not in counts:
                raise InvalidPlanError(f"token_ids given for request {rid!r}, which is not in the plan")
            arr = as_token_ids(ids, f"token_ids[{rid!r}]")
            n = int(counts[rid])
            if len(arr) != n:
                raise InvalidPlanError(f"request {rid!r}: {len(arr)} token ids for {n} new tokens in the plan")
            start = self.cache._requests[rid].num_tokens
            pr = self.requests.get(rid)
            known = pr.token_ids if pr is not None else array("q")
            if start > len(known):
                raise InvalidPlanError(
                    f"request {rid!r}: token ids for positions {start}..{start + n - 1} but only its first "
                    f"{len(known)} positions have known ids (give the ids of every step, or none)"
                )
            overlap = min(len(known) - start, n)
            if overlap > 0 and known[start : start + overlap] != arr[:overlap]:
                at = next(i for i in range(overlap) if known[start + i] != arr[i])
                raise InvalidPlanError(
                    f"request {rid!r}: token ids disagree with its known tokens at position {start + at} "
                    f"(known {known[start + at]}, fed {arr[at]})"
                )
            out[rid] = arr
        return out

    def after_step(self, items: Sequence[tuple[str, int]], ids: Mapping[str, array]) -> None:
        """``prepare_forward`` committed: extend known ids, and remember where each tracked request's step ends."""
        for rid, n in items:
            new = ids.get(rid)
            rec = self.cache._requests[rid]
            pr = self.requests.get(rid)
            if new is not None:
                if pr is None:
                    pr = self.register(rid, array("q"))
                assert pr is not None
                start = rec.num_tokens - int(n)
                have = len(pr.token_ids)
                if start + len(new) > have:
                    pr.token_ids.extend(new[have - start :])
            if pr is not None and self.enabled:
                self.pending[rid] = rec.num_tokens

    def plan_captures(self, items: Sequence[tuple[str, int]]) -> list[tuple[int, int, int]]:
        """``prepare_forward`` committed: the block boundaries strictly inside each tracked request's new tokens (with
        known ids) that have no snapshot yet get a snapshot row each (least recently used rows evicted if needed,
        at most half of them per step); the layers fill them (``dsv4.ops.prefix_capture``), the next publication
        attaches them. Returns ``StepBatch.prefix_captures``: ``[(b, P, row)]``."""
        if not self.enabled:
            return []
        bs = self.block_size
        want: list[tuple[int, str, int]] = []
        for b, (rid, n) in enumerate(items):
            pr = self.requests.get(rid)
            if pr is None or pr.diverged:
                continue
            rec = self.cache._requests[rid]
            end = rec.num_tokens
            first, last = (end - int(n)) // bs + 1, min(end - 1, len(pr.token_ids)) // bs
            if last < first:
                continue
            self.chain_keys(pr.token_ids, last, pr.keys)
            for j in range(first, last + 1):
                node = self.nodes.get(pr.keys[j - 1])
                if node is not None and (node.state_row is not None or (self.has_pool and node.block != rec.blocks[j - 1])):
                    continue  # snapshotted already, or another computation's prefix (this one will not be published)
                want.append((b, rid, j * bs))
        want = sorted(want, key=lambda w: -w[2])[: max(1, self.states.num_rows // 2)]  # the deepest, if too many
        short = len(want) - len(self.states.free_rows)
        if short > 0:
            self._evict_rows(short, set())
        captures = []
        for b, rid, point in want:
            row = self.states.free_rows.pop()
            self.in_flight.setdefault(rid, []).append((point, row))
            captures.append((b, point, row))
        return captures

    def check_writable(self, steps: Iterable[tuple[str, Sequence[int], int]]) -> None:
        """Each ``(request id, block table, start)``: a step from position ``start`` writes blocks
        ``table[start // block_size:]``, none of which may be cached. ``AssertionError`` (an internal error)."""
        if not self.has_pool or not self.nodes:
            return
        cached = self.cached_blocks()
        for rid, table, start in steps:
            shared = [b for b in table[start // self.block_size :] if b in cached]
            if shared:
                raise AssertionError(f"request {rid!r} would write into cached prefix blocks {shared} (internal error)")

    # ================================================================ publication
    def apply_pending(self) -> None:
        """Publish the blocks (and the state, at a block boundary) of every step prepared since the last call."""
        if not self.pending:
            return
        pending, self.pending = self.pending, {}
        captures: dict[bytes, tuple[int, PrefixNode]] = {}  # by node: requests of an SWA-only cache share nodes
        for rid, end in pending.items():
            rec = self.cache._requests.get(rid)
            pr = self.requests.get(rid)
            flight = self.in_flight.pop(rid, [])
            if rec is None or pr is None or rec.num_tokens != end:
                self.states.free_rows.extend(row for _, row in flight)
                continue
            node = self._publish_blocks(rec, pr)
            self._attach_in_flight(pr, flight)
            if node is not None and node.state_row is None and end == node.depth * self.block_size:
                captures.setdefault(node.key, (rec.slot, node))
        if captures:
            self._capture(list(captures.values()))

    def _attach_in_flight(self, pr: PrefixRequest, flight: list[tuple[int, int]]) -> None:
        """Rows the layers filled inside the step become their nodes' snapshots (if the request published the node
        and it has none); the others go back to the free rows."""
        tick = self._touch()
        for point, row in flight:
            j = point // self.block_size
            node = self.nodes.get(pr.keys[j - 1]) if pr.published >= j else None
            if node is not None and node.state_row is None:
                node.state_row, node.last_used = row, tick
            else:
                self.states.free_rows.append(row)

    def _publish_blocks(self, rec: RequestRecord, pr: PrefixRequest) -> PrefixNode | None:
        """Publish ``rec``'s complete known blocks; returns the node of its last published block (``None`` if it
        published none, or diverged before its last complete block)."""
        k = min(rec.num_tokens, len(pr.token_ids)) // self.block_size
        if pr.diverged or k == 0:
            return None
        self.chain_keys(pr.token_ids, k, pr.keys)
        tick = self._touch()
        for j in range(pr.published, k):
            key = pr.keys[j]
            block = rec.blocks[j] if self.has_pool else None
            node = self.nodes.get(key)
            if node is None:
                parent = pr.keys[j - 1] if j else None
                self._uid += 1
                node = PrefixNode(key, parent, j + 1, block, self._uid, last_used=tick)
                if block is not None:
                    self.cache.allocator.incref([block])
                if parent is not None:
                    self.nodes[parent].children += 1
                self.nodes[key] = node
            elif node.block != block:
                pr.diverged = True
                return None
            node.users += 1
            pr.published = j + 1
        last = self.nodes[pr.keys[k - 1]]
        last.last_used = tick
        return last

    def _capture(self, captures: list[tuple[int, PrefixNode]]) -> None:
        """Snapshot the state of each ``(slot, node)`` into a row (evicting least recently used rows if needed)."""
        captures = captures[: self.states.num_rows]
        keep = {id(n) for _, n in captures}
        need = len(captures) - len(self.states.free_rows)
        if need > 0:
            self._evict_rows(need, keep)
        tick = self._touch()
        slots, rows = [], []
        for slot, node in captures:
            node.state_row = self.states.free_rows.pop()
            node.last_used = tick
            slots.append(slot)
            rows.append(node.state_row)
        self.states.capture(self.cache.state, slots, rows)

    # ================================================================ release and eviction
    def drop_step(self, rid: str) -> None:
        """Forget what ``rid``'s last prepared step would publish (its layers did not run it)."""
        self.pending.pop(rid, None)
        self.states.free_rows.extend(row for _, row in self.in_flight.pop(rid, []))

    def forget(self, rid: str) -> None:
        """The request leaves the cache (release / preempt): it stops being a user of its published nodes."""
        self.drop_step(rid)
        pr = self.requests.pop(rid, None)
        if pr is None:
            return
        for key in pr.keys[: pr.published]:
            self.nodes[key].users -= 1
        if pr.published:
            self._collect(pr.keys[pr.published - 1])

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

    def _collect(self, key: bytes | None) -> None:
        """Remove useless nodes from ``key`` up its chain: unused leaves without a state snapshot (nothing can hit
        them, and they would stop a later request from publishing the same prefix)."""
        while key is not None:
            node = self.nodes.get(key)
            if node is None or not self._removable(node) or node.state_row is not None:
                return
            key = node.parent
            self._remove(node)

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

    def _evict_rows(self, n: int, keep: set[int]) -> None:
        """Free ``n`` snapshot rows, least recently used first (not the nodes in ``keep``)."""
        owners = sorted((node.last_used, node.depth, node.key) for node in self.nodes.values()
                        if node.state_row is not None and id(node) not in keep)
        for _, _, key in owners[:n]:
            node = self.nodes[key]
            self.states.free_rows.append(node.state_row)  # type: ignore[arg-type]
            node.state_row = None
            self._collect(key)

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

    def host_state(self) -> tuple[Any, ...]:
        """A comparable copy of every host record (for ``HybridCache.snapshot``)."""
        import copy

        return (
            copy.deepcopy(self.nodes), copy.deepcopy(self.requests), dict(self.pending),
            copy.deepcopy(self.in_flight), tuple(self.states.free_rows), self._tick, self._uid,
        )

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

    # ================================================================ preemption (restore re-shares cached blocks)
    def published_nodes(self, rid: str) -> tuple[tuple[bytes, int], ...]:
        """``(key, uid)`` of the nodes ``rid`` uses, in chain order (``RequestSnapshot.prefix_nodes``)."""
        pr = self.requests.get(rid)
        if pr is None:
            return ()
        return tuple((k, self.nodes[k].uid) for k in pr.keys[: pr.published])

    def reusable(
        self, prefix_nodes: Sequence[tuple[bytes, int]], token_ids: array, pages: Mapping[tuple[int, str], Tensor]
    ) -> list[PrefixNode]:
        """The leading nodes of a ``RequestSnapshot``'s ``prefix_nodes`` that this cache still holds as the same
        publication, whose keys follow from the snapshot's token ids and whose blocks hold exactly the snapshot's
        pages (compared on the device: a host sync). Restore shares those blocks instead of copying them."""
        if not self.has_pool or not prefix_nodes:
            return []
        k = min(len(prefix_nodes), len(token_ids) // self.block_size)
        keys = self.chain_keys(token_ids, k)
        out: list[PrefixNode] = []
        for j in range(k):
            key, uid = prefix_nodes[j]
            node = self.nodes.get(key)
            if key != keys[j] or node is None or node.uid != uid or node.depth != j + 1:
                break
            out.append(node)
        if not out:
            return out
        dev = self.cache.device
        idx = torch.tensor([n.block for n in out], dtype=torch.int64, device=dev)
        same = torch.ones(len(out), dtype=torch.bool, device=dev)
        for (layer, name), t in pages.items():
            have = self.cache.pool.tensors[layer][name].index_select(0, idx)
            same &= (have == t[: len(out)].to(dev)).flatten(1).all(1)
        equal = same.tolist()
        return out[: equal.index(False)] if False in equal else out

    def attach_restored(self, rid: str, token_ids: array | None, nodes: list[PrefixNode]) -> None:
        """A restored request re-shares ``nodes`` (from ``reusable``; its table already holds their blocks)."""
        pr = self.register(rid, token_ids)
        if pr is None:
            return
        tick = self._touch()
        for n in nodes:
            n.users += 1
            n.last_used = tick
        pr.keys = [n.key for n in nodes]
        pr.published = len(nodes)

    # ================================================================ export / import
    def export(self, token_ids: array) -> PrefixSnapshot | None:
        path = self.lookup(token_ids, whole=True)
        if not path:
            return None
        k = len(path)
        dev = self.cache.device
        pages = {}
        if self.has_pool:
            idx = torch.tensor([n.block for n in path], dtype=torch.int64, device=dev)
            pages = {(layer, name): t.index_select(0, idx).to("cpu", copy=True)
                     for layer, d in self.cache.pool.tensors.items() for name, t in d.items()}
        row = path[-1].state_row
        state = {(layer, name): t[row].to("cpu", copy=True) for layer, d in self.states.tensors.items()
                 for name, t in d.items()}
        return PrefixSnapshot(tuple(token_ids[: k * self.block_size]), k, self.geometry, state, pages)

    def check_import(self, snap: object) -> array:
        """``IncompatibleSnapshotError`` unless ``snap`` fits this cache; returns its token ids."""
        if not isinstance(snap, PrefixSnapshot):
            raise IncompatibleSnapshotError(f"expected a PrefixSnapshot from export_prefix, got {type(snap).__name__}")
        diffs = snap.geometry.mismatch(self.geometry) if isinstance(snap.geometry, type(self.geometry)) else ["no geometry"]
        if diffs:
            raise IncompatibleSnapshotError("prefix snapshot comes from a cache of another geometry: " + "; ".join(diffs))
        try:
            ids = as_token_ids(snap.token_ids, "prefix snapshot token_ids")
        except (TypeError, ValueError) as e:
            raise IncompatibleSnapshotError(str(e)) from None
        k = snap.num_blocks
        if not isinstance(k, int) or k < 1 or len(ids) != k * self.block_size:
            raise IncompatibleSnapshotError(
                f"prefix snapshot: {len(ids)} token ids for {k} blocks of {self.block_size} positions"
            )
        want = {("state", layer, name): (tuple(t.shape[1:]), t.dtype) for layer, d in self.states.tensors.items()
                for name, t in d.items()}
        if self.has_pool:
            want |= {("pages", layer, name): ((k, *t.shape[1:]), t.dtype) for layer, d in self.cache.pool.tensors.items()
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
        if not self.enabled:
            raise InvalidPlanError("cannot import a prefix: prefix caching is off (prefix_states=0)")
        return ids

    def import_(self, snap: PrefixSnapshot, ids: array) -> int:
        """Publish a checked ``PrefixSnapshot`` (see ``HybridCache.import_prefix``)."""
        keys = self.chain_keys(ids, snap.num_blocks)
        if any(key in self.nodes for key in keys):
            return 0
        need = snap.num_blocks if self.has_pool else 0
        if need > self.cache.allocator.num_free + self.num_evictable():
            raise CacheFullError(
                f"cannot import a prefix of {snap.num_blocks} blocks: {self.cache.allocator.num_free} free and "
                f"{self.num_evictable()} evictable of {self.cache.allocator.num_blocks}"
            )
        self.apply_pending()
        self.ensure_free_blocks(need)
        blocks = self.cache.allocator.allocate(need)
        dev = self.cache.device
        if blocks:
            idx = torch.tensor(blocks, dtype=torch.int64, device=dev)
            for (layer, name), pages in snap.pages.items():
                self.cache.pool.tensors[layer][name].index_copy_(0, idx, pages.to(dev))
        tick = self._touch()
        for j, key in enumerate(keys):
            self._uid += 1
            node = PrefixNode(key, keys[j - 1] if j else None, j + 1, blocks[j] if blocks else None, self._uid,
                              last_used=tick)
            if j:
                self.nodes[keys[j - 1]].children += 1
            self.nodes[key] = node
        last = self.nodes[keys[-1]]
        if not self.states.free_rows:
            self._evict_rows(1, {id(last)})
        last.state_row = self.states.free_rows.pop()
        for (layer, name), t in snap.state.items():
            self.states.tensors[layer][name][last.state_row].copy_(t.to(dev))
        return snap.num_blocks * self.block_size

    # ================================================================ invariants
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` on the first broken prefix invariant (see ``HybridCache.check_invariants``)."""
        users: dict[bytes, int] = {key: 0 for key in self.nodes}
        children: dict[bytes, int] = {key: 0 for key in self.nodes}
        blocks: dict[int, bytes] = {}
        rows: dict[int, bytes] = {}
        bs = self.block_size
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
                blocks[n.block] = key
            if n.state_row is not None:
                if n.state_row in rows or not 0 <= n.state_row < self.states.num_rows:
                    raise AssertionError(f"snapshot row {n.state_row} invalid or owned twice")
                rows[n.state_row] = key
        for key, n in self.nodes.items():
            if children[key] != n.children:
                raise AssertionError(f"prefix node at depth {n.depth}: {n.children} children recorded, {children[key]} found")
        free = self.states.free_rows
        flight = [row for f in self.in_flight.values() for _, row in f]
        if len(set(free)) != len(free) or set(free) & set(rows) or len(set(flight)) != len(flight) \
                or set(flight) & (set(free) | set(rows)) or len(free) + len(rows) + len(flight) != self.states.num_rows:
            raise AssertionError(f"snapshot rows: used {sorted(rows)}, in flight {sorted(flight)}, free {sorted(free)} "
                                 f"of {self.states.num_rows}")
        for rid in self.in_flight:
            if rid not in self.pending:
                raise AssertionError(f"snapshot rows in flight for {rid!r} without a pending publication")
        for rid, pr in self.requests.items():
            rec = self.cache._requests.get(rid)
            if rec is None:
                raise AssertionError(f"prefix record of inactive request {rid!r}")
            if pr.published > len(pr.keys) or pr.published * bs > rec.num_tokens:
                raise AssertionError(f"request {rid!r}: published {pr.published} blocks of {rec.num_tokens} tokens")
            if self.chain_keys(pr.token_ids, min(len(pr.keys), len(pr.token_ids) // bs)) != pr.keys:
                raise AssertionError(f"request {rid!r}: chain keys do not match its token ids")
            for j, key in enumerate(pr.keys[: pr.published]):
                node = self.nodes.get(key)
                if node is None or node.depth != j + 1:
                    raise AssertionError(f"request {rid!r}: published block {j} has no node")
                if self.has_pool and rec.blocks[j] != node.block:
                    raise AssertionError(f"request {rid!r}: block {j} is {rec.blocks[j]}, its node holds {node.block}")
                users[key] += 1
        for rid, rec in self.cache._requests.items():
            writable = rec.blocks[rec.num_tokens // bs :]
            if set(writable) & set(blocks):
                raise AssertionError(f"request {rid!r}: a cached block is in its writable blocks {writable}")
        for key, n in self.nodes.items():
            if users[key] != n.users:
                raise AssertionError(f"prefix node at depth {n.depth}: {n.users} users recorded, {users[key]} found")
        for rid in self.pending:
            if rid not in self.cache._requests:
                raise AssertionError(f"pending publication of inactive request {rid!r}")
        self._check_fingerprints()

    def _check_fingerprints(self) -> None:
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
