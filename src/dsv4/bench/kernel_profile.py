"""Reading the torch profiler's device side (shared by ``benchmarks/profile_layer.py`` and ``profile_step.py``).

    kernels = device_events(prof)                 # kernels, copies, memsets (user annotations left out)
    name    = short_kernel_name(e.name)           # without template arguments and launch-config noise
    totals  = kernel_totals(kernels)              # [(name, launches, device µs)], the costliest first
    busy_us = union_us([(e.time_range.start, e.time_range.end) for e in kernels])
    sites   = torch_sync_sites(run)               # where run() made torch synchronise host and device
"""

from __future__ import annotations

import collections
import re
import traceback
import warnings
from typing import Any, Callable

import torch

__all__ = ["device_events", "kernel_totals", "short_kernel_name", "torch_sync_sites", "union_us"]


def short_kernel_name(name: str, width: int = 60) -> str:
    """A kernel's name without template arguments, the argument list and namespaces, at most ``width`` chars."""
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"\(.*", "", name)
    return name.split("::")[-1][:width]


def device_events(prof: Any) -> list:
    """The profiler's device events (kernels, copies, memsets) with a device time; user annotations left out."""
    return [e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time_total > 0
            and not getattr(e, "is_user_annotation", False)]


def kernel_totals(events: list, width: int = 60) -> list[tuple[str, int, float]]:
    """``(name, launches, device µs summed)`` per ``short_kernel_name`` of ``events`` (``device_events``), the
    costliest first."""
    totals: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        row = totals[short_kernel_name(e.name, width)]
        row[0] += 1
        row[1] += e.device_time_total
    return sorted(((k, n, us) for k, (n, us) in totals.items()), key=lambda r: -r[2])


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals (the time at least one of them ran)."""
    total, start, end = 0.0, None, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    return total + ((end - start) if end is not None else 0.0)


def torch_sync_sites(run: Callable[[], Any], frames: int = 4) -> collections.Counter:
    """Where ``run()`` made torch synchronise the host with a CUDA device (``torch.cuda.set_sync_debug_mode``:
    ``.item()``, pageable copies, ``nonzero`` …): a count per call chain, the innermost ``frames`` frames of the
    dsv4 package and ``benchmarks/`` first (``"(outside dsv4)"`` for a call with none)."""
    sites: collections.Counter = collections.Counter()
    shown = warnings.showwarning

    def note(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        ours = [f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()
                if "/dsv4/" in f.filename or "/benchmarks/" in f.filename][-frames - 1 : -1]
        sites[" <- ".join(reversed(ours)) or "(outside dsv4)"] += 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = note
            run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sites
