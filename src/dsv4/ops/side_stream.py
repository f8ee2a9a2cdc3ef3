"""``SideStream``: a layer step's independent stages launched on a second CUDA stream.

Two stages of a layer step share no data with the launches that follow them in the code. The writes before
attention (the compressors' GEMM, the window and compressor entries) and the query path (query projection, query
norm and RoPE, the indexer's queries) read only the layer's input and write different tensors; the ring commit
after attention and the output projection likewise. On one stream their small, latency-bound kernels run one after
another with the weight-streaming GEMMs and leave most of the GPU idle while they run; on a second stream they run
beside those GEMMs. ``SideStream`` forks and joins that second stream:

* ``run(fn, *args)``: the second stream first waits for everything launched so far on the current stream, then
  ``fn``'s launches go to it;
* leaving the ``with`` block (error or not): the current stream waits for everything launched on the second one.

Both are CUDA events only (no host synchronisation), so a CUDA graph captured over them holds the same fork and
join as edges of its graph. Where the step's plan does not overlap (CPU, the interpreter, the torch backend) both
are no-ops and ``fn`` runs in place.

Memory: ``run`` keeps its arguments referenced until the join. A tensor made on the current stream and handed
to the second one (the window KV) would otherwise go back to the caching allocator as soon as the caller drops it,
and the current stream's next allocation could overwrite it before the second stream has read it. Everything the
second stream makes is read on the current one only after the join, and every fork waits for the current stream,
so its blocks are never handed out while still read (the discipline ``torch.cuda.graph`` also needs of a capture
over several streams).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch

__all__ = ["SideStream"]

T = TypeVar("T")


@functools.lru_cache(maxsize=None)
def _side_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(index)


class SideStream:
    """A second stream beside the current one on ``device``, for one layer step (``with SideStream(...) as side``).

    Args:
        device: the step's device.
        enabled: the step's plan overlaps (``LayerPlan.overlap``); ``False``: every call runs in place.
    """

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self._main: torch.cuda.Stream | None = None
        self._side: torch.cuda.Stream | None = None
        self._held: list[Any] = []
        if enabled and device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            self._main = torch.cuda.current_stream(index)
            self._side = _side_stream(index)

    def __enter__(self) -> SideStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.join()

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` with its launches on the second stream, after everything launched so far on the current
        one (in place where not overlapping)."""
        if self._side is None or self._side == self._main:
            return fn(*args)
        self._side.wait_stream(self._main)
        self._held.append(args)
        with torch.cuda.stream(self._side):
            return fn(*args)

    def join(self) -> None:
        """The current stream waits for the second stream's launches, and ``run``'s arguments are let go (nothing
        forked: nothing happens)."""
        if self._held:
            self._main.wait_stream(self._side)
            self._held.clear()
