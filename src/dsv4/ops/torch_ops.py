"""The stages of one attention step over the cache, in plain torch (any device): the oracle for the kernels.

Every op reads the ``StepBatch`` built by ``HybridCache.prepare_forward`` and the tensors of one cached layer
(``LayerCache``). The math is the reference's (``dsv4.reference``); these functions only decide where each
operand comes from (the step's fresh tokens, the per-request state, or the paged pool) and where results go.

Order inside a layer's step (see ``dsv4.layer.Attention``): compressor accumulate + flush (entries that close in
this step become visible to this step's queries), indexer top-k, window keys (ring ∪ this step's tokens), gather
of compressed keys, attention with sink, and last ``append_swa`` (a multi-token step would otherwise overwrite
ring slots that its own earlier queries still read).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Sequence

import torch
from torch import Tensor

from ..cache.batch import StepBatch
from ..cache.manager import LayerCache
from ..cache.storage import EntryStorage
from ..reference.compressor import finish_entries, pool_windows, project
from ..reference.core import attend_with_sink, window_indices
from ..config import ModelConfig
from ..numerics import Numerics
from ..reference.indexer import index_scores, indexer_queries as _reference_indexer_queries, select_topk
from ..reference.primitives import rms_norm as _reference_rms_norm
from ..reference.rope import apply_rope
from ..weights import CompressorWeights, IndexerWeights

__all__ = [
    # the backend interface (dsv4.ops.BACKEND_OPS), called by dsv4.Attention
    "rms_norm", "queries", "window_entries", "compress", "indexer_queries", "indexer_topk", "all_visible_entries", "attend",
    "append_swa",
    # building blocks of the torch backend
    "window_keys", "compressor_step", "write_entries", "gather", "sparse_attention", "visible_entries",
]

GRAPH_SAFE = False  # host loops and boolean-mask indexing: the oracle, not for CUDA graphs


def visible_entries(batch: StepBatch, m: int) -> Tensor:
    """Compressed entries each token may see, ``(pos + 1) // m`` (the prototype's compute_valid_lens, computed from
    positions, not block counts). Returns int64 ``[T]``."""
    return batch.visible_entries[m]


# ------------------------------------------------------------------------------------------------ queries
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``reference.primitives.rms_norm``: ``weight ⊙ x / sqrt(mean(x²) + eps)`` over the last dim, in FP32, cast
    back to ``x``'s dtype (``c^Q`` and the window KV ``RMSNorm(W_kv x)``).

    Args:
        x: ``[rows, C]`` act dtype; weight: ``[C]``; eps: the epsilon. Returns ``[rows, C]`` act dtype.
    """
    return _reference_rms_norm(x, weight, eps)


def queries(q: Tensor, positions: Tensor, inv_freq: Tensor, eps: float) -> Tensor:
    """The attention queries from their projection (SPEC §3 step 2): per-head unweighted RMSNorm, then RoPE.

    Args:
        q: ``[T, H, D]`` act dtype, ``W_qb c^Q`` split into heads.
        positions: int64 ``[T]``; inv_freq: float32 ``[R/2]``; eps: the RMSNorm epsilon.
    Returns:
        ``[T, H, D]`` act dtype.
    """
    return apply_rope(_reference_rms_norm(q, None, eps), positions, inv_freq)


# ------------------------------------------------------------------------------------------------ sliding window
def window_entries(kv: Tensor, positions: Tensor, inv_freq: Tensor, numerics: Numerics, nope_dim: int) -> Tensor:
    """The step's window entries as stored: RoPE on the last dims, then rounded to the KV storage format.

    Args:
        kv: ``[T, D]`` act dtype, ``RMSNorm(W_kv x)`` of the step's tokens.
        positions: int64 ``[T]``; inv_freq: float32 ``[R/2]``.
    Returns:
        ``[T, D]`` act dtype: each token's key/value exactly as the ring will hold it.
    """
    return numerics.qdq_kv(apply_rope(kv, positions, inv_freq), nope_dim)


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


def append_swa(layer: LayerCache, batch: StepBatch, kv_new: Tensor) -> None:
    """Write this step's window entries into each request's ring (slot ``p mod W``) with their positions.

    Only a request's last ``W`` tokens of the step are written (``batch.ring_rows``): earlier ones would be
    overwritten within the same step, so the writes never collide.
    """
    keep = batch.ring_rows
    slots, ring_slots = batch.token_slots[keep], batch.ring_slots[keep]
    layer.schema.kv_storage.write(layer.ring, slots, ring_slots, kv_new[keep].float())
    layer.ring_positions[slots, ring_slots] = batch.positions[keep].to(layer.ring_positions.dtype)


