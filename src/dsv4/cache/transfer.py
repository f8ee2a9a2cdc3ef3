"""Host → device copies that never wait for the device's queue.

``torch.tensor(values, device="cuda")`` and ``cpu_tensor.to("cuda")`` copy from pageable memory and then
synchronise the stream: the host stops until every kernel queued before has finished, so it can no longer prepare
the next launches while the device works. The cache's host-built index tensors go through ``to_device`` instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["index_tensor", "to_device"]


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """The host tensor ``t`` on ``device`` without a host synchronisation (pinned staging and an asynchronous copy
    on CUDA; the caching host allocator keeps the staging buffer alive until the copy has run)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def index_tensor(values: Sequence[int], device: torch.device) -> Tensor:
    """int64 ``[len(values)]`` on ``device``, copied without a host synchronisation (``to_device``)."""
    return to_device(torch.tensor(list(values), dtype=torch.int64), device)
