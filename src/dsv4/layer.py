"""``dsv4.Attention``: one DeepSeek-V4 attention layer that runs a step of many requests over a ``HybridCache``.

A step carries the new tokens of every scheduled request, concatenated in plan order (``StepBatch``): any mix
of prefill chunks and decode tokens (1–4 per request for speculative decoding). The layer computes the query
and KV paths, feeds the compressors (emitting the entries whose window closes in this step into the paged pool),
runs the indexer (CSA), attends over window ∪ compressed keys with the sink, writes the window ring, and projects
the output. ``backend="torch"`` runs ``dsv4.ops.torch_ops`` on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .cache.batch import StepBatch
from .cache.manager import HybridCache
from .config import LayerKind, ModelConfig
from .ops import torch_ops as ops
from .reference.indexer import indexer_head_weights, indexer_queries
from .reference.layer import output_projection, query_path, window_kv
from .reference.rope import rope_inv_freq
from .weights import AttentionWeights

__all__ = ["Attention", "BACKENDS", "StepOutputs"]

BACKENDS = ("torch",)


@dataclass
class StepOutputs:
    """What one layer step produced (``Attention.forward_with_aux``).

    Attributes:
        y: ``[T, d]`` layer output (act dtype).
        lse: ``[T, H]`` float32 log-sum-exp of each head's softmax denominator (sink included).
        entry_idx: int64 ``[T, K]`` compressed entries each token attended (CSA top-k, HCA all visible), −1 =
            invalid; ``[T, 0]`` for SWA layers.
    """

    y: Tensor
    lse: Tensor
    entry_idx: Tensor


class Attention:
    """DeepSeek-V4 attention of one layer over the paged hybrid cache.

    Args:
        weights: the layer's weights (checked against ``cfg``).
        cfg: the model configuration.
        layer_idx: which layer (its kind and ratio come from ``cfg``).
        backend: ``"torch"`` (any device). ``"auto"`` picks the best available here.
        check_inputs: validate ``x`` (shape, dtype, device, finite values). The finiteness check synchronises
            with the device; turn it off inside CUDA graphs.
    """

    def __init__(
        self, weights: AttentionWeights, cfg: ModelConfig, layer_idx: int, backend: str = "auto", check_inputs: bool = True
    ) -> None:
        if backend == "auto":
            backend = "torch"
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; available: {BACKENDS}")
        weights.check(cfg, layer_idx)
        self.weights = weights
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.kind = cfg.layer_kind(layer_idx)
        self.ratio = cfg.ratio(layer_idx)
        self.backend = backend
        self.check_inputs = check_inputs
        self._device_weights: dict[torch.device, tuple[AttentionWeights, Tensor]] = {}

    def __repr__(self) -> str:
        return f"Attention({self.cfg.name}, layer {self.layer_idx} {self.kind.name}, backend={self.backend})"

    def _weights_on(self, device: torch.device) -> tuple[AttentionWeights, Tensor]:
        """The weights and the layer's RoPE frequencies ``[R/2]`` on ``device`` (moved once, then reused)."""
        if device not in self._device_weights:
            self._device_weights[device] = (self.weights.to(device), rope_inv_freq(self.cfg, self.kind, device))
        return self._device_weights[device]

    def _validate(self, x: Tensor, batch: StepBatch, cache: HybridCache) -> None:
        if not isinstance(batch, StepBatch):
            raise TypeError(f"batch must be a StepBatch from HybridCache.prepare_forward, got {type(batch).__name__}")
        if cache.cfg != self.cfg:
            raise ValueError(f"cache was built for config {cache.cfg.name!r}, this layer for {self.cfg.name!r}")
        if self.layer_idx not in cache.schemas:
            raise KeyError(f"layer {self.layer_idx} is not held by this cache (cached layers: {cache.layer_indices})")
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2 or x.shape != (batch.num_tokens, self.cfg.hidden_size):
            raise ValueError(
                f"x must be [num_tokens={batch.num_tokens}, hidden={self.cfg.hidden_size}] for this step, got {list(x.shape)}"
            )
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
        if x.device != cache.device:
            raise ValueError(f"x is on {x.device} but the cache is on {cache.device}")
        if batch.device != cache.device:
            raise ValueError(f"batch is on {batch.device} but the cache is on {cache.device}")
        if self.check_inputs and not bool(torch.isfinite(x).all()):
            raise ValueError("x contains NaN or Inf; hidden states must be finite (nothing was written to the cache)")

    def forward(self, x: Tensor, batch: StepBatch, cache: HybridCache) -> Tensor:
        """Run this layer's part of a step; see ``forward_with_aux``. Returns ``[T, d]``."""
        return self.forward_with_aux(x, batch, cache).y

    __call__ = forward

    @torch.no_grad()
    def forward_with_aux(self, x: Tensor, batch: StepBatch, cache: HybridCache) -> StepOutputs:
        """Run this layer's part of a step.

        Args:
            x: ``[T, d]`` attention inputs of the step's tokens, in plan order (``T = batch.num_tokens``).
            batch: from ``cache.prepare_forward(plan)`` for this step.
            cache: the cache holding this layer.
        Returns:
            ``StepOutputs`` (``y``: ``[T, d]`` in the numerics' activation dtype). The layer's cache state
            advances by the step. On invalid input nothing is written.
        """
        self._validate(x, batch, cache)
        cfg, nm = self.cfg, cache.numerics
        w, inv_freq = self._weights_on(x.device)
        layer = cache.layer(self.layer_idx)
        act = nm.act_dtype
        x = x.to(act)
        pos = batch.positions

        q, q_latent = query_path(w, cfg, x, pos, inv_freq, nm)
        kv = window_kv(w, cfg, x, pos, inv_freq, nm)  # [T, D], rounded as stored
        keys, valid = ops.window_keys(layer, batch, kv)
        entry_idx = torch.empty((batch.num_tokens, 0), dtype=torch.int64, device=x.device)

        if self.kind is not LayerKind.SWA:
            m = self.ratio
            overlap = self.kind is LayerKind.CSA
            entries = ops.compressor_step(x, w.compressor, layer.state, "", batch, m, overlap, inv_freq, cfg.norm_eps, act)
            ops.write_entries(layer.kv_pages, layer.schema.kv_storage, batch, m, nm.qdq_kv(entries, cfg.nope_dim))
            if self.kind is LayerKind.CSA:
                index_keys = ops.compressor_step(
                    x, w.indexer.compressor, layer.state, "index_", batch, m, True, inv_freq, cfg.norm_eps, act
                )
                ops.write_entries(layer.index_pages, layer.schema.index_storage, batch, m, nm.qdq_index(index_keys))
                q_idx = indexer_queries(q_latent, w.indexer, pos, inv_freq, cfg, nm)
                head_w = indexer_head_weights(x, w.indexer, cfg, nm)
                entry_idx = ops.indexer_topk(layer, batch, m, q_idx, head_w, cfg.index_topk, nm.score_dtype)
            else:
                entry_idx = ops.all_visible_entries(batch, m)
            keys = torch.cat((keys, ops.gather(layer, batch, m, entry_idx, kv.dtype)), dim=1)
            valid = torch.cat((valid, entry_idx >= 0), dim=1)

        o, lse = ops.sparse_attention(q, keys, valid, w.attn_sink, cfg.softmax_scale, nm.prob_dtype, act)
        ops.append_swa(layer, batch, kv)
        return StepOutputs(output_projection(w, cfg, o, pos, inv_freq, nm), lse, entry_idx)
