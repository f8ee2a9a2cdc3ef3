"""Context parallelism in the torch backend: the stages of a CSA / HCA layer step that read the sharded pool.

Layout (``cache.schema.LayerCacheSchema``): CP rank ``r`` of ``P`` holds the compressed entries ``i ≡ r (mod P)``
of every request — main KV entries and CSA indexer keys alike — in pages of ``block_size // m // P`` entries.
Entry-wise interleaving keeps every rank's share within one entry of ``n / P`` at every length (decode appends
to all ranks in turn; the indexer's and HCA's work is balanced, and a cluster of important entries — the start
of a document, the recent past — is spread over the ranks), while block tables, the allocator, prefix sharing
and every host decision stay identical on all ranks (a block holds the same positions everywhere; only its page
is smaller). The state (SWA ring, compressor tails) is replicated: every rank runs the compressors on the step's
tokens and writes the entries it holds (``torch_ops.new_entries``, through the schema).

Per layer step:

* CSA ``indexer_topk``: each rank scores its own entries and takes their causal top-k; one all-gather of every
  rank's ``[T, k_r]`` (score, index) candidates; the global top-k of the union is the one-process selection (any
  entry of the global top-k is in its owner's local top-k) — up to the order of exact ties;
* ``attend``: each rank attends its share of the window (``Parallel.cp_window``) and of the compressed keys —
  CSA: the selected entries it holds; HCA: its visible entries — and the parts combine into the one softmax,
  the sink counted once (``Parallel.cp_merge``: a shared maximum and summed numerators, or partial outputs merged
  by their log-sum-exp; ``merge``).

SWA layers hold no pool: every rank computes them whole (no collective).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from torch import Tensor

from ..cache.batch import StepBatch
from ..cache.manager import LayerCache
from ..ops import torch_ops
from ..ops.step import LayerStep
from ..reference.indexer import index_scores
from ..reference.rope import apply_rope
from .collectives import all_gather_stacked
from .merge import attend_shared_max, merge_across, partial_attention

__all__ = ["attend", "held_entries", "held_index_keys", "indexer_topk", "window_columns"]


def held_entries(n: int, cp_rank: int, cp_size: int, device: torch.device) -> Tensor:
    """int64 ``[⌈(n − cp_rank) / cp_size⌉]``: the entries ``i < n`` that CP rank ``cp_rank`` holds."""
    return torch.arange(cp_rank, max(n, cp_rank), cp_size, device=device)


def window_columns(window: int, cp_rank: int, cp_size: int, mode: str, device: torch.device) -> Tensor:
    """bool ``[W]``: the window columns (``torch_ops.window_keys``' order, oldest first) this rank attends —
    ``"split"``: columns ``w`` with ``⌊w · P / W⌋ = r`` (contiguous, ``W/P`` each); ``"first"``: all on rank 0."""
    if mode == "first":
        return torch.full((window,), cp_rank == 0, dtype=torch.bool, device=device)
    return torch.arange(window, device=device) * cp_size // window == cp_rank


def held_index_keys(layer: LayerCache, batch: StepBatch, m: int) -> Iterator[tuple[slice, Tensor, Tensor]]:
    """Each request's indexer keys held by this rank, after the step (a host loop over requests).

    Yields ``(rows, entries, keys)``: the request's token rows of the step, int64 ``[n_r]`` the (request-global)
    indices of the entries held here and float32 ``[n_r, c_I]`` their keys — for every request with one."""
    cp_rank, cp_size = layer.schema.cp_rank, layer.schema.cp_size
    cu = [0, *itertools.accumulate(batch.num_new)]
    for b, (s, n) in enumerate(zip(batch.start_positions, batch.num_new)):
        idx = held_entries((s + n) // m, cp_rank, cp_size, batch.device)
        if idx.numel() == 0 or n == 0:
            continue
        block, slot = torch_ops._entry_addresses(batch, m, torch.full_like(idx, b), idx, cp_size)
        yield slice(cu[b], cu[b + 1]), idx, layer.schema.index_storage.read(layer.index_pages, block, slot)


def indexer_topk(step: LayerStep, q_idx: Tensor, head_weights: Tensor, group) -> Tensor:
    """``ops.backend.AttentionBackend.indexer_topk`` over the CP group's pool. Returns the same int64
    ``[T, min(k, N)]`` (−1 padded) on every rank of the group: the global selection."""
    batch, m, k = step.batch, step.ratio, step.cfg.index_topk
    cp_size = step.cache.schema.cp_size
    N = torch_ops._max_entries(batch, m)
    width = min(k, N)
    T, dev = batch.num_tokens, q_idx.device
    if width == 0:
        return torch.empty((T, 0), dtype=torch.int64, device=dev)
    k_rank = min(k, -(-N // cp_size))  # no rank holds more than ⌈N / P⌉ entries of a request
    cand = torch.empty((T, k_rank, 2), dtype=torch.float64, device=dev)
    cand[..., 0] = float("-inf")  # score
    cand[..., 1] = -1  # entry
    visible = batch.visible_entries[m]
    for rows, held, keys in held_index_keys(step.cache, batch, m):
        scores = index_scores(q_idx[rows], head_weights[rows], keys, step.numerics.score_dtype).float()
        scores = scores.masked_fill(held[None, :] >= visible[rows][:, None], float("-inf"))
        val, pos = scores.topk(min(k_rank, held.numel()), dim=-1)
        cand[rows, : val.shape[1], 0] = val.double()
        cand[rows, : val.shape[1], 1] = torch.where(torch.isinf(val), -1, held[pos]).double()
    every = all_gather_stacked(cand, group).transpose(0, 1).reshape(T, -1, 2)  # [T, P · k_rank, 2]
    val, pos = every[..., 0].topk(width, dim=-1)
    chosen = every[..., 1].gather(1, pos).long()
    return torch.where(torch.isinf(val), -1, chosen)


def attend(step: LayerStep, q: Tensor, kv: Tensor, entry_idx: Tensor, group, window_mode: str, merge: str
           ) -> tuple[Tensor, Tensor]:
    """``ops.backend.AttentionBackend.attend`` of a CSA / HCA layer over the CP group (module docstring).

    Args:
        entry_idx: CSA int64 ``[T, K]`` the global selection (−1 = none); HCA int64 ``[T]`` visible counts.
        group: the CP process group. window_mode: ``Parallel.cp_window``. merge: ``Parallel.cp_merge``
            (``merge.MERGES``).
    Returns:
        ``o`` ``[T, H, D]`` act dtype (inverse RoPE applied), ``lse`` float32 ``[T, H]`` (sink included) — the
        same on every rank of the group.
    """
    layer, batch, m, nm = step.cache, step.batch, step.ratio, step.numerics
    cp_rank, cp_size = layer.schema.cp_rank, layer.schema.cp_size
    keys, valid = torch_ops.window_keys(layer, batch, kv)
    valid = valid & window_columns(batch.window, cp_rank, cp_size, window_mode, valid.device)[None, :]
    if entry_idx.dim() == 1:  # HCA: the visible entries held here
        held = held_entries(torch_ops._max_entries(batch, m), cp_rank, cp_size, entry_idx.device)
        lists = torch.where(held[None, :] < entry_idx[:, None], held[None, :], -1)
    else:  # CSA: the selected entries held here
        lists = torch.where((entry_idx >= 0) & (entry_idx % cp_size == cp_rank), entry_idx, -1)
    keys = torch.cat((keys, torch_ops.gather(layer, batch, m, lists, kv.dtype)), dim=1)
    valid = torch.cat((valid, lists >= 0), dim=1)
    sink, scale = step.weights.attn_sink, step.cfg.softmax_scale
    if merge == "sums":
        o, lse = attend_shared_max(q, keys, valid, sink, scale, nm.prob_dtype, group)
    else:
        o, lse = merge_across(*partial_attention(q, keys, valid, scale, nm.prob_dtype), sink, group)
    return apply_rope(o.to(nm.act_dtype), batch.positions, step.inv_freq, inverse=True), lse
