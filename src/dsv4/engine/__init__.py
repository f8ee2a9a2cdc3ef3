"""The runner: a stack of attention layers over one ``HybridCache`` with continuous batching.

* ``requests``  — ``Request`` (prompt / generation lengths, prompt token ids, progress), ``LengthSpec`` (fixed or
  distributions), ``make_requests`` (seeded prompts, optionally sharing a prefix per group);
* ``scheduler`` — ``Scheduler``: decode first, chunked prefill under a token budget, admission when slots and
  blocks (reserved for each request's whole length) allow; finished requests release their cache;
* ``hidden``    — token hidden states (no embeddings in scope): ``TokenHidden`` (a seeded embedding per token id)
  or any deterministic callback of the token id;
* ``prefix_plan`` — ``PrefixPlanner``: where prefill chunks end and which requests wait, for prefix caching;
* ``runner``    — ``Engine``: builds the layers, the cache and the scheduler; runs steps;
* ``config``    — ``EngineConfig`` (how the engine runs), ``pick_device``;
* ``weights``   — ``WeightSource``: the layers' weights (random, shared-random, checkpoint or given; whole or a
  tensor-parallel shard) as the engine holds them; ``weights_bytes``;
* ``trace``     — ``Trace``: a traced request's per-layer inputs and outputs, for the spot check;
* ``token_ids`` — every submitted request's token ids, laid end to end; a step's ids in one gather;
* ``stats``     — ``StepRecord`` per step, ``RunStats`` per run: ``summary()`` gives throughput, latency and memory;
* ``graphs``    — CUDA-graph decode (one graph per decode batch-size bucket; ``prepare_forward`` outside);
* ``check``     — ``spot_check``: traced requests, layer by layer, against ``dsv4.reference``.
"""

from .check import SpotCheckRow, spot_check
from .hidden import HashHidden, TokenHidden
from .prefix_plan import PrefixPlanner
from .requests import LengthSpec, Request, make_requests
from .runner import Engine, EngineConfig, Trace, pick_device
from .scheduler import RequestTooLargeError, ScheduledStep, Scheduler, SchedulerConfig
from .stats import DENSE_BF16_BYTES_PER_TOKEN_LAYER, RunStats, StepRecord

__all__ = [
    "DENSE_BF16_BYTES_PER_TOKEN_LAYER",
    "Engine",
    "EngineConfig",
    "HashHidden",
    "LengthSpec",
    "PrefixPlanner",
    "Request",
    "RequestTooLargeError",
    "RunStats",
    "ScheduledStep",
    "Scheduler",
    "SchedulerConfig",
    "SpotCheckRow",
    "StepRecord",
    "TokenHidden",
    "Trace",
    "make_requests",
    "pick_device",
    "spot_check",
]
