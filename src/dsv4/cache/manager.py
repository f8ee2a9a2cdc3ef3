"""``HybridCache``: the per-model cache manager (requests, state slots, pool blocks, ``prepare_forward``).

Host side only: it owns the tensors (``CompressedPool``, ``StateCache``), the block allocator and one record per
active request (state slot, tokens cached so far, block table). ``prepare_forward`` is the only place that
allocates; the device step (ops) then runs on the ``StepBatch`` without allocating or syncing.

Every mutating call validates everything first and changes nothing when it raises.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from ..config import LayerKind, ModelConfig, require_config
from ..numerics import Numerics, NumericsLike, resolve_numerics
from .allocator import BlockAllocator
from .batch import StepBatch, build_step_batch
from .capture_index import build_capture_index
from .errors import CacheFullError, DuplicateRequestError, InvalidPlanError, UnknownRequestError
from .invariants import check_invariants
from .layer_view import LayerCache, resolve_device
from .plan_check import Plan, check_int, check_plan_requests, normalise_plan
from .pool import CompressedPool
from .preempt import RequestSnapshot, restore_request, save_request
from .prefix import PrefixCache, PrefixSnapshot, as_token_ids, prefix_state_bytes
from .records import RequestRecord
from .schema import LayerCacheSchema, resolve_layers, layer_schemas
from .snapshot import CacheSnapshot, cache_tensors, snapshot_differences, take_snapshot
from .state import StateCache
from .steps import StepLedger
from .workspace import Workspace

__all__ = ["HybridCache", "LayerCache", "CacheSnapshot", "RequestRecord"]

class HybridCache:
    """Paged, quantized KV cache of a stack of DeepSeek-V4 attention layers.

    Args:
        cfg: model configuration.
        layers: layer indices to cache (default ``range(cfg.num_layers)``: the main layers; pass MTP indices
            explicitly to cache them too).
        max_requests: state slots (concurrent requests).
        num_blocks: pool blocks (shared by all compressed layers). Exactly one of ``num_blocks`` /
            ``memory_bytes`` must be given.
        memory_bytes: total budget; ``num_blocks`` becomes what fits after the fixed state of ``max_requests``
            slots.
        block_size: token positions per pool block; a multiple of every cached compression ratio.
        device: where the tensors live.
        numerics: ``"official"`` / ``"exact"`` / a ``Numerics``: picks the KV and indexer storage formats.
        max_step_tokens: token budget of one step: ``prepare_forward`` rejects a plan scheduling more new tokens
            in all (``InvalidPlanError``, nothing changes). ``None``: no limit.
        prefix_states: prefix caching (``dsv4.cache.prefix``): how many state snapshots at block boundaries the
            cache keeps (each ``prefix_state_bytes``; with ``memory_bytes`` they come out of the budget). 0: off.
        cp_rank, cp_size: context parallelism (``dsv4.distributed``): this cache is rank ``cp_rank`` of
            ``cp_size`` and holds only the compressed entries ``i ≡ cp_rank (mod cp_size)`` of every request (pool
            pages of ``block_size // m // cp_size`` entries; see ``LayerCacheSchema``). Everything else — requests,
            block tables, state slots, the SWA rings and compressor tails — is the same on every rank of the group.

    Every constructor argument is validated (``InvalidPlanError`` naming the bad value; an unknown layer index
    raises ``IndexError``).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layers: Iterable[int] | None = None,
        max_requests: int = 8,
        num_blocks: int | None = None,
        memory_bytes: int | None = None,
        block_size: int = 256,
        device: torch.device | str = "cpu",
        numerics: NumericsLike = "official",
        max_step_tokens: int | None = None,
        prefix_states: int = 0,
        cp_rank: int = 0,
        cp_size: int = 1,
    ) -> None:
        require_config(cfg)
        if (num_blocks is None) == (memory_bytes is None):
            raise InvalidPlanError("give exactly one of num_blocks / memory_bytes")
        check_int("block_size", block_size, 1)
        check_int("max_requests", max_requests, 1)
        if num_blocks is not None:
            check_int("num_blocks", num_blocks, 0)
        if memory_bytes is not None:
            check_int("memory_bytes", memory_bytes, 0)
        if max_step_tokens is not None:
            check_int("max_step_tokens", max_step_tokens, 1)
        check_int("prefix_states", prefix_states, 0)
        check_int("cp_size", cp_size, 1)
        check_int("cp_rank", cp_rank, 0)
        if cp_rank >= cp_size:
            raise InvalidPlanError(f"cp_rank must be < cp_size ({cp_size}), got {cp_rank}")
        self.cp_rank, self.cp_size = int(cp_rank), int(cp_size)
        self.max_step_tokens: int | None = None if max_step_tokens is None else int(max_step_tokens)
        self.cfg = cfg
        self.numerics: Numerics = resolve_numerics(numerics)
        self.block_size = int(block_size)
        self.device = resolve_device(device)
        self.layer_indices: list[int] = resolve_layers(cfg, layers)
        self.schemas: dict[int, LayerCacheSchema] = {
            s.layer_idx: s
            for s in layer_schemas(cfg, self.layer_indices, self.numerics, self.block_size, self.cp_rank, self.cp_size)
        }
        self.ratios: tuple[int, ...] = tuple(sorted({s.ratio for s in self.schemas.values() if s.ratio}))
        self._csa_ratios = {s.ratio for s in self.schemas.values() if s.kind is LayerKind.CSA}
        self.min_ratio: int = self.ratios[0] if self.ratios else 0
        state_per_slot = sum(s.state_bytes_per_request for s in self.schemas.values())
        pool_per_block = sum(s.pool_bytes_per_block for s in self.schemas.values())
        if memory_bytes is not None:
            fixed = max_requests * state_per_slot + prefix_states * prefix_state_bytes(self.schemas.values())
            if memory_bytes < fixed:
                raise InvalidPlanError(
                    f"memory_bytes {memory_bytes} cannot hold the fixed state of {max_requests} slots "
                    f"({state_per_slot} B each) and {prefix_states} prefix states ({fixed} B in all)"
                )
            num_blocks = (memory_bytes - fixed) // pool_per_block if pool_per_block else 0
        self.state = StateCache(list(self.schemas.values()), max_requests, self.device)
        self.pool = CompressedPool(list(self.schemas.values()), int(num_blocks), self.device)
        self.workspace = Workspace(self.device)
        self.allocator = BlockAllocator(int(num_blocks))
        self._requests: dict[str, RequestRecord] = {}
        self.steps = StepLedger(self.layer_indices)
        #: int32 [max_requests]: 1 where a layer step with ``nan_policy="flag"`` left NaN/Inf (see ``nonfinite_requests``)
        self.nonfinite = torch.zeros(self.state.max_requests, dtype=torch.int32, device=self.device)
        self.prefix = PrefixCache(self, int(prefix_states))

    # ================================================================ requests
    def add_request(self, request_id: str, token_ids: Sequence[int] | Tensor | None = None) -> int:
        """Register ``request_id`` with a fresh (reset) state slot; returns the slot.

        ``token_ids``: the prompt's token ids (a sequence of ints or a 1-D integer tensor). With prefix caching on,
        the cache looks up the longest cached prefix of them (whole blocks, at most ``len − 1`` tokens, see
        ``dsv4.cache.prefix``); on a hit the request starts with that prefix's blocks (shared) and the state at
        its end, and ``num_tokens(request_id)`` (= ``cached_tokens(request_id)``) tells how many tokens are
        already computed: the caller feeds the rest from there. The ids also let ``prepare_forward`` check the
        tokens fed later (its ``token_ids``).

        Raises:
            TypeError: the id is not a str, or ``token_ids`` is not a sequence of ints.
            InvalidPlanError: a token id out of range, or more ids than ``cfg.max_position``.
            DuplicateRequestError: the id is already active.
            CacheFullError: no free state slot.
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request ids are str, got {type(request_id).__name__} {request_id!r}")
        ids = None if token_ids is None else as_token_ids(token_ids)
        if ids is not None and len(ids) > self.cfg.max_position:
            raise InvalidPlanError(
                f"request {request_id!r}: {len(ids)} token ids exceed max_position {self.cfg.max_position}"
            )
        if request_id in self._requests:
            raise DuplicateRequestError(f"request {request_id!r} is already active (slot {self._requests[request_id].slot})")
        self.steps.check_mutation("add_request")
        if self.state.num_free == 0:
            raise CacheFullError(
                f"cannot add request {request_id!r}: all {self.state.max_requests} state slots are in use"
            )
        self.prefix.apply_pending()
        slot = self.state.allocate_slot()  # resets the slot
        self.nonfinite[slot].zero_()  # a kernel: assigning a Python number would copy it synchronously
        rec = self._requests[request_id] = RequestRecord(slot=slot)
        pr = self.prefix.register(request_id, ids)
        if pr is not None:
            self.prefix.attach_hit(rec, pr, self.prefix.lookup(pr.token_ids))
        self.steps.commit_mutation(f"add_request({request_id!r})", self._requests)
        return slot

    def release(self, request_id: str, *, cache_prefix: bool = True) -> None:
        """Free the request's blocks (decref) and its state slot (reset). Unknown id → ``UnknownRequestError``.

        Blocks other requests or the prefix cache still reference stay (shared blocks are only ever dropped by
        their last reference). ``cache_prefix=False``: do not publish the request's last step into the prefix
        cache — for a request whose last prepared step did not run through every layer (an abandoned step)."""
        self._release(request_id, f"release({request_id!r})", cache_prefix)

    def _release(self, request_id: str, action: str, cache_prefix: bool = True) -> None:
        rec = self._record(request_id)
        if not cache_prefix:
            self.prefix.drop_step(request_id)
        self.prefix.apply_pending()
        self.allocator.decref(rec.blocks)
        self.prefix.forget(request_id)
        self.state.free_slot(rec.slot)
        self.nonfinite[rec.slot].zero_()
        del self._requests[request_id]
        self.steps.commit_mutation(action, self._requests)

    # ================================================================ preemption (see dsv4.cache.preempt)
    def save_request(self, request_id: str) -> RequestSnapshot:
        """CPU copy of the request's cache (state rows of every layer, pages of its blocks, token count); the
        cache is not changed. Unknown id → ``UnknownRequestError``. See ``RequestSnapshot`` for shapes."""
        return save_request(self, request_id)

    def restore_request(self, request_id: str, snapshot: RequestSnapshot) -> int:
        """Re-activate a saved request as ``request_id`` in a fresh slot and fresh blocks (copying the snapshot in);
        returns the slot. The request then continues bit-identically to an uninterrupted run.

        Raises (nothing changes):
            DuplicateRequestError: ``request_id`` is active.
            IncompatibleSnapshotError: snapshot of another cache geometry, or tensors of the wrong shape / dtype.
            CacheFullError: no free slot, or fewer free blocks than the snapshot holds.
        """
        return restore_request(self, request_id, snapshot)

    def preempt_request(self, request_id: str) -> RequestSnapshot:
        """``save_request`` then ``release``: frees the request's slot and blocks, returns what restores it."""
        self._record(request_id)
        self.steps.check_mutation("preempt", request_id)
        self.prefix.apply_pending()
        snapshot = save_request(self, request_id)
        self._release(request_id, f"preempt_request({request_id!r})")
        return snapshot

    # ================================================================ prefix caching (see dsv4.cache.prefix)
    def cached_tokens(self, request_id: str) -> int:
        """Tokens the request got from the prefix cache when it was added (0: a miss or no token ids)."""
        self._record(request_id)
        pr = self.prefix.requests.get(request_id)
        return pr.cached_tokens if pr is not None else 0

    def publish_prefixes(self) -> None:
        """Publish into the prefix cache what the steps prepared so far computed (their layers must have run).
        Every mutating call does this first; call it to see those prefixes (e.g. in a scheduler's lookups)."""
        self.prefix.apply_pending()

    @property
    def prefix_state_bytes(self) -> int:
        """Bytes of one prefix state snapshot (the live state of every layer at a block boundary)."""
        return prefix_state_bytes(self.schemas.values())

    def prefix_cache_bytes(self) -> int:
        """Memory only the prefix cache keeps alive: cached blocks no active request uses, plus the state
        snapshots held (blocks shared with active requests are counted by ``memory_in_use`` as theirs)."""
        return self.prefix.held_bytes()

    @property
    def num_reclaimable_blocks(self) -> int:
        """Free blocks plus the cached prefix blocks no active request uses (evicted when blocks are needed)."""
        return self.allocator.num_free + self.prefix.num_evictable()

    def clear_prefix_cache(self) -> int:
        """Evict every cached prefix no active request uses; returns the blocks freed."""
        self.prefix.apply_pending()
        return self.prefix.clear()

    def export_prefix(self, token_ids: Sequence[int] | Tensor) -> PrefixSnapshot | None:
        """CPU copy of the longest cached prefix of ``token_ids`` that ends in a state snapshot (its blocks' pages,
        the snapshot, its token ids), or ``None``; the cache is not changed. ``import_prefix`` puts it into a cache
        of the same geometry (e.g. on another device, or after a restart)."""
        return self.prefix.export(as_token_ids(token_ids))

    def import_prefix(self, snapshot: PrefixSnapshot) -> int:
        """Add an exported prefix to this cache's prefix cache (fresh blocks and a snapshot row; evicts unused
        prefixes if needed). Returns the tokens it makes available, or 0 when the cache already holds a prefix
        starting with the same block (a prefix is never assembled from two computations).

        Raises (nothing changes):
            IncompatibleSnapshotError: not a ``PrefixSnapshot``, taken from a cache of another geometry (config,
                layers, block size, numerics), or tensors of the wrong shape / dtype.
            InvalidPlanError: prefix caching is off.
            CacheFullError: not enough free or evictable blocks.
        """
        ids = self.prefix.check_import(snapshot)
        return self.prefix.import_(snapshot, ids)

    def prepare_forward(
        self, plan: Plan, *, max_blocks: int | None = None, token_ids: Mapping[str, Sequence[int] | Tensor] | None = None
    ) -> StepBatch:
        """Schedule one step: ``plan`` maps request id → number of new tokens (plan order = token order).

        ``max_blocks`` pads the batch's device block table to that width, so batches of the same plan shape have
        identical tensor shapes (for CUDA-graph replay through ``StepBatch.copy_``; see ``dsv4.cache.batch``).

        ``token_ids`` (optional): ``{request id: the ids of its new tokens}`` for some of the plan's requests. Ids
        of positions the cache already knows (from ``add_request`` or earlier steps) must agree with them; new
        ones extend them, so prefix caching can publish the blocks they fill (e.g. generated tokens).

        Blocks are taken from the free list, then from cached prefixes no active request uses (least recently
        used first, see ``dsv4.cache.prefix``).

        Validates everything first (non-empty plan; known ids, none twice; counts are ints ≥ 1; new lengths ≤
        ``cfg.max_position``; at most ``max_step_tokens`` new tokens in all; token ids; enough free blocks for all
        requests together), then grows each request's block table to ``blocks_for_tokens(end, m_min, block_size)`` blocks,
        advances its token count and returns the ``StepBatch`` on the cache's device. On any error nothing changes
        (docs/errors.md lists every error).

        Raises:
            InvalidPlanError: malformed plan, or more tokens than ``max_step_tokens``.
            UnknownRequestError: an id that is not active.
            CacheFullError: not enough free pool blocks.
        """
        self.steps.check_mutation("prepare_forward")
        items = normalise_plan(plan)
        if max_blocks is not None:
            check_int("max_blocks", max_blocks, 0)
        needs = check_plan_requests(
            items, self._record, max_position=self.cfg.max_position, max_step_tokens=self.max_step_tokens,
            min_ratio=self.min_ratio, block_size=self.block_size,
        )
        step_ids = self.prefix.check_step_ids(items, token_ids)
        total = sum(needs)
        evictable = self.prefix.num_evictable() if total > self.allocator.num_free else 0
        if total > self.allocator.num_free + evictable:
            detail = ", ".join(f"{rid!r}: {k}" for (rid, _), k in zip(items, needs) if k)
            raise CacheFullError(
                f"step needs {total} new blocks ({detail}) but only {self.allocator.num_free} of "
                f"{self.allocator.num_blocks} are free" + (f" (+ {evictable} in unused cached prefixes)" if evictable else "")
            )

        # ---- commit (allocation is atomic; roll back if building the batch fails)
        recs = [self._requests[rid] for rid, _ in items]
        self.prefix.check_writable((rid, r.blocks, r.num_tokens) for (rid, _), r in zip(items, recs))
        self.prefix.apply_pending()
        self.prefix.ensure_free_blocks(total)
        new_blocks = self.allocator.allocate(total)
        starts = [r.num_tokens for r in recs]
        tables, offset = [], 0
        for rec, k in zip(recs, needs):
            tables.append(rec.blocks + new_blocks[offset : offset + k])
            offset += k
        try:
            batch = build_step_batch(
                request_ids=[rid for rid, _ in items],
                num_new=[int(n) for _, n in items],
                start_positions=starts,
                slots=[r.slot for r in recs],
                block_tables=tables,
                ratios=self.ratios,
                block_size=self.block_size,
                window=self.cfg.window,
                device=self.device,
                max_blocks=max_blocks,
            )
        except BaseException:
            self.allocator.decref(reversed(new_blocks))  # reversed: the free list gets its exact order back
            raise
        for rec, table, (_, n) in zip(recs, tables, items):
            rec.blocks = table
            rec.num_tokens += int(n)
        self.steps.commit_mutation("prepare_forward", self._requests)
        batch.ticket = self.steps.open_step(self._requests, [(rid, int(n)) for rid, n in items])
        self.prefix.after_step(items, step_ids)
        batch.prefix_captures = self.prefix.plan_captures(items)
        batch.prefix_capture_index = build_capture_index(
            batch.prefix_captures, batch.num_new, batch.start_positions, self.cfg.window, self._csa_ratios, self.device)
        return batch

    def repeatable(self, batch: StepBatch) -> StepBatch:
        """``batch`` as a step the layers run without step accounting, as often as asked — for benchmarks that
        time a layer step by repeating it (the rows it writes then hold whatever the last repetition left: use a
        cache made for the benchmark). Raises ``StaleBatchError`` unless ``batch`` is this cache's current step."""
        self.steps.check(batch, ())
        return dataclasses.replace(batch, ticket=self.steps.pad_ticket(batch.ticket.step), plans={})

    def claim_step(self, batch: StepBatch, layers: Iterable[int] | None = None) -> list[int]:
        """Record that ``layers`` (default: every cached layer that has not run it yet) ran ``batch``'s step by
        other means than ``dsv4.Attention``: a CUDA-graph replay (no Python runs inside it; call this right before
        the replay), or a caller that writes the step's data itself (cache-only tests, benchmarks that advance
        positions). ``Attention`` claims its own layer. Returns the layers recorded.

        Raises (nothing changes):
            StaleBatchError: ``batch`` is not this cache's current step (see ``dsv4.cache.steps``).
            StepOrderError: one of ``layers`` already ran the step, is not cached, or a request of the step
                lacks cache data.
        """
        todo = self.steps.remaining() if layers is None else list(layers)
        for li in todo:
            if isinstance(li, bool) or not isinstance(li, numbers.Integral):
                raise TypeError(f"layers must be layer indices (int), got {type(li).__name__} {li!r}")
        return self.steps.claim(batch, todo)

    def _record(self, request_id: str) -> RequestRecord:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise UnknownRequestError(
                f"unknown request {request_id!r} (active: {len(self._requests)} requests)"
            ) from None

    # ================================================================ NaN / Inf flags (nan_policy="flag")
    def flag_nonfinite(self, batch: StepBatch, bad: Tensor) -> None:
        """Record (on the device, no sync) that the requests ``bad`` [B] (nonzero = affected) of ``batch`` got
        NaN / Inf in their outputs or cache rows. Layers with ``nan_policy="flag"`` call this."""
        self.nonfinite.scatter_reduce_(0, batch.slots, bad.to(self.nonfinite.dtype), "amax")

    def nonfinite_requests(self) -> list[str]:
        """Active requests whose outputs or cache received NaN / Inf in a layer step with ``nan_policy="flag"``
        (host sync). Their cache must not be trusted: release them (and recompute, or restore a snapshot saved
        earlier; a snapshot holding NaN / Inf is refused by ``restore_request``)."""
        flags = self.nonfinite.tolist()
        return [rid for rid, rec in self._requests.items() if flags[rec.slot]]

    # ================================================================ introspection
    def num_tokens(self, request_id: str) -> int:
        """Tokens cached for the request so far (including those of prepared steps)."""
        return self._record(request_id).num_tokens

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table (physical block per logical block)."""
        return list(self._record(request_id).blocks)

    def slot(self, request_id: str) -> int:
        """The request's state slot."""
        return self._record(request_id).slot

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def max_requests(self) -> int:
        return self.state.max_requests

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_free_slots(self) -> int:
        return self.state.num_free

    @property
    def active_requests(self) -> list[str]:
        """Active request ids, in the order they were added."""
        return list(self._requests)

    def layer(self, layer_idx: int) -> LayerCache:
        """The tensors and schema of one cached layer."""
        if layer_idx not in self.schemas:
            raise KeyError(f"layer {layer_idx} is not cached (cached layers: {self.layer_indices})")
        pool = self.pool.tensors.get(layer_idx, {})
        return LayerCache(
            schema=self.schemas[layer_idx],
            kv_pages=pool.get("kv_pages"),
            index_pages=pool.get("index_pages"),
            state=self.state.tensors[layer_idx],
            workspace=self.workspace,
            prefix_states=self.prefix.states.tensors.get(layer_idx, {}),
        )

    def memory_bytes(self) -> int:
        """Bytes of every tensor the cache allocated (pool pages + state + prefix state snapshots)."""
        return self.pool.nbytes() + self.state.nbytes() + self.prefix.states.nbytes()

    def memory_in_use(self) -> int:
        """Bytes of the blocks in use (cached prefixes included) plus the state of active slots and the prefix
        state snapshots held."""
        rows = self.prefix.states.num_rows - len(self.prefix.states.free_rows)
        return (
            self.allocator.num_used * self.pool.bytes_per_block + len(self._requests) * self.state.bytes_per_slot
            + rows * self.prefix.states.bytes_per_row
        )

    # ================================================================ checks and snapshots
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` on the first broken invariant of the cache's blocks, tables, slots and prefix
        cache (host sync; the list: ``dsv4.cache.invariants.check_invariants``)."""
        check_invariants(self)

    def _tensors(self) -> dict[tuple[str, int, str], Tensor]:
        """Every cache tensor (live, not copied) by ``("state" | "pool", layer, name)``, and the NaN flags."""
        return cache_tensors(self)

    def snapshot(self) -> CacheSnapshot:
        """Deep copy of all host records and device tensors (expensive; for tests and debugging;
        ``dsv4.cache.snapshot``)."""
        return take_snapshot(self)

    def differences(self, snap: CacheSnapshot) -> list[str]:
        """What differs between the cache now and ``snap`` (empty list: identical, byte for byte)."""
        return snapshot_differences(self, snap)

    def equal_to_snapshot(self, snap: CacheSnapshot) -> bool:
        return not self.differences(snap)

    def assert_same(self, snap: CacheSnapshot) -> None:
        """``AssertionError`` listing every difference from ``snap``."""
        diffs = self.differences(snap)
        if diffs:
            raise AssertionError("cache changed: " + "; ".join(diffs))

    def __repr__(self) -> str:
        def desc(s: LayerCacheSchema) -> str:
            return f"{s.layer_idx}:{s.kind.name}" + (f"/{s.ratio}" if s.ratio else "")

        layers = ", ".join(desc(s) for s in self.schemas.values())
        return (
            f"HybridCache({self.cfg.name}, layers=[{layers}], kv={self.numerics.kv_format}, "
            f"index={self.numerics.index_format}, block_size={self.block_size}, "
            f"blocks {self.allocator.num_used}/{self.allocator.num_blocks} used, "
            f"slots {len(self._requests)}/{self.max_requests} used, "
            f"{self.memory_bytes() / 2**20:.2f} MiB on {self.device})"
        )
