"""Preemption without loss: copy one request's cache to host memory and back into other blocks and another slot.

Everything the cache holds for a request is

* its **state-slot rows** in every cached layer (SWA ring and ring positions; CSA/HCA compressor tails), and
* the **pool pages of the blocks in its block table** in every compressed layer (``kv_pages``; CSA ``index_pages``),

plus its token count. ``save_request`` copies exactly that to CPU tensors (a ``RequestSnapshot``);
``restore_request`` allocates a fresh slot and fresh blocks (whichever the allocator hands out) and copies it back,
so the request continues bit-identically to an uninterrupted run: block ids never appear in the data (entries are
addressed through the block table, ring slots by position), so moving pages to other block ids changes nothing
the layers compute. ``HybridCache.preempt_request`` is ``save_request`` followed by ``release``.

Save between steps: after ``prepare_forward`` the token count already includes the prepared step, but its data
is written only when the layers run it. ``save_request`` refuses a request whose step some but not all layers have
run (``StepOrderError``); one saved before any layer ran its step records that in ``RequestSnapshot.missing``, and
the restored request is refused by the layers (``dsv4.cache.steps``).

Integrity: ``save_request`` stores a checksum of the snapshot; ``restore_request`` validates every field, tensor,
the checksum and the values before it writes a byte (``check_snapshot``, ``dsv4.cache.integrity``).

Pages are copied whole (the part of the last block that holds no entry yet is copied too, so a restored block is
byte-for-byte the saved one). Blocks shared with other requests (reference count > 1) are saved as copies. On
restore, the leading blocks that came from the prefix cache (``dsv4.cache.prefix``) are shared again if the cache
still holds them as the same publication (cached blocks are never written, so their bytes are the saved ones);
the others are restored as private blocks. The request's known token ids travel with the snapshot, so a restored
request keeps publishing its prefix.

The other way to preempt without loss is to drop the request (``release``) and later recompute it: add it again
and run its tokens through the layers (tested in ``tests/cache/test_cache_preemption.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .errors import CacheFullError, CorruptSnapshotError, DuplicateRequestError, IncompatibleSnapshotError
from .integrity import snapshot_digest, value_problems
from .prefix import as_token_ids
from .records import CacheGeometry, RequestRecord
from .schema import blocks_for_tokens

if TYPE_CHECKING:
    from .manager import HybridCache

__all__ = ["CacheGeometry", "RequestSnapshot", "restore_request", "save_request"]


@dataclass(frozen=True, eq=False)
class RequestSnapshot:
    """Host copy of one request's cache (``HybridCache.save_request``).

    Attributes:
        request_id: the id the request had when it was saved (``restore_request`` may give it another).
        num_tokens: tokens cached (positions ``0 … num_tokens−1``).
        num_blocks: blocks in its block table, ``blocks_for_tokens(num_tokens, m_min, block_size)``.
        geometry: the cache it was taken from (restore needs the same).
        state: ``{(layer_idx, name): CPU tensor}`` — the request's row of every state tensor, shaped like one row of
            ``StateCache.tensors[layer_idx][name]``: ``ring`` uint8 ``[ring_page_bytes]``, ``ring_positions`` int32
            ``[window]``, CSA ``tail_kv / tail_gate`` fp32 ``[m, 2c]``, ``prev_kv / prev_gate`` fp32 ``[m, c]`` and
            the ``index_*`` ones (c = index_head_dim), HCA ``tail_kv / tail_gate`` fp32 ``[m', c]``.
        pages: ``{(layer_idx, name): CPU uint8 tensor [num_blocks, page_bytes]}`` for ``kv_pages`` (CSA/HCA) and
            ``index_pages`` (CSA): row j is the page of logical block j (token positions
            ``j·block_size … (j+1)·block_size−1``) in the layer's storage format.
        token_ids: the request's known token ids (``None``: it was added without).
        prefix_nodes: ``(chain key, publication uid)`` of its leading blocks that came from / went into the prefix
            cache (restore shares those blocks again while the cache still holds them).
        checksum: SHA-256 (hex) of every field above and every tensor's bytes, taken at save time
            (``dsv4.cache.integrity`` says exactly what it covers); ``restore_request`` refuses a snapshot that no
            longer matches it.
        missing: why the request's cache lacked the data of some of its tokens when it was saved (saved after
            ``prepare_forward`` and before the layers ran that step; see ``dsv4.cache.steps``), else ``None``. A
            restored request keeps the note, and layers refuse to run it.
    """

    request_id: str
    num_tokens: int
    num_blocks: int
    geometry: CacheGeometry
    state: dict[tuple[int, str], Tensor]
    pages: dict[tuple[int, str], Tensor]
    token_ids: tuple[int, ...] | None = None
    prefix_nodes: tuple[tuple[bytes, int], ...] = ()
    checksum: str = ""
    missing: str | None = None

    def digest(self) -> str:
        """SHA-256 (hex) of every field and tensor byte as they are now (``checksum`` holds the one taken at save
        time; ``dsv4.cache.integrity.snapshot_digest`` says what it covers)."""
        return snapshot_digest(self.request_id, self.num_tokens, self.num_blocks, self.missing, self.geometry,
                               self.state, self.pages, (self.token_ids, self.prefix_nodes))

    @property
    def nbytes(self) -> int:
        """Host bytes held by the snapshot's tensors."""
        return sum(t.numel() * t.element_size() for d in (self.state, self.pages) for t in d.values())

    def __repr__(self) -> str:
        return (
            f"RequestSnapshot({self.request_id!r}, {self.num_tokens} tokens, {self.num_blocks} blocks, "
            f"{len(self.geometry.layers)} layers, {self.nbytes} B)"
        )


