"""``dsv4.reference`` — the readable, stateless DeepSeek-V4 attention: the oracle for the cache and kernels.

``attention(w, cfg, layer_idx, x, numerics)`` runs one layer over positions ``0 … S−1``; ``forward`` returns
every intermediate. The building blocks (rope, compressor, indexer, core attention) are shared with the cache's
torch backend so that both compute the same thing the same way.
"""

from .compressor import compress, finish_entries, overlap_slots, pool_windows, project
from .core import attend_with_sink, window_indices
from .indexer import index_scores, indexer_head_weights, indexer_queries, select_topk, topk_differences, topk_within
from .layer import ReferenceResult, attention, compressed_entry_indices, forward, output_projection, query_path, window_kv
from .primitives import linear, rms_norm
from .rope import apply_rope, rope_inv_freq

__all__ = [
    "ReferenceResult", "attention", "forward", "query_path", "window_kv", "output_projection", "compressed_entry_indices",
    "compress", "finish_entries", "overlap_slots", "pool_windows", "project",
    "attend_with_sink", "window_indices", "index_scores", "indexer_head_weights", "indexer_queries", "select_topk", "topk_differences", "topk_within",
    "linear", "rms_norm", "apply_rope", "rope_inv_freq",
]
