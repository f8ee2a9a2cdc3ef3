"""Snapshots of the live request state at block boundaries *inside* a step (prefix caching, ``dsv4.cache.prefix``).

A step of one request covering positions ``s … e−1`` crosses the block boundaries P (``s < P < e``) without the
request's state ever being at P. For each ``(b, P, row)`` of ``StepBatch.prefix_captures`` a layer writes, before
its own write ops change anything (``Attention`` calls this op right after ``window_kv``), the state it
would hold at P into row ``row`` of ``PrefixStates``:

* ``ring`` / ``ring_positions``: the request's pre-step ring, with the slots of positions ``max(s, P − W) … P − 1``
  replaced by those positions' window entries — the window entries (RoPE, rounding as stored) of the step's
  ``kv_in`` rows, elementwise per row, so the same values either backend's step computes — encoded by the layer's
  KV storage as the ring commit encodes them;
* CSA ``prev_kv / prev_gate`` and ``index_prev_*``: the first half of window ``[P − m, P)``: projections of its rows
  in the step (``reference.compressor.project`` of those rows: the step's own FP32 projection up to GEMM rounding)
  and, for positions before ``s``, the pre-step tail.

The compressor tails are not live at a block boundary (``dsv4.cache.prefix``), so nothing else is needed. The
index tensors (which tokens, ring slots and tail rows) come built with the batch (``StepBatch.prefix_capture_index``,
``dsv4.cache.capture_index``): a layer only gathers, computes and scatters on the device, with no host loop and no
host synchronisation. A step with captures is still not graph-safe (its index tensors change shape from step to
step; CUDA-graph replays never carry captures).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from ..cache.batch import StepBatch
from ..cache.capture_index import CaptureIndex, build_capture_index
from ..config import LayerKind
from ..reference.compressor import project
from ..reference.rope import apply_rope
from .step import LayerStep


__all__ = ["capture_prefix_states"]


def capture_prefix_states(step: LayerStep, x: Tensor, kv_in: Tensor) -> None:
    """Write the layer's state at each capture's boundary into its snapshot row (see the module doc).

    Args:
        step: the layer's step (``step.batch.prefix_captures`` and their index tensors; ``step.cache.prefix_states``:
            the snapshot rows).
        x: ``[T, d]`` the step's attention inputs (act dtype).
        kv_in: ``[T, D]`` ``RMSNorm(W_kv x)`` of the step's tokens (the input of the window entries).
    """
    batch, layer, weights = step.batch, step.cache, step.weights
    if not batch.prefix_captures:
        return
    index = batch.prefix_capture_index
    if index is None:  # a batch whose captures were set by hand (tests): index them here
        m = [layer.schema.ratio] if layer.schema.kind is LayerKind.CSA else []
        index = build_capture_index(batch.prefix_captures, batch.num_new, batch.start_positions, batch.window, m,
                                    x.device)
    rows_t, state, W = layer.prefix_states, layer.state, batch.window
    slot = batch.slots.index_select(0, index.requests)  # [C] state slot of each capture
    for name in ("ring", "ring_positions"):
        rows_t[name].index_copy_(0, index.rows, state[name].index_select(0, slot))
    if index.ring_tok.numel():  # the step's positions of the window before P
        pos = batch.positions.index_select(0, index.ring_tok)
        kv = step.numerics.qdq_kv(apply_rope(kv_in.index_select(0, index.ring_tok), pos, step.inv_freq),
                                  step.cfg.nope_dim)  # as stored
        layer.schema.kv_storage.write(rows_t["ring"], index.ring_dst, pos % W, kv.float())
        rows_t["ring_positions"][index.ring_dst, pos % W] = pos.to(rows_t["ring_positions"].dtype)
    if layer.schema.kind is LayerKind.CSA:
        m = layer.schema.ratio
        for cw, prefix in ((weights.compressor, ""), (weights.indexer.compressor, "index_")):
            _capture_prev_half(x, cw, state, rows_t, prefix, batch, index, slot, m, step.numerics.act_dtype)


def _capture_prev_half(
    x: Tensor,
    cw,
    state: Mapping[str, Tensor],
    rows_t: Mapping[str, Tensor],
    prefix: str,
    batch: StepBatch,
    index: CaptureIndex,
    slot: Tensor,
    m: int,
    weight_dtype: torch.dtype,
) -> None:
    """CSA: ``{prefix}prev_kv / prev_gate`` ``[m, c]`` at each capture's P = first half of window ``[P − m, P)``."""
    tail_kv, tail_gate = state[f"{prefix}tail_kv"], state[f"{prefix}tail_gate"]
    c = tail_kv.shape[-1] // 2
    C, dev = index.rows.numel(), x.device
    half = index.prev[m]
    kv = torch.empty(C * m, c, dtype=torch.float32, device=dev)
    gate = torch.empty_like(kv)
    if half.step_tok.numel():
        tok = half.step_tok
        a, z = project(x.index_select(0, tok), cw, batch.positions.index_select(0, tok), weight_dtype)
        kv[half.step_dst], gate[half.step_dst] = a[:, :c], z[:, :c]
    if half.tail_dst.numel():  # the window began before the step: its row is in the tail (written by an earlier step)
        src_slot = slot.index_select(0, half.tail_cap)
        kv[half.tail_dst] = tail_kv[src_slot, half.tail_row, :c]
        gate[half.tail_dst] = tail_gate[src_slot, half.tail_row, :c]
    rows_t[f"{prefix}prev_kv"].index_copy_(0, index.rows, kv.view(C, m, c))
    rows_t[f"{prefix}prev_gate"].index_copy_(0, index.rows, gate.view(C, m, c))
