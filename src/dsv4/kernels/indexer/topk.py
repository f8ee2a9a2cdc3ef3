"""Row-wise top-k without a sort (SPEC §6): the indices of the ``k`` largest of each row's first ``n_t`` scores.

Each score becomes an order-preserving unsigned key (``topk_common.sortable_key``; BF16 → 16 bits, FP32 → 32 bits:
flip all bits of negatives, set the sign bit of the others). Ties at the threshold: any valid choice; exactly
``min(k, n_t)`` indices are written, then −1. ``radix_topk`` runs the algorithm its plan names (``topk_plan``:
the rules, the launch constants, the scratch):

* ``"bisect"`` (``topk_bisect``; in Gluon on Hopper, ``topk_bisect_sm90``) — one launch, one program per row holding
  the whole row in registers (up to ``BISECT_MAX_COLUMNS``): a lower bound of the threshold (the smallest maximum of
  groups of C columns: with at least k nonempty groups, the k maxima are k distinct elements at or above it), the
  threshold by bisection on the key bits — only those below the highest bit where the bound and the row's maximum
  differ, one block-wide count each —, then one scan that places the selection. No candidate list and no barrier.
* ``"filter"`` (``topk_filter``) — one launch, rows up to one per multiprocessor, each cut over programs that are
  all resident at once and meet at per-row barriers (global atomics):

  1. each program loads its columns into a register block and takes the maximum of every group of C columns; the
     smallest of those maxima over the whole row (an atomic max exchange, then a barrier) is the lower bound;
  2. the columns at or above the bound (about 10% of a 32K row of index scores) are appended to the row's candidate
     list (int32 scratch ``[rows, columns]``; one atomic per block, in-block slots by a scan);
  3. the row's first program waits for every append, loads the candidates and their keys into registers, finds the
     threshold by bisection and writes the selection; then it zeroes the row's int32 header (bound, arrivals,
     candidate count), which must be zero on entry. A list longer than the register block (a weak bound, e.g.
     scores increasing with the column) selects with 4-bit histogram passes over the list in blocks.
* ``"split"`` (``topk_split``) — radix select with each row cut into chunks over enough programs for every
  multiprocessor, one launch per 8-bit digit: each program adds its chunk's digit histogram to the row's with
  atomics (int32 workspace, zeroed here), narrowing the key prefix of the threshold; the last launch writes the
  elements above the threshold and as many equal ones as are needed, with one atomic per block on two per-row
  counters.

Triton note: a ``tl.histogram`` mask that went through ``tl.reshape`` miscounted on the GPU (the interpreter was
right), so ``topk_filter._block_histogram`` masks by value instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..device import interpreting
from . import topk_bisect, topk_bisect_sm90, topk_filter, topk_split
from .topk_plan import BISECT_SM90_VECTOR, TopkPlan

__all__ = ["radix_topk"]


def radix_topk(scores: Tensor, counts: Tensor, plan: TopkPlan, out: Tensor | None = None, *,
               workspace: Tensor | None = None, header: Tensor | None = None,
               candidates: Tensor | None = None) -> Tensor:
    """Top-``plan.k`` column indices of each row among its first ``counts[t]`` scores, by ``plan``'s algorithm.

    Args:
        scores: ``[rows, columns]`` BF16 or FP32 as planned (``plan_topk``); columns ≥ ``counts[t]`` are ignored.
        counts: integer ``[rows]`` candidates per row (each ≤ columns).
        plan: the launch (``topk_plan.plan_topk``).
        out: optional int64 ``[rows, k]`` destination.
        workspace, header, candidates: the plan's int32 scratch (``plan.scratch()``: shapes, and which must be zero
            when passed — ``header``, left zero again); each is allocated here when omitted, ``workspace`` is zeroed
            here.
    Returns:
        int64 ``[rows, k]``: the selected indices (order unspecified), −1 in the slots past ``min(k, counts[t])``.
    Raises:
        ValueError: scores, scratch or a device that do not match the plan.
    """
    T = scores.shape[0]
    if out is None:
        out = torch.empty((T, plan.k), dtype=torch.int64, device=scores.device)
    if T == 0 or plan.k == 0:
        return out
    bits = _score_bits(scores, plan)
    given = {"workspace": workspace, "header": header, "candidates": candidates}
    scratch = {name: _scratch_view(given[name], shape, name, scores.device, zero)
               for name, (shape, zero) in plan.scratch().items()}
    if plan.algorithm == "bisect":
        if plan.gluon:
            return topk_bisect_sm90.launch(bits, counts, out, plan)
        return topk_bisect.launch(bits, counts, out, plan)
    if plan.algorithm == "filter":
        return topk_filter.launch(bits, counts, out, scratch["header"], scratch["candidates"], plan)
    return topk_split.launch(bits, counts, out, scratch["workspace"].zero_(), plan)


def _score_bits(scores: Tensor, plan: TopkPlan) -> Tensor:
    """The scores' bits (int16 for BF16, int32 for FP32), after checking them and the device against ``plan``."""
    if plan.interpreted != interpreting():
        raise ValueError(f"radix_topk: a plan for {'the interpreter' if plan.interpreted else 'a GPU'} cannot run "
                         f"{'in the interpreter' if interpreting() else 'on a GPU'}")
    if tuple(scores.shape) != (plan.rows, plan.columns):
        raise ValueError(f"radix_topk: scores of shape {tuple(scores.shape)}, the plan is for "
                         f"{(plan.rows, plan.columns)}")
    if plan.gluon and scores.stride(0) % BISECT_SM90_VECTOR:
        raise ValueError(f"radix_topk: the Gluon bisect reads whole {BISECT_SM90_VECTOR}-column vectors; the scores' "
                         f"row stride is {scores.stride(0)}")
    if scores.dtype == torch.bfloat16 and plan.key_bits == 16:
        return scores.view(torch.int16)
    if scores.dtype == torch.float32 and plan.key_bits == 32:
        return scores.view(torch.int32)
    raise ValueError(f"radix_topk: {scores.dtype} scores, the plan is for {plan.key_bits}-bit keys "
                     "(bfloat16: 16, float32: 32)")


def _scratch_view(t: Tensor | None, shape: tuple[int, int], what: str, device: torch.device, zero: bool) -> Tensor:
    """``shape`` int32 viewed from the caller's flat scratch ``t`` (checked), or allocated (zeroed if ``zero``)."""
    if t is None:
        return (torch.zeros if zero else torch.empty)(shape, dtype=torch.int32, device=device)
    if t.dtype != torch.int32 or t.numel() < shape[0] * shape[1]:
        raise ValueError(f"radix_topk: {what} must be int32 with >= {shape[0] * shape[1]} elements")
    return t.view(-1)[: shape[0] * shape[1]].view(shape)
