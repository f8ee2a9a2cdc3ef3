"""Tensor parallelism: the output projection of a rank's heads and the one all-reduce per layer.

A rank holds ``G/tp`` whole output groups: ``W_oa`` of its groups gives its ``[T, (G/tp)·o_lora_rank]`` part of
``[y_0; …; y_{G−1}]``, and its columns of ``W_ob`` turn that into a partial output ``[T, d]``. The partials are
summed in FP32 over the TP group (one all-reduce) and rounded once to the activation dtype — so the result is
the one-process product up to the order of its FP32 sums. The FP8 ``W_ob`` GEMM quantizes its input per
1 × 128 block; a rank's columns are whole blocks (``sharding.check_fp8_split``), so every product is the one
the single process forms.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..numerics import Numerics
from ..ops import projections
from ..ops.step import LayerStep
from ..reference.primitives import project
from ..weights import Projection
from .collectives import all_reduce_sum

__all__ = ["output"]


def output(step: LayerStep, o: Tensor, group) -> Tensor:
    """``ops.backend.AttentionBackend.output`` of a rank's heads: o ``[T, H/tp, D]`` → the layer's ``[T, d]`` (act
    dtype), the same on every rank of the TP group."""

    def summed(x: Tensor, w: Projection, numerics: Numerics) -> Tensor:
        return all_reduce_sum(project(x, w, numerics, out_dtype=torch.float32), group).to(numerics.act_dtype)

    return projections.output(step, o, summed)
