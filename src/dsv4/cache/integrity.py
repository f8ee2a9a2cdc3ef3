"""Integrity of saved requests: the snapshot checksum and the value checks ``restore_request`` runs before it
writes anything.

**Checksum** (``snapshot_digest``): SHA-256 over, in this order, a format tag, the request id, ``num_tokens``,
``num_blocks``, the ``missing`` note, the cache geometry (``repr`` of the ``CacheGeometry``: every config field,
the layers, the block size, the numerics and storage formats), then for every state row and page tensor (sorted
by group and key) its key, dtype and shape followed by its raw bytes. ``save_request`` stores it in the snapshot;
``restore_request`` recomputes it, so a payload changed after saving (a bit flip on disk, a truncated or edited
tensor, a changed field) is refused. It detects corruption, not forgery: anyone can recompute it, which is why the
value checks below run as well.

**Values** (``value_problems``): what the cache of any request must satisfy —

* ``ring_positions``: slot ``s`` holds the latest position ``p < num_tokens`` with ``p ≡ s (mod window)``, or −1
  (for a snapshot whose data is known incomplete, ``missing``: each entry −1 or such a position below
  ``num_tokens``);
* every occupied ring entry (position ≥ 0) and every pool entry the request has (``num_tokens // m`` per
  compressed layer, KV and indexer keys) decodes to finite values;
* the FP32 compressor state: ``*_kv`` finite; ``*_gate`` without NaN or +Inf (−Inf is the empty-slot value).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Mapping

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .manager import HybridCache
    from .records import CacheGeometry

__all__ = ["SNAPSHOT_FORMAT", "canonical_ring_positions", "snapshot_digest", "value_problems"]

#: bumped when the digest's contents change
SNAPSHOT_FORMAT = "dsv4-request-snapshot-1"


def snapshot_digest(
    request_id: str,
    num_tokens: int,
    num_blocks: int,
    missing: str | None,
    geometry: CacheGeometry,
    state: Mapping[tuple[int, str], Tensor],
    pages: Mapping[tuple[int, str], Tensor],
    extra: tuple = (),
) -> str:
    """SHA-256 (hex) of a snapshot's fields and tensor bytes (see the module docstring for what it covers);
    ``extra``: further plain fields (the prefix cache's token ids and nodes), hashed by their ``repr``."""
    h = hashlib.sha256()
    h.update(repr((SNAPSHOT_FORMAT, request_id, num_tokens, num_blocks, missing, repr(geometry), extra)).encode())
    for group, tensors in (("state", state), ("pages", pages)):
        for key in sorted(tensors):
            t = tensors[key]
            h.update(repr((group, key, str(t.dtype), tuple(t.shape))).encode())
            flat = t.detach().reshape(-1).contiguous().cpu()
            if flat.numel():
                h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def canonical_ring_positions(num_tokens: int, window: int) -> Tensor:
    """int32 ``[window]``: the position ring slot ``s`` holds after ``num_tokens`` tokens (the latest
    ``p < num_tokens`` with ``p ≡ s mod window``), −1 where there is none."""
    s = torch.arange(window, dtype=torch.int64)
    last = num_tokens - 1
    p = s + window * torch.div(last - s, window, rounding_mode="floor")
    return torch.where(s <= last, p, torch.full_like(p, -1)).to(torch.int32)


def _entry_addresses(num_entries: int, m: int, block_size: int, cp_rank: int = 0, cp_size: int = 1
                     ) -> tuple[Tensor, Tensor]:
    """Logical block and slot of the entries of ``0 … num_entries−1`` (ratio ``m``) that a cache holds: all, or
    a context-parallel share's ``i ≡ cp_rank (mod cp_size)`` at their local slots (``LayerCacheSchema``)."""
    pos = torch.arange(cp_rank, max(num_entries, cp_rank), cp_size, dtype=torch.int64) * m
    return pos // block_size, (pos % block_size) // m // cp_size


def value_problems(
    cache: HybridCache,
    num_tokens: int,
    missing: str | None,
    state: Mapping[tuple[int, str], Tensor],
    pages: Mapping[tuple[int, str], Tensor],
) -> list[str]:
    """What in a snapshot's tensors no cache of ``cache``'s geometry can hold (empty: plausible). The tensors
    must already have the cache's shapes and dtypes (``check_snapshot`` checks those first)."""
    problems: list[str] = []
    window = cache.cfg.window
    for layer, schema in cache.schemas.items():
        pos = state[(layer, "ring_positions")].to("cpu", torch.int64)
        want = canonical_ring_positions(num_tokens, window).long()
        if missing is None:
            bad = pos != want
        else:  # incomplete data: stale positions are possible, impossible ones are not
            slot = torch.arange(window)
            bad = (pos != -1) & ((pos < 0) | (pos >= num_tokens) | (pos % window != slot))
        if bool(bad.any()):
            s = int(bad.nonzero()[0, 0])
            problems.append(
                f"state ({layer}, 'ring_positions') slot {s} holds {int(pos[s])}, impossible after {num_tokens} tokens"
                + (f" (want {int(want[s])})" if missing is None else "")
            )
            continue
        occupied = (pos >= 0).nonzero().squeeze(1)
        if occupied.numel():
            ring = state[(layer, "ring")].to("cpu")[None]
            vals = schema.kv_storage.read(ring, torch.zeros_like(occupied), occupied)
            if not bool(torch.isfinite(vals).all()):
                problems.append(f"state ({layer}, 'ring') holds NaN/Inf entries")
        for (li, name), t in state.items():
            if li != layer or not t.dtype.is_floating_point:
                continue
            t = t.to("cpu")
            ok = ~torch.isnan(t) & (t != float("inf")) if name.endswith("gate") else torch.isfinite(t)
            if not bool(ok.all()):
                problems.append(f"state ({layer}, {name!r}) holds NaN" + ("/+Inf" if name.endswith("gate") else "/Inf"))
        if schema.ratio:
            blocks, slots = _entry_addresses(num_tokens // schema.ratio, schema.ratio, cache.block_size,
                                             schema.cp_rank, schema.cp_size)
            for name, storage in (("kv_pages", schema.kv_storage), ("index_pages", schema.index_storage)):
                if storage is None or not blocks.numel():
                    continue
                vals = storage.read(pages[(layer, name)].to("cpu"), blocks, slots)
                if not bool(torch.isfinite(vals).all()):
                    first = int((~torch.isfinite(vals)).any(dim=1).nonzero()[0, 0])
                    problems.append(f"pages ({layer}, {name!r}) entry {first} decodes to NaN/Inf")
    return problems
