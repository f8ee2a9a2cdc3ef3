"""Launching a Triton / Gluon kernel compiled for one CTA as thread-block clusters (Hopper).

A kernel compiled with ``num_ctas=1`` runs unchanged when launched in clusters of ``n`` CTAs along x: each CTA is
the program it always was (``program_id(0)`` is the CTA's index in the grid, so a cluster is ``n`` consecutive
programs), and the cluster only adds what the kernel asks for in inline PTX — e.g. ``barrier.cluster``, which
guarantees that the ``n`` programs run at the same time and orders their memory operations. (Compiling with
``num_ctas=n`` instead would make every layout of the kernel describe ``n`` CTAs.)

Triton's launcher reads ``num_ctas`` from the compiled kernel's packed metadata, multiplies the grid's x by it and
passes the cluster dimension; ``launch`` sets that field on the compiled kernel of the cluster's specialisation (the
kernel takes the cluster size as a constexpr, so each size is its own compiled kernel) and launches it directly —
graph-capturable like any launch. ``max_active_clusters`` asks the driver how many clusters of a compiled kernel
the GPU holds at once (a cluster's CTAs share one GPC). Importing this module needs no GPU and no Triton.
"""

from __future__ import annotations

import ctypes
from typing import Any

__all__ = ["MAX_CLUSTER", "compiled_kernel", "launch", "max_active_clusters"]

#: the largest cluster an H100 / H200 launches (above 8 it is "non-portable": the kernel must opt in)
MAX_CLUSTER = 16
_PORTABLE = 8
_CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4

_libcuda: Any = None
_active: dict[tuple[int, int], int] = {}


def _driver() -> Any:
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
    return _libcuda


def compiled_kernel(kernel: Any, grid: tuple, args: tuple, kwargs: dict) -> Any | None:
    """The compiled kernel a ``kernel[grid](*args, **kwargs)`` launch would run (compiled now if it is not yet);
    ``None`` where a JIT hook skipped the compile (``kernels.census.LaunchCensus``: nothing launches)."""
    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    if compiled is None:
        return None
    if hasattr(compiled, "result"):  # asynchronous compilation
        compiled = compiled.result()
    compiled._init_handles()
    return compiled


def _allow(compiled: Any, cluster: int) -> None:
    """Let ``compiled`` run in clusters of ``cluster`` CTAs: above 8 ("non-portable") the kernel must opt in."""
    if not 1 <= cluster <= MAX_CLUSTER:
        raise ValueError(f"cluster size must be 1…{MAX_CLUSTER}, got {cluster}")
    if cluster > _PORTABLE:
        err = _driver().cuFuncSetAttribute(ctypes.c_void_p(compiled.function),
                                           _CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
        if err != 0:
            raise RuntimeError(f"cuFuncSetAttribute(non-portable cluster size) failed: CUDA error {err}")


def _prepare(compiled: Any, cluster: int) -> None:
    """Make ``compiled`` launch in clusters of ``cluster`` CTAs (once per compiled kernel)."""
    warps, ctas, shared = compiled.packed_metadata
    if ctas == cluster:
        return
    _allow(compiled, cluster)
    compiled.packed_metadata = (warps, cluster, shared)


def launch(kernel: Any, compiled: Any | None, grid: tuple[int, ...], cluster: int, args: tuple, kwargs: dict
           ) -> None:
    """Launch ``compiled`` (``compiled_kernel(kernel, grid, args, kwargs)``: a ``@triton.jit`` / ``@gluon.jit``
    function compiled for one CTA) as ``grid[0]`` clusters of ``cluster`` consecutive programs along x
    (``grid[0] · cluster`` programs in all; ``grid[1:]`` as usual); ``None`` (a census skipped it) launches nothing.

    The cluster size must be one of the kernel's constexpr arguments (in ``kwargs``), so that each size is its own
    compiled kernel: the size is a property of the launch that this module sets on it."""
    if compiled is None:
        return
    _prepare(compiled, cluster)
    params = [kwargs[name] if name in kwargs else args[i] for i, name in enumerate(kernel.arg_names)]
    grid = tuple(grid) + (1,) * (3 - len(grid))
    compiled[grid](*params)


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def max_active_clusters(compiled: Any, cluster: int) -> int:
    """How many clusters of ``cluster`` CTAs of ``compiled`` (``compiled_kernel``) the device holds at once
    (``cuOccupancyMaxActiveClusters``; cached per compiled kernel and size); 0 when the driver cannot say."""
    key = (id(compiled), cluster)
    if key not in _active:
        warps, _, shared = compiled.packed_metadata
        attr = _LaunchAttribute()
        attr.id = _CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value[0], attr.value[1], attr.value[2] = cluster, 1, 1
        cfg = _LaunchConfig()
        cfg.grid[:] = [cluster, 1, 1]
        cfg.block[:] = [32 * warps, 1, 1]
        cfg.shared = shared
        cfg.attrs = ctypes.pointer(attr)
        cfg.num_attrs = 1
        count = ctypes.c_int(0)
        try:
            _allow(compiled, cluster)  # the driver answers 0 for a non-portable size the kernel did not allow
            err = _driver().cuOccupancyMaxActiveClusters(ctypes.byref(count), ctypes.c_void_p(compiled.function),
                                                         ctypes.byref(cfg))
        except (OSError, AttributeError, RuntimeError):
            err = -1
        _active[key] = count.value if err == 0 else 0
    return _active[key]
