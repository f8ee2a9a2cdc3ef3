"""The Triton backend: each op of ``dsv4.ops.BACKEND_OPS`` from its kernel module in ``dsv4.kernels``.

The glue modules (one per kernel family, each owning its launches and buffers):

* ``triton_write``     — ``rms_norm``, ``queries``, ``window_entries``, ``compress``, ``append_swa`` (the write
  path, and the norms and query RoPE ahead of it);
* ``triton_indexer``   — ``indexer_queries``, ``indexer_topk`` (MXFP4 scores + radix top-k);
* ``triton_attention`` — ``all_visible_entries``, ``attend`` (sparse attention over the 584-B pages).

An op whose glue module is not present runs the torch backend's version; ``TORCH_FALLBACKS`` lists them, and the
backend is graph-safe only when no op falls back.
"""

from __future__ import annotations

import importlib
import importlib.util

from . import BACKEND_OPS, torch_ops

_GLUE = {
    "triton_write": ("rms_norm", "queries", "window_entries", "compress", "append_swa"),
    "triton_indexer": ("indexer_queries", "indexer_topk"),
    "triton_attention": ("all_visible_entries", "attend"),
}

TORCH_FALLBACKS: list[str] = []
for _module_name, _ops in _GLUE.items():
    _full = f"{__package__}.{_module_name}"
    _module = importlib.import_module(_full) if importlib.util.find_spec(_full) is not None else None
    for _op in _ops:
        if _module is None:
            TORCH_FALLBACKS.append(_op)
            globals()[_op] = getattr(torch_ops, _op)
        else:
            globals()[_op] = getattr(_module, _op)

assert set(BACKEND_OPS) == {op for ops in _GLUE.values() for op in ops}
GRAPH_SAFE = not TORCH_FALLBACKS

__all__ = [*BACKEND_OPS, "GRAPH_SAFE", "TORCH_FALLBACKS"]
