"""dsv4 — DeepSeek-V4 hybrid attention (SWA / CSA / HCA) with a paged, quantized cache, for Hopper GPUs.

Public API::

    cfg = dsv4.ModelConfig.preset("v4-flash")
    w = dsv4.AttentionWeights.random(cfg, layer_idx=2, seed=0)
    y = dsv4.reference.attention(w, cfg, layer_idx=2, x=x, numerics="official")

    cache = dsv4.HybridCache(cfg, layers=[2], max_requests=64, num_blocks=4096, numerics="official")
    layer = dsv4.Attention(w, cfg, layer_idx=2)
    cache.add_request("r1")
    batch = cache.prepare_forward({"r1": 300})   # 300 new tokens of r1 in this step
    y = layer(x_r1, batch, cache)                # x_r1: [300, hidden]
    cache.release("r1")
"""

from . import formats, reference
from .cache import (
    CacheFullError,
    CorruptSnapshotError,
    DuplicateRequestError,
    HybridCache,
    IncompatibleSnapshotError,
    InvalidPlanError,
    NonFiniteError,
    RequestSnapshot,
    StaleBatchError,
    StepBatch,
    StepOrderError,
    UnknownRequestError,
)
from .checkpoint import CheckpointError
from .config import InvalidConfigError, LayerKind, ModelConfig
from .layer import Attention, StepOutputs
from .numerics import Numerics
from .weights import AttentionWeights, CompressorWeights, IndexerWeights

__version__ = "0.1.0"

__all__ = [
    "ModelConfig", "LayerKind", "Numerics", "AttentionWeights", "CompressorWeights", "IndexerWeights",
    "HybridCache", "StepBatch", "RequestSnapshot", "Attention", "StepOutputs", "formats", "reference",
    # errors (docs/errors.md)
    "CacheFullError", "CheckpointError", "CorruptSnapshotError", "DuplicateRequestError", "IncompatibleSnapshotError",
    "InvalidConfigError", "InvalidPlanError", "NonFiniteError", "StaleBatchError", "StepOrderError",
    "UnknownRequestError",
]
