"""CUDA-graph decode: one graph of the whole layer stack per decode batch-size bucket.

A decode step's ``StepBatch`` changes shape from step to step (number of requests, block-table width, entries
emitted per ratio). A graph needs fixed shapes and fixed addresses, so every decode step is *padded* to its
bucket and copied into that bucket's static batch before the replay (``dsv4.cache.batch`` describes the recipe):

* **rows**: a bucket of capacity ``c`` has ``c`` request rows: the real requests first, then pad rows (none when
  the step fills the bucket, so that a full bucket's projections run the row count their launches are planned
  and measured for, e.g. 64 rather than 65: ``kernels.project.plan``). A pad row is a fake request of ``w``
  (= ``decode_tokens``) tokens at positions ``0 … w−1`` in the *pad slot* (a state slot the engine reserves for
  this, ``Engine.PAD_REQUEST``) with block table ``[pad_block]`` (a pool block reserved likewise). Pad rows only
  ever read and write the pad slot and block.
* **block tables**: ``[c, max_blocks]``, −1 padded, ``max_blocks`` = blocks of the longest request of the run.
* **emitted entries**: the batch's fixed-capacity ``emit_pad_request`` / ``emit_pad_entry`` (−1 padded, length
  ``Σ_b ⌈w / m⌉``) and ``num_emit_device``; the variable-length ``emit_*`` lists are for eager ops only.

``prepare_forward`` runs eagerly on the host as always (it owns the bookkeeping); ``pad_step_batch`` then builds
the padded batch from the cache's host records (no device→host sync), ``StepBatch.copy_`` writes it into the
bucket's static batch, the step's token ids go into the static ids (pad rows: id 0), and the graph is replayed.
The graph holds the whole device side of the step: the hidden states of the ids when the engine's hidden source is
graph-safe (``dsv4.engine.hidden.is_graph_safe``; the default ``TokenHidden`` is), every layer, and the residual
glue between layers; a source that is not graph-safe runs eagerly before the replay, its output copied into the
static input.

Contract for a backend with ``GRAPH_SAFE = True``: during a step it reads from the host side of the ``StepBatch``
only what is fixed for the bucket (shapes, ``num_tokens``, ``num_requests``, ``max_new``, ``block_size``,
``window``, ``ratios``, ``emit_capacity``); everything else (positions, starts, tables, which entries are emitted)
comes from the fixed-shape device tensors, and it allocates nothing whose size depends on data (it uses
``cache.workspace``). A captured graph replays whatever host logic ran at capture time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..cache import HybridCache, blocks_for_tokens
from ..cache.batch import StepBatch, build_step_batch
from .hidden import is_graph_safe

if TYPE_CHECKING:
    from .runner import Engine
    from .scheduler import ScheduledStep

__all__ = ["DecodeGraphs", "copy_step_batch", "default_batch_sizes", "pad_step_batch", "reserve_pad"]


def default_batch_sizes(max_running: int) -> tuple[int, ...]:
    """Powers of two below ``max_running``, and ``max_running`` itself."""
    sizes = {1 << k for k in range(max(1, max_running).bit_length()) if (1 << k) < max_running}
    sizes.add(max_running)
    return tuple(sorted(sizes))


def decode_table_width(max_len: int, min_ratio: int, block_size: int) -> int:
    """Block-table width of the captured decode steps: the blocks of the run's longest request (0 without
    compressed layers)."""
    return max(1, blocks_for_tokens(max_len, min_ratio, block_size)) if min_ratio else 0


def reserve_pad(cache: HybridCache, request_id: str) -> tuple[int, int]:
    """Register the pad request: it holds one state slot and (if any layer is compressed) one pool block, which
    the pad rows of padded batches read and write. Bookkeeping only (no layer runs).
    Returns ``(pad_slot, pad_block)`` (block 0 when the cache has no compressed layer: unused)."""
    cache.add_request(request_id)
    if cache.min_ratio:
        # grows its table to exactly one block; no layer runs this step (the pad rows' data is scratch)
        cache.claim_step(cache.prepare_forward({request_id: cache.block_size}))
    return cache.slot(request_id), (cache.block_table(request_id)[0] if cache.min_ratio else 0)


def pad_step_batch(
    cache: HybridCache,
    request_ids: Sequence[str],
    num_new: Sequence[int],
    rows: int,
    tokens_per_row: int,
    max_blocks: int,
    pad_slot: int,
    pad_block: int,
) -> StepBatch:
    """A fixed-shape ``StepBatch`` for a decode step (see the module docstring for the layout).

    Args:
        cache: the cache; the real requests' slots, block tables and token counts are read from its host
            records, so call this *after* ``prepare_forward`` of the same plan.
        request_ids, num_new: the real requests of the step (each ``num_new == tokens_per_row``), plan order.
        rows: request rows of the padded batch (≥ ``len(request_ids)``).
        tokens_per_row: w, tokens of every row.
        max_blocks: block-table width.
        pad_slot, pad_block: the reserved pad state slot and pool block.
    Returns:
        ``StepBatch`` with ``rows`` requests, ``rows · w`` tokens and ``block_tables [rows, max_blocks]`` (its
        fixed-capacity emit tensors have ``rows · ceil(w / m)`` entries per ratio m). Its ticket
        (``dsv4.cache.steps``) is the cache's current step when ``request_ids`` are that step's requests, or a pad
        ticket when there are none (a static batch to capture on: layers run it without step accounting).
    Raises:
        StaleBatchError: ``request_ids`` / ``num_new`` are not the cache's current step.
    """
    B, w = len(request_ids), tokens_per_row
    if B > rows:
        raise ValueError(f"{B} requests do not fit a padded batch of {rows} rows")
    if any(n != w for n in num_new):
        raise ValueError(f"every request of a padded decode step must have {w} tokens, got {list(num_new)}")
    npad = rows - B
    ends = [cache.num_tokens(r) for r in request_ids]
    tables = [cache.block_table(r) for r in request_ids]
    if any(len(t) > max_blocks for t in tables):
        raise ValueError(f"a block table is longer than the padded width {max_blocks}")
    ticket = cache.steps.graph_ticket(request_ids, num_new)
    pad_table = [pad_block] if cache.min_ratio else []
    kwargs = dict(
        request_ids=list(request_ids) + [f"__pad{i}__" for i in range(npad)],
        num_new=list(num_new) + [w] * npad,
        start_positions=[e - w for e in ends] + [0] * npad,
        slots=[cache.slot(r) for r in request_ids] + [pad_slot] * npad,
        block_tables=tables + [pad_table] * npad,
        ratios=cache.ratios,
        block_size=cache.block_size,
        window=cache.cfg.window,
        device=cache.device,
    )
    b = build_step_batch(**kwargs, max_blocks=max_blocks)
    b.ticket = ticket
    return b


def copy_step_batch(dst: StepBatch, src: StepBatch) -> None:
    """Make the static ``dst`` describe ``src``'s step in place (``StepBatch.copy_``)."""
    dst.copy_(src)


