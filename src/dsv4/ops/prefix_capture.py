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

The compressor tails are not live at a block boundary (``dsv4.cache.prefix``), so nothing else is needed. Index lists
are built on the host: a step with captures is not graph-safe (CUDA-graph replays never carry captures).
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from ..cache.batch import StepBatch
from ..config import LayerKind
from ..reference.compressor import project
from ..reference.rope import apply_rope
from .step import LayerStep


__all__ = ["capture_prefix_states"]


def capture_prefix_states(step: LayerStep, x: Tensor, kv_in: Tensor) -> None:
    """Write the layer's state at each capture's boundary into its snapshot row (see the module doc).

    Args:
        step: the layer's step (``step.batch.prefix_captures``; ``step.cache.prefix_states``: the snapshot rows).
        x: ``[T, d]`` the step's attention inputs (act dtype).
        kv_in: ``[T, D]`` ``RMSNorm(W_kv x)`` of the step's tokens (the input of the window entries).
    """
    batch, layer, weights = step.batch, step.cache, step.weights
    caps = batch.prefix_captures
    if not caps:
        return
    rows_t = layer.prefix_states
    state, W, dev = layer.state, batch.window, x.device
    cu = list(itertools.accumulate(batch.num_new, initial=0))
    slot = batch.slots[torch.tensor([b for b, _, _ in caps], device=dev)]  # [C] state slot of each capture
    rows = torch.tensor([row for _, _, row in caps], device=dev)
    for name in ("ring", "ring_positions"):
        rows_t[name].index_copy_(0, rows, state[name].index_select(0, slot))
    # the step's positions of the window before P
    dst, tok = [], []
    for b, point, row in caps:
        s = batch.start_positions[b]
        for p in range(max(s, point - W), point):
            dst.append(row)
            tok.append(cu[b] + p - s)
    if tok:
        tok_t, dst_t = torch.tensor(tok, device=dev), torch.tensor(dst, device=dev)
        pos = batch.positions[tok_t]
        kv = step.numerics.qdq_kv(apply_rope(kv_in[tok_t], pos, step.inv_freq), step.cfg.nope_dim)  # as stored
        layer.schema.kv_storage.write(rows_t["ring"], dst_t, pos % W, kv.float())
        rows_t["ring_positions"][dst_t, pos % W] = pos.to(rows_t["ring_positions"].dtype)
    if layer.schema.kind is LayerKind.CSA:
        m = layer.schema.ratio
        for cw, prefix in ((weights.compressor, ""), (weights.indexer.compressor, "index_")):
            _capture_prev_half(x, cw, state, rows_t, prefix, batch, caps, cu, slot, rows, m, step.numerics.act_dtype)


def _capture_prev_half(
    x: Tensor,
    cw,
    state: dict[str, Tensor],
    rows_t: dict[str, Tensor],
    prefix: str,
    batch: StepBatch,
    caps: list[tuple[int, int, int]],
    cu: list[int],
    slot: Tensor,
    rows: Tensor,
    m: int,
    weight_dtype: torch.dtype,
) -> None:
    """CSA: ``{prefix}prev_kv / prev_gate`` ``[m, c]`` at each capture's P = first half of window ``[P − m, P)``."""
    tail_kv, tail_gate = state[f"{prefix}tail_kv"], state[f"{prefix}tail_gate"]
    c = tail_kv.shape[-1] // 2
    C, dev = len(caps), x.device
    step_dst, step_tok, tail_dst, tail_cap, tail_row = [], [], [], [], []
    for i, (b, point, _) in enumerate(caps):
        s = batch.start_positions[b]
        for r in range(m):
            p = point - m + r
            if p >= s:
                step_dst.append(i * m + r)
                step_tok.append(cu[b] + p - s)
            else:  # the window began before the step: its row is in the tail (written by an earlier step)
                tail_dst.append(i * m + r)
                tail_cap.append(i)
                tail_row.append(p % m)
    kv = torch.empty(C * m, c, dtype=torch.float32, device=dev)
    gate = torch.empty_like(kv)
    if step_tok:
        tok = torch.tensor(step_tok, device=dev)
        a, z = project(x[tok], cw, batch.positions[tok], weight_dtype)
        d = torch.tensor(step_dst, device=dev)
        kv[d], gate[d] = a[:, :c], z[:, :c]
    if tail_dst:
        d = torch.tensor(tail_dst, device=dev)
        src_slot, src_row = slot[torch.tensor(tail_cap, device=dev)], torch.tensor(tail_row, device=dev)
        kv[d], gate[d] = tail_kv[src_slot, src_row, :c], tail_gate[src_slot, src_row, :c]
    rows_t[f"{prefix}prev_kv"].index_copy_(0, rows, kv.view(C, m, c))
    rows_t[f"{prefix}prev_gate"].index_copy_(0, rows, gate.view(C, m, c))
