"""What a run of the engine measured: ``StepRecord`` per step, ``RunStats`` for the run and its ``summary()``.

Host-side records only (no tensors); ``Engine.step`` makes the records and ``Engine.run`` the ``RunStats``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .requests import Request

__all__ = ["DENSE_BF16_BYTES_PER_TOKEN_LAYER", "RunStats", "StepRecord", "percentiles"]

#: A dense BF16 cache keeps every token's 512-dim KV entry (K ≡ V, one KV head) in every layer: 1024 B.
DENSE_BF16_BYTES_PER_TOKEN_LAYER = 512 * 2


@dataclass
class StepRecord:
    """One engine step: tokens by phase, requests, wall seconds (``jit_seconds`` of them compiling Triton kernels,
    measured inside ``Engine.run``), whether it replayed a CUDA graph.

    ``seconds``: the step's wall time — host start to device completion, or, with ``EngineConfig.overlap_host``,
    from the previous step's completion to this one's (the period of the pipelined loop). ``host_seconds``: the
    host's time in the step (scheduling, ``prepare_forward``, launches; a launch waits while the device's queue is
    full, so with the host a step or more ahead this approaches the GPU's time); ``prepare_seconds`` the part before
    the layers' first launch (scheduling and admissions, ``prepare_forward``, the token ids). ``gpu_seconds``: its
    GPU time (CUDA events around its launches; ``nan`` on the CPU)."""

    step: int
    num_requests: int
    prefill_tokens: int
    decode_tokens: int
    seconds: float
    graph: bool
    tokens_cached: int
    cache_bytes_in_use: int
    jit_seconds: float = 0.0
    jit_kernels: int = 0
    prefix_bytes: int = 0
    host_seconds: float = math.nan
    gpu_seconds: float = math.nan
    prepare_seconds: float = math.nan

    @property
    def kind(self) -> str:
        return "decode" if self.prefill_tokens == 0 else ("prefill" if self.decode_tokens == 0 else "mixed")


def percentiles(values: Sequence[float], qs: Iterable[float] = (50, 90, 99)) -> dict[str, float]:
    """Nearest-rank percentiles plus max/mean (``nan`` when empty)."""
    v = sorted(values)
    out: dict[str, float] = {}
    for q in qs:
        out[f"p{q:g}"] = v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))] if v else math.nan
    out["max"] = v[-1] if v else math.nan
    out["mean"] = sum(v) / len(v) if v else math.nan
    return out


@dataclass
class RunStats:
    """Summary of a run (see ``Engine.run``); every figure is derived from ``steps`` and ``requests``."""

    steps: list[StepRecord]
    requests: list[Request]
    wall_s: float
    setup_s: float
    graph_capture_s: float
    cache_bytes_allocated: int
    num_layers: int
    prefix: dict[str, Any] = field(default_factory=dict)
    warmup: dict[str, Any] = field(default_factory=dict)
    graph_buckets: list[int] = field(default_factory=list)
    prepare_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        """Throughput, latency and memory figures as a flat-ish dict (JSON-serialisable).

        * ``prefill_tok_s``: prompt tokens / seconds of the steps that carried prefill (mixed steps included);
        * ``decode_tok_s``: decode tokens of decode-only steps / their seconds;
        * ``step_ms``: latency percentiles of decode-only steps (``decode``) and of steps with prefill
          (``prefill``); ``decode_gpu_busy``: the GPU time of decode-only steps over their wall time, with
          ``decode_host_ms`` / ``decode_gpu_ms`` (each step's host work and GPU time, CUDA);
        * ``prepare_s``: from ``run()``'s call to its first step (warm-up, cache allocation, graph capture);
        * ``warmup``: what the ahead-of-time compilation did before the first step (``WarmupReport``; empty when
          it did not run);
        * ``jit_s`` / ``jit_kernels``: Triton JIT compilation inside the timed steps (first use of each kernel
          specialisation; seconds on a fresh machine), and ``prefill_tok_s_without_jit`` /
          ``decode_tok_s_without_jit``: the throughputs with that time taken out;
        * ``ttft_s`` / ``e2e_s``: time to first token (end of prefill) and to finish, from the run's start;
        * cache: peak bytes in use, tokens cached at that moment, and what a dense BF16 cache of those tokens
          would need (``DENSE_BF16_BYTES_PER_TOKEN_LAYER`` per token and layer);
        * prefix caching: ``prompt_tokens`` submitted, ``prefix_cached_tokens`` restored from the cache (so
          ``prefill_tokens`` = computed), ``prefix_hit_rate`` (their ratio), ``prefix_requests_hit``, and the memory
          only the prefix cache held (``prefix_cache_bytes_peak`` / ``_end``: unused cached blocks + snapshots)
          with the cache's figures at the end (``prefix``).
        """
        pre = [s for s in self.steps if s.prefill_tokens]
        dec = [s for s in self.steps if not s.prefill_tokens and s.decode_tokens]
        pre_tok = sum(s.prefill_tokens for s in self.steps)
        dec_tok_all = sum(s.decode_tokens for s in self.steps)
        pre_s = sum(s.seconds for s in pre)
        dec_tok = sum(s.decode_tokens for s in dec)
        dec_s = sum(s.seconds for s in dec)
        pre_jit = sum(s.jit_seconds for s in pre)
        dec_jit = sum(s.jit_seconds for s in dec)
        peak = max(self.steps, key=lambda s: s.cache_bytes_in_use, default=None)
        tokens_peak = peak.tokens_cached if peak else 0
        done = [r for r in self.requests if r.finished_s is not None]
        prompt = sum(r.prompt_len for r in self.requests)
        cached = sum(r.cached_tokens for r in self.requests)
        return {
            "steps": len(self.steps),
            "decode_steps": len(dec),
            "graph_steps": sum(s.graph for s in self.steps),
            "requests": len(self.requests),
            "requests_finished": len(done),
            "prefill_tokens": pre_tok,
            "decode_tokens": dec_tok_all,
            "wall_s": self.wall_s,
            "setup_s": self.setup_s,
            "graph_capture_s": self.graph_capture_s,
            "graph_buckets": self.graph_buckets,
            "prepare_s": self.prepare_s,
            "warmup": dict(self.warmup),
            "prefill_tok_s": pre_tok / pre_s if pre_s else math.nan,
            "decode_tok_s": dec_tok / dec_s if dec_s else math.nan,
            "jit_s": sum(s.jit_seconds for s in self.steps),
            "jit_kernels": sum(s.jit_kernels for s in self.steps),
            "prefill_tok_s_without_jit": pre_tok / (pre_s - pre_jit) if pre_s > pre_jit else math.nan,
            "decode_tok_s_without_jit": dec_tok / (dec_s - dec_jit) if dec_s > dec_jit else math.nan,
            "total_tok_s": (pre_tok + dec_tok_all) / self.wall_s if self.wall_s else math.nan,
            "step_ms": {
                "decode": {k: v * 1e3 for k, v in percentiles([s.seconds for s in dec]).items()},
                "prefill": {k: v * 1e3 for k, v in percentiles([s.seconds for s in pre]).items()},
            },
            "decode_batch_mean": (sum(s.num_requests for s in dec) / len(dec)) if dec else math.nan,
            "decode_gpu_busy": (sum(s.gpu_seconds for s in dec) / dec_s) if dec_s else math.nan,
            "decode_host_ms": percentiles([s.host_seconds * 1e3 for s in dec], (50, 90)),
            "decode_gpu_ms": percentiles([s.gpu_seconds * 1e3 for s in dec], (50, 90)),
            "ttft_s": percentiles([r.first_token_s for r in done if r.first_token_s is not None], (50, 90)),
            "e2e_s": percentiles([r.finished_s for r in done], (50, 90)),
            "cache_bytes_allocated": self.cache_bytes_allocated,
            "cache_bytes_peak": peak.cache_bytes_in_use if peak else 0,
            "tokens_cached_at_peak": tokens_peak,
            "dense_bf16_bytes_at_peak": tokens_peak * self.num_layers * DENSE_BF16_BYTES_PER_TOKEN_LAYER,
            "prompt_tokens": prompt,
            "prefix_cached_tokens": cached,
            "prefix_hit_rate": cached / prompt if prompt else 0.0,
            "prefix_requests_hit": sum(r.cached_tokens > 0 for r in self.requests),
            "prefix_cache_bytes_peak": max((s.prefix_bytes for s in self.steps), default=0),
            "prefix_cache_bytes_end": self.prefix.get("held_bytes", 0),
            "prefix": dict(self.prefix),
        }
