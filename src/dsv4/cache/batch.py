"""``StepBatch``: everything the device side of one step needs, built once on the host by
``HybridCache.prepare_forward`` and consumed by the ops without host branching or syncs.

Tokens of all scheduled requests are concatenated in plan order: request b owns tokens
``cu_seqlens[b] … cu_seqlens[b+1]−1``, at positions ``start_pos[b] … end_pos[b]−1``.

Compressed entry i of a layer with ratio m covers tokens ``[i·m, (i+1)·m)``; it is emitted in the step that
processes token ``(i+1)·m − 1``, stored in block ``block_tables[b, (i·m) // block_size]`` at slot
``((i·m) % block_size) // m``, carries RoPE position ``i·m``, and is visible to a query at t iff
``i < (t+1) // m`` (SPEC §4, §6).

CUDA graphs. The ``emit_*`` lists have a length E_m that changes from step to step, so a captured graph cannot
use them. Every batch therefore also carries fixed-capacity copies, ``emit_pad_request`` / ``emit_pad_entry``,
of length ``emit_capacity[m] = Σ_b ⌈num_new[b] / m⌉`` (an upper bound on E_m that depends only on the step's
geometry), padded with request −1, and the count itself on the device (``num_emit_device``). The recipe for an
engine that captures a step once and replays it:

1. ``static = cache.prepare_forward(plan, max_blocks=N)`` — pad the block tables to a fixed width ``N`` (the most
   blocks a request may hold), so every later batch of the same plan shape has identical tensor shapes;
2. run the layers once eagerly on ``static`` (warm-up: Triton compilation, workspace growth), then capture them in
   a ``torch.cuda.CUDAGraph`` (capture records launches, it does not run them);
3. every step: ``fresh = cache.prepare_forward(plan, max_blocks=N)`` (same request count and tokens per
   request, any positions / slots / blocks), ``static.copy_(fresh)``, copy the inputs into the captured input
   tensors, ``graph.replay()``.

Graph-safe kernels read only the fixed-shape device tensors (never ``num_emit`` or the unpadded ``emit_*``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from .packed import Packing, pack_to_device
from .steps import StepTicket

__all__ = ["StepBatch", "visible_entries", "build_step_batch"]

_PER_M = (
    "entries_before", "entries_after", "entries_to_emit", "cu_emit", "visible_entries", "emit_pad_request",
    "emit_pad_entry", "num_emit_device", "emit_request", "emit_entry", "emit_block", "emit_slot", "emit_position",
)


def visible_entries(positions: Tensor, m: int) -> Tensor:
    """Compressed entries visible to a query at each position: ``(t + 1) // m`` (SPEC §6).

    Computed from positions, never from block counts (a partly filled last block would overstate it).

    Args:
        positions: integer ``[...]`` absolute token positions.
        m: compression ratio (≥ 1).
    Returns:
        ``[...]`` same dtype as ``positions``.
    """
    if m < 1:
        raise ValueError(f"compression ratio must be >= 1, got {m}")
    return torch.div(positions + 1, m, rounding_mode="floor")


@dataclass
class StepBatch:
    """One step of the cache: tokens, positions, slots, block tables and the compressed entries it emits.

    B = number of scheduled requests, T = total new tokens, ``m`` ranges over the compression ratios of the
    cached layers (dict keys), E_m = entries emitted this step by layers of ratio m.

    Host attributes:
        request_ids: ``list[str]`` [B], plan order.
        num_new: ``list[int]`` [B], new tokens per request this step.
        start_positions: ``list[int]`` [B], position of each request's first new token.
        num_tokens: ``int`` T = sum(num_new).
        max_new: ``int`` max(num_new).
        block_size: ``int`` token positions per pool block.
        window: ``int`` SWA ring length.
        ratios: ``tuple[int, ...]`` the compression ratios present (sorted), keys of the per-ratio dicts.
        num_emit: ``dict[int, int]`` E_m per ratio (host copy, so ops can size buffers without a sync).
        ticket: ``StepTicket`` set by ``HybridCache.prepare_forward``: the cache and step this batch belongs to
            (layers refuse a batch that is not their cache's current step; see ``dsv4.cache.steps``).

    Device tensors (on the cache's device):
        token_request: int32 [T] — index 0…B−1 of the request each token belongs to.
        positions: int64 [T] — absolute position of each token.
        cu_seqlens: int32 [B+1] — token offsets; request b owns tokens ``cu_seqlens[b]:cu_seqlens[b+1]``.
        start_pos: int64 [B] — position of each request's first new token.
        end_pos: int64 [B] — one past the last new token's position (= tokens cached after this step).
        slots: int64 [B] — state-cache slot of each request.
        token_slots: int64 [T] — state-cache slot of each token's request.
        block_tables: int32 [B, max_blocks] — physical pool block of each logical block, −1 padded;
            ``max_blocks`` = the longest table in this step (0 if no compressed layer is cached).
        ring_slots: int64 [T] — SWA ring slot of each token, ``position % window``.
        ring_keep: bool [T] — the token is among its request's last ``window`` positions of this step, i.e. its
            window entry survives the step and must be written to the ring (the others would be overwritten by
            later tokens of the same step; writing only these keeps ring writes collision-free).
        ring_rows: int64 [K] — the indices of the kept tokens (``ring_keep.nonzero()``), K = Σ_b min(num_new[b],
            window): the ring commit's rows, so its grid covers K tokens, not T (an 8K-token prefill chunk keeps
            128). Depends only on ``num_new``, like the other fixed-shape tensors.
        entries_before[m]: int64 [B] — entries the request had before the step, ``start // m``.
        entries_after[m]: int64 [B] — entries after the step, ``end // m``.
        entries_to_emit[m]: int64 [B] — ``entries_after − entries_before``.
        cu_emit[m]: int64 [B+1] — offsets of each request's emitted entries in the flat ``emit_*`` lists.
        emit_request[m]: int32 [E_m] — request index of each emitted entry.
        emit_entry[m]: int64 [E_m] — entry index i (within its request).
        emit_block[m]: int64 [E_m] — physical block ``block_tables[b, (i·m) // block_size]``.
        emit_slot[m]: int64 [E_m] — slot inside the block, ``((i·m) % block_size) // m``.
        emit_position[m]: int64 [E_m] — RoPE position of the entry, ``i·m`` (first token of its window).
        visible_entries[m]: int64 [T] — compressed entries visible to each token, ``(pos + 1) // m``.

    Fixed-capacity emit metadata (graph-safe; see the module docstring):
        emit_capacity[m]: ``int`` host, ``Σ_b ⌈num_new[b] / m⌉`` ≥ E_m.
        emit_pad_request[m]: int32 [emit_capacity[m]] — ``emit_request[m]`` followed by −1 padding.
        emit_pad_entry[m]: int64 [emit_capacity[m]] — ``emit_entry[m]`` followed by 0 padding.
        num_emit_device[m]: int32 [1] — E_m on the device.

    Launch plans:
        plans: ``{backend name: ops.plan.StepPlan}`` — the step's launch decisions, made on first use by a layer
            (``dsv4.Attention``) and shared by every layer of the step (they depend only on the fixed shapes above).

    Prefix caching (host, set by ``HybridCache.prepare_forward``; empty without it):
        prefix_captures: ``[(b, P, row)]`` — block boundaries P strictly inside request b's new tokens at which every
            layer snapshots its live state into ``PrefixStates`` row ``row`` (``dsv4.ops.prefix_capture``); a step
            with captures is not graph-safe (CUDA-graph replays skip it).
        prefix_capture_index: the captures' index tensors on the device (``dsv4.cache.capture_index``, built
            with them; ``None`` without captures).
    """

    request_ids: list[str]
    num_new: list[int]
    start_positions: list[int]
    num_tokens: int
    max_new: int
    block_size: int
    window: int
    ratios: tuple[int, ...]
    num_emit: dict[int, int]
    token_request: Tensor
    positions: Tensor
    cu_seqlens: Tensor
    start_pos: Tensor
    end_pos: Tensor
    slots: Tensor
    token_slots: Tensor
    block_tables: Tensor
    ring_slots: Tensor
    ring_keep: Tensor
    ring_rows: Tensor
    entries_before: dict[int, Tensor] = field(default_factory=dict)
    entries_after: dict[int, Tensor] = field(default_factory=dict)
    entries_to_emit: dict[int, Tensor] = field(default_factory=dict)
    cu_emit: dict[int, Tensor] = field(default_factory=dict)
    emit_request: dict[int, Tensor] = field(default_factory=dict)
    emit_entry: dict[int, Tensor] = field(default_factory=dict)
    emit_block: dict[int, Tensor] = field(default_factory=dict)
    emit_slot: dict[int, Tensor] = field(default_factory=dict)
    emit_position: dict[int, Tensor] = field(default_factory=dict)
    visible_entries: dict[int, Tensor] = field(default_factory=dict)
    emit_capacity: dict[int, int] = field(default_factory=dict)
    emit_pad_request: dict[int, Tensor] = field(default_factory=dict)
    emit_pad_entry: dict[int, Tensor] = field(default_factory=dict)
    num_emit_device: dict[int, Tensor] = field(default_factory=dict)
    plans: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    #: the cache state this batch was prepared for (``dsv4.cache.steps``); ``None``: not bound to any cache
    ticket: StepTicket | None = field(default=None, repr=False, compare=False)
    prefix_captures: list[tuple[int, int, int]] = field(default_factory=list)
    prefix_capture_index: Any = field(default=None, repr=False, compare=False)
    #: the one device buffer the device tensors are views of (``dsv4.cache.packed``; ``None``: separate tensors)
    packing: Packing | None = field(default=None, repr=False, compare=False)

    #: device tensors copied in place by ``copy_`` (the per-ratio dicts are listed in ``_PER_RATIO_STATIC``)
    _STATIC = (
        "token_request", "positions", "cu_seqlens", "start_pos", "end_pos", "slots", "token_slots", "ring_slots",
        "ring_keep", "ring_rows",
    )
    _PER_RATIO_STATIC = (
        "entries_before", "entries_after", "entries_to_emit", "cu_emit", "visible_entries", "emit_pad_request",
        "emit_pad_entry", "num_emit_device",
    )
    _PER_RATIO_VARIABLE = ("emit_request", "emit_entry", "emit_block", "emit_slot", "emit_position")

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def shape_key(self) -> tuple:
        """The step's fixed-shape geometry — tokens per request, block-table width, block size, window, ratios, emit
        capacities: what a launch plan (``dsv4.ops.StepPlan``) may depend on. Two batches with the same key can
        share a plan (and a captured CUDA graph); positions, slots and block ids do not enter it."""
        return (tuple(self.num_new), int(self.block_tables.shape[1]), self.block_size, self.window, self.ratios,
                tuple(sorted(self.emit_capacity.items())))

    def addressable_entries(self, m: int) -> int:
        """Entries at ratio ``m`` that the block tables can address: a host bound on every token's visible
        entries that depends only on this batch's shapes. Graph-safe kernels size grids and buffers with it, never
        with the step's own positions: a captured graph replays the bound it was captured with."""
        return self.block_tables.shape[1] * (self.block_size // m)

    def copy_(self, other: "StepBatch") -> "StepBatch":
        """Make this batch describe ``other``'s step, writing every fixed-shape device tensor in place (so a CUDA
        graph captured on this batch replays ``other``'s step). Returns ``self``.

        ``other`` must have the same geometry: the same tokens per request (``num_new``), ratios, block size and
        window, and block tables no wider than this batch's (narrower tables are copied and padded with −1).
        Host fields (ids, start positions, ``num_emit``, the ``ticket`` binding it to its cache step) and the
        variable-length ``emit_*`` lists are replaced by ``other``'s, so eager (non-graph) ops keep working on this
        batch too.

        Raises:
            ValueError: the geometries differ.
        """
        if not isinstance(other, StepBatch):
            raise TypeError(f"copy_ needs a StepBatch, got {type(other).__name__}")
        mismatch = [
            name
            for name, a, b in (
                ("num_new", self.num_new, other.num_new),
                ("ratios", self.ratios, other.ratios),
                ("block_size", self.block_size, other.block_size),
                ("window", self.window, other.window),
                ("device", self.device, other.device),
            )
            if a != b
        ]
        if other.block_tables.shape[1] > self.block_tables.shape[1]:
            mismatch.append(f"block table width ({other.block_tables.shape[1]} > {self.block_tables.shape[1]})")
        if mismatch:
            raise ValueError(f"StepBatch.copy_: geometry differs in {', '.join(mismatch)}")
        if self._packed_head() and other._packed_head() and self.packing.head_layout == other.packing.head_layout:
            n = self.packing.head_bytes  # both hold every fixed-shape tensor at the same offsets: one copy
            self.packing.buffer[:n].copy_(other.packing.buffer[:n])
        else:
            self._copy_fields(other)
        for name in self._PER_RATIO_VARIABLE:
            getattr(self, name).update(getattr(other, name))
        self.request_ids = list(other.request_ids)
        self.start_positions = list(other.start_positions)
        self.num_emit = dict(other.num_emit)
        self.ticket = other.ticket
        return self

    def _packed_head(self) -> bool:
        """Whether the fixed-shape device tensors are still the views ``build_step_batch`` packed at the head of
        ``packing.buffer`` (``packing.head``: ``_STATIC``, the block table, ``_PER_RATIO_STATIC``; a field replaced
        since, e.g. by assignment, makes it ``False``)."""
        p = self.packing
        if p is None:
            return False
        have = [getattr(self, k) for k in self._STATIC + ("block_tables",)]
        have += [getattr(self, k).get(m) for k in self._PER_RATIO_STATIC for m in self.ratios]
        return len(have) == len(p.head) and all(a is b for a, b in zip(have, p.head))

    def _copy_fields(self, other: "StepBatch") -> None:
        """``copy_``'s fixed-shape tensors one by one."""
        for name in self._STATIC:
            getattr(self, name).copy_(getattr(other, name))
        for name in self._PER_RATIO_STATIC:
            dst, src = getattr(self, name), getattr(other, name)
            for m in self.ratios:
                dst[m].copy_(src[m])
        w = other.block_tables.shape[1]
        if w == self.block_tables.shape[1]:
            self.block_tables.copy_(other.block_tables)
        else:
            self.block_tables[:, :w].copy_(other.block_tables)
            self.block_tables[:, w:].fill_(-1)

    def __repr__(self) -> str:
        parts = ", ".join(f"{r}:{s}+{n}" for r, s, n in zip(self.request_ids, self.start_positions, self.num_new))
        emits = ", ".join(f"m={m}: {e}" for m, e in self.num_emit.items())
        return (
            f"StepBatch(B={self.num_requests}, T={self.num_tokens}, [{parts}], "
            f"blocks={list(self.block_tables.shape)}, emit {{{emits}}}, device={self.device})"
        )


def build_step_batch(
    request_ids: Sequence[str],
    num_new: Sequence[int],
    start_positions: Sequence[int],
    slots: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    ratios: Sequence[int],
    block_size: int,
    window: int,
    device: torch.device | str = "cpu",
    max_blocks: int | None = None,
) -> StepBatch:
    """Build a ``StepBatch`` from host lists (vectorised on the host in int64, then moved once to ``device``).

    ``block_tables[b]`` must already cover every entry the step emits (``HybridCache.prepare_forward`` grows the
    tables before calling this). ``max_blocks`` pads the device block table to that width (−1), for batches a
    CUDA graph reuses (``StepBatch.copy_``); ``None``: the longest table of the step.
    """
    B = len(request_ids)
    n = np.array(num_new, dtype=np.int64).reshape(B)
    start = np.array(start_positions, dtype=np.int64).reshape(B)
    end = start + n
    T = int(n.sum())
    cu = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(n, out=cu[1:])
    req = np.repeat(np.arange(B, dtype=np.int64), n)  # [T]
    positions = start[req] + np.arange(T, dtype=np.int64) - cu[:-1][req]
    slot_t = np.array(slots, dtype=np.int64).reshape(B)
    lengths = [len(t) for t in block_tables]
    longest = max(lengths, default=0)
    if max_blocks is None:
        max_blocks = longest
    elif max_blocks < longest:
        raise ValueError(f"max_blocks={max_blocks} is smaller than the longest block table of the step ({longest})")
    # one array from the −1-padded host lists (an array per request costs more than the whole table)
    tables = np.full((B, max_blocks), -1, dtype=np.int64)
    if longest:
        filled = np.arange(max_blocks) < np.array(lengths)[:, None]
        tables[filled] = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int64, count=sum(lengths))

    ms = sorted(set(ratios))
    per_m: dict[str, dict[int, np.ndarray]] = {k: {} for k in _PER_M}
    num_emit: dict[int, int] = {}
    emit_capacity: dict[int, int] = {}
    for m in ms:
        before, after = start // m, end // m
        emit = after - before
        cu_e = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(emit, out=cu_e[1:])
        E = int(cu_e[-1])
        e_req = np.repeat(np.arange(B, dtype=np.int64), emit)
        e_entry = before[e_req] + np.arange(E, dtype=np.int64) - cu_e[:-1][e_req]
        e_pos = e_entry * m
        e_block = tables[e_req, e_pos // block_size]
        if E and bool((e_block < 0).any()):
            raise AssertionError(f"block tables do not cover the entries emitted at ratio {m} (internal error)")
        num_emit[m] = E
        cap = int((-(-n // m)).sum())
        emit_capacity[m] = cap
        pad_req = np.full(cap, -1, dtype=np.int32)
        pad_req[:E] = e_req
        pad_entry = np.zeros(cap, dtype=np.int64)
        pad_entry[:E] = e_entry
        for k, a in (
            ("entries_before", before), ("entries_after", after), ("entries_to_emit", emit), ("cu_emit", cu_e),
            ("visible_entries", (positions + 1) // m), ("emit_pad_request", pad_req), ("emit_pad_entry", pad_entry),
            ("num_emit_device", np.array([E], dtype=np.int32)), ("emit_request", e_req.astype(np.int32)),
            ("emit_entry", e_entry), ("emit_block", e_block), ("emit_slot", (e_pos % block_size) // m),
            ("emit_position", e_pos),
        ):
            per_m[k][m] = a

    keep = positions >= end[req] - window
    fixed = {
        "token_request": req.astype(np.int32), "positions": positions, "cu_seqlens": cu.astype(np.int32),
        "start_pos": start, "end_pos": end, "slots": slot_t, "token_slots": slot_t[req],
        "block_tables": tables.astype(np.int32), "ring_slots": positions % window, "ring_keep": keep,
        "ring_rows": np.flatnonzero(keep).astype(np.int64, copy=False),
    }
    # the fixed-shape tensors first (one device copy moves a whole step into a captured batch), then the emit lists
    head = [fixed[k] for k in StepBatch._STATIC + ("block_tables",)]
    head += [per_m[k][m] for k in StepBatch._PER_RATIO_STATIC for m in ms]
    tail = [per_m[k][m] for k in StepBatch._PER_RATIO_VARIABLE for m in ms]
    packing, (head_t, tail_t) = pack_to_device([head, tail], torch.device(device))
    it = iter(head_t)
    tensors: dict[str, Any] = {k: next(it) for k in StepBatch._STATIC + ("block_tables",)}
    for k in StepBatch._PER_RATIO_STATIC:
        tensors[k] = {m: next(it) for m in ms}
    it = iter(tail_t)
    for k in StepBatch._PER_RATIO_VARIABLE:
        tensors[k] = {m: next(it) for m in ms}
    return StepBatch(
        request_ids=list(request_ids),
        num_new=n.tolist(),
        start_positions=start.tolist(),
        num_tokens=T,
        max_new=int(n.max()) if B else 0,
        block_size=block_size,
        window=window,
        ratios=tuple(ms),
        num_emit=num_emit,
        emit_capacity=emit_capacity,
        packing=packing,
        **tensors,
    )