# ------------------------------------------------------------------------------------------------ compressor
def compressor_step(
    x: Tensor,
    cw: CompressorWeights,
    state: dict[str, Tensor],
    prefix: str,
    batch: StepBatch,
    m: int,
    overlap: bool,
    inv_freq: Tensor,
    eps: float,
    act_dtype: torch.dtype,
) -> Tensor:
    """Accumulate this step's tokens into the compressor tails and pool every window that closes (SPEC §4.4).

    Args:
        x: ``[T, d]`` the step's attention inputs.
        cw: compressor weights (``ape`` is ``[m, width]``).
        state: the layer's state tensors; uses ``{prefix}tail_kv / tail_gate`` fp32 ``[R, m, width]`` (current
            partial window, row ``p mod m``) and, when ``overlap``, ``{prefix}prev_kv / prev_gate`` fp32 ``[R, m, c]``
            (first-half features of the last closed window; 0 / −inf after a reset). Updated in place.
        prefix: ``""`` for the main compressor, ``"index_"`` for the CSA indexer's.
        batch: the step; entries emitted are ``batch.emit_*[m]`` (E of them, ``batch.num_emit[m]``).
        overlap: CSA-style ``2m`` slots (previous window's ``[:c]`` + own ``[c:]``) or HCA-style ``m`` slots.
    Returns:
        ``[E, c]`` the emitted entries in ``act_dtype`` (normed, RoPE at ``i·m``; not yet quantized), in the order
        of ``batch.emit_*[m]``.
    """
    tail_kv, tail_gate = state[f"{prefix}tail_kv"], state[f"{prefix}tail_gate"]
    R, width = tail_kv.shape[0], tail_kv.shape[-1]
    T = batch.num_tokens
    a, z = project(x, cw, batch.positions)  # [T, width] fp32, gate biased at p mod m

    E = batch.num_emit[m]
    entries = x.new_zeros((0, cw.norm.shape[0]), dtype=act_dtype)
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
        entries = finish_entries(pool_windows(slots_kv, slots_gate), cw.norm, batch.emit_position[m], inv_freq, eps, act_dtype)

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


def compress(
    layer: LayerCache,
    batch: StepBatch,
    x: Tensor,
    compressors: Sequence[tuple[CompressorWeights, str]],
    m: int,
    overlap: bool,
    inv_freq: Tensor,
    eps: float,
    numerics: Numerics,
    nope_dim: int,
    window_kv: Tensor,
) -> Tensor:
    """A compressed layer's writes before attention: the step's window entries, and every compressor's
    accumulate + flush (pool every closing window, quantize, scatter into the pool through the block table).

    One op for all of them so that a backend can fuse them into one launch (the Triton backend does).

    Args:
        x: ``[T, d]`` the step's attention inputs (act dtype).
        compressors: ``(weights, role)`` pairs, in order: role ``"kv"`` (main entries → ``layer.kv_pages``, KV
            format) and, for CSA, ``"index"`` (indexer keys → ``layer.index_pages``, index format).
        m, overlap: the compression ratio and CSA-style overlap (see ``compressor_step``).
        window_kv: ``[T, D]`` ``RMSNorm(W_kv x)`` of the step's tokens (the input of ``window_entries``).
    Returns:
        ``window_entries(window_kv, batch.positions, …)``: ``[T, D]`` act dtype, the window entries as stored.
    """
    kv = window_entries(window_kv, batch.positions, inv_freq, numerics, nope_dim)
    for cw, role in compressors:
        if role == "kv":
            entries = compressor_step(x, cw, layer.state, "", batch, m, overlap, inv_freq, eps, numerics.act_dtype)
            write_entries(layer.kv_pages, layer.schema.kv_storage, batch, m, numerics.qdq_kv(entries, nope_dim))
        elif role == "index":
            entries = compressor_step(x, cw, layer.state, "index_", batch, m, overlap, inv_freq, eps, numerics.act_dtype)
            write_entries(layer.index_pages, layer.schema.index_storage, batch, m, numerics.qdq_index(entries))
        else:
            raise ValueError(f"role must be 'kv' or 'index', got {role!r}")
    return kv


def write_entries(pages: Tensor, storage: EntryStorage, batch: StepBatch, m: int, entries: Tensor) -> None:
    """Scatter the step's emitted entries ``[E, c]`` (already rounded) into the pool through the block table."""
    if batch.num_emit[m]:
        storage.write(pages, batch.emit_block[m], batch.emit_slot[m], entries.float())


