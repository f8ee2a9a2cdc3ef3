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

Modules: ``prefix_index`` (the nodes by chain key, lookup, reference counts, LRU eviction), ``prefix_states``
(the snapshot rows), ``prefix_transfer`` (``PrefixSnapshot``: export / import), this one (``PrefixCache``: each
request's record, publication, hits, captures inside a step).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from .errors import InvalidPlanError
from .prefix_index import PrefixIndex, PrefixNode
from .prefix_states import PREFIX_STATE_NAMES, PrefixStates, prefix_state_bytes
from .prefix_transfer import PrefixSnapshot, check_prefix_snapshot, export_prefix, import_prefix
from .records import RequestRecord
from .token_ids import as_token_ids

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


class PrefixCache(PrefixIndex):
    """The prefix index (``PrefixIndex``: nodes, snapshot rows, eviction) of one ``HybridCache`` with its
    per-request prefix records, which publish into it and take hits from it (see the module doc).

    Args:
        cache: the owning cache (its allocator, pool, state and records are used, never replaced).
        num_states: snapshot rows; 0 turns prefix caching off (token ids are still checked).
    """

    def __init__(self, cache: HybridCache, num_states: int) -> None:
        super().__init__(cache, num_states)
        self.requests: dict[str, PrefixRequest] = {}
        self.pending: dict[str, int] = {}
        self.in_flight: dict[str, list[tuple[int, int]]] = {}  # request -> [(P, row)] captured inside its last step

    # ================================================================ requests
    def register(self, request_id: str, token_ids: array | None) -> PrefixRequest | None:
        """Start tracking an added request (``None`` ids: nothing to track)."""
        if token_ids is None:
            return None
        pr = PrefixRequest(token_ids)
        self.requests[request_id] = pr
        return pr

    def attach_hit(self, rec: RequestRecord, pr: PrefixRequest, path: list[PrefixNode]) -> None:
        """Give a freshly added request the prefix ``path`` (from ``lookup``): its blocks (one more reference
        each), its token count and the state snapshot at its end (copied into the request's slot)."""
        if not path:
            return
        tick = self.touch()
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
            self.evict_rows(short, set())
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
        tick = self.touch()
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
        tick = self.touch()
        for j in range(pr.published, k):
            key = pr.keys[j]
            block = rec.blocks[j] if self.has_pool else None
            node = self.nodes.get(key)
            if node is None:
                if block is not None:
                    self.cache.allocator.incref([block])
                node = self.add_node(key, pr.keys[j - 1] if j else None, j + 1, block, tick)
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
            self.evict_rows(need, keep)
        tick = self.touch()
        slots, rows = [], []
        for slot, node in captures:
            node.state_row = self.states.free_rows.pop()
            node.last_used = tick
            slots.append(slot)
            rows.append(node.state_row)
        self.states.capture(self.cache.state, slots, rows)

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
            self.collect(pr.keys[pr.published - 1])

    # ================================================================ introspection
    def host_state(self) -> tuple[Any, ...]:
        """A comparable copy of every host record (for ``HybridCache.snapshot``)."""
        import copy

        return (
            copy.deepcopy(self.nodes), copy.deepcopy(self.requests), dict(self.pending),
            copy.deepcopy(self.in_flight), tuple(self.states.free_rows), self._tick, self._uid,
        )

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
        tick = self.touch()
        for n in nodes:
            n.users += 1
            n.last_used = tick
        pr.keys = [n.key for n in nodes]
        pr.published = len(nodes)

    # ================================================================ export / import (dsv4.cache.prefix_transfer)
    def export(self, token_ids: array) -> PrefixSnapshot | None:
        return export_prefix(self, token_ids)

    def check_import(self, snap: object) -> array:
        return check_prefix_snapshot(self, snap)

    def import_(self, snap: PrefixSnapshot, ids: array) -> int:
        return import_prefix(self, snap, ids)

    # ================================================================ invariants
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` on the first broken prefix invariant (see ``HybridCache.check_invariants``)."""
        self.check_nodes()
        users: dict[bytes, int] = {key: 0 for key in self.nodes}
        blocks = self.cached_blocks()
        rows = {n.state_row for n in self.nodes.values() if n.state_row is not None}
        bs = self.block_size
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
            if set(writable) & blocks:
                raise AssertionError(f"request {rid!r}: a cached block is in its writable blocks {writable}")
        for key, n in self.nodes.items():
            if users[key] != n.users:
                raise AssertionError(f"prefix node at depth {n.depth}: {n.users} users recorded, {users[key]} found")
        for rid in self.pending:
            if rid not in self.cache._requests:
                raise AssertionError(f"pending publication of inactive request {rid!r}")
        self.check_fingerprints()
