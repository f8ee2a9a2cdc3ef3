"""NaN / Inf guard of one layer step: which requests' outputs or cache rows written by the step are not finite,
and the rows needed to undo the step.

``nonfinite_requests`` inspects exactly what a layer step leaves behind, with fixed-shape tensor ops only (no host
synchronisation, no allocation whose size depends on data; usable inside a captured CUDA graph):

* the outputs ``y`` of every token;
* the window entries the step wrote into the ring (``batch.ring_rows``), decoded from the stored bytes;
* the layer's FP32 compressor state rows of the step's slots (``*_kv`` must be finite; ``*_gate`` may hold −Inf,
  the empty-slot value, but not NaN or +Inf);
* the compressed entries (KV and indexer keys) the step emitted into the pool, decoded from the stored bytes,
  addressed through the batch's fixed-capacity emit lists (a context-parallel cache: those it holds).

``save_rows`` / ``restore_rows`` copy the state rows of the step's slots and the pool pages of the blocks it emits
into, and write them back (the rollback of ``nan_policy="raise"``; eager only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .batch import StepBatch

__all__ = ["SavedRows", "nonfinite_requests", "restore_rows", "save_rows"]


@dataclass
class SavedRows:
    """Copies of the cache rows one layer step may write.

    Attributes:
        state: ``{name: [B, ...]}`` the layer's state rows of ``batch.slots``.
        pages: ``{"kv_pages" | "index_pages": (block ids int64 [n], pages uint8 [n, page_bytes])}``.
    """

    state: dict[str, Tensor]
    pages: dict[str, tuple[Tensor, Tensor]]


def save_rows(layer, batch: StepBatch) -> SavedRows:  # layer: dsv4.cache.LayerCache
    """Copy what a step of ``layer`` may write for ``batch`` (host sync: the emitted blocks are deduplicated)."""
    state = {name: t.index_select(0, batch.slots) for name, t in layer.state.items()}
    pages: dict[str, tuple[Tensor, Tensor]] = {}
    m = layer.schema.ratio
    if m and batch.num_emit.get(m, 0):
        blocks = torch.unique(batch.emit_block[m])
        for name, t in (("kv_pages", layer.kv_pages), ("index_pages", layer.index_pages)):
            if t is not None:
                pages[name] = (blocks, t.index_select(0, blocks))
    return SavedRows(state, pages)


def restore_rows(layer, batch: StepBatch, saved: SavedRows) -> None:
    """Write ``saved`` back: the layer's cache rows are as they were before the step."""
    for name, rows in saved.state.items():
        layer.state[name].index_copy_(0, batch.slots, rows)
    for name, (blocks, pages) in saved.pages.items():
        (layer.kv_pages if name == "kv_pages" else layer.index_pages).index_copy_(0, blocks, pages)


def _per_request(bad: Tensor, request: Tensor, out: Tensor) -> None:
    """``out[request[i]] |= bad[i]`` (int32 ``out`` [B]; duplicate requests allowed)."""
    if bad.numel():
        out.scatter_reduce_(0, request.long(), bad.to(out.dtype), "amax")


def nonfinite_requests(layer, batch: StepBatch, y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Which requests of the step got a non-finite output or left a non-finite value in ``layer``'s cache.

    Args:
        layer: the ``LayerCache`` the step wrote.
        batch: the step.
        y: ``[T, d]`` the step's outputs.
    Returns:
        int32 ``[B]`` (1 = request ``b`` is affected) and ``{part: bool 0-d tensor}`` for the parts ``"outputs"``,
        ``"ring"``, ``"compressor state"``, ``"pool entries"`` (device tensors; reading them syncs).
    """
    B = batch.num_requests
    out = torch.zeros(B, dtype=torch.int32, device=y.device)
    parts: dict[str, Tensor] = {}
    req = batch.token_request

    y_bad = ~torch.isfinite(y).all(dim=1)
    _per_request(y_bad, req, out)
    parts["outputs"] = y_bad.any()

    rows = batch.ring_rows
    ring = layer.schema.kv_storage.read(layer.ring, batch.token_slots[rows], batch.ring_slots[rows])
    ring_bad = ~torch.isfinite(ring).all(dim=1)
    _per_request(ring_bad, req[rows], out)
    parts["ring"] = ring_bad.any()

    state_bad = torch.zeros(B, dtype=torch.bool, device=y.device)
    for name, t in layer.state.items():
        if not t.dtype.is_floating_point:
            continue
        r = t.index_select(0, batch.slots).flatten(1)
        bad = (torch.isnan(r) | (r == float("inf"))) if name.endswith("gate") else ~torch.isfinite(r)
        state_bad |= bad.any(dim=1)
    _per_request(state_bad, torch.arange(B, device=y.device), out)
    parts["compressor state"] = state_bad.any()

    m = layer.schema.ratio
    pool_bad = torch.zeros((), dtype=torch.bool, device=y.device)
    if m and batch.emit_capacity.get(m, 0) and batch.block_tables.shape[1]:  # no table: nothing can be emitted
        e_req = batch.emit_pad_request[m].long()
        valid = e_req >= 0
        e_req = e_req.clamp(min=0)
        pos = batch.emit_pad_entry[m] * m
        block = batch.block_tables.long()[e_req, pos // batch.block_size].clamp(min=0)
        slot = (pos % batch.block_size) // m
        cp_rank, cp_size = layer.schema.cp_rank, layer.schema.cp_size
        if cp_size > 1:  # context parallelism: only this rank's entries are here, at local slots
            valid = valid & (batch.emit_pad_entry[m] % cp_size == cp_rank)
            slot = slot // cp_size
        for pages, storage in ((layer.kv_pages, layer.schema.kv_storage), (layer.index_pages, layer.schema.index_storage)):
            if pages is None or storage is None:
                continue
            bad = ~torch.isfinite(storage.read(pages, block, slot)).all(dim=1) & valid
            _per_request(bad, e_req, out)
            pool_bad = pool_bad | bad.any()
    parts["pool entries"] = pool_bad
    return out, parts
