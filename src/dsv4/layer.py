"""``dsv4.Attention``: one DeepSeek-V4 attention layer that runs a step of many requests over a ``HybridCache``.

A step carries the new tokens of every scheduled request, concatenated in plan order (``StepBatch``): any mix
of prefill chunks and decode tokens (1–4 per request for speculative decoding). ``forward`` calls its backend's
ops (``dsv4.ops.backend``) top to bottom, SPEC §3 in order: the query path, the window KV, the compressors (their
entries whose window closes in this step go into the paged pool), the indexer (CSA), attention over window ∪
compressed keys with the sink, the ring commit, the output projection. ``backend="torch"`` runs
``dsv4.ops.torch_ops`` on any device; ``backend="triton"`` runs ``dsv4.ops.triton_ops`` (Hopper kernels, CUDA
tensors); ``"auto"`` picks Triton for CUDA inputs when it is available, else torch. Where the step's plan says so
(``LayerPlan.overlap``), two stages run on a second CUDA stream beside the stage that follows them in the code (the
writes beside the queries, the ring commit beside the output projection; ``dsv4.ops.side_stream``); the layer's
result and cache bytes are the same either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .cache.batch import StepBatch
from .cache.errors import NonFiniteError
from .cache.guard import nonfinite_requests, restore_rows, save_rows
from .cache.manager import HybridCache
from .config import LayerKind, ModelConfig, require_config
from .input_stack import input_stack
from .layer_stacks import stack_layer_weights
from .numerics import Numerics
from .ops import BACKENDS, LayerStep, StepPlan, backend_ops, triton_available
from .ops.side_stream import SideStream
from .reference.rope import rope_inv_freq
from .validate import require_bool, require_choice, require_instance, require_int
from .weights import AttentionWeights

if TYPE_CHECKING:
    from .distributed import Parallel

__all__ = ["Attention", "BACKENDS", "NAN_POLICIES", "StepOutputs"]

NAN_POLICIES = ("raise", "flag", "off")


@dataclass
class StepOutputs:
    """What one layer step produced (``Attention.forward_with_aux``).

    Attributes:
        y: ``[T, d]`` layer output (act dtype).
        lse: ``[T, H]`` float32 log-sum-exp of each head's softmax denominator (sink included); a tensor-parallel
            rank's ``[T, H/tp]``: its heads.
        entry_idx: the compressed entries each token attended: CSA int64 ``[T, k]`` top-k (−1 = none); HCA int64
            ``[T]`` how many it saw (it attends every entry ``i < entry_idx[t]``); SWA ``[T, 0]``.
    """

    y: Tensor
    lse: Tensor
    entry_idx: Tensor

    def attended_entries(self) -> Tensor:
        """int64 ``[T, K]``: the attended entries as a list, −1 padded (HCA's counts expanded)."""
        if self.entry_idx.dim() == 2:
            return self.entry_idx
        n = int(self.entry_idx.max()) if self.entry_idx.numel() else 0
        idx = torch.arange(n, device=self.entry_idx.device)[None, :].expand(self.entry_idx.shape[0], n)
        return torch.where(idx < self.entry_idx[:, None], idx, torch.full_like(idx, -1))


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
        nan_policy: what a step does about NaN / Inf it produces from finite inputs (weights changed to NaN after
            the layer was built, values that overflow inside the layer; docs/errors.md):
            ``"raise"`` (default) — check the outputs and every value the step left in the cache (host sync);
            if one is not finite, roll the step's writes back and raise ``NonFiniteError`` (nothing changed);
            ``"flag"`` — no host sync (graph-safe): record the requests affected in the cache's device-side flags
            (``HybridCache.nonfinite_requests()`` reads them); ``"off"`` — no check: a NaN stays inside the
            request it came from.
        parallel: ``dsv4.distributed.Parallel``: this rank's process groups (``None``: one process, no
            collective). Tensor parallelism: ``weights`` are this rank's shard (``AttentionWeights.shard``) and
            the layer computes its ``H/tp`` heads, with one all-reduce of the output; context parallelism: the
            cache is this rank's (``HybridCache(cp_rank=, cp_size=)``) and CSA / HCA layers merge their top-k and
            attention over the group (torch backend). Every rank of the groups runs every step of the layer.
    """

    def __init__(
        self,
        weights: AttentionWeights,
        cfg: ModelConfig,
        layer_idx: int,
        backend: str = "auto",
        check_inputs: bool = True,
        nan_policy: str = "raise",
        parallel: Parallel | None = None,
    ) -> None:
        require_instance("weights", weights, AttentionWeights, "build them with AttentionWeights.random / "
                         "from_checkpoint / from_hf_module")
        require_config(cfg)
        require_int("layer_idx", layer_idx)
        if not isinstance(backend, str) or backend not in (*BACKENDS, "auto"):
            raise ValueError(f"unknown backend {backend!r}; available: {BACKENDS} or 'auto'")
        require_bool("check_inputs", check_inputs)
        require_choice("nan_policy", nan_policy, NAN_POLICIES)
        #: the layer as this rank computes it (``LayerStep.cfg``): ``cfg``, or its ``H/tp`` heads under tensor
        #: parallelism
        self.step_cfg = cfg
        if parallel is not None:
            from .distributed import Parallel

            require_instance("parallel", parallel, Parallel, "build it with dsv4.distributed.Parallel.build or "
                             "init_from_env")
            self.step_cfg = parallel.local_config(cfg)
            if weights.tp_shard != (parallel.tp_rank, parallel.tp_size):
                raise ValueError(
                    f"weights are tensor-parallel shard {weights.tp_shard[0]} of {weights.tp_shard[1]} but this rank "
                    f"is {parallel.tp_rank} of {parallel.tp_size}: pass weights.shard({parallel.tp_rank}, "
                    f"{parallel.tp_size}) of the full weights"
                )
            if parallel.cp_size > 1 and backend == "triton":
                raise ValueError("context parallelism runs the torch backend's ops: use backend='torch' or 'auto'")
            parallel = parallel if parallel.is_split else None
        weights.check(self.step_cfg, layer_idx)
        self.parallel = parallel
        self._parallel_ops: dict[str, Any] = {}
        self.weights = weights
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.kind = cfg.layer_kind(layer_idx)
        self.ratio = cfg.ratio(layer_idx)
        self.backend = backend
        self.check_inputs = check_inputs
        self.nan_policy = nan_policy
        self._device_weights: dict[tuple[torch.device, Numerics], tuple[AttentionWeights, Tensor]] = {}

    def backend_for(self, device: torch.device) -> str:
        """The backend a step on ``device`` runs (resolves ``"auto"``; torch under context parallelism)."""
        if self.backend != "auto":
            return self.backend
        if self.parallel is not None and self.parallel.cp_size > 1:
            return "torch"
        return "triton" if device.type == "cuda" and triton_available() else "torch"

    def ops_for(self, device: torch.device) -> Any:
        """The ops a step on ``device`` runs: its backend's (``dsv4.ops.backend``), with the parallel stages swapped
        in under a ``parallel`` split (``dsv4.distributed.ops``)."""
        name = self.backend_for(device)
        if self.parallel is None:
            return backend_ops(name)
        ops = self._parallel_ops.get(name)
        if ops is None:
            from .distributed.ops import parallel_ops

            ops = self._parallel_ops[name] = parallel_ops(backend_ops(name), self.parallel, self.kind,
                                                          self.step_cfg.num_heads)
        return ops

    def graph_safe(self, device: torch.device) -> bool:
        """Whether a step on ``device`` can be captured in a CUDA graph (graph-safe backend, no input check, NaN
        policy ``"flag"`` or ``"off"``)."""
        return bool(self.ops_for(device).GRAPH_SAFE) and not self.check_inputs and self.nan_policy != "raise"

    def plan_step(self, batch: StepBatch, cache: HybridCache, *, streams: bool = True) -> StepPlan:
        """The step's launch decisions for this layer's backend (build it once per step and pass it to every
        layer's ``forward``; see ``dsv4.ops.plan``). ``streams=False``: every launch on the caller's current stream
        (the Triton backend otherwise runs two stages of each layer on a second CUDA stream; ``ops.side_stream``)."""
        return self.ops_for(cache.device).plan_step(batch, cache, streams=streams)

    def input_takes_codes(self, cache: HybridCache, plan: StepPlan) -> bool:
        """Whether this layer's input GEMM (the stacked ``[W_qa; W_kv]``) reads activations already quantized by
        the launch that made them, as ``plan`` runs it (a TMA launch of the block GEMM): the engine's residual
        norm then makes the input's FP8 codes too (``kernels.project.residual_norm``'s ``quantize``)."""
        proj = plan.layer(self.kind).projection
        if proj is None:
            return False
        stack = input_stack(self._weights_on(cache.device, cache.numerics)[0])
        return stack is not None and proj.takes_codes(*stack.shape)

    def __repr__(self) -> str:
        split = f", {self.parallel.describe()}" if self.parallel is not None else ""
        return f"Attention({self.cfg.name}, layer {self.layer_idx} {self.kind.name}, backend={self.backend}{split})"

    def reload_weights(self) -> None:
        """Forget the device copies of the weights: the next step copies ``self.weights`` again (after changing
        them in place; a step computes with the copy made at the layer's first step on a device)."""
        self._device_weights.clear()

    def _weights_on(self, device: torch.device, numerics: Numerics) -> tuple[AttentionWeights, Tensor]:
        """The weights and the layer's RoPE frequencies ``[R/2]`` on ``device`` (moved once, then reused), as
        ``numerics`` computes with them (``AttentionWeights.for_numerics``); with BF16 activations the matrices that
        read one input stacked (``dsv4.layer_stacks``: the compressor matrices, one GEMM for all of them on CUDA;
        ``wq_a`` and ``wkv``; CSA: ``wq_b`` and the indexer's ``wq_b``)."""
        key = (device, numerics)
        if key not in self._device_weights:
            w = self.weights.to(device).for_numerics(numerics)
            if numerics.act_dtype == torch.bfloat16:
                w = stack_layer_weights(w)
            self._device_weights[key] = (w, rope_inv_freq(self.cfg, self.kind, device))
        return self._device_weights[key]

    def _validate(self, x: Tensor, batch: StepBatch, cache: HybridCache, plan: StepPlan | None) -> None:
        if not isinstance(cache, HybridCache):
            raise TypeError(f"cache must be a dsv4.HybridCache, got {type(cache).__name__}")
        if not isinstance(batch, StepBatch):
            raise TypeError(f"batch must be a StepBatch from HybridCache.prepare_forward, got {type(batch).__name__}")
        if cache.cfg != self.cfg:
            raise ValueError(f"cache was built for config {cache.cfg.name!r}, this layer for {self.cfg.name!r}")
        if self.layer_idx not in cache.schemas:
            raise KeyError(f"layer {self.layer_idx} is not held by this cache (cached layers: {cache.layer_indices})")
        cache.steps.check(batch, (self.layer_idx,))
        if plan is not None and not isinstance(plan, StepPlan):
            raise TypeError(f"plan must be a StepPlan from Attention.plan_step, got {type(plan).__name__}")
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2 or x.shape != (batch.num_tokens, self.cfg.hidden_size):
            raise ValueError(
                f"x must be [num_tokens={batch.num_tokens}, hidden={self.cfg.hidden_size}] for this step, got {list(x.shape)}"
            )
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
        backend = self.backend_for(x.device)
        if backend == "triton" and x.device.type != "cuda":
            raise ValueError(f"the triton backend needs CUDA tensors, got x on {x.device}")
        if plan is not None and plan.backend != backend:
            raise ValueError(f"plan was made by the {plan.backend!r} backend, this layer runs {backend!r}")
        if plan is not None and not plan.fits(batch.shape_key()):
            raise ValueError(f"plan was made for another step shape ({plan.summary}); build one per step with "
                             "Attention.plan_step(batch, cache)")
        if x.device != cache.device:
            raise ValueError(f"x is on {x.device} but the cache is on {cache.device}")
        if batch.device != cache.device:
            raise ValueError(f"batch is on {batch.device} but the cache is on {cache.device}")
        self._validate_parallel(cache)
        if self.check_inputs and not bool(torch.isfinite(x).all()):
            raise ValueError("x contains NaN or Inf; hidden states must be finite (nothing was written to the cache)")

    def _validate_parallel(self, cache: HybridCache) -> None:
        """The cache is this rank's share of the pool (one process: the whole pool), and the numerics can split
        ``wo_b`` over the TP ranks."""
        p = self.parallel
        rank, size = (p.cp_rank, p.cp_size) if p is not None else (0, 1)
        if (cache.cp_rank, cache.cp_size) != (rank, size):
            raise ValueError(
                f"the cache holds context-parallel share {cache.cp_rank} of {cache.cp_size} but this layer runs "
                + (f"rank {rank} of {size}: build it with HybridCache(..., cp_rank={rank}, cp_size={size})"
                   if p is not None else "in one process (no parallel split): it needs the whole pool")
            )
        if p is not None:
            from .distributed import check_fp8_split

            check_fp8_split(self.cfg, p.tp_size, cache.numerics)

    def layer_step(self, batch: StepBatch, cache: HybridCache, plan: StepPlan) -> LayerStep:
        """What this layer's ops read in the step (weights on the cache's device, its cache tensors, its plan)."""
        w, inv_freq = self._weights_on(cache.device, cache.numerics)
        return LayerStep(self.step_cfg, self.layer_idx, self.kind, self.ratio, w, inv_freq, cache.numerics,
                         cache.layer(self.layer_idx), batch, plan.layer(self.kind))

    def forward(self, x: Tensor, batch: StepBatch, cache: HybridCache, plan: StepPlan | None = None) -> Tensor:
        """Run this layer's part of a step; see ``forward_with_aux``. Returns ``[T, d]``."""
        return self.forward_with_aux(x, batch, cache, plan).y

    __call__ = forward

    @torch.no_grad()
    def forward_with_aux(self, x: Tensor, batch: StepBatch, cache: HybridCache, plan: StepPlan | None = None
                         ) -> StepOutputs:
        """Run this layer's part of a step.

        Args:
            x: ``[T, d]`` attention inputs of the step's tokens, in plan order (``T = batch.num_tokens``).
            batch: from ``cache.prepare_forward(plan)`` for this step.
            cache: the cache holding this layer.
            plan: the step's launch decisions (``plan_step``), shared by every layer of the step; ``None``: made on
                first use and kept on the batch.
        Returns:
            ``StepOutputs`` (``y``: ``[T, d]`` in the numerics' activation dtype). The layer's cache state
            advances by the step. On invalid input nothing is written.
        Raises (nothing changed): ``TypeError`` / ``ValueError`` / ``KeyError`` for bad arguments,
            ``StaleBatchError`` / ``StepOrderError`` for a batch that is not the cache's current step for this layer
            (``dsv4.cache.steps``), ``NonFiniteError`` (``nan_policy="raise"``) for a step that produced NaN / Inf.
        """
        self._validate(x, batch, cache, plan)
        claimed = cache.steps.claim(batch, (self.layer_idx,))
        layer = cache.layer(self.layer_idx)
        saved = save_rows(layer, batch) if self.nan_policy == "raise" else None
        try:
            out = self._step(x, batch, cache, plan)
            if self.nan_policy != "off":
                bad, parts = nonfinite_requests(layer, batch, out.y)
                if self.parallel is not None and self.nan_policy == "raise":
                    self.parallel.agree_max(bad)  # every rank of the split rolls back together, or none
                if self.nan_policy == "flag":
                    cache.flag_nonfinite(batch, bad)
                elif bool(bad.any()):
                    raise NonFiniteError(self._nonfinite_message(x, batch, bad, parts))
        except BaseException:
            if saved is not None:
                restore_rows(layer, batch, saved)
                cache.steps.unclaim(batch, claimed)
            raise
        return out

    def _nonfinite_message(self, x: Tensor, batch: StepBatch, bad: Tensor, parts: dict[str, Tensor]) -> str:
        """Why a step is refused: the requests and parts affected, and the likely cause."""
        rids = [rid for rid, b in zip(batch.request_ids, bad.tolist()) if b]
        where = [name for name, flag in parts.items() if bool(flag)] or ["share of another rank of the split"]
        bad_w = self.weights.nonfinite()
        if bad_w:
            cause = f"the layer's weights now hold NaN/Inf in {bad_w} (changed after the layer was built)"
        elif not bool(torch.isfinite(x).all()):
            cause = "its input x holds NaN/Inf (check_inputs=False)"
        else:
            cause = f"values overflowed inside the layer (inputs finite, largest |x| = {float(x.abs().max()):.3g})"
        return (
            f"layer {self.layer_idx} ({self.kind.name}) produced NaN/Inf in its {', '.join(where)} for requests "
            f"{rids}: {cause}; the step was rolled back (nothing written)"
        )

    def _step(self, x: Tensor, batch: StepBatch, cache: HybridCache, plan: StepPlan | None) -> StepOutputs:
        """The layer's ops over one validated, claimed step, SPEC §3 top to bottom."""
        ops = self.ops_for(x.device)
        if plan is None:
            plan = batch.plans.get(ops.NAME)
            if plan is None:
                plan = batch.plans[ops.NAME] = ops.plan_step(batch, cache)
        step = self.layer_step(batch, cache, plan)
        x = x.to(cache.numerics.act_dtype)

        q_latent, kv = ops.input_projections(step, x)           # SPEC §3 steps 1 and 3: c^Q, the window KV
        if batch.prefix_captures:                               # prefix caching: states at block boundaries
            ops.capture_prefix_states(step, x, kv)              # inside the step, before any write
        with SideStream(x.device, step.plan.overlap) as side:  # as planned, the writes beside the queries on a
            kv = side.run(ops.new_entries, step, x, kv)         # second stream, joined at the block's end; SPEC §4:
                                                                # windows closing → the pool
            q, q_index = ops.queries(step, q_latent)            # step 2; CSA: W_Iq c^Q if the same GEMM made it
            if self.kind is LayerKind.CSA:
                q_idx = ops.indexer_queries(step, q_latent, q_index)
        entry_idx = None
        if self.kind is LayerKind.CSA:                          # SPEC §5–6: the lightning indexer's top-k
            entry_idx = ops.indexer_topk(step, q_idx, ops.indexer_weights(step, x))
        elif self.kind is LayerKind.HCA:                        # every visible entry
            entry_idx = ops.visible_entries(step)
        o, lse = ops.attend(step, q, kv, entry_idx)             # steps 4–6
        with SideStream(x.device, step.plan.overlap) as side:  # the ring commit beside the output projection
            side.run(ops.append_swa, step, kv)
            y = ops.output(step, o)                             # step 7
        if entry_idx is None:
            entry_idx = torch.empty((batch.num_tokens, 0), dtype=torch.int64, device=x.device)
        return StepOutputs(y, lse, entry_idx)
