"""Triton cache keys that do not depend on which kernel a process launched first.

A ``@triton.jit`` function's ``cache_key`` (part of the on-disk cache key of every binary compiled from it) hashes
its source, its callees' keys and the ``tl.constexpr`` globals it uses — its own and those it merges from its
callees. Triton 3.6 merges a callee's globals *before* it computes the callee's key, so a callee not hashed yet
contributes none: a kernel's key depends on whether its helpers were hashed before it, i.e. on which kernel the
process launched first. Two processes launching the same specialisation in another order then miss each other's
binaries on disk — the warm-up's compile workers and its load pass did, for the write kernels (``engine.load_misses``
reported "a worker launched the same specialisation, but the disk cache missed it").

``canonical_cache_keys`` rehashes every JIT function of the package until no key changes. At that fixed point each
function's globals are the closure over its callees, so every process reaches the same keys whatever it launched
first. ``ops.triton_ops`` calls it once, when imported (every kernel module loaded first).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

__all__ = ["callees_first", "canonical_cache_keys", "package_jit_functions"]

#: rehash passes at most (each pass completes one more level of the call graph; the package's is 4 deep)
MAX_PASSES = 8


def package_jit_functions() -> list:
    """Every ``@triton.jit`` / ``@gluon.jit`` function defined in an imported ``dsv4`` module, by qualified name."""
    from triton.runtime.jit import JITCallable

    found = {}
    for name, module in sorted(sys.modules.items()):
        if not name.startswith("dsv4.") or module is None:
            continue
        for attr, value in vars(module).items():
            if isinstance(value, JITCallable) and getattr(value, "__module__", None) == name:
                found[f"{name}.{attr}"] = value
    return [found[k] for k in sorted(found)]


def callees_first(functions: list, universe: list | None = None) -> list:
    """``functions`` and the JIT functions of ``universe`` (default: ``functions``) they call, ordered so that each
    comes after the JIT functions it names as globals (its callees, as far as its code's global names tell), found
    without parsing a source: hashed in this order, one pass reaches the fixed point and a second confirms it."""
    known = {id(f) for f in (functions if universe is None else universe)}
    seen: set[int] = set()
    order: list = []

    def visit(f) -> None:
        if id(f) in seen:
            return
        seen.add(id(f))
        fn = getattr(f, "fn", None)
        for name in getattr(getattr(fn, "__code__", None), "co_names", ()):
            callee = fn.__globals__.get(name)
            if callee is not None and id(callee) in known:
                visit(callee)
        order.append(f)

    for f in functions:
        visit(f)
    return order


def canonical_cache_keys() -> int:
    """Import every kernel module of ``dsv4.kernels``, then rehash all of the package's JIT functions, callees
    first, until their keys stop changing. Returns the passes taken (2 when the order holds). Raises
    ``RuntimeError`` if they do not settle within ``MAX_PASSES`` (a call cycle between JIT functions)."""
    import dsv4.kernels

    for info in pkgutil.walk_packages(dsv4.kernels.__path__, "dsv4.kernels."):
        importlib.import_module(info.name)
    functions = callees_first(package_jit_functions())
    previous = None
    for passes in range(1, MAX_PASSES + 1):
        for fn in functions:
            fn.hash = None
        keys = [fn.cache_key for fn in functions]
        if keys == previous:
            return passes
        previous = keys
    raise RuntimeError(f"Triton cache keys of dsv4's kernels did not settle in {MAX_PASSES} passes")
