"""Which kernel specialisations host code launches — recorded without compiling or launching any — and compiling
one recorded specialisation on its own.

A Triton / Gluon kernel compiles once per *specialisation* (its constexprs, the integer arguments equal to 1 or
divisible by 16, the 16-byte-aligned pointers, the launch options). Before compiling one that a process has not
seen, Triton calls ``knobs.runtime.jit_cache_hook`` with the specialisation serialised (``specialization_data``:
everything ``JITFunction.preload`` needs to compile exactly that binary); a hook returning ``True`` makes Triton
skip the compile *and the launch*.

* ``LaunchCensus`` is such a hook: inside it, host code runs as usual and every specialisation it would launch is
  recorded as a ``KernelSpec``, but no kernel runs — their outputs hold whatever the memory held. Use it only on
  synthetic state that nothing reads afterwards (the warm-up's worker processes, ``engine.compile_workers``),
  never on a cache that serves requests. A launch whose binary is already in the process's memory would bypass
  the hook and run, so the census sets the package's in-memory kernels aside while it runs.
* ``device_query()`` marks host code that needs a real binary while a census runs (``sm90_serial``'s occupancy
  question to the driver): compiles inside it happen as usual and are not recorded, and their binaries leave the
  in-memory caches again when it ends (a launch of the same specialisation must still reach the census).
* ``compile_spec`` compiles one recorded specialisation (``JITFunction.preload``) and its launcher into Triton's
  on-disk cache and this process's memory: a later launch of it (here, or in any process whose kernels hash alike
  — ``cache_keys``) finds both without compiling.

Importing this module needs no GPU and no Triton.
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["KernelSpec", "LaunchCensus", "compile_cost", "compile_spec", "device_query", "jit_function"]

_QUERYING = contextvars.ContextVar("dsv4_census_device_query", default=False)
_ACTIVE: contextvars.ContextVar["LaunchCensus | None"] = contextvars.ContextVar("dsv4_census", default=None)


@dataclass(frozen=True)
class KernelSpec:
    """One specialisation of one kernel, as Triton serialises it.

    Attributes:
        name: the kernel's full name, ``module.qualname`` (a ``dsv4`` JIT function).
        key: Triton's in-memory key of the specialisation (argument specialisations and options): two launches
            with equal keys run the same binary.
        data: ``specialization_data``, the JSON ``JITFunction.preload`` compiles from.
    """

    name: str
    key: str
    data: str

    @classmethod
    def from_data(cls, data: str) -> "KernelSpec":
        """The spec of Triton's ``specialization_data`` JSON. Raises ``ValueError`` if it is not one."""
        try:
            obj = json.loads(data)
            name, key = obj["name"], obj["key"]
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"not Triton specialization data: {e}") from None
        if not isinstance(name, str) or not isinstance(key, str):
            raise ValueError("not Triton specialization data: name and key must be strings")
        return cls(name, key, data)


@contextmanager
def device_query() -> Iterator[None]:
    """Compile for real inside (a census does not skip or record these): for host code that asks the device
    about a compiled binary (occupancy) rather than launching it."""
    token = _QUERYING.set(True)
    try:
        yield
    finally:
        _QUERYING.reset(token)
        if _ACTIVE.get() is not None:
            _set_aside_in_memory_kernels()


class LaunchCensus:
    """A context manager recording, in ``specs`` (first launch order, one per key and kernel), every kernel
    specialisation of the package launched inside it — and skipping its compile and launch (see the module
    docstring). The package's kernels already in this process's memory are set aside while it runs (they would
    launch without asking the hook) and restored after. Not re-entrant; restores the hook it replaced."""

    def __init__(self) -> None:
        self.specs: list[KernelSpec] = []
        self._seen: set[tuple[str, str]] = set()
        self._rt: Any = None
        self._prev: Any = None
        self._aside: list[tuple[dict, dict]] = []
        self._token: Any = None

    def _hook(self, *args: Any, **kwargs: Any) -> Any:
        if _QUERYING.get():
            return self._prev(*args, **kwargs) if self._prev is not None else None
        spec = KernelSpec.from_data(kwargs["compile"]["specialization_data"])
        if spec.name.startswith("dsv4.") and (spec.name, spec.key) not in self._seen:  # others: no compile_spec
            self._seen.add((spec.name, spec.key))
            self.specs.append(spec)
        return True

    def __enter__(self) -> "LaunchCensus":
        from triton import knobs

        self._rt = knobs.runtime
        self._prev = self._rt.jit_cache_hook
        self._rt.jit_cache_hook = self._hook
        self._aside = _set_aside_in_memory_kernels()
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.reset(self._token)
        self._rt.jit_cache_hook = self._prev
        self._rt = None
        for cache, kept in self._aside:
            cache.update(kept)
        self._aside = []


def _set_aside_in_memory_kernels() -> list[tuple[dict, dict]]:
    """Empty every in-memory kernel cache of the package's JIT functions (one per function and device): each cache
    with a copy of the entries it held, to restore."""
    from .cache_keys import package_jit_functions

    out = []
    for fn in package_jit_functions():
        for caches in getattr(fn, "device_caches", {}).values():
            cache = caches[0]
            out.append((cache, dict(cache)))
            cache.clear()
    return out


def jit_function(name: str) -> Any:
    """The ``dsv4`` JIT function of full name ``name`` (``module.qualname``). Raises ``KeyError`` for any other
    name: a spec never makes this process import or compile code outside the package."""
    from .cache_keys import package_jit_functions

    found = {fn._fn_name: fn for fn in package_jit_functions()}
    if name not in found:
        raise KeyError(f"{name!r} is not a JIT function of dsv4's kernels")
    return found[name]


def compile_spec(spec: KernelSpec) -> Any:
    """Compile ``spec`` on the current device (or load it from Triton's on-disk cache), build its launcher (a C
    module, cached on disk too) and load it onto the device: the compiled kernel, ready to launch."""
    fn = jit_function(spec.name)
    compiled = fn.preload(spec.data)
    compiled = compiled.result() if hasattr(compiled, "result") else compiled
    compiled._init_handles()  # the launcher: else built at the first launch, inside a step
    return compiled


def compile_cost(name: str) -> int:
    """A cost estimate of compiling kernel ``name``: the characters of its source and of every JIT function it
    calls (bigger kernels compile longer; the warm-up hands out the costliest first)."""
    from .cache_keys import callees_first, package_jit_functions

    fn = jit_function(name)
    return sum(len(f.src) for f in callees_first([fn], package_jit_functions()))
