"""``LayerStep``: what every op of one layer's step reads besides its tensors.

``dsv4.Attention`` builds one per call (host objects only: no device work) and hands it to each op of its backend
in turn; the ops read the layer's weights, its cache tensors, the step's ``StepBatch`` and this layer kind's launch
decisions (``LayerPlan``) from it, so that an op's signature is just its data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from ..cache.batch import StepBatch
from ..cache.manager import LayerCache
from ..config import LayerKind, ModelConfig
from ..numerics import Numerics
from ..weights import AttentionWeights

if TYPE_CHECKING:
    from .plan import LayerPlan

__all__ = ["LayerStep"]


@dataclass(frozen=True)
class LayerStep:
    """One layer's part of one step.

    Attributes:
        cfg: the model configuration as this layer computes it: the model's, or under tensor parallelism the rank's
            share (``num_heads`` = H/tp, ``o_groups`` = G/tp; ``dsv4.distributed.local_config``).
        layer_idx: the layer; ``kind`` its kind; ``ratio`` its compression ratio m (0 for SWA).
        weights: the layer's weights on the step's device (compressors in FP32, projections in the GEMM dtype).
        inv_freq: float32 ``[R/2]`` the layer's RoPE frequencies (SPEC §2.2).
        numerics: the cache's numerics (activation dtype, storage formats, score dtype).
        cache: the layer's pool pages, state rows and the cache's workspace.
        batch: the step (``HybridCache.prepare_forward``'s ``StepBatch``).
        plan: this layer kind's launch decisions for the step (``LayerPlan``; the torch backend has none to make).
    """

    cfg: ModelConfig
    layer_idx: int
    kind: LayerKind
    ratio: int
    weights: AttentionWeights
    inv_freq: Tensor
    numerics: Numerics
    cache: LayerCache
    batch: StepBatch
    plan: LayerPlan

    @property
    def positions(self) -> Tensor:
        """int64 ``[T]``: the step's token positions."""
        return self.batch.positions

    @property
    def compressors(self) -> int:
        """Compressors of the layer: 0 (SWA), 1 (HCA: the main one), 2 (CSA: main + indexer)."""
        return {LayerKind.SWA: 0, LayerKind.HCA: 1, LayerKind.CSA: 2}[self.kind]
