"""The Triton backend: the ops of one layer step (``ops.backend``) on Triton / Gluon kernels for Hopper GPUs
(CUDA tensors; the Triton interpreter runs them on the CPU for tests), in call order:

* ``input_projections``, ``new_entries``, ``queries``, ``append_swa`` — ``triton_write`` (``kernels.project``,
  ``kernels.write``);
* ``indexer_queries``, ``indexer_weights``, ``indexer_topk`` — ``triton_indexer`` (``kernels.indexer``);
* ``visible_entries``, ``attend`` — ``triton_attention`` (``kernels.attention``);
* ``output`` — the grouped output projection (``ops.projections``).

``plan_step`` makes every launch decision of a step once (``ops.plan.StepPlan``); the ops only consume it. A stage
whose plan is ``None`` (a format or geometry the kernels do not handle) runs the torch backend's op.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache.batch import StepBatch
from ..cache.manager import HybridCache
from ..config import LayerKind
from ..kernels.cache_keys import canonical_cache_keys
from ..kernels.device import DeviceFacts
from ..kernels.device_facts import facts
from ..kernels.write.plan import plan_write
from ..kernels.project.plan import fp8_projection_shapes, plan_projections
from . import projections, triton_attention, triton_indexer
from .triton_attention import attend
from .triton_indexer import indexer_queries, indexer_topk
from .plan import LayerPlan, StepPlan
from .prefix_capture import capture_prefix_states
from .step import LayerStep
from .triton_project import projector
from .triton_write import append_swa, input_projections, kernels_handle, new_entries, queries

__all__ = [
    "GRAPH_SAFE", "NAME", "plan_step",
    "input_projections", "capture_prefix_states", "new_entries", "queries", "indexer_queries", "indexer_weights",
    "indexer_topk", "visible_entries", "attend", "append_swa", "output",
]

NAME = "triton"
GRAPH_SAFE = True


def plan_step(batch: StepBatch, cache: HybridCache, device: DeviceFacts | None = None, heads: int | None = None,
              *, streams: bool = True) -> StepPlan:
    """The step's launch decisions for every layer kind ``cache`` holds (host arithmetic on the batch's shape).

    ``device``: plan for these device facts instead of the cache's device's (tests plan for an H200 on the CPU).
    ``heads``: the query heads a layer computes (default the config's; a tensor-parallel rank's ``H/tp``).
    ``streams``: where the device has them, run the writes and the ring commit on a second CUDA stream
    (``LayerPlan.overlap``); ``False``: every launch on the caller's current stream.
    """
    dev = device if device is not None else facts(cache.device)
    nm, cfg = cache.numerics, cache.cfg
    kernels = dev.kernels and nm.act_dtype == torch.bfloat16 and (cfg.head_dim, cfg.rope_dim) == (512, 64)
    formats = kernels and kernels_handle(nm, cfg.nope_dim, cfg.head_dim, cfg.index_head_dim)
    projection = None  # one per step: every layer kind multiplies the same rows by the same weight shapes
    if kernels and nm.fp8_projections and dev.fp8_gemm is not None:
        projection = plan_projections(batch.num_tokens, fp8_projection_shapes(cfg, heads), dev.fp8_gemm,
                                      dev.sm_count, triton_gemm=dev.sm90)
    layers: dict[LayerKind, LayerPlan] = {}
    for schema in cache.schemas.values():
        kind, m = schema.kind, schema.ratio
        if kind in layers:
            continue
        write = attention = indexer = None
        if formats:
            write = plan_write(ratio=m, overlap=kind is LayerKind.CSA, has_index=kind is LayerKind.CSA,
                               tokens=batch.num_tokens, requests=batch.num_requests, max_new=batch.max_new,
                               emit_capacity=batch.emit_capacity.get(m, 0))
        if kernels:
            attention = triton_attention.plan_layer(batch, cache.layer(schema.layer_idx),
                                                    cfg.num_heads if heads is None else heads, m,
                                                    cfg.index_topk, nm, dev)
        if dev.kernels and kind is LayerKind.CSA:
            indexer = triton_indexer.indexer_plan(cache.layer(schema.layer_idx), batch, m, cfg.index_topk,
                                                  cfg.index_n_heads, nm.score_dtype, dev)
        overlap = streams and dev.streams and write is not None
        layers[kind] = LayerPlan(kind, kernels=kernels, projection=projection, write=write, indexer=indexer,
                                 attention=attention, overlap=overlap)
    summary = f"B={batch.num_requests}, T={batch.num_tokens}, max new {batch.max_new}"
    return StepPlan(NAME, layers, summary, batch.shape_key())


def indexer_weights(step: LayerStep, x: Tensor) -> triton_indexer.HeadWeights:
    """See ``backend.AttentionBackend.indexer_weights``: the projection ``W_w x`` (BF16) with its scale, applied by
    ``indexer_topk``'s one launch that also folds in the queries' scales (``kernels.indexer.score_weights``)."""
    return triton_indexer.head_weights(step, x)


def visible_entries(step: LayerStep) -> Tensor:
    """See ``backend.AttentionBackend.visible_entries``."""
    return step.batch.visible_entries[step.ratio]


def output(step: LayerStep, o: Tensor) -> Tensor:
    """See ``backend.AttentionBackend.output``: grouped ``W_oa``, then ``W_ob`` as the plan's FP8 GEMM."""
    return projections.output(step, o, projector(step))


canonical_cache_keys()  # every kernel's on-disk cache key independent of which one this process launches first
