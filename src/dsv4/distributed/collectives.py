"""The collectives the parallel layer steps use, over ``torch.distributed`` process groups (NCCL on GPUs, gloo on
the CPU). Each takes the group it runs on; every rank of the group must call it with tensors of the same shape
and dtype, in the same order."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_gather_stacked", "all_reduce_max", "all_reduce_sum"]


def all_reduce_sum(t: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``t`` summed over the group's ranks, in place (every rank gets the same bits). Returns ``t``."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_reduce_max(t: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``t``'s elementwise maximum over the group's ranks, in place. Returns ``t``."""
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def all_gather_stacked(t: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every rank's ``t`` stacked in group-rank order: ``[P, *t.shape]`` (``P`` = the group's size)."""
    out = torch.empty((dist.get_world_size(group), *t.shape), dtype=t.dtype, device=t.device)
    dist.all_gather(list(out.unbind(0)), t.contiguous(), group=group)
    return out