def save_request(cache: HybridCache, request_id: str) -> RequestSnapshot:
    """Copy ``request_id``'s state rows and block pages to CPU; the cache is not changed.

    Raises:
        UnknownRequestError: the id is not active.
        StepOrderError: the request is in a step that some but not all layers have run.
    """
    rec = cache._record(request_id)
    cache.steps.check_mutation("save", request_id)
    state = {
        (layer, name): t[rec.slot].to("cpu", copy=True)
        for layer, d in cache.state.tensors.items()
        for name, t in d.items()
    }
    idx = torch.tensor(rec.blocks, dtype=torch.int64, device=cache.device)
    pages = {
        (layer, name): t.index_select(0, idx).to("cpu", copy=True)
        for layer, d in cache.pool.tensors.items()
        for name, t in d.items()
    }
    missing = rec.missing or cache.steps.unwritten(request_id)
    geometry = CacheGeometry.of(cache)
    pr = cache.prefix.requests.get(request_id)
    token_ids = tuple(pr.token_ids) if pr is not None else None
    prefix_nodes = cache.prefix.published_nodes(request_id)
    snapshot = RequestSnapshot(
        request_id=request_id, num_tokens=rec.num_tokens, num_blocks=len(rec.blocks), geometry=geometry,
        state=state, pages=pages, token_ids=token_ids, prefix_nodes=prefix_nodes, missing=missing,
    )
    return dataclasses.replace(snapshot, checksum=snapshot.digest())


