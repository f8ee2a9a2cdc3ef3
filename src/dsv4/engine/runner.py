"""``Engine``: a stack of DeepSeek-V4 attention layers over one ``HybridCache``, driven by continuous batching.

Per step (``Engine.step``)::

    plan   = scheduler.schedule()                    host: decodes + prefill chunks under the token budget,
                                                     admission when slots and blocks allow
    batch  = cache.prepare_forward(plan)             host: blocks, positions, StepBatch (outside any graph)
    h      = hidden(token_ids)                       [T, d] float32 residual stream: a seeded embedding per token
                                                     id (no embeddings in scope); prompt ids as submitted,
                                                     generated ones drawn per (request, position)
    x      = rms_norm(h) → act dtype                 the first layer's input (h itself is only read)
    for each layer l:                                the stack; MoE / mHC are out of scope, so the
        y  = Attention_l(x, batch, cache)            residual is h ← h + attn_l(norm(h))
        h  = h + y;  x = rms_norm(h) → act dtype     ``Engine.residual`` (``dsv4.engine.residual``): one Triton
                                                     launch per layer on the Triton backend, the sums in a
                                                     step-owned h; no norm after the last layer
    scheduler.commit(plan)                           advance requests, release finished ones (blocks, slot)

With prefix caching (``EngineConfig.prefix_caching``) the cache gets every request's prompt token ids and each
step's ids; a request admitted on a cached prefix starts at its end (``Request.cached_tokens``), and the scheduler
holds admissions so a shared prefix is computed once (``dsv4.engine.prefix_plan``).

Decode-only steps run as CUDA-graph replays when the device is CUDA and every layer's backend is graph-safe
(``dsv4.engine.graphs``); ``prepare_forward`` always runs eagerly on the host first. A graph-safe hidden source
(``TokenHidden``, the default) runs inside the graph: the host only copies the step's token ids.

Across processes (``Engine(..., parallel=)``, ``dsv4.distributed``): every rank runs the same engine over the same
requests — the scheduler's decisions, the block tables and the hidden states are the same everywhere — with its
share of the heads (tensor parallelism: sharded weights, one all-reduce per layer) and of the compressed pool
(context parallelism: ``HybridCache(cp_rank=, cp_size=)``); every layer's output is the same on every rank.

Timing: each step is timed on the host around all of the above, with a device synchronisation at its end (a
serving loop needs the step's results before it can schedule the next decode), so step latency includes the
host-side scheduling and ``prepare_forward``.

The engine's parts live beside it: ``config`` (``EngineConfig``), ``weights`` (``WeightSource``: the layers'
weights), ``token_ids`` (the requests' token ids; a step's in one gather), ``residual`` (the residual add and
input norm between layers), ``trace`` (per-layer records for the spot check).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..cache import HybridCache, blocks_for_tokens, layer_schemas
from ..cache.schema import resolve_layers
from ..cache.batch import StepBatch
from ..cache.transfer import to_device
from ..config import ModelConfig, require_config
from ..layer import Attention
from ..numerics import Numerics, resolve_numerics
from ..ops import StepPlan
from ..validate import require_bool, require_instance
from ..weights import AttentionWeights
from .config import EngineConfig, pick_device
from .hidden import TokenHidden
from .jit_clock import JitClock
from .requests import Request
from .residual import ResidualStep, residual_step
from .scheduler import Scheduler, SchedulerConfig
from .stats import DENSE_BF16_BYTES_PER_TOKEN_LAYER, RunStats, StepRecord  # noqa: F401 - re-exported
from .token_ids import lay_out_token_ids, request_token_ids, step_token_ids
from .trace import Trace, alloc_traces, fill_prefix_traces, record_traces, trace_layers
from .weights import WeightSource, weights_bytes  # noqa: F401 - weights_bytes re-exported

if TYPE_CHECKING:
    from ..distributed import Parallel

__all__ = [
    "DENSE_BF16_BYTES_PER_TOKEN_LAYER", "Engine", "EngineConfig", "RunStats", "StepRecord", "Trace", "pick_device",
    "weights_bytes",
]


class Engine:
    """A stack of attention layers with a paged hybrid cache and a continuous-batching scheduler.

    Args:
        cfg: model configuration.
        layers: layer indices to stack (default: the main layers ``0 … num_layers−1``; MTP indices may be added).
        config: ``EngineConfig``.
        weights: per-layer weights overriding ``config.weights``: a mapping ``{layer: AttentionWeights}`` or a
            callable ``layer -> AttentionWeights``.
        hidden: hidden-state source ``(token_ids [T] int64) -> [T, d] float32``, a pure function of the token id
            (default ``TokenHidden(d, config.seed)``). One with ``graph_safe = True`` runs inside the decode graphs
            (``dsv4.engine.hidden`` says what that promises); any other runs eagerly before each replay.
        progress: show a progress bar while building the layers.
        parallel: ``dsv4.distributed.Parallel``: this rank's share of a tensor- / context-parallel run (every rank
            builds the same engine and runs the same requests). The weights (built or given whole) are sharded
            for the rank's heads; the cache holds the rank's share of the pool. CUDA graphs stay off unless
            ``cuda_graphs="on"``.

    Usage::

        eng = Engine(cfg, config=EngineConfig(max_running=8))
        stats = eng.run(make_requests(16, "uniform:64:512", 32))
        print(stats.summary())
    """

    PAD_REQUEST = "__dsv4_graph_pad__"

    def __init__(
        self,
        cfg: ModelConfig,
        layers: Sequence[int] | None = None,
        config: EngineConfig | None = None,
        weights: Mapping[int, AttentionWeights] | Callable[[int], AttentionWeights] | None = None,
        hidden: Callable[[Tensor], Tensor] | None = None,
        progress: bool = False,
        parallel: Parallel | None = None,
    ) -> None:
        require_config(cfg)
        if config is not None:
            require_instance("config", config, EngineConfig)
        if weights is not None and not (isinstance(weights, Mapping) or callable(weights)):
            raise TypeError(f"weights must be a mapping layer -> AttentionWeights or a callable, got {type(weights).__name__}")
        if hidden is not None and not callable(hidden):
            raise TypeError(f"hidden must be a callable (request_numbers, positions) -> [T, d], got {type(hidden).__name__}")
        require_bool("progress", progress)
        self.cfg = cfg
        self.config = config = config or EngineConfig()
        self.device = pick_device(config.device)
        self.numerics: Numerics = resolve_numerics(config.numerics)
        self.layer_ids: list[int] = resolve_layers(cfg, layers)
        if not self.layer_ids:
            raise ValueError("the engine needs at least one layer")
        if config.backend not in ("auto", "torch", "triton"):
            raise ValueError(f"unknown backend {config.backend!r}; choose auto, torch or triton")
        if config.backend == "triton" and self.device.type != "cuda":
            raise ValueError("the triton backend needs a CUDA device (use --backend torch on the CPU)")
        layer_schemas(cfg, self.layer_ids, self.numerics, config.block_size)  # validates block_size early
        self.hidden = hidden if hidden is not None else TokenHidden(cfg.hidden_size, config.seed)
        self._ids: dict[str, Tensor] = {}  # request id -> int64 [total_len] token ids (CPU), prompt + generated
        self._flat_ids: Tensor | None = None  # after submit: every request's ids end to end, _ids views of it
        self._id_offsets: dict[str, int] | None = None  # request id -> where its ids start in _flat_ids
        self.check_finite = config.check_finite if config.check_finite is not None else self.device.type == "cpu"
        self.parallel = self._check_parallel(parallel)
        t0 = time.perf_counter()
        self._weight_source = WeightSource.open(cfg, self.layer_ids, config, self.numerics, self.device, weights,
                                                self.parallel)
        self.weights = self._weight_source.build(progress)
        # NaN policy of the layers: with check_finite, a CPU step that would leave NaN/Inf is rolled back and raises;
        # on CUDA the layers only flag the requests (no sync, graph-safe) and the step's end checks the flags.
        self.nan_policy = "off" if not self.check_finite else ("flag" if self.device.type == "cuda" else "raise")
        self.layers = [
            Attention(self.weights[li], cfg, li, backend=config.backend, check_inputs=False, nan_policy=self.nan_policy,
                      parallel=self.parallel)
            for li in self.layer_ids
        ]
        # between layers: h ← h + y and the next layer's input norm (one Triton launch on the Triton backend)
        self.residual: ResidualStep = residual_step(self.backend, self.device, self.numerics.act_dtype, cfg.norm_eps)
        self.setup_s = time.perf_counter() - t0
        self.cache: HybridCache | None = None
        self.scheduler: Scheduler | None = None
        self.graphs: Any = None
        self.traces: dict[str, Trace] = {}
        self._trace_layers: list[int] = []
        self._records: list[StepRecord] = []
        self._nonfinite = torch.zeros((), dtype=torch.bool, device=self.device)
        cuda = self.device.type == "cuda"
        self.overlap_host = cuda if config.overlap_host is None else (config.overlap_host and cuda)
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # per step record: GPU start / end
        self.graph_capture_s = 0.0
        self._jit_clock: JitClock | None = None  # set while run() runs
        self.warmup_report: Any = None  # dsv4.engine.warmup.WarmupReport of the last run (None: no warm-up)
        self.plans_seen: dict[str, StepPlan] = {}  # first step plan of each kind of step (--explain)

    # ------------------------------------------------------------------ construction
    @property
    def backend(self) -> str:
        """The backend the layers resolve to on this device."""
        return self.layers[0].backend_for(self.device)

    @property
    def graph_safe(self) -> bool:
        """Whether every layer's backend can be captured in a CUDA graph on this device."""
        return self.device.type == "cuda" and all(layer.graph_safe(self.device) for layer in self.layers)

    def _check_parallel(self, parallel: Parallel | None) -> Parallel | None:
        """``parallel`` if it splits anything (validated against the model and the configuration), else ``None``."""
        if parallel is None:
            return None
        from ..distributed import Parallel

        require_instance("parallel", parallel, Parallel, "build it with dsv4.distributed.Parallel.build / init_from_env")
        if not parallel.is_split:
            return None
        parallel.check(self.cfg)
        from ..distributed import check_fp8_split

        check_fp8_split(self.cfg, parallel.tp_size, self.numerics)
        if parallel.cp_size > 1 and self.config.backend == "triton":
            raise ValueError("context parallelism runs the torch backend's ops: use backend 'torch' or 'auto'")
        return parallel

    def full_weights(self, layer_idx: int) -> AttentionWeights:
        """Layer ``layer_idx``'s whole weights as the engine holds them (the spot check's reference): its own, or —
        when its layers hold tensor-parallel shards — rebuilt from their source."""
        if self._weight_source.tp_size == 1:
            return self.weights[layer_idx]
        return self._weight_source.full_held(layer_idx)

    # ------------------------------------------------------------------ tracing (spot check)
    def trace(self, request_ids: Iterable[str], layers: Iterable[int] | None = None) -> None:
        """Record the per-layer inputs and outputs of ``request_ids`` in ``layers`` (default: all) during the
        next ``run`` (for ``dsv4.engine.check.spot_check``). Costs a device copy per traced layer and step."""
        self._trace_layers = trace_layers(layers, self.layer_ids)
        self.traces = {rid: Trace(rid, 0) for rid in request_ids}

    # ------------------------------------------------------------------ the stack
    def forward_layers(
        self, batch: StepBatch, h: Tensor, keep: Iterable[int] = ()
    ) -> tuple[Tensor, dict[int, tuple[Tensor, Tensor, Tensor]]]:
        """Run every layer of the stack over one prepared step (no host sync; graph-capturable when the backend is).

        Args:
            batch: from ``cache.prepare_forward``.
            h: float32 ``[T, d]`` residual stream entering the first layer.
            keep: layers whose ``(x, y, entry_idx)`` to return (tracing).
        Returns:
            ``h`` float32 ``[T, d]`` after the last layer, and ``{layer: (x [T, d], y [T, d], entry_idx [T, K])}``.
        """
        assert self.cache is not None
        keep = set(keep)
        kept: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        plan = self.layers[0].plan_step(batch, self.cache, streams=self.config.side_stream)  # once per step, every layer
        self._remember_plan(batch, plan)
        last = len(self.layers) - 1
        # whether each layer's input GEMM takes the FP8 codes of its input from the norm that makes it
        codes = [layer.input_takes_codes(self.cache, plan) for layer in self.layers]
        _, x = self.residual(h, None, quantize=codes[0])  # the first layer's input; the caller's h is only read
        for i, layer in enumerate(self.layers):
            out = layer.forward_with_aux(x, batch, self.cache, plan)
            if layer.layer_idx in keep:
                kept[layer.layer_idx] = (x, out.y, out.entry_idx)
            # h + y, and the next layer's input; the first sum is a new tensor (the step's own), later ones may
            # overwrite it
            h, x = self.residual(h, out.y, norm=i < last, in_place=i > 0, quantize=i < last and codes[i + 1])
        return h, kept

    def _remember_plan(self, batch: StepBatch, plan: StepPlan) -> None:
        """Keep the first plan of each step shape class (prefill / decode / mixed) for ``dsv4 run --explain``."""
        decode = batch.max_new <= self.config.decode_tokens
        prefill = min(batch.num_new) > self.config.decode_tokens
        label = "decode" if decode else "prefill" if prefill else "mixed"
        self.plans_seen.setdefault(label, plan)

    def token_ids(self, request_id: str) -> Tensor:
        """int64 ``[total_len]`` (CPU) every token id of a submitted request: its prompt's, then the generated
        ones (``dsv4.engine.hidden.generated_token_ids``)."""
        return self._ids[request_id]

    def step_token_ids(self, plan: Sequence[tuple[str, int]], starts: Sequence[int]) -> Tensor:
        """int64 ``[T]`` (CPU) the token ids of a step's tokens: ``plan``'s requests from ``starts`` on."""
        return step_token_ids(plan, starts, self._ids, self._flat_ids, self._id_offsets)

    def _assign_token_ids(self, r: Request) -> None:
        """Every token id of ``r``: its prompt's (drawn from the seed if it has none), then generated ones."""
        self._ids[r.request_id] = request_token_ids(r, self.config.seed, self.config.vocab)

    # ------------------------------------------------------------------ running
    def build_cache(self, requests: Sequence[Request], device: torch.device | None = None) -> HybridCache:
        """Allocate the cache for a run: ``config.cache_memory`` bytes, or exactly enough blocks for
        ``max_running`` requests of the longest submitted length (plus one pad slot/block for CUDA graphs).
        ``device``: another device than the engine's (``meta``: a cache of the same geometry that holds no
        memory, to replay a run's scheduling)."""
        cfg, c = self.cfg, self.config
        max_len = max(r.total_len for r in requests)
        use_graphs = self._want_graphs()
        extra_slot = 1 if use_graphs else 0
        max_requests = c.max_running + extra_slot
        states = (c.prefix_states if c.prefix_states is not None else 2 * c.max_running) if c.prefix_caching else 0
        cp = dict(cp_rank=self.parallel.cp_rank, cp_size=self.parallel.cp_size) if self.parallel is not None else {}
        if c.cache_memory is not None:
            cache = HybridCache(cfg, self.layer_ids, max_requests=max_requests, memory_bytes=int(c.cache_memory),
                                block_size=c.block_size, device=device or self.device, numerics=self.numerics,
                                prefix_states=states, **cp)
        else:
            ratios = [cfg.ratio(li) for li in self.layer_ids if cfg.ratio(li)]
            per = blocks_for_tokens(max_len, min(ratios), c.block_size) if ratios else 0
            num_blocks = per * min(c.max_running, len(requests)) + (1 if use_graphs and ratios else 0)
            cache = HybridCache(cfg, self.layer_ids, max_requests=max_requests, num_blocks=num_blocks,
                                block_size=c.block_size, device=device or self.device, numerics=self.numerics,
                                prefix_states=states, **cp)
        return cache

    def _want_graphs(self) -> bool:
        mode = self.config.cuda_graphs
        if mode == "off" or (mode == "auto" and self.parallel is not None):  # collectives in graphs: on request
            return False
        ok = self.graph_safe
        if mode == "on" and not ok:
            why = "the device is not CUDA" if self.device.type != "cuda" else f"backend {self.backend!r} is not graph-safe"
            raise ValueError(f"cuda_graphs='on' but {why}")
        return ok

    def submit(self, requests: Sequence[Request], graph_batch_sizes: Sequence[int] | None = None) -> None:
        """Create the cache and scheduler for ``requests`` (called by ``run``). ``graph_batch_sizes``: the decode
        buckets to capture (default ``config.graph_batch_sizes``, else powers of two up to ``max_running``)."""
        if not requests:
            raise ValueError("no requests to run")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate request ids")
        self.cache = self.build_cache(requests)
        self.scheduler = Scheduler(
            self.cache,
            SchedulerConfig(
                max_batched_tokens=self.config.max_batched_tokens,
                max_running=self.config.max_running,
                decode_tokens=self.config.decode_tokens,
                max_prefill_chunk=self.config.max_prefill_chunk,
                prefix_caching=self.config.prefix_caching,
            ),
        )
        self.graphs = None
        if self._want_graphs() and (graph_batch_sizes is None or len(graph_batch_sizes)):
            from .graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, max_len=max(r.total_len for r in requests),
                                       batch_sizes=graph_batch_sizes)
        self._ids = {}
        for i, r in enumerate(requests):
            if r.number < 0:
                r.number = i
            self._assign_token_ids(r)
            self.scheduler.add(r)
        self._flat_ids, self._id_offsets = lay_out_token_ids(self._ids)
        alloc_traces(self.traces, self._trace_layers, {r.request_id: r for r in requests}, self.cfg,
                     self.numerics.act_dtype, self.device)
        self._records = []
        self._events = []

    def step(self, t_start: float | None = None) -> StepRecord | None:
        """Schedule and run one step; ``None`` when nothing could run (waiting requests not yet arrived)."""
        assert self.cache is not None and self.scheduler is not None, "call submit() first"
        sched = self.scheduler
        t0 = time.perf_counter()
        clock = self._jit_clock
        jit0, kernels0 = (clock.seconds, clock.kernels) if clock is not None else (0.0, 0)
        plan = sched.schedule()
        if plan is None:
            sched.skip_step()
            return None
        starts = [sched.running[rid].num_computed for rid, _ in plan.plan]
        ids = self.step_token_ids(plan.plan, starts)
        step_ids = None
        if self.config.prefix_caching:  # the cache checks them against the prompts and publishes what they fill
            step_ids, at = {}, 0
            for rid, n in plan.plan:
                step_ids[rid] = ids[at : at + n]
                at += n
        batch = self.cache.prepare_forward(plan.plan, token_ids=step_ids)
        ids = to_device(ids, self.device)
        keep = self._trace_layers if any(rid in self.traces for rid, _ in plan.plan) else []
        cuda = self.device.type == "cuda"
        t_launch = time.perf_counter()
        if cuda:
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
        used_graph = False
        if self.graphs is not None and self.graphs.can_run(plan, batch):
            h, kept = self.graphs.run(batch, ids, keep)
            used_graph = True
        else:
            h, kept = self.forward_layers(batch, self.hidden(ids), keep)
        if self.check_finite:
            self._nonfinite |= ~torch.isfinite(h).all()
        record_traces(self.traces, batch, kept)
        if cuda:
            ev1.record()
            self._events.append((ev0, ev1))
            if not self.overlap_host:
                torch.cuda.synchronize(self.device)
        if self.check_finite and bool(self._nonfinite):
            raise FloatingPointError(f"step {plan.step}: the stack produced NaN/Inf")
        if self.nan_policy == "flag":
            poisoned = [rid for rid in self.cache.nonfinite_requests() if rid != self.PAD_REQUEST]
            if self.parallel is not None:  # a rank's share of the pool: every rank stops, or none
                flag = torch.tensor([len(poisoned)], dtype=torch.int32, device=self.device)
                if int(self.parallel.agree_max(flag)) and not poisoned:
                    poisoned = ["(on another rank)"]
            if poisoned:
                raise FloatingPointError(f"step {plan.step}: NaN/Inf reached the cache of requests {poisoned}")
        t1 = time.perf_counter()
        tokens_cached = sum(self.cache.num_tokens(rid) for rid in sched.running)
        in_use = self.cache.memory_in_use()
        sched.commit(plan, (t1 - t_start) if t_start is not None else None)
        rec = StepRecord(
            step=plan.step, num_requests=len(plan.plan), prefill_tokens=plan.num_prefill_tokens,
            decode_tokens=plan.num_decode_tokens, seconds=t1 - t0, host_seconds=t1 - t0, graph=used_graph,
            tokens_cached=tokens_cached, cache_bytes_in_use=in_use,
            jit_seconds=(clock.seconds - jit0) if clock is not None else 0.0,
            jit_kernels=(clock.kernels - kernels0) if clock is not None else 0,
            prefix_bytes=self.cache.prefix_cache_bytes(), prepare_seconds=t_launch - t0,
        )
        self._records.append(rec)
        return rec

    def run(
        self,
        requests: Sequence[Request],
        progress: bool = False,
        on_step: Callable[[StepRecord], None] | None = None,
    ) -> RunStats:
        """Run ``requests`` to completion. Returns ``RunStats`` (per-step records and a ``summary()``).

        Args:
            requests: fresh ``Request`` objects (their progress fields are filled in).
            progress: tqdm bar of tokens processed.
            on_step: called after every step with its record.
        """
        t_call = time.perf_counter()
        self.warmup_report = None
        if self.config.warmup if self.config.warmup is not None else self.backend == "triton":
            from .warmup import warm_up

            self.warmup_report = warm_up(self, requests, progress=progress)
        buckets = self.warmup_report.graph_buckets if self.warmup_report is not None else None
        self.submit(requests, graph_batch_sizes=buckets)
        assert self.scheduler is not None and self.cache is not None
        if self.graphs is not None:
            t0 = time.perf_counter()
            self.graphs.capture()
            self.graph_capture_s = time.perf_counter() - t0
        total = sum(r.total_len for r in requests)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, unit="tok", desc="run", leave=False, dynamic_ncols=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._t0_event = torch.cuda.Event(enable_timing=True)
            self._t0_event.record()
        t_start = time.perf_counter()
        prepare_s = t_start - t_call
        idle = 0
        try:
            with JitClock() as self._jit_clock:
                while self.scheduler.has_work:
                    rec = self.step(t_start)
                    if rec is None:
                        idle += 1
                        if idle > 1_000_000:
                            raise RuntimeError("scheduler made no progress for 1e6 steps")
                        continue
                    idle = 0
                    if bar is not None:
                        bar.update(rec.prefill_tokens + rec.decode_tokens)
                        bar.set_postfix(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                                        refresh=False)
                    if on_step is not None:
                        on_step(rec)
        finally:
            self._jit_clock = None
            if bar is not None:
                bar.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._device_timings(requests)
        wall = time.perf_counter() - t_start
        if self.device.type == "cpu":
            self.cache.check_invariants()
        fill_prefix_traces(self.traces, requests, self._ids)
        return RunStats(
            steps=list(self._records), requests=list(requests), wall_s=wall, setup_s=self.setup_s,
            graph_capture_s=self.graph_capture_s,
            graph_buckets=sorted(self.graphs.captured) if self.graphs is not None else [],
            cache_bytes_allocated=self.cache.memory_bytes(), num_layers=len(self.layer_ids),
            prefix=self.cache.prefix.stats(),
            warmup=self.warmup_report.as_dict() if self.warmup_report is not None else {},
            prepare_s=prepare_s,
        )

    def _device_timings(self, requests: Sequence[Request]) -> None:
        """After a CUDA run: each step's GPU time from its events and, with ``overlap_host``, its wall time as the
        interval between consecutive step completions on the device; requests' first-token and finish times at the
        completion of the steps that produced them (the host ran ahead of the device)."""
        ends = []
        for rec, (ev0, ev1) in zip(self._records, self._events):
            rec.gpu_seconds = ev0.elapsed_time(ev1) / 1e3
            ends.append(self._t0_event.elapsed_time(ev1) / 1e3)
        if not self.overlap_host:
            return
        prev = 0.0
        for rec, end in zip(self._records, ends):
            rec.seconds, prev = max(end - prev, rec.gpu_seconds), end
        at = {rec.step: end for rec, end in zip(self._records, ends)}
        for r in requests:
            if r.prefill_done_step in at:
                r.first_token_s = at[r.prefill_done_step]
            if r.finished_step in at:
                r.finished_s = at[r.finished_step]
