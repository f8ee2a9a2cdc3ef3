"""The torch backend: the ops of one layer step (``ops.backend``) in plain torch, on any device — the oracle the
kernels are tested against.

The math is the reference's (``dsv4.reference``); these functions only decide where each operand comes from (the
step's fresh tokens, the per-request state, or the paged pool) and where results go. Host loops over requests and
boolean-mask indexing make it unfit for CUDA graphs (``GRAPH_SAFE = False``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from torch import Tensor

from ..cache.batch import StepBatch
from ..cache.manager import HybridCache, LayerCache
from ..cache.storage import EntryStorage
from ..config import LayerKind
from ..numerics import Numerics
from ..reference.compressor import finish_entries, pool_windows
from ..reference.core import attend_with_sink, window_indices
from ..reference.indexer import (index_scores, indexer_queries as _reference_indexer_queries,
                                 rounded_indexer_queries, select_topk)
from ..reference.primitives import rms_norm
from ..reference.rope import apply_rope
from ..weights import CompressorWeights
from . import projections
from .prefix_capture import capture_prefix_states
from .plan import StepPlan
from .step import LayerStep

__all__ = [
    "GRAPH_SAFE", "NAME", "plan_step",
    # the ops, in call order (ops.backend.OP_NAMES)
    "input_projections", "capture_prefix_states", "new_entries", "queries", "indexer_queries", "indexer_weights",
    "indexer_topk", "visible_entries", "attend", "append_swa", "output",
    # building blocks
    "query_latent", "window_kv", "attend_layer", "compressor_step", "entry_lists", "gather", "request_index_keys",
    "window_entries", "window_keys",
]

NAME = "torch"
GRAPH_SAFE = False


def plan_step(batch: StepBatch, cache: HybridCache, *, streams: bool = True) -> StepPlan:
    """The torch backend decides nothing ahead: an empty plan (every op on the current stream)."""
    return StepPlan.empty(NAME)


# ------------------------------------------------------------------------------------------------ queries, window KV
def input_projections(step: LayerStep, x: Tensor) -> tuple[Tensor, Tensor]:
    """See ``backend.AttentionBackend.input_projections``: one GEMM per projection (the reference's)."""
    return query_latent(step, x), window_kv(step, x)


def query_latent(step: LayerStep, x: Tensor) -> Tensor:
    """``c^Q = RMSNorm_{q_norm}(W_qa x)``: x ``[T, d]`` → ``[T, q_lora_rank]`` act dtype."""
    return projections.query_latent(step, x, rms_norm)


def queries(step: LayerStep, q_latent: Tensor) -> tuple[Tensor, None]:
    """See ``backend.AttentionBackend.queries``: per-head unweighted RMSNorm, then RoPE (SPEC §3 step 2). The
    indexer's projection is not made here (``indexer_queries`` runs its own GEMM): ``(q, None)``."""
    q = projections.query_projection(step, q_latent)
    return apply_rope(rms_norm(q, None, step.cfg.norm_eps), step.positions, step.inv_freq), None


def window_kv(step: LayerStep, x: Tensor) -> Tensor:
    """The window KV ``RMSNorm_{kv_norm}(W_kv x)``: x ``[T, d]`` → ``[T, D]`` act dtype (before RoPE)."""
    return projections.window_kv(step, x, rms_norm)


def window_entries(step: LayerStep, kv: Tensor) -> Tensor:
    """The step's window entries as stored: RoPE on the last dims, then rounded to the KV storage format.
    ``[T, D]`` act dtype → ``[T, D]`` act dtype (each token's key/value exactly as the ring will hold it)."""
    return step.numerics.qdq_kv(apply_rope(kv, step.positions, step.inv_freq), step.cfg.nope_dim)


def window_keys(layer: LayerCache, batch: StepBatch, kv_new: Tensor) -> tuple[Tensor, Tensor]:
    """Each token's window keys ``t−W+1 … t``: from this step's tokens where the position is new, else from the ring.

    Args:
        layer: the layer's cache (ring + ring positions of each state slot).
        kv_new: ``[T, D]`` this step's window entries, already rounded to the storage format.
    Returns:
        ``keys`` ``[T, W, D]`` (dtype of ``kv_new``), ``valid`` bool ``[T, W]`` (position ≥ 0 and present).
    """
    T, W = batch.num_tokens, batch.window
    storage = layer.schema.kv_storage
    req = batch.token_request.long()
    start = batch.start_pos[req][:, None]  # [T, 1]
    pos = window_indices(batch.positions, W)  # [T, W], −1 before position 0
    in_step = pos >= start
    new_rows = (batch.cu_seqlens.long()[req][:, None] + pos - start).clamp(0, max(T - 1, 0))
    ring_slot = pos.clamp(min=0) % W
    token_slot = batch.token_slots[:, None].expand(T, W)
    from_ring = storage.read(layer.ring, token_slot.reshape(-1), ring_slot.reshape(-1)).view(T, W, -1)
    ring_holds = layer.ring_positions[token_slot, ring_slot].long() == pos
    keys = torch.where(in_step[..., None], kv_new[new_rows], from_ring.to(kv_new.dtype))
    return keys, (pos >= 0) & (in_step | ring_holds)


# ------------------------------------------------------------------------------------------------ compressors
def compressor_step(
    step: LayerStep, x: Tensor, cw: CompressorWeights, prefix: str,
    projected: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Accumulate this step's tokens into one compressor's tails and pool every window that closes (SPEC §4.4).

    Args:
        x: ``[T, d]`` the step's attention inputs.
        cw: the compressor's weights (``ape`` is ``[m, width]``).
        prefix: ``""`` for the main compressor, ``"index_"`` for the CSA indexer's; the layer's state tensors
            ``{prefix}tail_kv / tail_gate`` fp32 ``[R, m, width]`` (current partial window, row ``p mod m``) and, CSA,
            ``{prefix}prev_kv / prev_gate`` fp32 ``[R, m, c]`` (first-half features of the last closed window;
            0 / −inf after a reset) are updated in place.
        projected: the compressor's ``(a, z_raw)``, float32 ``[T, width]`` (any row stride), as
            ``projections.layer_compressor_projections`` computes them for the layer; ``None``: computed here
            (``projections.compressor_projections``, one GEMM per matrix).
    Returns:
        ``[E, c]`` the emitted entries in the act dtype (normed, RoPE at ``i·m``; not yet quantized), in the order
        of ``batch.emit_*[m]``.
    """
    batch, m, overlap = step.batch, step.ratio, step.kind is LayerKind.CSA
    state = step.cache.state
    tail_kv, tail_gate = state[f"{prefix}tail_kv"], state[f"{prefix}tail_gate"]
    R, width = tail_kv.shape[0], tail_kv.shape[-1]
    T = batch.num_tokens
    # [T, width] fp32 (reference.compressor.project's)
    a, z_raw = projected if projected is not None else projections.compressor_projections(step, x, cw)
    z = z_raw + cw.ape.float()[batch.positions % m]  # the gate biased at p mod m

    E = batch.num_emit[m]
    entries = x.new_zeros((0, cw.norm.shape[0]), dtype=step.numerics.act_dtype)
    own_kv = own_gate = None
    if E:
        e_req = batch.emit_request[m].long()
        start, first_row, slot = batch.start_pos[e_req], batch.cu_seqlens.long()[e_req], batch.slots[e_req]
        r = torch.arange(m, device=x.device)
        # Own window's m slots: position i·m + r comes from this step if new, else from the tail.
        own_pos = batch.emit_entry[m][:, None] * m + r  # [E, m]
        in_step = own_pos >= start[:, None]
        own_idx = torch.where(in_step, first_row[:, None] + own_pos - start[:, None], T + slot[:, None] * m + r)
        own_kv = torch.cat((a, tail_kv.reshape(R * m, width)))[own_idx]  # [E, m, width]
        own_gate = torch.cat((z, tail_gate.reshape(R * m, width)))[own_idx]
        if overlap:
            c = width // 2
            # Previous window's first half: from the state if that window closed before this step
            # (i == start // m), else from this step's tokens or the tail, like the own window.
            prev_pos = own_pos - m
            from_state = (batch.emit_entry[m] == start // m)[:, None]
            prev_in_step = prev_pos >= start[:, None]
            prev_idx = torch.where(
                from_state,
                T + R * m + slot[:, None] * m + r,
                torch.where(prev_in_step, first_row[:, None] + prev_pos - start[:, None], T + slot[:, None] * m + r),
            ).clamp(min=0)
            src_kv = torch.cat((a[:, :c], tail_kv[..., :c].reshape(R * m, c), state[f"{prefix}prev_kv"].reshape(R * m, c)))
            src_gate = torch.cat(
                (z[:, :c], tail_gate[..., :c].reshape(R * m, c), state[f"{prefix}prev_gate"].reshape(R * m, c))
            )
            slots_kv = torch.cat((src_kv[prev_idx], own_kv[..., c:]), dim=1)  # [E, 2m, c]
            slots_gate = torch.cat((src_gate[prev_idx], own_gate[..., c:]), dim=1)
        else:
            slots_kv, slots_gate = own_kv, own_gate
        entries = finish_entries(pool_windows(slots_kv, slots_gate), cw.norm, batch.emit_position[m], step.inv_freq,
                                 step.cfg.norm_eps, step.numerics.act_dtype)

    # Tail: tokens of each request's final, still open window.
    req = batch.token_request.long()
    open_from = (batch.end_pos[req] // m) * m
    keep = (batch.positions >= open_from).nonzero().squeeze(1)
    tail_slot, tail_row = batch.token_slots[keep], batch.positions[keep] % m
    tail_kv[tail_slot, tail_row] = a[keep]
    tail_gate[tail_slot, tail_row] = z[keep]
    if overlap and E:
        # The last closed window's first half becomes the next entry's previous window.
        emitted = batch.entries_to_emit[m] > 0
        last = (batch.cu_emit[m][1:] - 1)[emitted]
        dest = batch.slots[emitted]
        c = width // 2
        state[f"{prefix}prev_kv"][dest] = own_kv[last][..., :c]
        state[f"{prefix}prev_gate"][dest] = own_gate[last][..., :c]
    return entries


def _write_entries(layer: LayerCache, pages: Tensor, storage: EntryStorage, batch: StepBatch, m: int,
                   entries: Tensor) -> None:
    """Scatter the step's emitted entries ``[E, c]`` (already rounded) into the pool through the block table (a
    context-parallel cache: the entries it holds, at their local slots; ``LayerCacheSchema``)."""
    if batch.num_emit[m]:
        block, slot = batch.emit_block[m], batch.emit_slot[m]
        cp_rank, cp_size = layer.schema.cp_rank, layer.schema.cp_size
        if cp_size > 1:
            mine = batch.emit_entry[m] % cp_size == cp_rank
            block, slot, entries = block[mine], slot[mine] // cp_size, entries[mine]
        storage.write(pages, block, slot, entries.float())


def new_entries(step: LayerStep, x: Tensor, kv: Tensor) -> Tensor:
    """See ``backend.AttentionBackend.new_entries``: the window entries (``window_entries``), then the main
    compressor's entries into ``kv_pages`` (KV format) and, CSA, the indexer's keys into ``index_pages`` (a
    context-parallel cache: those it holds; every rank runs the compressors)."""
    layer, nm, nope = step.cache, step.numerics, step.cfg.nope_dim
    window = window_entries(step, kv)
    if step.ratio == 0:
        return window
    projected = projections.layer_compressor_projections(step, x)  # main, then the indexer's: one GEMM on CUDA
    main = compressor_step(step, x, step.weights.compressor, "", projected[0])
    _write_entries(layer, layer.kv_pages, layer.schema.kv_storage, step.batch, step.ratio, nm.qdq_kv(main, nope))
    if step.weights.indexer is not None:
        keys = compressor_step(step, x, step.weights.indexer.compressor, "index_", projected[1])
        _write_entries(layer, layer.index_pages, layer.schema.index_storage, step.batch, step.ratio, nm.qdq_index(keys))
    return window


# ------------------------------------------------------------------------------------------------ indexer
def indexer_queries(step: LayerStep, q_latent: Tensor, projection: Tensor | None = None) -> Tensor:
    """See ``backend.AttentionBackend.indexer_queries``: float32 ``[T, H_I, c_I]`` on the index format's grid (from
    ``projection`` when given, else the reference's own GEMM)."""
    if projection is not None:
        return rounded_indexer_queries(projection, step.positions, step.inv_freq, step.cfg, step.numerics)
    return _reference_indexer_queries(q_latent, step.weights.indexer, step.positions, step.inv_freq, step.cfg,
                                      step.numerics)


def indexer_weights(step: LayerStep, x: Tensor) -> Tensor:
    """See ``backend.AttentionBackend.indexer_weights``."""
    return projections.indexer_weights(step, x)


def _max_entries(batch: StepBatch, m: int) -> int:
    """The most compressed entries any request of the step has after it (host arithmetic, no sync)."""
    return max(((s + n) // m for s, n in zip(batch.start_positions, batch.num_new)), default=0)


def _entry_addresses(batch: StepBatch, m: int, token_req: Tensor, idx: Tensor, cp_size: int = 1
                     ) -> tuple[Tensor, Tensor]:
    """Physical (block, slot) of entry ``idx`` of each row's request; ``idx`` ≥ 0. Shapes as ``idx``.
    ``cp_size`` > 1: the slot in a context-parallel rank's page (``LayerCacheSchema``; ``idx`` must be its own)."""
    first_pos = idx * m
    block = batch.block_tables.long()[token_req, first_pos // batch.block_size]
    slot = (first_pos % batch.block_size) // m
    return block.clamp(min=0), (slot // cp_size if cp_size > 1 else slot)


def request_index_keys(layer: LayerCache, batch: StepBatch, m: int) -> Iterator[tuple[slice, Tensor]]:
    """Each request's indexer keys after the step, read from the pool (a host loop over requests).

    Yields ``(rows, keys)``: the request's token rows of the step and float32 ``[n_entries, c_I]`` keys, for every
    request with at least one entry.
    """
    cu = [0, *itertools.accumulate(batch.num_new)]
    for b, (s, n) in enumerate(zip(batch.start_positions, batch.num_new)):
        n_entries = (s + n) // m
        if n_entries == 0 or n == 0:
            continue
        idx = torch.arange(n_entries, device=batch.device)
        block, slot = _entry_addresses(batch, m, torch.full_like(idx, b), idx)
        yield slice(cu[b], cu[b + 1]), layer.schema.index_storage.read(layer.index_pages, block, slot)


def indexer_topk(step: LayerStep, q_idx: Tensor, head_weights: Tensor) -> Tensor:
    """See ``backend.AttentionBackend.indexer_topk``. Returns int64 ``[T, min(k, N)]`` (N = the most entries any
    request of the step has), −1 padded."""
    batch, m, k = step.batch, step.ratio, step.cfg.index_topk
    out = torch.full((batch.num_tokens, min(k, _max_entries(batch, m))), -1, dtype=torch.int64, device=q_idx.device)
    for rows, keys in request_index_keys(step.cache, batch, m):
        scores = index_scores(q_idx[rows], head_weights[rows], keys, step.numerics.score_dtype)
        chosen = select_topk(scores, batch.visible_entries[m][rows], k)
        out[rows, : chosen.shape[1]] = chosen
    return out


def visible_entries(step: LayerStep) -> Tensor:
    """See ``backend.AttentionBackend.visible_entries``: ``(t + 1) // m`` per token, int64 ``[T]``."""
    return step.batch.visible_entries[step.ratio]


def entry_lists(counts: Tensor, n: int) -> Tensor:
    """HCA: every visible entry as a list, ``[T, n]`` int64, −1 where ``i ≥ counts[t]`` (counts int ``[T]``)."""
    idx = torch.arange(n, device=counts.device)[None, :].expand(counts.shape[0], n)
    return torch.where(idx < counts[:, None], idx, torch.full_like(idx, -1))


# ------------------------------------------------------------------------------------------------ attention
def gather(layer: LayerCache, batch: StepBatch, m: int, entry_idx: Tensor, dtype: torch.dtype) -> Tensor:
    """Dense tile of the compressed entries each token attends (the prototype's gather_kv); −1 → zeros.

    Args:
        entry_idx: int64 ``[T, K]`` entry indices of each token's request, −1 = invalid slot (a context-parallel
            cache: entries it holds only).
    Returns:
        ``[T, K, D]`` in ``dtype``.
    """
    T, K = entry_idx.shape
    if K == 0:
        return torch.zeros((T, 0, layer.schema.head_dim), dtype=dtype, device=entry_idx.device)
    req = batch.token_request.long()[:, None].expand(T, K)
    block, slot = _entry_addresses(batch, m, req, entry_idx.clamp(min=0), layer.schema.cp_size)
    vals = layer.schema.kv_storage.read(layer.kv_pages, block.reshape(-1), slot.reshape(-1)).view(T, K, -1)
    return vals.masked_fill((entry_idx < 0)[..., None], 0.0).to(dtype)


def attend(step: LayerStep, q: Tensor, kv: Tensor, entry_idx: Tensor | None) -> tuple[Tensor, Tensor]:
    """See ``backend.AttentionBackend.attend``."""
    return attend_layer(step.cache, step.batch, q, kv, step.ratio, entry_idx, step.weights.attn_sink,
                        step.cfg.softmax_scale, step.inv_freq, step.numerics)


def attend_layer(
    layer: LayerCache, batch: StepBatch, q: Tensor, kv_new: Tensor, m: int, entry_idx: Tensor | None, sink: Tensor,
    scale: float, inv_freq: Tensor, numerics: Numerics,
) -> tuple[Tensor, Tensor]:
    """``attend`` on explicit tensors (what kernel tests compare against).

    Args:
        layer, batch: the layer's cache and the step. q: ``[T, H, D]`` queries (head-normed, RoPE'd). kv_new:
            ``[T, D]`` the step's window entries as stored. m: the layer's ratio (0: SWA).
        entry_idx: CSA int64 ``[T, K]`` lists (−1 = none), HCA int64 ``[T]`` counts, SWA ``None``.
        sink: float32 ``[H]`` sink logits; scale: the softmax scale; inv_freq: float32 ``[R/2]``.
    Returns:
        ``o`` ``[T, H, D]`` act dtype (inverse RoPE applied), ``lse`` float32 ``[T, H]`` (sink included).
    """
    keys, valid = window_keys(layer, batch, kv_new)
    if entry_idx is not None:
        if entry_idx.dim() == 1:  # HCA: every entry i < count
            entry_idx = entry_lists(entry_idx, _max_entries(batch, m))
        keys = torch.cat((keys, gather(layer, batch, m, entry_idx, kv_new.dtype)), dim=1)
        valid = torch.cat((valid, entry_idx >= 0), dim=1)
    o, lse = attend_with_sink(q, keys, valid, sink, scale, numerics.prob_dtype, numerics.act_dtype)
    return apply_rope(o, batch.positions, inv_freq, inverse=True), lse


def append_swa(step: LayerStep, kv: Tensor) -> None:
    """See ``backend.AttentionBackend.append_swa``. Only a request's last ``W`` tokens of the step are written
    (``batch.ring_rows``): earlier ones would be overwritten within the same step, so the writes never collide."""
    layer, batch = step.cache, step.batch
    keep = batch.ring_rows
    slots, ring_slots = batch.token_slots[keep], batch.ring_slots[keep]
    layer.schema.kv_storage.write(layer.ring, slots, ring_slots, kv[keep].float())
    layer.ring_positions[slots, ring_slots] = batch.positions[keep].to(layer.ring_positions.dtype)


# ------------------------------------------------------------------------------------------------ output
def output(step: LayerStep, o: Tensor) -> Tensor:
    """See ``backend.AttentionBackend.output``."""
    return projections.output(step, o)
