"""Scratch buffers the kernels reuse from step to step (index scores, split-KV partials, staging tiles).

A kernel launcher asks for ``workspace.get(name, shape, dtype)``: the first request (or one larger than before)
allocates, every later one returns a view of the same memory. Warm-up steps therefore allocate and steady-state
steps do not, so a captured CUDA graph keeps reading and writing the same addresses.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["Workspace"]


class Workspace:
    """Named, growable scratch buffers on one device (one per ``HybridCache``, shared by its layers).

    Buffers of different names never alias; a buffer's contents are undefined when it is handed out, except for
    buffers requested with ``zero=True`` (zero on allocation, and kept zero by their users).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._buffers: dict[str, Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...] | list[int], dtype: torch.dtype, *, zero: bool = False) -> Tensor:
        """A contiguous ``shape`` tensor of ``dtype`` backed by buffer ``name`` (grown if too small).

        ``zero=True``: the buffer is zero-filled when it is (re)allocated, for kernels that expect zeros on entry and
        leave zeros on exit (e.g. the top-k's barrier counters); every user of that name must keep that contract.
        """
        nbytes = math.prod(shape) * dtype.itemsize
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < nbytes:
            if torch.cuda.is_available() and self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"workspace buffer {name!r} must grow to {nbytes} B during CUDA graph capture; run the same step "
                    "shape once eagerly before capturing"
                )
            buf = (torch.zeros if zero else torch.empty)(max(nbytes, 1), dtype=torch.uint8, device=self.device)
            self._buffers[name] = buf
        return buf[:nbytes].view(dtype).view(tuple(shape))

    def buffers(self) -> tuple[Tensor, ...]:
        """The buffers as they are now (a captured CUDA graph keeps their addresses: hold them to keep them alive
        should a later eager step grow one)."""
        return tuple(self._buffers.values())

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(b.numel() for b in self._buffers.values())

    def clear(self) -> None:
        """Drop every buffer (the next ``get`` allocates again)."""
        self._buffers.clear()
