"""Where a step's prefix captures read and write (``StepBatch.prefix_captures``), as index tensors built once per
step on the host and copied to the device without a synchronisation.

Every layer of the step snapshots its state at each capture ``(b, P, row)`` (``dsv4.ops.prefix_capture``), and
which tokens of the step, ring slots and tail rows that takes depends only on the captures, the batch's start
positions and token offsets, the window W and the CSA ratio m — never on the layer. ``HybridCache.prepare_forward``
builds them here once (``build_capture_index``) instead of every layer building index lists in Python and copying
each to the device (43 layers × a dozen synchronising copies per step on V4-Flash, each of which stalls the host
until the device has drained its queue).

Orders are those of the captures: capture i's entries precede capture i+1's, positions ascending within one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .transfer import to_device

__all__ = ["CaptureIndex", "PrevHalfIndex", "build_capture_index"]


@dataclass(frozen=True)
class PrevHalfIndex:
    """CSA (ratio m): the rows of each capture's previous-window first half, ``[P − m, P)``, flat over
    ``C · m`` (capture i's row r at ``i·m + r``). All int64 on the device.

    Attributes:
        step_dst: ``[S]`` flat rows whose position is in the step; ``step_tok`` ``[S]`` the step's token there.
        tail_dst: ``[U]`` flat rows whose position precedes the step (held in the request's tail);
            ``tail_cap`` ``[U]`` their capture, ``tail_row`` ``[U]`` their tail row (position mod m).
    """

    step_dst: Tensor
    step_tok: Tensor
    tail_dst: Tensor
    tail_cap: Tensor
    tail_row: Tensor


@dataclass(frozen=True)
class CaptureIndex:
    """A step's prefix captures as device index tensors (int64), C = number of captures.

    Attributes:
        rows: ``[C]`` the ``PrefixStates`` row of each capture.
        requests: ``[C]`` the batch index b of each capture's request (its state slot is ``batch.slots[b]``).
        ring_tok: ``[R]`` the step's tokens whose window entries replace ring slots: for capture i, positions
            ``max(s_b, P − W) … P − 1`` (``s_b`` the request's first new position).
        ring_dst: ``[R]`` the ``PrefixStates`` row each of them goes to (its capture's row).
        prev: ``{m: PrevHalfIndex}`` for each CSA ratio asked for.
    """

    rows: Tensor
    requests: Tensor
    ring_tok: Tensor
    ring_dst: Tensor
    prev: dict[int, PrevHalfIndex] = field(default_factory=dict)


def _ranges(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """Concatenated ``lo[i] … hi[i] − 1`` over i (int64 host tensors ``[C]``, ``hi ≥ lo``) → ``(owner [N], value [N])``:
    the i each value belongs to, and the value."""
    count = hi - lo
    owner = torch.repeat_interleave(torch.arange(len(lo)), count)
    first = torch.cumsum(count, 0) - count
    return owner, lo[owner] + torch.arange(int(count.sum())) - first[owner]


def build_capture_index(
    captures: Sequence[tuple[int, int, int]],
    num_new: Sequence[int],
    start_positions: Sequence[int],
    window: int,
    csa_ratios: Iterable[int],
    device: torch.device,
) -> CaptureIndex | None:
    """The index tensors of ``captures`` (``[(b, P, row)]``, ``s_b < P < s_b + num_new[b]``) for a step with these
    ``num_new`` / ``start_positions`` (plan order), on ``device``; ``None`` without captures.

    Args:
        window: the SWA window W (ring slots).
        csa_ratios: the ratios m of the cached CSA layers (a ``PrevHalfIndex`` each).
    """
    if not captures:
        return None
    new = torch.tensor(list(num_new), dtype=torch.int64)
    cu = torch.cumsum(new, 0) - new  # first token of each request in the step
    start = torch.tensor(list(start_positions), dtype=torch.int64)
    b, point, row = (torch.tensor(col, dtype=torch.int64) for col in zip(*captures))
    s, first_tok = start[b], cu[b]
    cap, pos = _ranges(torch.maximum(s, point - window), point)
    to = lambda t: to_device(t, device)  # noqa: E731
    index = CaptureIndex(rows=to(row), requests=to(b), ring_tok=to(first_tok[cap] + pos - s[cap]),
                         ring_dst=to(row[cap]))
    for m in sorted(set(csa_ratios)):
        cap_m = torch.arange(len(captures)).repeat_interleave(m)
        r = torch.arange(m).repeat(len(captures))
        p = point[cap_m] - m + r
        flat = cap_m * m + r
        in_step = p >= s[cap_m]
        index.prev[m] = PrevHalfIndex(
            step_dst=to(flat[in_step]), step_tok=to((first_tok[cap_m] + p - s[cap_m])[in_step]),
            tail_dst=to(flat[~in_step]), tail_cap=to(cap_m[~in_step]), tail_row=to((p % m)[~in_step]),
        )
    return index
