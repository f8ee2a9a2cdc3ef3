"""The Triton backend's projections: the FP8-GEMM projections of SPEC §1.3 as the step's plan says
(``LayerPlan.projection``: a ``kernels.project.plan.ProjectionPlan`` — the Triton block GEMM's launch per weight
shape, else its way of ``kernels.project.fp8_gemm``), handed to ``ops.projections`` as its ``Project``."""

from __future__ import annotations

import functools

from torch import Tensor

from ..cache.workspace import Workspace
from ..formats.block_fp8 import BlockFp8Weight
from ..kernels.device import runs_here
from ..kernels.project import block_gemm, fp8_gemm
from ..kernels.project.plan import ProjectionPlan
from ..numerics import Numerics
from ..reference.primitives import project as reference_project
from ..weights import Projection
from . import projections
from .step import LayerStep

__all__ = ["projector", "takes_codes"]


def projector(step: LayerStep) -> projections.Project:
    """The step's FP8-GEMM projection (``LayerPlan.projection``), or the torch reference's ``project`` where the
    plan has none."""
    plan = step.plan.projection
    if plan is None:
        return reference_project
    return functools.partial(_project_fp8, plan=plan, workspace=step.cache.workspace)


def _project_fp8(x: Tensor, weight: Projection, numerics: Numerics, plan: ProjectionPlan,
                 workspace: Workspace) -> Tensor:
    if not (numerics.fp8_projections and isinstance(weight, BlockFp8Weight) and runs_here(x)):
        return reference_project(x, weight, numerics)
    launch = plan.launch(*weight.shape)
    if launch is None:
        return fp8_gemm.fp8_linear(x, weight, numerics.act_dtype, plan.way(*weight.shape))
    codes = fp8_gemm.attached_codes(x) if launch.tma else None  # x's producer quantized it (plan.takes_codes)
    x2 = x.reshape(-1, x.shape[-1])
    out = block_gemm.block_fp8_linear(x2, weight, numerics.act_dtype, launch, workspace, codes)
    return out.reshape(*x.shape[:-1], -1)


def takes_codes(step: LayerStep, weight: Projection | None) -> bool:
    """Whether the step's GEMM over ``weight`` reads pre-quantized activations (a TMA launch of the block GEMM):
    then the launch that makes its input quantizes it too (``fp8_gemm.attach_codes``), saving a launch."""
    plan = step.plan.projection
    return plan is not None and weight is not None and plan.takes_codes(*weight.shape)
