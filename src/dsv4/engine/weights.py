"""An engine's layer weights: where they come from (``WeightSource``: the caller's, a checkpoint's or seeded random
ones, whole or one tensor-parallel rank's shard) and how the engine holds them (``engine_weights``), and their size
(``weights_bytes``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..config import LayerKind, ModelConfig
from ..formats.block_fp8 import BlockFp8Weight
from ..layer_stacks import stack_layer_weights
from ..numerics import Numerics
from ..weights import AttentionWeights

if TYPE_CHECKING:
    from ..checkpoint import CheckpointIndex
    from ..distributed import Parallel
    from .config import EngineConfig

__all__ = ["WeightSource", "engine_weights", "weights_bytes"]

GivenWeights = Mapping[int, AttentionWeights] | Callable[[int], AttentionWeights]
"""Per-layer weights a caller gives an engine: ``{layer: AttentionWeights}`` or ``layer -> AttentionWeights``."""


def engine_weights(w: AttentionWeights, act: torch.dtype, device: torch.device) -> AttentionWeights:
    """Weights as an engine holds them: block-scaled FP8 projections as they are (the checkpoint's bytes), other
    matrices in the activation dtype (what the checkpoint ships in and the GEMMs read: BF16 for the official
    numerics), vectors (norms, sinks) and the position biases in FP32. Under BF16 activations the matrices that
    read one input are row views of one stacked matrix (``dsv4.layer_stacks``: the compressor matrices; ``wq_a``
    and ``wkv``; CSA: ``wq_b`` and the indexer's ``wq_b``)."""

    def cast(path: str, t: Tensor) -> Tensor:
        small = t.dim() < 2 or path.endswith("ape")
        return t.to(device=device, dtype=torch.float32 if small else act)

    def mv(x: Any, path: str) -> Any:
        if isinstance(x, BlockFp8Weight):
            return x.to(device)
        if isinstance(x, Tensor):
            return cast(path, x)
        if dataclasses.is_dataclass(x):
            return dataclasses.replace(x, **{f.name: mv(getattr(x, f.name), f.name) for f in dataclasses.fields(x)})
        return x

    out = mv(w, "")
    # the layer's stacked GEMMs (its compressors', its input projections', CSA its query projections') read stacked
    # matrices (``layer_stacks``): stack here, so the layer's device copy reuses this memory instead of holding a
    # second one
    return stack_layer_weights(out) if act == torch.bfloat16 else out


def weights_bytes(cfg: ModelConfig, layers: Sequence[int], act_bytes: int = 2) -> int:
    """Bytes of the attention weights of ``layers`` as the engine holds them (matrices at ``act_bytes``)."""
    total = 0
    for li in layers:
        d, H, D = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        mats = cfg.q_lora_rank * d + H * D * cfg.q_lora_rank + D * d + cfg.o_groups * cfg.o_lora_rank * (H * D // cfg.o_groups)
        mats += d * cfg.o_groups * cfg.o_lora_rank
        vecs = cfg.q_lora_rank + D + H
        kind = cfg.layer_kind(li)
        if kind is LayerKind.CSA:
            mats += 2 * (2 * D * d) + cfg.index_n_heads * cfg.index_head_dim * cfg.q_lora_rank + cfg.index_n_heads * d
            mats += 2 * (2 * cfg.index_head_dim * d)
            vecs += D + cfg.index_head_dim + cfg.csa_ratio * (2 * D + 2 * cfg.index_head_dim)
        elif kind is LayerKind.HCA:
            mats += 2 * D * d
            vecs += D + cfg.hca_ratio * D
        total += mats * act_bytes + vecs * 4
    return total


@dataclass(frozen=True)
class WeightSource:
    """Where an engine's layer weights come from, and which tensor-parallel shard of them it holds.

    Attributes:
        cfg: model configuration.
        layer_ids: the engine's stack.
        numerics: the engine's numerics (activation dtype; whether projections stay FP8).
        device: where the weights live.
        mode: ``EngineConfig.weights``: ``"random"``, ``"shared"`` or a checkpoint directory.
        seed: of random weights.
        given: the caller's weights (override ``mode``), or ``None``.
        index: the open checkpoint when ``mode`` names one (and ``given`` is ``None``), else ``None``.
        tp_rank, tp_size: this rank's share of the heads (``0, 1``: whole weights).
    """

    cfg: ModelConfig
    layer_ids: tuple[int, ...]
    numerics: Numerics
    device: torch.device
    mode: str
    seed: int
    given: GivenWeights | None
    index: CheckpointIndex | None
    tp_rank: int = 0
    tp_size: int = 1

    @classmethod
    def open(
        cls, cfg: ModelConfig, layer_ids: Sequence[int], config: EngineConfig, numerics: Numerics,
        device: torch.device, given: GivenWeights | None, parallel: Parallel | None,
    ) -> WeightSource:
        """The source of an engine's weights; opens the checkpoint ``config.weights`` names (when nothing is
        ``given``)."""
        mode = config.weights
        index = None
        if given is None and mode not in ("random", "shared"):
            from ..checkpoint import CheckpointIndex

            index = CheckpointIndex.open(mode)
        tp_rank, tp_size = (parallel.tp_rank, parallel.tp_size) if parallel is not None else (0, 1)
        return cls(cfg, tuple(layer_ids), numerics, device, mode, config.seed, given, index, tp_rank, tp_size)

    def full(self, li: int) -> AttentionWeights:
        """Layer ``li``'s whole weights from their source (the caller's, the checkpoint, or the seed; ``"shared"``:
        the first layer of its kind's). Under tensor parallelism with numerics that run no FP8 GEMM, FP8
        projections come dequantized (exactly; what the layers compute with anyway), so they shard at any group
        boundary, not only along their 128 × 128 blocks."""
        cfg = self.cfg
        if self.given is not None:
            w = self.given[li] if isinstance(self.given, Mapping) else self.given(li)
        elif self.index is not None:
            w = AttentionWeights.from_checkpoint(self.index, li, cfg)
        else:
            if self.mode == "shared":
                li = next(i for i in self.layer_ids if cfg.layer_kind(i) is cfg.layer_kind(li))
            w = AttentionWeights.random(cfg, li, self.seed, device=self.device)
        split = self.tp_size > 1
        return w.for_numerics(self.numerics) if split and not self.numerics.fp8_projections else w

    def full_held(self, li: int) -> AttentionWeights:
        """Layer ``li``'s whole weights as the engine holds them (``engine_weights`` of ``full``)."""
        return engine_weights(self.full(li), self.numerics.act_dtype, self.device)

    def build(self, progress: bool = False) -> dict[int, AttentionWeights]:
        """Every layer's weights as the engine holds them: this rank's shard (``"shared"``: one set per layer
        kind, the same objects for every layer of the kind). ``progress``: a tqdm bar over the layers."""
        act, dev, mode, given = self.numerics.act_dtype, self.device, self.mode, self.given
        shared: dict[LayerKind, AttentionWeights] = {}
        out: dict[int, AttentionWeights] = {}
        it: Iterable[int] = self.layer_ids
        if progress:
            from tqdm.auto import tqdm

            it = tqdm(self.layer_ids, desc="layers", unit="layer", leave=False)
        for li in it:
            kind = self.cfg.layer_kind(li)
            if given is None and mode == "shared" and kind in shared:
                out[li] = shared[kind]
                continue
            if given is None and self.index is not None and self.numerics.fp8_projections:
                w = AttentionWeights.from_checkpoint(self.index, li, self.cfg, tp_rank=self.tp_rank,
                                                     tp_size=self.tp_size)
            else:
                w = self.full(li).shard(self.tp_rank, self.tp_size)
            out[li] = engine_weights(w, act, dev)
            if given is None and mode == "shared":
                shared[kind] = out[li]
        return out
