"""The stages of one attention step over the cache, behind one interface with two backends.

Each backend is a module with the functions named in ``BACKEND_OPS`` (same signatures; see ``torch_ops`` for the
documentation of each) and a flag ``GRAPH_SAFE`` (no host synchronisation or allocation that depends on data, so
a step can be captured in a CUDA graph):

* ``torch_ops`` — plain torch, any device: the oracle the kernels are tested against.
* ``triton_ops`` — Triton kernels for Hopper GPUs (``dsv4.kernels``); CUDA tensors only.

``dsv4.Attention`` calls them in this order per layer step: ``rms_norm`` (of ``c^Q`` and of the window KV) and
``queries`` (the per-head norm + RoPE of the query projection) → ``window_entries`` (SWA layers) or ``compress``
(compressed layers: the window entries and every compressor of the layer in one op) → ``indexer_queries`` +
``indexer_topk`` (CSA) or ``all_visible_entries`` (HCA) → ``attend`` → ``append_swa`` (last: a multi-token step
would otherwise overwrite ring slots its own earlier queries still read).
"""

from __future__ import annotations

from types import ModuleType

from . import torch_ops

__all__ = ["BACKEND_OPS", "backend_ops", "torch_ops", "triton_available"]

BACKEND_OPS = (
    "rms_norm", "queries", "window_entries", "compress", "indexer_queries", "indexer_topk", "all_visible_entries", "attend",
    "append_swa",
)


def triton_available() -> bool:
    """Whether the Triton backend can run here: ``triton`` importable and a CUDA device present."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def backend_ops(name: str) -> ModuleType:
    """The ops module of backend ``name`` (``"torch"`` or ``"triton"``)."""
    if name == "torch":
        return torch_ops
    if name == "triton":
        from . import triton_ops

        return triton_ops
    raise ValueError(f"unknown backend {name!r}; available: ('torch', 'triton')")
