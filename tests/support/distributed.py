"""Process groups in tests: ranks started with ``torch.multiprocessing`` (spawn) over gloo on 127.0.0.1, and the
layer steps the distributed tests run on every rank and in one process.

``launch(worker, nprocs, *args)`` starts ``nprocs`` processes, each initializing the default group (gloo, a free
port) and calling ``worker(rank, *args)`` — a module-level function — then destroying it; an exception in a rank
fails the launch with that rank's traceback, a rank still running after ``timeout`` seconds kills them all.

``run_steps(scenario, parallel)`` runs a fixed sequence of steps (prefill chunks, mixed steps, 1–3-token decodes of
three requests) through ``dsv4.Attention`` for each of the scenario's layers over one cache, with fresh random
inputs from the scenario's seed, and returns every output: the same call with ``parallel=None`` is the
one-process run the ranks are compared with.
"""

from __future__ import annotations

import dataclasses
import datetime
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dsv4
import dsv4.distributed
from dsv4.cache import HybridCache
from dsv4.ops import StepPlan, torch_ops
from dsv4.reference.indexer import index_scores

#: the steps of every scenario: request → new tokens (a request joins at its first step)
STEPS: tuple[dict[str, int], ...] = (
    {"a": 70, "b": 5},
    {"a": 3, "b": 40, "c": 1},
    {"a": 1, "b": 1, "c": 30},
    {"a": 2, "b": 1, "c": 1},
    {"a": 1, "b": 3, "c": 1},
    {"a": 1, "b": 1, "c": 2},
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, worker: Callable, world: int, port: int, backend: str, args: tuple) -> None:
    torch.set_num_threads(1)
    extra = {}
    if backend == "nccl":  # one GPU per rank
        torch.cuda.set_device(rank)
        extra["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120), **extra)
    try:
        worker(rank, *args)
    finally:
        dist.destroy_process_group()


def launch(worker: Callable, nprocs: int, *args, timeout: float = 120.0, backend: str = "gloo") -> None:
    """Run ``worker(rank, *args)`` on ``nprocs`` ranks of a ``backend`` group (gloo on the CPU, or NCCL with GPU
    ``rank`` per rank; module docstring); returns when all have finished."""
    ctx = mp.start_processes(_entry, args=(worker, nprocs, free_port(), backend, args), nprocs=nprocs, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{nprocs} ranks still running after {timeout:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


@dataclass(frozen=True)
class Scenario:
    """What one run computes: ``cfg``'s ``layers`` under ``numerics`` with random weights (``fp8``: block-scaled
    FP8 projections) from ``seed``; ``tp`` × ``cp`` ranks (the split to build on the ranks)."""

    name: str
    cfg: dsv4.ModelConfig
    layers: tuple[int, ...]
    numerics: str
    tp: int = 1
    cp: int = 1
    fp8: bool = True
    seed: int = 0
    cp_window: str = "split"
    cp_merge: str = "sums"
    backend: str = "torch"
    cuda: bool = False  # on the rank's GPU (cuda:rank; one process: cuda:0)


def tiny(o_lora_rank: int | None = None) -> dsv4.ModelConfig:
    """The tiny preset; ``o_lora_rank`` 128 gives each of 2 TP ranks whole 128-column blocks of ``wo_b``."""
    cfg = dsv4.ModelConfig.preset("tiny")
    return cfg if o_lora_rank is None else dataclasses.replace(cfg, name=f"tiny-o{o_lora_rank}",
                                                               o_lora_rank=o_lora_rank)


def _index_scores(layer: dsv4.Attention, x: torch.Tensor, batch, cache: HybridCache) -> torch.Tensor:
    """float32 ``[T, N]``: the index scores the torch backend's top-k of this step chose from (NaN past a
    request's entries), recomputed by its ops after the step (they read the cache, write nothing)."""
    step = layer.layer_step(batch, cache, StepPlan.empty("torch"))
    x = x.to(cache.numerics.act_dtype)
    q_idx = torch_ops.indexer_queries(step, torch_ops.query_latent(step, x))
    weights = torch_ops.indexer_weights(step, x)
    n = max(((s + k) // layer.ratio for s, k in zip(batch.start_positions, batch.num_new)), default=0)
    out = torch.full((batch.num_tokens, n), float("nan"), device=x.device)
    for rows, keys in torch_ops.request_index_keys(step.cache, batch, layer.ratio):
        out[rows, : keys.shape[0]] = index_scores(q_idx[rows], weights[rows], keys, cache.numerics.score_dtype).float()
    return out


def run_steps(scn: Scenario, parallel: dsv4.distributed.Parallel | None = None) -> dict:
    """Every step's outputs of every layer: ``{"y" | "lse" | "idx": {(step, layer): tensor}, "pool_bytes": int}``
    (``idx``: the attended entries as lists, −1 padded); one process (``parallel=None``) also ``"scores"``: the
    CSA layers' index scores (``[T, N]``)."""
    cfg = scn.cfg
    tp_rank, tp_size = (parallel.tp_rank, parallel.tp_size) if parallel is not None else (0, 1)
    cp_rank, cp_size = (parallel.cp_rank, parallel.cp_size) if parallel is not None else (0, 1)
    device = torch.device("cuda", torch.cuda.current_device()) if scn.cuda else torch.device("cpu")
    cache = HybridCache(cfg, layers=list(scn.layers), max_requests=4, num_blocks=24, block_size=64, device=device,
                        numerics=scn.numerics, cp_rank=cp_rank, cp_size=cp_size)
    layers = {}
    for li in scn.layers:
        w = dsv4.AttentionWeights.random(cfg, li, seed=scn.seed, fp8=scn.fp8).shard(tp_rank, tp_size)
        layers[li] = dsv4.Attention(w, cfg, li, backend=scn.backend, parallel=parallel)
    gen = torch.Generator().manual_seed(scn.seed + 1)
    out: dict = {"y": {}, "lse": {}, "idx": {}, "scores": {}, "pool_bytes": cache.pool.nbytes()}
    for s, plan in enumerate(STEPS):
        for rid in plan:
            if rid not in cache:
                cache.add_request(rid)
        batch = cache.prepare_forward(plan)
        for li, layer in layers.items():
            x = torch.randn(batch.num_tokens, cfg.hidden_size, generator=gen).to(device)
            res = layer.forward_with_aux(x, batch, cache)
            out["y"][s, li] = res.y.cpu()
            out["lse"][s, li] = res.lse.cpu()
            out["idx"][s, li] = res.attended_entries().cpu()
            if parallel is None and layer.kind is dsv4.LayerKind.CSA:
                out["scores"][s, li] = _index_scores(layer, x, batch, cache).cpu()
    return out
