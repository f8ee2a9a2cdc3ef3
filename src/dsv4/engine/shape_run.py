"""One step shape run once, eagerly, through one layer of each kind on a small synthetic cache: what the warm-up
(``engine.warmup``) runs to make every kernel of a run's step compile — or, inside a census
(``kernels.census.LaunchCensus``), to learn which specialisations those are.

Layers of one kind launch the same kernels (the weights are arguments), so one layer per kind suffices.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from ..config import LayerKind, ModelConfig
from .hidden import TokenHidden
from .residual import residual_step
from .shape_store import StepShape

__all__ = ["kind_layers", "run_shape"]


def kind_layers(cfg: ModelConfig, layers: Iterable[int]) -> list[int]:
    """One layer of each kind among ``layers`` (the first of each), ascending."""
    first: dict[LayerKind, int] = {}
    for li in layers:
        first.setdefault(cfg.layer_kind(li), li)
    return sorted(first.values())


_LAYERS: dict[tuple, dict] = {}  # per process: (cfg, layers, backend, device) -> {layer: Attention}


def run_shape(cfg: ModelConfig, layers: list[int], numerics: str, backend: str, block_size: int,
              shape: StepShape, device: str) -> float:
    """Run ``shape`` once, eagerly, through ``layers`` (one of each kind) with random weights on a small synthetic
    cache of the shape's geometry, the engine's default hidden states (``engine.hidden.TokenHidden``) and glue
    between layers (``engine.residual``) included: every kernel the shape launches compiles, or loads from the
    disk cache. Returns its seconds."""
    import dsv4
    from dsv4.cache import HybridCache

    t0 = time.perf_counter()
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    key = (cfg, tuple(layers), backend, device)
    if key not in _LAYERS:
        _LAYERS[key] = {
            li: dsv4.Attention(dsv4.AttentionWeights.random(cfg, li, seed=0, device=dev), cfg, li, backend=backend,
                               check_inputs=False, nan_policy="off")
            for li in layers
        }
    attn = _LAYERS[key]
    B = len(shape.num_new)
    cache = HybridCache(cfg, layers=layers, max_requests=B, num_blocks=B * shape.width + 1, block_size=block_size,
                        device=dev, numerics=numerics)
    for b in range(B):
        cache.add_request(f"r{b}")
    with torch.no_grad():
        batch = cache.prepare_forward({f"r{b}": n for b, n in enumerate(shape.num_new)}, max_blocks=shape.width)
        glue = residual_step(backend, dev, cache.numerics.act_dtype, cfg.norm_eps)
        ids = torch.arange(batch.num_tokens, device=dev)
        h, x = glue(TokenHidden(cfg.hidden_size)(ids), None)
        plan = attn[layers[0]].plan_step(batch, cache)
        for li in layers:
            y = attn[li](x, batch, cache, plan)
        h, _ = glue(h, y)
        glue(h, y, norm=False, in_place=True)  # every variant of the glue compiles
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0
