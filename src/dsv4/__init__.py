"""dsv4 — DeepSeek-V4 hybrid attention (SWA / CSA / HCA) with a paged, quantized cache, for Hopper GPUs.

Public API::

    cfg = dsv4.ModelConfig.preset("v4-flash")
    w = dsv4.AttentionWeights.random(cfg, layer_idx=2, seed=0)
    y = dsv4.reference.attention(w, cfg, layer_idx=2, x=x, numerics="official")
"""

from . import formats, reference
from .config import LayerKind, ModelConfig
from .numerics import Numerics
from .weights import AttentionWeights, CompressorWeights, IndexerWeights

__version__ = "0.1.0"

__all__ = ["ModelConfig", "LayerKind", "Numerics", "AttentionWeights", "CompressorWeights", "IndexerWeights", "formats", "reference"]