def check_snapshot(cache: HybridCache, snapshot: RequestSnapshot) -> None:
    """Raise unless ``snapshot`` can be restored into ``cache``; reads the snapshot, changes nothing.

    In order: the fields' types; the geometry (config, layers, block size, numerics); the token and block
    counts; every state row and page tensor present, a dense tensor on the CPU (or the cache's device) with this
    cache's shape and dtype (``IncompatibleSnapshotError`` for all of these); the checksum taken at save time; the
    values (``dsv4.cache.integrity.value_problems``) (``CorruptSnapshotError`` for these two)."""
    if not isinstance(snapshot, RequestSnapshot):
        raise IncompatibleSnapshotError(f"expected a RequestSnapshot from save_request, got {type(snapshot).__name__}")
    fields = (
        ("request_id", str), ("num_tokens", int), ("num_blocks", int), ("geometry", CacheGeometry),
        ("state", dict), ("pages", dict), ("checksum", str), ("missing", (str, type(None))),
    )
    for name, kind in fields:
        v = getattr(snapshot, name, None)
        if not isinstance(v, kind) or isinstance(v, bool):
            raise IncompatibleSnapshotError(f"snapshot field {name} has the wrong type: {type(v).__name__} {v!r:.60}")
    rid = snapshot.request_id
    diffs = snapshot.geometry.mismatch(CacheGeometry.of(cache))
    if diffs:
        raise IncompatibleSnapshotError(f"snapshot of {rid!r} comes from a cache of another geometry: " + "; ".join(diffs))
    want_blocks = blocks_for_tokens(snapshot.num_tokens, cache.min_ratio, cache.block_size)
    if not 0 <= snapshot.num_tokens <= cache.cfg.max_position or snapshot.num_blocks != want_blocks:
        raise IncompatibleSnapshotError(
            f"snapshot of {rid!r}: {snapshot.num_blocks} blocks for {snapshot.num_tokens} tokens, want {want_blocks} "
            f"(and 0 <= num_tokens <= max_position {cache.cfg.max_position})"
        )
    want: dict[tuple, tuple[tuple[int, ...], torch.dtype]] = {}
    for layer, d in cache.state.tensors.items():
        for name, t in d.items():
            want[("state", layer, name)] = (tuple(t.shape[1:]), t.dtype)
    for layer, d in cache.pool.tensors.items():
        for name, t in d.items():
            want[("pages", layer, name)] = ((snapshot.num_blocks, *t.shape[1:]), t.dtype)
    have = {
        (group, *(k if isinstance(k, tuple) else (k,))): v
        for group, d in (("state", snapshot.state), ("pages", snapshot.pages))
        for k, v in d.items()
    }
    problems = [f"{k[0]} {k[1:]} missing" for k in want.keys() - have.keys()]
    problems += [f"unexpected {k[0]} {k[1:]}" for k in have.keys() - want.keys()]
    devices = {torch.device("cpu"), cache.device}
    for k in want.keys() & have.keys():
        t, (shape, dtype) = have[k], want[k]
        if not isinstance(t, Tensor) or t.layout != torch.strided:
            problems.append(f"{k[0]} {k[1:]} is {type(t).__name__}{'' if not isinstance(t, Tensor) else ' ' + str(t.layout)}, want a dense tensor")
        elif tuple(t.shape) != shape or t.dtype != dtype:
            problems.append(f"{k[0]} {k[1:]} is {list(t.shape)} {t.dtype}, want {list(shape)} {dtype}")
        elif t.device not in devices:
            problems.append(f"{k[0]} {k[1:]} is on {t.device}, want " + " or ".join(sorted({"cpu", str(cache.device)})))
    if snapshot.token_ids is not None:
        try:
            ids = as_token_ids(snapshot.token_ids, "token_ids")
        except (TypeError, ValueError) as e:
            problems.append(str(e))
        else:
            if len(snapshot.prefix_nodes) * cache.block_size > min(len(ids), snapshot.num_tokens):
                problems.append(f"prefix_nodes cover more than its {len(ids)} token ids / {snapshot.num_tokens} tokens")
    nodes = snapshot.prefix_nodes
    if not isinstance(nodes, tuple) or not all(
        isinstance(n, tuple) and len(n) == 2 and isinstance(n[0], bytes) and isinstance(n[1], int) for n in nodes
    ):
        problems.append("prefix_nodes must be (chain key, uid) pairs")
    if problems:
        raise IncompatibleSnapshotError(f"snapshot of {rid!r} does not fit this cache: " + "; ".join(sorted(problems)))
    if snapshot.digest() != snapshot.checksum:
        raise CorruptSnapshotError(
            f"snapshot of {rid!r} fails its checksum: its tensors or fields changed after save_request "
            f"(corrupted or edited); restore refused"
        )
    bad = value_problems(cache, snapshot.num_tokens, snapshot.missing, snapshot.state, snapshot.pages)
    if bad:
        raise CorruptSnapshotError(f"snapshot of {rid!r} holds values no cache can: " + "; ".join(bad))


