"""The Triton backend's attention (``ops.backend``): sparse attention with sink over each token's window (its ring
∪ the step's new entries) and compressed entries, then the inverse RoPE (``dsv4.kernels.attention``).

Compressed entries come as CSA's fixed-width ``[T, k]`` top-k lists (−1 = none) or HCA's per-token counts ``[T]``
(every entry ``i < count``, walked straight through the block table: nothing of data-dependent size is built).
Every launch decision is the step's ``AttentionPlan`` (``plan_layer``, made once per step from the batch's shape;
``LayerStep.plan.attention``). The kernels read the official ``fp8_ds_mla`` 584-B entries; where the plan is
``None`` (another KV format, a geometry other than 512 = 448 + 64, a device without the kernels) the torch
backend serves the layer (same results; not graph-safe). ``attend_layer`` / ``attention_plan`` take explicit
tensors (kernel tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..cache.batch import StepBatch
from ..cache.manager import LayerCache
from ..config import LayerKind
from ..kernels.device import DeviceFacts, runs_here
from ..numerics import Numerics
from . import torch_ops
from .step import LayerStep

if TYPE_CHECKING:
    from ..kernels.attention.plan import AttentionPlan

__all__ = ["attend", "attend_layer", "attention_plan", "plan_layer", "supports"]


def supports(layer: LayerCache, q: Tensor, numerics: Numerics) -> bool:
    """Whether the Triton kernel handles this layer/input (else ``attend`` falls back to torch)."""
    s = layer.schema
    aligned = all(t is None or t.data_ptr() % 16 == 0 for t in (layer.kv_pages, layer.ring))  # 8-B scale words
    return (
        runs_here(q)
        and aligned
        and numerics.kv_format == "fp8_ds_mla"
        and s.kv_storage.name == "fp8_ds_mla"
        and (s.head_dim, s.rope_dim) == (512, 64)
        and q.dtype == torch.bfloat16
    )


def _entry_keywords(batch: StepBatch, m: int, entry_idx: Tensor | None) -> dict:
    """``sparse_attention_fwd``'s keywords for the step's compressed entries: CSA lists ``[T, K]`` or HCA counts
    ``[T]`` (with the bound on them), and the bound on any token's visible entries."""
    counts = entry_idx if entry_idx is not None and entry_idx.dim() == 1 else None
    return dict(
        window=batch.window, ratio=m, block_size=batch.block_size,
        entry_idx=entry_idx if entry_idx is not None and entry_idx.dim() == 2 else None, visible=counts,
        max_entries=batch.addressable_entries(m) if counts is not None else 0,
        max_visible=batch.addressable_entries(m) if m else None,
    )


def attention_plan(batch: StepBatch, q: Tensor, kv_new: Tensor, m: int, entry_idx: Tensor | None,
                   **requests) -> AttentionPlan:
    """The plan ``attend`` makes for this step when given none (arguments as there); ``requests`` override the
    rules (``plan_attention``'s ``impl``, ``keys``, ``combine``, ``num_splits``, …), checked."""
    from ..kernels.attention.launch import plan_for

    return plan_for(q, kv_new, batch.block_tables, **_entry_keywords(batch, m, entry_idx), **requests)


def plan_layer(batch: StepBatch, layer: LayerCache, heads: int, ratio: int, entries_per_token: int,
               numerics: Numerics, device: DeviceFacts) -> AttentionPlan | None:
    """The step's ``AttentionPlan`` for a layer (``None``: the torch backend serves it — formats, geometry or a
    device the kernels do not handle). ``entries_per_token``: CSA the width of the indexer's lists (``k``); HCA
    and SWA ignore it (HCA attends every visible entry, bounded by the block tables' reach)."""
    s = layer.schema
    aligned = all(t is None or t.data_ptr() % 16 == 0 for t in (layer.kv_pages, layer.ring))  # 8-B scale words
    if not (device.kernels and aligned and numerics.kv_format == s.kv_storage.name == "fp8_ds_mla"
            and (s.head_dim, s.rope_dim) == (512, 64) and numerics.act_dtype == torch.bfloat16):
        return None
    from ..kernels.attention.plan import plan_attention

    reach = batch.addressable_entries(ratio) if ratio else 0
    mode, num = ("window", 0) if not ratio else ("list", entries_per_token) if s.kind is LayerKind.CSA else ("all", reach)
    return plan_attention(
        tokens=batch.num_tokens, requests=batch.num_requests, heads=heads, window=batch.window, ratio=ratio,
        block_size=batch.block_size, mode=mode if num else "window", num_compressed=num,
        max_visible=reach if ratio else None, sm_count=device.sm_count, sm90=device.sm90,
        resident_clusters=device.resident_clusters)


def attend(step: LayerStep, q: Tensor, kv: Tensor, entry_idx: Tensor | None) -> tuple[Tensor, Tensor]:
    """See ``backend.AttentionBackend.attend``: as ``step.plan.attention`` says (``None``: the torch backend)."""
    plan = step.plan.attention
    if plan is None:
        return torch_ops.attend(step, q, kv, entry_idx)
    return attend_layer(step.cache, step.batch, q, kv, step.ratio, entry_idx, step.weights.attn_sink,
                        step.cfg.softmax_scale, step.inv_freq, step.numerics, plan)


def attend_layer(
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
    plan: AttentionPlan | None = None,
) -> tuple[Tensor, Tensor]:
    """``attend`` on explicit tensors (``torch_ops.attend_layer``'s arguments): the kernels where ``supports``,
    else the torch backend.

    Args:
        entry_idx: CSA int ``[T, K]`` entry indices (−1 = none); HCA int64 ``[T]`` counts (a ``[T, K]`` list works
            too); ``None`` for SWA layers.
        plan: the step's ``AttentionPlan`` (``attention_plan``); ``None``: made here from the batch.
    Returns:
        ``o`` ``[T, H, D]`` act dtype (inverse RoPE applied), ``lse`` ``[T, H]`` float32 (sink included).
    """
    if not supports(layer, q, numerics):
        return torch_ops.attend_layer(layer, batch, q, kv_new, m, entry_idx, sink, scale, inv_freq, numerics)

    from ..kernels.attention.launch import sparse_attention_fwd

    return sparse_attention_fwd(
        q, kv_new, layer.ring, layer.ring_positions, layer.kv_pages, batch.block_tables, batch.token_request,
        batch.positions, batch.cu_seqlens, batch.start_pos, batch.token_slots, sink.float(), inv_freq.float(), scale,
        workspace=layer.workspace, plan=plan, **_entry_keywords(batch, m, entry_idx),
    )
