"""How an engine runs: ``EngineConfig`` (every field validated on construction) and ``pick_device``."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..numerics import Numerics
from ..validate import require_bool, require_choice, require_device, require_int
from .requests import DEFAULT_VOCAB

__all__ = ["EngineConfig", "pick_device"]

_DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")


def pick_device(name: str | torch.device | None, arg: str = "device") -> torch.device:
    """``"auto"`` / ``None`` → CUDA when available, else CPU. ``ValueError`` naming ``arg`` for a device that is
    not ``cpu`` / ``cuda[:N]`` or does not exist here (CUDA without a GPU)."""
    if name is None or name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = require_device(arg, name)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{arg} {name!r} cannot run the engine; use auto, cpu, cuda or cuda:N")
    return dev


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs.

    Attributes:
        backend: ``"auto"`` (Triton on CUDA when available, else torch), ``"torch"`` or ``"triton"``.
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"`` …
        numerics: ``"official"`` (BF16 activations, 584-B FP8 KV entries, 68-B MXFP4 indexer keys) or ``"exact"``.
        block_size: token positions per pool block (a multiple of every compression ratio).
        max_running: concurrently running requests (state slots).
        max_batched_tokens: token budget per step.
        max_prefill_chunk: largest prefill chunk per request and step (default: the budget).
        decode_tokens: tokens per decode step per request (1–4).
        cache_memory: cache budget in bytes (pool + state); ``None``: exactly enough for ``max_running``
            requests of the longest submitted length (nobody ever waits for memory).
        cuda_graphs: ``"auto"`` (on for CUDA + graph-safe backend), ``"on"`` (error if impossible), ``"off"``.
        graph_batch_sizes: decode batch sizes to capture (each decode step uses the smallest that fits; larger
            decode batches run eagerly). ``None``: powers of two up to ``max_running``.
        weights: ``"random"`` (distinct random weights per layer), ``"shared"`` (one random set per layer kind,
            shared by every layer of that kind: less memory, faster start) or a checkpoint directory.
        seed: weights, hidden states, and the token ids of requests submitted without them.
        check_finite: check every step's output for NaN/Inf (a device sync per step; on by default on the CPU), and
            what the layers leave in the cache (their ``nan_policy``: ``"raise"`` on the CPU — a step that would
            leave NaN/Inf is rolled back —, ``"flag"`` on CUDA — checked at the end of the step).
        prefix_caching: reuse cached prompt prefixes (``dsv4.cache.prefix``; see ``dsv4.engine.scheduler``).
        prefix_states: state snapshots the prefix cache keeps (default ``2 · max_running``; each
            ``HybridCache.prefix_state_bytes``, out of ``cache_memory`` when that is given).
        vocab: token ids of requests without them, and generated ones, are drawn from ``[0, vocab)``.
        overlap_host: on CUDA, let the host schedule and prepare the next step while the GPU runs this one (no
            device synchronisation per step; each step's GPU time is measured with CUDA events and its wall time
            is the interval between consecutive step completions). Default: on for CUDA. Off: every step ends
            with a device synchronisation (latency of an isolated step).
        warmup: before the first step, compile every kernel the run will launch, in parallel over the CPU cores,
            into Triton's on-disk cache (``dsv4.engine.warmup``), and capture CUDA graphs only for the decode
            batch sizes the run uses. Default: on for the Triton backend on CUDA.
        side_stream: on CUDA, run two stages of each layer on a second stream beside the others (the writes beside
            the queries, the ring commit beside the output projection: ``dsv4.ops.side_stream``; the same results).
            Off: every launch on the engine's stream.
    """

    backend: str = "auto"
    device: str = "auto"
    numerics: str = "official"
    block_size: int = 256
    max_running: int = 16
    max_batched_tokens: int = 2048
    max_prefill_chunk: int | None = None
    decode_tokens: int = 1
    cache_memory: int | None = None
    cuda_graphs: str = "auto"
    graph_batch_sizes: tuple[int, ...] | None = None
    weights: str = "random"
    seed: int = 0
    check_finite: bool | None = None
    prefix_caching: bool = False
    prefix_states: int | None = None
    vocab: int = DEFAULT_VOCAB
    overlap_host: bool | None = None
    warmup: bool | None = None
    side_stream: bool = True

    def __post_init__(self) -> None:
        """Validate every field: ``TypeError`` / ``ValueError`` naming it (nothing is truncated or defaulted)."""
        require_choice("backend", self.backend, ("auto", "torch", "triton"))
        if not isinstance(self.device, (str, torch.device)) or not _DEVICE_RE.fullmatch(str(self.device)):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not isinstance(self.numerics, Numerics):
            require_choice("numerics", self.numerics, ("official", "exact"))
        require_int("block_size", self.block_size, 1)
        require_int("max_running", self.max_running, 1)
        require_int("max_batched_tokens", self.max_batched_tokens, 1)
        if self.max_prefill_chunk is not None:
            require_int("max_prefill_chunk", self.max_prefill_chunk, 1)
        require_int("decode_tokens", self.decode_tokens, 1, 4)
        if self.cache_memory is not None:
            require_int("cache_memory", self.cache_memory, 0)
        require_choice("cuda_graphs", self.cuda_graphs, ("auto", "on", "off"))
        if self.graph_batch_sizes is not None:
            if isinstance(self.graph_batch_sizes, (str, bytes)) or not isinstance(self.graph_batch_sizes, Iterable):
                raise TypeError(f"graph_batch_sizes must be a sequence of ints, got {self.graph_batch_sizes!r}")
            sizes = tuple(require_int("graph_batch_sizes entry", b, 1) for b in self.graph_batch_sizes)
            object.__setattr__(self, "graph_batch_sizes", sizes)
        if not isinstance(self.weights, (str, os.PathLike)) or not str(self.weights):
            raise TypeError(f"weights must be 'random', 'shared' or a checkpoint directory, got {self.weights!r}")
        require_int("seed", self.seed, 0)
        if self.check_finite is not None:
            require_bool("check_finite", self.check_finite)
        if self.overlap_host is not None:
            require_bool("overlap_host", self.overlap_host)
        if self.warmup is not None:
            require_bool("warmup", self.warmup)
        require_bool("side_stream", self.side_stream)
