"""``dsv4.Attention``: one DeepSeek-V4 attention layer that runs a step of many requests over a ``HybridCache``.

A step carries the new tokens of every scheduled request, concatenated in plan order (``StepBatch``): any mix
of prefill chunks and decode tokens (1–4 per request for speculative decoding). The layer computes the query
and KV paths, feeds the compressors (emitting the entries whose window closes in this step into the paged pool),
runs the indexer (CSA), attends over window ∪ compressed keys with the sink, writes the window ring, and projects
the output. ``backend="torch"`` runs ``dsv4.ops.torch_ops`` on any device; ``backend="triton"`` runs
``dsv4.ops.triton_ops`` (Hopper kernels, CUDA tensors); ``"auto"`` picks Triton for CUDA inputs when it is
available, else torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .cache.batch import StepBatch
from .cache.manager import HybridCache
from .config import LayerKind, ModelConfig
from .ops import backend_ops, triton_available
from .ops.prefix_capture import capture_prefix_states
from .reference.indexer import indexer_head_weights
from .reference.layer import grouped_output, query_projection
from .reference.primitives import linear
from .reference.rope import rope_inv_freq
from .weights import AttentionWeights

__all__ = ["Attention", "BACKENDS", "StepOutputs"]

BACKENDS = ("torch", "triton")


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
        backend: ``"torch"`` (any device), ``"triton"`` (CUDA) or ``"auto"`` (Triton for CUDA inputs when
            available, else torch; decided per call from the input's device).
        check_inputs: validate ``x`` (shape, dtype, device, finite values). The finiteness check synchronises
            with the device; turn it off inside CUDA graphs.
    """

    def __init__(
        self, weights: AttentionWeights, cfg: ModelConfig, layer_idx: int, backend: str = "auto", check_inputs: bool = True
    ) -> None:
        if backend not in (*BACKENDS, "auto"):
            raise ValueError(f"unknown backend {backend!r}; available: {BACKENDS}")
        weights.check(cfg, layer_idx)
        self.weights = weights
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.kind = cfg.layer_kind(layer_idx)
        self.ratio = cfg.ratio(layer_idx)
        self.backend = backend
        self.check_inputs = check_inputs
        self._device_weights: dict[tuple[torch.device, torch.dtype | None], tuple[AttentionWeights, Tensor]] = {}

    def backend_for(self, device: torch.device) -> str:
        """The backend a step on ``device`` runs (resolves ``"auto"``)."""
        if self.backend != "auto":
            return self.backend
        return "triton" if device.type == "cuda" and triton_available() else "torch"

    def graph_safe(self, device: torch.device) -> bool:
        """Whether a step on ``device`` can be captured in a CUDA graph (graph-safe backend, no input check)."""
        return bool(backend_ops(self.backend_for(device)).GRAPH_SAFE) and not self.check_inputs

    def __repr__(self) -> str:
        return f"Attention({self.cfg.name}, layer {self.layer_idx} {self.kind.name}, backend={self.backend})"

    def _weights_on(self, device: torch.device, gemm_dtype: torch.dtype | None = None) -> tuple[AttentionWeights, Tensor]:
        """The weights and the layer's RoPE frequencies ``[R/2]`` on ``device`` (moved once, then reused), the
        projection matrices in ``gemm_dtype`` (the numerics' activation dtype; ``None``: as given)."""
        key = (device, gemm_dtype)
        if key not in self._device_weights:
            w = self.weights.to(device).with_fp32_compressors()
            if gemm_dtype is not None:
                w = w.with_gemm_dtype(gemm_dtype)
            self._device_weights[key] = (w, rope_inv_freq(self.cfg, self.kind, device))
        return self._device_weights[key]

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
        if self.backend_for(x.device) == "triton" and x.device.type != "cuda":
            raise ValueError(f"the triton backend needs CUDA tensors, got x on {x.device}")
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
        ops = backend_ops(self.backend_for(x.device))
        cfg, nm = self.cfg, cache.numerics
        w, inv_freq = self._weights_on(x.device, nm.act_dtype)
        layer = cache.layer(self.layer_idx)
        act = nm.act_dtype
        x = x.to(act)
        pos = batch.positions

        # SPEC §3 steps 1-3 (reference.layer.query_path / window_kv), the norms and the RoPE as backend ops
        q_proj, q_latent = query_projection(w, cfg, x, nm, norm=ops.rms_norm)
        q = ops.queries(q_proj, pos, inv_freq, cfg.norm_eps)
        kv_in = ops.rms_norm(linear(x, w.wkv, act), w.kv_norm, cfg.norm_eps)
        if batch.prefix_captures:  # prefix caching: the state at block boundaries inside the step, before any write
            capture_prefix_states(cache, self.layer_idx, batch, x, kv_in, w, inv_freq, nm, cfg.nope_dim)
        m, entry_idx = self.ratio, None
        if self.kind is LayerKind.SWA:
            kv = ops.window_entries(kv_in, pos, inv_freq, nm, cfg.nope_dim)
        else:
            # The window entries and every compressor of the layer in one op (one launch on the Triton backend).
            compressors = [(w.compressor, "kv")]
            if self.kind is LayerKind.CSA:
                compressors.append((w.indexer.compressor, "index"))
            kv = ops.compress(
                layer, batch, x, compressors, m, self.kind is LayerKind.CSA, inv_freq, cfg.norm_eps, nm, cfg.nope_dim,
                kv_in,
            )
            if self.kind is LayerKind.CSA:
                q_idx = ops.indexer_queries(q_latent, w.indexer, pos, inv_freq, cfg, nm)
                head_w = indexer_head_weights(x, w.indexer, cfg, nm)
                entry_idx = ops.indexer_topk(layer, batch, m, q_idx, head_w, cfg.index_topk, nm.score_dtype)
            else:
                entry_idx = ops.all_visible_entries(batch, m)

        o, lse = ops.attend(layer, batch, q, kv, m, entry_idx, w.attn_sink, cfg.softmax_scale, inv_freq, nm)
        ops.append_swa(layer, batch, kv)
        if entry_idx is None:
            entry_idx = torch.empty((batch.num_tokens, 0), dtype=torch.int64, device=x.device)
        elif entry_idx.dim() == 1:  # HCA on the Triton backend: per-token counts; StepOutputs keeps the [T, N] list
            entry_idx = backend_ops("torch").all_visible_entries(batch, m)
        return StepOutputs(grouped_output(w, cfg, o, nm), lse, entry_idx)
