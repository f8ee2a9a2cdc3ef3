"""Many small host arrays on the device through one transfer, as views of one buffer.

A step's index tensors (``dsv4.cache.batch``) are a few dozen arrays of a few hundred bytes each. Moved one by one,
each costs a pinned staging buffer and a copy launch on CUDA; packed, they cost one of each, and copying a whole
step into a CUDA graph's captured batch is one device copy (``StepBatch.copy_``).

Layout: the arrays of each *segment* (in the order given), grouped by dtype within the segment (int64, then
int32, then bool), every array starting on a 16-byte boundary — the alignment a tensor of its own would have and
the one Triton specialises its kernels on, so a packed tensor compiles and runs like a separate one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .transfer import to_device

__all__ = ["Packing", "pack_to_device"]

_ALIGN = 16
_DTYPES = ((np.dtype(np.int64), torch.int64), (np.dtype(np.int32), torch.int32), (np.dtype(np.bool_), torch.bool))
_PADS = {npd: [np.zeros(k, npd) for k in range(_ALIGN // npd.itemsize)] for npd, _ in _DTYPES}


@dataclass(frozen=True)
class Packing:
    """The buffer behind a set of packed tensors and what its first segment holds.

    Attributes:
        buffer: uint8 ``[nbytes]`` on the device; every packed tensor is a view of it.
        head_bytes: bytes of the first segment (``buffer[:head_bytes]`` holds exactly its arrays and padding).
        head_layout: ``((dtype, shape, byte offset), …)`` of the first segment's arrays, in order: two packings
            with equal layouts hold the same tensors at the same offsets.
        head: the first segment's tensors as packed (views of ``buffer``), in order.
    """

    buffer: Tensor
    head_bytes: int
    head_layout: tuple[tuple[np.dtype, tuple[int, ...], int], ...]
    head: tuple[Tensor, ...]


def pack_to_device(
    segments: Sequence[Sequence[np.ndarray]], device: torch.device
) -> tuple[Packing, list[list[Tensor]]]:
    """Copy ``segments`` (lists of C-contiguous int64 / int32 / bool host arrays) to ``device`` in one transfer
    (``dsv4.cache.transfer.to_device``: pinned staging on CUDA, no host synchronisation; on the CPU the packed host
    buffer itself). Returns the ``Packing`` and, per segment, the arrays as tensors (views of its buffer, same
    shapes and dtypes, in the order given)."""
    offsets: list[list[int]] = []  # per segment, per array: byte offset
    plan = []  # per segment, per dtype: (torch dtype, [array indices], [sizes with pads], byte offset, bytes)
    offset = 0
    head_bytes = 0
    for si, seg in enumerate(segments):
        groups = []
        seg_offsets = [0] * len(seg)
        for npd, td in _DTYPES:
            idx = [i for i, a in enumerate(seg) if a.dtype == npd]
            if not idx:
                continue
            per = _ALIGN // npd.itemsize
            sizes = []
            at = offset
            for i in idx:
                k = seg[i].size
                sizes += (k, -k % per)
                seg_offsets[i] = at
                at += (k + sizes[-1]) * npd.itemsize
            nbytes = sum(sizes) * npd.itemsize
            groups.append((npd, td, idx, sizes, offset, nbytes))
            offset += nbytes
        if sum(len(g[2]) for g in groups) != len(seg):
            raise TypeError(f"pack_to_device: arrays must be int64, int32 or bool, got {[a.dtype for a in seg]}")
        plan.append(groups)
        offsets.append(seg_offsets)
        if si == 0:
            head_bytes = offset
    host = torch.empty(offset, dtype=torch.uint8, pin_memory=device.type == "cuda")
    hb = host.numpy()
    for seg, groups in zip(segments, plan):
        for npd, _, idx, sizes, off, nbytes in groups:
            pieces = []
            for j, i in enumerate(idx):
                pieces += (seg[i].reshape(-1), _PADS[npd][sizes[2 * j + 1]])
            np.concatenate(pieces, out=hb[off : off + nbytes].view(npd))
    buf = to_device(host, device)
    out: list[list[Tensor]] = []
    for seg, groups in zip(segments, plan):
        views: list[Tensor | None] = [None] * len(seg)
        for _, td, idx, sizes, off, nbytes in groups:
            parts = buf[off : off + nbytes].view(td).split(sizes)
            for j, i in enumerate(idx):
                t = parts[2 * j]
                views[i] = t if seg[i].ndim == 1 else t.view(seg[i].shape)
        out.append(views)  # type: ignore[arg-type]
    if not segments:
        return Packing(buf, 0, (), ()), out
    layout = tuple(zip([a.dtype for a in segments[0]], [a.shape for a in segments[0]], offsets[0]))
    return Packing(buf, head_bytes, layout, tuple(out[0])), out