# ------------------------------------------------------------------------------------------------ pool reads
def _max_entries(batch: StepBatch, m: int) -> int:
    """The most compressed entries any request of the step has after it (host arithmetic, no sync)."""
    return max(((s + n) // m for s, n in zip(batch.start_positions, batch.num_new)), default=0)


def _entry_addresses(batch: StepBatch, m: int, token_req: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """Physical (block, slot) of entry ``idx`` of each row's request; ``idx`` ≥ 0. Shapes as ``idx``."""
    first_pos = idx * m
    block = batch.block_tables.long()[token_req, first_pos // batch.block_size]
    return block.clamp(min=0), (first_pos % batch.block_size) // m


def gather(layer: LayerCache, batch: StepBatch, m: int, entry_idx: Tensor, dtype: torch.dtype) -> Tensor:
    """Dense tile of the compressed entries each token attends (the prototype's gather_kv); −1 → zeros.

    Args:
        entry_idx: int64 ``[T, K]`` entry indices of each token's request, −1 = invalid slot.
    Returns:
        ``[T, K, D]`` in ``dtype``.
    """
    T, K = entry_idx.shape
    if K == 0:
        return torch.zeros((T, 0, layer.schema.head_dim), dtype=dtype, device=entry_idx.device)
    req = batch.token_request.long()[:, None].expand(T, K)
    block, slot = _entry_addresses(batch, m, req, entry_idx.clamp(min=0))
    vals = layer.schema.kv_storage.read(layer.kv_pages, block.reshape(-1), slot.reshape(-1)).view(T, K, -1)
    return vals.masked_fill((entry_idx < 0)[..., None], 0.0).to(dtype)


def all_visible_entries(batch: StepBatch, m: int) -> Tensor:
    """HCA: every entry visible to each token, −1 padded to the step's largest count. int64 ``[T, N]``."""
    n_max = _max_entries(batch, m)
    vis = batch.visible_entries[m]
    idx = torch.arange(n_max, device=vis.device)[None, :].expand(vis.shape[0], n_max)
    return torch.where(idx < vis[:, None], idx, torch.full_like(idx, -1))


def indexer_queries(
    q_latent: Tensor, iw: IndexerWeights, positions: Tensor, inv_freq: Tensor, cfg: ModelConfig, numerics: Numerics
) -> Tensor:
    """Indexer queries (SPEC §5): ``W_Iq c^Q`` per head, RoPE, rounded as the index format (Hadamard + quant).

    Returns float32 ``[T, H_I, c_I]``; ``indexer_topk`` of the same backend consumes them.
    """
    return _reference_indexer_queries(q_latent, iw, positions, inv_freq, cfg, numerics)


def indexer_topk(
    layer: LayerCache, batch: StepBatch, m: int, q_idx: Tensor, head_weights: Tensor, k: int, score_dtype: torch.dtype
) -> Tensor:
    """Index scores over each request's indexer keys in the pool, then causal top-k (SPEC §5–6).

    Args:
        q_idx: ``[T, H_I, c_I]`` float32 indexer queries (rounded as the index format).
        head_weights: ``[T, H_I]`` float32.
        k: ``index_topk``.
    Returns:
        int64 ``[T, min(k, N)]`` entry indices, −1 padded (N = the most entries any request of the step has).
    """
    out = torch.full((batch.num_tokens, min(k, _max_entries(batch, m))), -1, dtype=torch.int64, device=q_idx.device)
    for rows, keys in request_index_keys(layer, batch, m):
        scores = index_scores(q_idx[rows], head_weights[rows], keys, score_dtype)
        chosen = select_topk(scores, batch.visible_entries[m][rows], k)
        out[rows, : chosen.shape[1]] = chosen
    return out


def request_index_keys(layer: LayerCache, batch: StepBatch, m: int) -> Iterator[tuple[slice, Tensor]]:
    """Each request's indexer keys after the step, read from the pool (a host loop over requests: the oracle's
    way, and the fallback of formats without a kernel).

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


# ------------------------------------------------------------------------------------------------ attention
def attend(
    layer: LayerCache,
    batch: StepBatch,
    q: Tensor,
    kv_new: Tensor,
    m: int,
    entry_idx: Tensor | None,
    sink: Tensor,
    scale: float,
    inv_freq: Tensor,
    numerics: Numerics,
) -> tuple[Tensor, Tensor]:
    """Attention of the step's queries over their window (ring ∪ this step's entries) and compressed entries,
    then the inverse RoPE at each query's position.

    Args:
        q: ``[T, H, D]`` queries (head-normed, RoPE'd), act dtype.
        kv_new: ``[T, D]`` this step's window entries as stored (``window_entries``).
        m: the layer's compression ratio (0 for SWA layers).
        entry_idx: int64 ``[T, K]`` compressed entries of each token's request to attend (CSA top-k, HCA all
            visible), −1 = none; ``None`` for SWA layers.
        sink: ``[H]`` float32 per-head sink logits; scale: softmax scale; inv_freq: float32 ``[R/2]``.
    Returns:
        ``o`` ``[T, H, D]`` act dtype (inverse RoPE applied on the last R dims), ``lse`` ``[T, H]`` float32 (sink
        included).
    """
    keys, valid = window_keys(layer, batch, kv_new)
    if entry_idx is not None:
        keys = torch.cat((keys, gather(layer, batch, m, entry_idx, kv_new.dtype)), dim=1)
        valid = torch.cat((valid, entry_idx >= 0), dim=1)
    o, lse = sparse_attention(q, keys, valid, sink, scale, numerics.prob_dtype, numerics.act_dtype)
    return apply_rope(o, batch.positions, inv_freq, inverse=True), lse


def sparse_attention(
    q: Tensor, keys: Tensor, valid: Tensor, sink: Tensor, scale: float, prob_dtype: torch.dtype, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """One softmax over each token's keys (window ∪ compressed) with the per-head sink; returns ``(o, lse)``.

    Shapes as ``dsv4.reference.attend_with_sink``: q ``[T, H, D]``, keys ``[T, K, D]``, valid ``[T, K]``.
    """
    return attend_with_sink(q, keys, valid, sink, scale, prob_dtype, out_dtype)
