"""Wall time spent compiling Triton kernels inside timed engine steps.

The first step of each new shape compiles (or loads from Triton's on-disk cache) the kernels it specialises —
seconds each on a fresh machine — and that time lands in the step's wall time. ``JitClock`` hooks Triton's JIT
(``triton.knobs.runtime.jit_cache_hook`` before a compile, ``jit_post_compile_hook`` after) so that a run can
report how much of its time was compilation, and the throughput without it. Where triton (or those hooks) is
missing it measures nothing.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["JitClock"]


def _runtime_knobs() -> Any | None:
    try:
        from triton import knobs
    except Exception:  # noqa: BLE001 - no triton, or one without knobs: nothing to measure
        return None
    rt = getattr(knobs, "runtime", None)
    return rt if rt is not None and hasattr(rt, "jit_cache_hook") and hasattr(rt, "jit_post_compile_hook") else None


class JitClock:
    """Accumulates ``seconds`` and ``kernels`` of Triton JIT compilations while entered (a context manager);
    ``records`` lists each one as ``(kernel name, seconds)`` (a load from the disk cache counts too: it is the
    time a first launch costs either way) and ``specs`` its specialisation, in the same order (Triton's
    ``name[options](argument: type / specialisation, ...)``: what its in-memory cache keys the kernel by).

    Hooks already installed are kept and called first; leaving restores them. Not re-entrant.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.kernels = 0
        self.records: list[tuple[str, float]] = []
        self.specs: list[str] = []
        self._started: float | None = None
        self._name = ""
        self._spec = ""
        self._rt = None
        self._prev: tuple[Any, Any] = (None, None)

    @property
    def active(self) -> bool:
        """Whether the hooks are installed (triton present, inside ``with``)."""
        return self._rt is not None

    def _before(self, *args: Any, **kwargs: Any) -> Any:
        prev = self._prev[0]
        skip = prev(*args, **kwargs) if prev is not None else None
        if not skip:  # a previous hook returning True skips the compile
            fn = kwargs.get("fn")
            self._spec = str(kwargs.get("repr", "?"))
            self._name = getattr(fn, "name", "") or self._spec.split("[", 1)[0]
            self._started = time.perf_counter()
        return skip

    def _after(self, *args: Any, **kwargs: Any) -> Any:
        if self._started is not None:
            took = time.perf_counter() - self._started
            self.seconds += took
            self.kernels += 1
            self.records.append((self._name, took))
            self.specs.append(self._spec)
            self._started = None
        prev = self._prev[1]
        return prev(*args, **kwargs) if prev is not None else None

    def __enter__(self) -> "JitClock":
        rt = _runtime_knobs()
        if rt is not None:
            self._rt = rt
            self._prev = (rt.jit_cache_hook, rt.jit_post_compile_hook)
            rt.jit_cache_hook = self._before
            rt.jit_post_compile_hook = self._after
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._rt is not None:
            self._rt.jit_cache_hook, self._rt.jit_post_compile_hook = self._prev
            self._rt = None
