"""The residual stream between the engine's layers: ``h ← h + y_l``, then the next layer's input ``x = norm(h)``.

The stack is ``h ← h + Attention_l(rms_norm(h))`` (MoE and mHC are out of scope): around every layer the engine
normalizes the fp32 residual ``h`` (unweighted RMSNorm, cast to the activation dtype) into the layer's input and
adds the layer's output back. ``residual_step`` picks, once per engine, how:

* ``TorchResidualStep`` (the torch backend, the CPU): ``h + y.float()`` and ``reference.primitives.rms_norm``,
  about eight kernels per layer;
* ``TritonResidualStep`` (the Triton backend on CUDA): ``dsv4.kernels.project.residual_norm``, one launch per
  layer that adds and normalizes, writing the sum in place when the caller says ``h`` is its own, and — where the
  next layer's input GEMM reads pre-quantized activations — the input's FP8 codes too.

Both are graph-safe (no host synchronisation) and compute the same ``h`` bit for bit; ``x`` differs at most by one
step of the activation dtype (the mean's summation order).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from ..reference.primitives import rms_norm

__all__ = ["ResidualStep", "TorchResidualStep", "TritonResidualStep", "residual_step"]


class ResidualStep(Protocol):
    def __call__(self, h: Tensor, y: Tensor | None, *, norm: bool = True, in_place: bool = False,
                 quantize: bool = False) -> tuple[Tensor, Tensor | None]:
        """``(h + y.float(), norm(h + y.float()))``.

        Args:
            h: fp32 ``[T, d]`` the residual stream.
            y: ``[T, d]`` (activation dtype) a layer's output; ``None``: nothing to add (``h`` comes back as is).
            norm: compute the next layer's input; ``False``: only the add (after the last layer).
            in_place: ``h`` belongs to the caller's step and may be overwritten with the sum (never the stack's
                input, which is the graph's static input during capture).
            quantize: the next layer's input GEMM reads pre-quantized activations
                (``Attention.input_takes_codes``): make the input's FP8 codes in the same launch where the step
                can (the Triton step; the torch step leaves them to the GEMM).
        Returns:
            fp32 ``[T, d]`` the residual after the add, and the activation-dtype ``[T, d]`` next input (a new tensor
            each call, so the traces can keep it; ``None`` when not ``norm``).
        """
        ...


class TorchResidualStep:
    """``ResidualStep`` in torch ops (the engine's reference glue): ``h + y.float()``, then
    ``rms_norm(h, None, eps).to(act_dtype)``; ``in_place`` is ignored (every sum is a new tensor)."""

    def __init__(self, act_dtype: torch.dtype, eps: float) -> None:
        self.act_dtype, self.eps = act_dtype, float(eps)

    def __call__(self, h: Tensor, y: Tensor | None, *, norm: bool = True, in_place: bool = False,
                 quantize: bool = False) -> tuple[Tensor, Tensor | None]:
        if y is not None:
            h = h + y.float()
        return h, (rms_norm(h, None, self.eps).to(self.act_dtype) if norm else None)


class TritonResidualStep:
    """``ResidualStep`` as one ``residual_rms_norm`` launch (CUDA, or the Triton interpreter)."""

    def __init__(self, act_dtype: torch.dtype, eps: float) -> None:
        from ..kernels.project.residual_norm import residual_rms_norm

        self._launch = residual_rms_norm
        self.act_dtype, self.eps = act_dtype, float(eps)

    def __call__(self, h: Tensor, y: Tensor | None, *, norm: bool = True, in_place: bool = False,
                 quantize: bool = False) -> tuple[Tensor, Tensor | None]:
        h_out = h if in_place and y is not None else None
        return self._launch(h, y, eps=self.eps, act_dtype=self.act_dtype, norm=norm, h_out=h_out,
                            quantize=quantize and norm and self.act_dtype == torch.bfloat16)


def residual_step(backend: str, device: torch.device, act_dtype: torch.dtype, eps: float) -> ResidualStep:
    """The Triton step when the layers run the ``"triton"`` backend on a CUDA ``device``, else the torch one."""
    if backend == "triton" and device.type == "cuda":
        return TritonResidualStep(act_dtype, eps)
    return TorchResidualStep(act_dtype, eps)
