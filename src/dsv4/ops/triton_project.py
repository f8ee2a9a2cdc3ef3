"""The Triton backend's projections: the FP8-GEMM projections of SPEC §1.3 as the step's plan says
(``LayerPlan.projection``: ``kernels.project.fp8_gemm``), handed to ``ops.projections`` as its ``Project``."""

from __future__ import annotations

import functools

from torch import Tensor

from ..formats.block_fp8 import BlockFp8Weight
from ..kernels.device import runs_here
from ..kernels.project import fp8_gemm
from ..numerics import Numerics
from ..reference.primitives import project as reference_project
from ..weights import Projection
from . import projections
from .step import LayerStep

__all__ = ["projector"]


def projector(step: LayerStep) -> projections.Project:
    """The step's FP8-GEMM projection (``LayerPlan.projection``: ``kernels.project.fp8_gemm``), or the torch
    reference's ``project`` where the plan has none."""
    gemm = step.plan.projection
    if gemm is None:
        return reference_project
    return functools.partial(_project_fp8, gemm=gemm)


def _project_fp8(x: Tensor, weight: Projection, numerics: Numerics, gemm: str) -> Tensor:
    if numerics.fp8_projections and isinstance(weight, BlockFp8Weight) and runs_here(x):
        return fp8_gemm.fp8_linear(x, weight, numerics.act_dtype, gemm)
    return reference_project(x, weight, numerics)