@dataclass
class _Captured:
    capacity: int
    graph: torch.cuda.CUDAGraph
    batch: StepBatch
    h_in: Tensor  # the stack's input: the in-graph hidden states of ids, or the static input they are copied into
    ids: Tensor
    h_out: Tensor
    kept: dict[int, tuple[Tensor, Tensor, Tensor]]


class DecodeGraphs:
    """CUDA graphs of the engine's layer stack for decode steps, one per batch-size bucket.

    Reserves the pad request (one state slot, one pool block) in ``engine.cache`` on construction; ``capture()``
    records the graphs (largest bucket first, sharing one memory pool); ``run()`` replays one. A graph-safe hidden
    source (``hidden_in_graph``, decided here) is captured in the graphs; another runs before each replay.

    Args:
        engine: the engine (its cache must exist).
        max_len: the longest request of the run (fixes the block-table width).
        batch_sizes: bucket capacities (default ``engine.config.graph_batch_sizes`` or ``default_batch_sizes``).
    """

    def __init__(self, engine: Engine, max_len: int, batch_sizes: Sequence[int] | None = None) -> None:
        if engine.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        cache = engine.cache
        assert cache is not None
        self.engine = engine
        self.cache = cache
        self.w = engine.config.decode_tokens
        sizes = batch_sizes or engine.config.graph_batch_sizes or default_batch_sizes(engine.config.max_running)
        self.sizes = tuple(sorted({int(s) for s in sizes if s >= 1}))
        self.pad_slot, self.pad_block = reserve_pad(cache, engine.PAD_REQUEST)
        self.max_blocks = decode_table_width(max_len, cache.min_ratio, cache.block_size)
        self.hidden_in_graph = is_graph_safe(engine.hidden)
        self.captured: dict[int, _Captured] = {}
        self.keep: list[int] = []
        self._pinned: list[Tensor] = []

    def bucket(self, num_requests: int) -> int | None:
        """The smallest captured capacity ≥ ``num_requests`` (``None`` if there is none)."""
        return next((c for c in self.sizes if c >= num_requests and c in self.captured), None)

    def can_run(self, plan: ScheduledStep, batch: StepBatch) -> bool:
        """A decode-only step of ``w``-token requests that fits a captured bucket (and takes no prefix snapshot)."""
        return (
            plan.is_decode_only
            and all(n == self.w for _, n in plan.plan)
            and self.bucket(len(plan.plan)) is not None
            and batch.block_tables.shape[1] <= self.max_blocks
            and not batch.prefix_captures  # prefix snapshots inside the step: host-built, run eagerly
        )

    def _static(self, capacity: int) -> StepBatch:
        return pad_step_batch(self.cache, [], [], capacity, self.w, self.max_blocks, self.pad_slot, self.pad_block)

    @torch.no_grad()
    def capture(self, keep: Iterable[int] | None = None) -> None:
        """Capture every bucket (warm-up runs first, on a side stream, touching only the pad slot and block). The
        hidden source runs eagerly once first, so what a graph-safe one creates and keeps is not made in capture."""
        eng = self.engine
        self.keep = list(eng._trace_layers if keep is None else keep)
        dev = eng.device
        pool = torch.cuda.graph_pool_handle()
        for c in sorted(self.sizes, reverse=True):
            batch = self._static(c)
            T = batch.num_tokens
            ids = torch.zeros(T, dtype=torch.int64, device=dev)
            h_in = torch.zeros(T, eng.cfg.hidden_size, dtype=torch.float32, device=dev)
            h_in.copy_(eng.hidden(ids))
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):
                    eng.forward_layers(batch, eng.hidden(ids) if self.hidden_in_graph else h_in, self.keep)
            torch.cuda.current_stream(dev).wait_stream(side)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                if self.hidden_in_graph:
                    h_in = eng.hidden(ids)
                h_out, kept = eng.forward_layers(batch, h_in, self.keep)
            self.captured[c] = _Captured(c, graph, batch, h_in, ids, h_out, kept)
            # The graph holds the addresses of the cache's workspace buffers as they are now. A later eager step
            # (a large prefill) may grow a buffer, i.e. replace it; keep the captured ones alive so a replay never
            # touches memory the allocator has handed to someone else.
            self._pinned.extend(self.cache.workspace.buffers())
        torch.cuda.synchronize(dev)

    @torch.no_grad()
    def run(
        self, batch: StepBatch, token_ids: Tensor, keep: Iterable[int] = ()
    ) -> tuple[Tensor, dict[int, tuple[Tensor, Tensor, Tensor]]]:
        """Replay the bucket for a prepared decode step of ``token_ids`` (int64 ``[T]`` on the device, plan order).
        Returns ``h [T, d]`` and the kept layers' outputs (views of the graph's static outputs, valid until the
        next replay). The step is claimed for every layer (``HybridCache.claim_step``) before the replay: the graph
        runs no Python, so the layers cannot."""
        c = self.bucket(batch.num_requests)
        assert c is not None
        cap = self.captured[c]
        padded = pad_step_batch(
            self.cache, batch.request_ids, batch.num_new, c, self.w, self.max_blocks, self.pad_slot, self.pad_block
        )
        self.cache.claim_step(batch)
        copy_step_batch(cap.batch, padded)
        T = batch.num_tokens
        cap.ids[:T].copy_(token_ids)
        cap.ids[T:].zero_()
        if not self.hidden_in_graph:
            cap.h_in.copy_(self.engine.hidden(cap.ids))
        cap.graph.replay()
        keep = set(keep)
        kept = {li: (x[:T], y[:T], idx[:T]) for li, (x, y, idx) in cap.kept.items() if li in keep}
        return cap.h_out[:T], kept