def restore_request(cache: HybridCache, request_id: str, snapshot: RequestSnapshot) -> int:
    """Re-activate a saved request as ``request_id`` in a fresh state slot and fresh blocks; returns the slot.

    Validates everything first and changes nothing when it raises.

    Raises:
        TypeError: ``request_id`` is not a str.
        DuplicateRequestError: ``request_id`` is already active.
        StepOrderError: a step is partly run (see ``dsv4.cache.steps``).
        IncompatibleSnapshotError: see ``check_snapshot`` (``CorruptSnapshotError``: checksum or values).
        CacheFullError: no free state slot, or fewer free blocks than ``snapshot.num_blocks``.
    """

    if not isinstance(request_id, str):
        raise TypeError(f"request ids are str, got {type(request_id).__name__} {request_id!r}")
    if request_id in cache:
        raise DuplicateRequestError(f"request {request_id!r} is already active (slot {cache.slot(request_id)})")
    cache.steps.check_mutation("restore_request")
    check_snapshot(cache, snapshot)
    if cache.state.num_free == 0:
        raise CacheFullError(
            f"cannot restore request {request_id!r}: all {cache.state.max_requests} state slots are in use"
        )
    token_ids = None if snapshot.token_ids is None else as_token_ids(snapshot.token_ids)
    shared = [] if token_ids is None else cache.prefix.reusable(snapshot.prefix_nodes, token_ids, snapshot.pages)
    need = snapshot.num_blocks - len(shared)
    unused = {id(n) for n in shared if n.users == 0}
    evictable = cache.prefix.num_evictable() - len(unused) if need > cache.allocator.num_free else 0
    if need > cache.allocator.num_free + evictable:
        raise CacheFullError(
            f"cannot restore request {request_id!r}: it needs {need} blocks but only "
            f"{cache.allocator.num_free} of {cache.allocator.num_blocks} are free"
            + (f" (+ {evictable} in unused cached prefixes)" if evictable else "")
        )

    slot = cache.state.allocate_slot()
    cache.nonfinite[slot].zero_()
    cache.prefix.attach_restored(request_id, token_ids, shared)  # now used: publication and eviction keep them
    kept = [n.block for n in shared]
    cache.allocator.incref(kept)
    cache.prefix.apply_pending()
    cache.prefix.ensure_free_blocks(need)
    fresh = cache.allocator.allocate(need)
    try:
        for (layer, name), row in snapshot.state.items():
            cache.state.tensors[layer][name][slot].copy_(row)
        if fresh:
            idx = torch.tensor(fresh, dtype=torch.int64, device=cache.device)
            for (layer, name), pages in snapshot.pages.items():
                cache.pool.tensors[layer][name].index_copy_(0, idx, pages[len(kept) :].to(cache.device))
    except BaseException:  # e.g. a device error: give the slot and blocks back (free-list order restored)
        cache.allocator.decref(reversed(fresh))
        cache.allocator.decref(kept)
        cache.prefix.forget(request_id)
        cache.state.free_slot(slot)
        raise
    cache._requests[request_id] = RequestRecord(
        slot=slot, num_tokens=snapshot.num_tokens, blocks=kept + fresh, missing=snapshot.missing
    )
    cache.steps.commit_mutation(f"restore_request({request_id!r})", cache._requests)
    return slot
