"""The stages of one attention step over the cache, behind one interface (``ops.backend.AttentionBackend``) with
two backends: ``torch_ops`` (plain torch, any device: the oracle) and ``triton_ops`` (Triton / Gluon kernels for
Hopper GPUs). ``dsv4.Attention`` calls a backend's ops in the order ``ops.backend`` lists them, on a ``LayerStep``
(``ops.step``) that carries the step's ``StepPlan`` (``ops.plan``)."""

from __future__ import annotations

from types import ModuleType

from . import torch_ops
from .backend import OP_NAMES, AttentionBackend
from .plan import LayerPlan, StepPlan
from .step import LayerStep

__all__ = ["BACKENDS", "OP_NAMES", "AttentionBackend", "LayerPlan", "LayerStep", "StepPlan", "backend_ops",
           "torch_ops", "triton_available"]

BACKENDS = ("torch", "triton")


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
    """The ops module of backend ``name`` (``"torch"`` or ``"triton"``; see ``ops.backend``)."""
    if name == "torch":
        return torch_ops
    if name == "triton":
        from . import triton_ops  # imports triton

        return triton_ops
    raise ValueError(f"unknown backend {name!r}; available: {BACKENDS}")
