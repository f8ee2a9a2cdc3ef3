"""The attention backend interface: the ops of one layer step, in the order ``dsv4.Attention`` calls them.

A backend is a module with these functions (``ops.torch_ops``: plain torch, any device, the oracle; ``ops.triton_ops``:
Triton / Gluon kernels for Hopper) plus ``NAME``, ``GRAPH_SAFE`` (a step can be captured in a CUDA graph: no host
synchronisation, no allocation that depends on data) and ``plan_step`` (the step's launch decisions, built once on
the host and shared by every layer of the step). Every op takes the layer's ``LayerStep`` first.

SPEC §3 in call order (``new_entries`` and ``append_swa`` may run on a second CUDA stream beside the ops after
them, up to the marked joins: ``LayerPlan.overlap``, ``ops.side_stream``)::

    c^Q, kv = input_projections(step, x)       RMSNorm(W_qa x), RMSNorm(W_kv x)                [T, q_lora], [T, D]
    capture_prefix_states(step, x, kv)          prefix caching: the state at block boundaries inside the step,
                                                before any write
    kv   = new_entries(step, x, kv)             the step's window entries (RoPE, rounded as stored); CSA/HCA also
                                                every compressor: accumulate into the tails, pool every window
                                                that closes, store its entries in the pool
    q, q_I = queries(step, c^Q)                 W_qb c^Q per head: RMSNorm, RoPE                      [T, H, D]
                                                (CSA: q_I = W_Iq c^Q where the same GEMM made it, else None)
    CSA:     q_idx = indexer_queries(step, c^Q, q_I)
    -- join: the pool's new entries are written --
    CSA:     idx = indexer_topk(step, q_idx, indexer_weights(step, x))                   [T, k], −1 padded
    HCA:     idx = visible_entries(step)        per-token count of visible entries              [T]
    o, lse = attend(step, q, kv, idx)           one softmax over window ∪ compressed keys + sink, inverse RoPE
    append_swa(step, kv)                        after attention: a multi-token step must not overwrite ring slots
                                                its own earlier queries still read
    y    = output(step, o)                      grouped W_oa, then W_ob                               [T, d]
    -- join: the ring is committed --
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

from ..cache.batch import StepBatch
from ..cache.manager import HybridCache
from .plan import StepPlan
from .step import LayerStep

__all__ = ["AttentionBackend", "OP_NAMES"]

#: the ops of a layer step, in call order
OP_NAMES = (
    "input_projections", "capture_prefix_states", "new_entries", "queries", "indexer_queries", "indexer_weights",
    "indexer_topk", "visible_entries", "attend", "append_swa", "output",
)


class AttentionBackend(Protocol):
    """What ``dsv4.Attention`` needs from a backend (a module satisfies it structurally)."""

    NAME: str
    GRAPH_SAFE: bool

    def plan_step(self, batch: StepBatch, cache: HybridCache, *, streams: bool = True) -> StepPlan:
        """Every launch decision of the step, for each layer kind the cache holds (host only). ``streams=False``:
        every launch on the caller's current stream (no stage on a second stream, ``LayerPlan.overlap``)."""

    def input_projections(self, step: LayerStep, x: Tensor) -> tuple[Tensor, Tensor]:
        """The layer's two projections of its input (SPEC §3 steps 1 and 3): ``c^Q = RMSNorm_{q_norm}(W_qa x)``
        ``[T, q_lora_rank]`` and the window KV ``RMSNorm_{kv_norm}(W_kv x)`` ``[T, D]`` (before RoPE and rounding),
        both act dtype. x: ``[T, d]`` act dtype. A backend may run both projections as one GEMM."""

    def capture_prefix_states(self, step: LayerStep, x: Tensor, kv: Tensor) -> None:
        """Prefix caching: for each of ``step.batch.prefix_captures`` (a block boundary strictly inside a request's
        new tokens) the state the layer would hold there, into its snapshot row — before any op writes the cache
        (``ops.prefix_capture``, shared by both backends). x: ``[T, d]``; kv: ``input_projections``' window KV."""

    def new_entries(self, step: LayerStep, x: Tensor, kv: Tensor) -> Tensor:
        """The step's new cache entries. Returns its window entries as stored (RoPE, then rounded to the KV
        format; ``[T, D]``: ``attend`` reads them, ``append_swa`` writes them to the ring). CSA/HCA layers also run
        every compressor: accumulate the step's tokens into the tails, pool every window that closes, finish and
        store its entry in the pool (main entries; CSA also indexer keys). x: ``[T, d]``; kv: ``input_projections``'."""

    def queries(self, step: LayerStep, q_latent: Tensor) -> tuple[Tensor, Tensor | None]:
        """``W_qb c^Q`` per head, unweighted RMSNorm, RoPE at each position: ``[T, H, D]`` act dtype. A backend may
        compute a CSA layer's indexer projection ``W_Iq c^Q`` in the same GEMM (both read ``c^Q``); it returns that
        ``[T, H_I·c_I]`` act dtype (possibly a column view of a wider output) for ``indexer_queries``, else
        ``None``."""

    def indexer_queries(self, step: LayerStep, q_latent: Tensor, projection: Tensor | None = None) -> Any:
        """CSA: the indexer queries ``W_Iq c^Q`` per head, RoPE, rounded as the index format; only the same
        backend's ``indexer_topk`` reads them (the torch backend: float32 ``[T, H_I, c_I]``). ``projection``: the
        ``W_Iq c^Q`` the same backend's ``queries`` returned, or ``None`` (then this op runs the GEMM)."""

    def indexer_weights(self, step: LayerStep, x: Tensor) -> Any:
        """CSA: the indexer's per-head weights ``W_w x · c_I^{-1/2} H_I^{-1/2}``; only the same backend's
        ``indexer_topk`` reads them (the torch backend: float32 ``[T, H_I]``)."""

    def indexer_topk(self, step: LayerStep, q_idx: Any, head_weights: Any) -> Tensor:
        """CSA: index scores over each request's indexer keys, causal top-k (SPEC §5–6). int64 ``[T, k]``: entry
        indices of each token's request, −1 padded."""

    def visible_entries(self, step: LayerStep) -> Tensor:
        """HCA: how many compressed entries each token sees, ``(t + 1) // m``: int64 ``[T]`` (it attends all)."""

    def attend(self, step: LayerStep, q: Tensor, kv: Tensor, entry_idx: Tensor | None) -> tuple[Tensor, Tensor]:
        """Attention over each token's window (ring ∪ this step's entries ``kv``) and compressed entries
        (``entry_idx``: CSA ``[T, k]`` list, −1 = none; HCA ``[T]`` counts; SWA ``None``) with the sink, then the
        inverse RoPE. Returns ``o`` ``[T, H, D]`` act dtype and ``lse`` float32 ``[T, H]`` (sink included)."""

    def append_swa(self, step: LayerStep, kv: Tensor) -> None:
        """Write the step's window entries into each request's ring (slot ``p mod W``) with their positions."""

    def output(self, step: LayerStep, o: Tensor) -> Tensor:
        """SPEC §3 step 7: grouped ``W_oa`` over the heads' groups, then ``W_ob``. Returns ``[T, d]`` act dtype."""
