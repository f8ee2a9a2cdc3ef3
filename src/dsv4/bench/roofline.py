"""Roofline measurements shared by every benchmark (kernel scripts under ``benchmarks/`` and ``dsv4 bench``).

A figure is reported as a fraction of its *roofline*: the time the op would take if it only moved its bytes at
the device's measured copy bandwidth, or only did its FLOPs at the measured matmul rate, whichever is longer::

    roofline_s    = max(bytes / copy_bw, flops / mm_rate)
    roofline_frac = roofline_s / measured_s            (1.0 = at the roofline; > 1 means the model is too coarse)

Both ceilings are measured in the same process on the same device (not taken from a datasheet), so the
fraction says how close a kernel gets to what this device really sustains.

API (all work on the CPU too, timed with ``time.perf_counter``, so tests can cover them)::

    env  = environment()                                   # device, versions, date, git commit
    bw   = measure_copy_bandwidth(device)                  # bytes/s (read + write counted)
    rate = measure_matmul_rate(device, torch.bfloat16)     # flop/s (torch.float8_e4m3fn: torch._scaled_mm)
    s    = time_cuda(fn, warmup=10, iters=50)              # median seconds of one fn() call
    row  = roofline_row("write_entries B=64", s, bytes=..., flops=..., copy_bw=bw, mm_rate=rate)

Results are cached per (device, dtype, size) in-process: calling the ``measure_*`` functions from several
benchmark scripts in one ``dsv4 bench`` run measures once.
"""

from __future__ import annotations

import datetime as _dt
import functools
import math
import os
import platform
import statistics
import subprocess
import time
from typing import Any, Callable

import torch

__all__ = [
    "environment",
    "measure_copy_bandwidth",
    "measure_matmul_rate",
    "time_cuda",
    "roofline_row",
    "git_commit",
]


def _dev(device: torch.device | str | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------------- timing
_L2_FLUSH: dict[torch.device, torch.Tensor] = {}


def time_cuda(
    fn: Callable[[], Any],
    warmup: int = 10,
    iters: int = 50,
    device: torch.device | str | None = None,
    flush_l2: bool | str = False,
    graph: bool = False,
    warmup_ms: float = 0.0,
) -> float:
    """Median wall time of one ``fn()`` call, in seconds.

    On CUDA each call is bracketed by its own pair of CUDA events (the host never waits between calls except
    once at the end), so launch overhead counts only where ``fn`` itself is launch-bound. On the CPU each call
    is timed with ``time.perf_counter``.

    Args:
        fn: the work; its return value is ignored. It must not change shapes between calls.
        warmup: untimed calls first (autotuning, allocator warm-up, lazy init).
        warmup_ms: CUDA only: after those, keep calling ``fn`` (untimed) until this many milliseconds have passed:
            the timed calls then run under sustained load (clocks as power limits leave them) rather than in a
            short burst. Either can be faster: ``benchmarks/RESULTS.md``, "Timing after a short burst or under
            sustained load", has both.
        iters: timed calls; the median is returned (robust to stragglers).
        device: where ``fn`` runs (default: CUDA if available, else CPU).
        flush_l2: CUDA only: before every timed call (outside the timed region) evict ``fn``'s data from L2 with
            a 256 MiB buffer, so ``fn`` reads its inputs from HBM rather than from a warm L2 (use for memory-bound
            kernels whose inputs would fit L2). ``True`` / ``"zero"``: overwrite the buffer — L2 is left full of
            dirty lines, which ``fn`` then writes back as it evicts them (up to an L2 of extra HBM writes: a cost
            of the method, as large as a 17 MB kernel's own traffic); ``"read"``: read it — clean lines, nothing
            to write back.
        graph: CUDA only: capture ``fn`` once in a CUDA graph (after a warm-up call on a side stream) and time
            its replays — the GPU time of the kernels without Python launch overhead, as the engine's decode
            steps run. ``fn`` must be graph-safe (no host synchronisation, no allocation that changes).
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if flush_l2 not in (False, True, "zero", "read"):
        raise ValueError(f"flush_l2 must be False, True, 'zero' or 'read', got {flush_l2!r}")
    dev = _dev(device)
    if graph and dev.type == "cuda":
        fn = _captured(fn, dev)
    for _ in range(max(0, warmup)):
        fn()
    if dev.type == "cuda" and warmup_ms > 0:
        _sync(dev)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < warmup_ms / 1e3:
            for _ in range(4):
                fn()
            _sync(dev)
    if dev.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    flush = None
    if flush_l2:
        flush = _L2_FLUSH.get(dev)
        if flush is None:
            flush = _L2_FLUSH[dev] = torch.zeros(64 << 20, dtype=torch.int32, device=dev)
    flush_sum = torch.empty((), dtype=torch.int64, device=dev) if flush_l2 == "read" else None
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    _sync(dev)
    for i in range(iters):
        if flush_sum is not None:
            torch.sum(flush, dim=0, out=flush_sum)
        elif flush is not None:
            flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    _sync(dev)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3


def _captured(fn: Callable[[], Any], dev: torch.device) -> Callable[[], Any]:
    """``fn`` captured in a CUDA graph; returns the graph's ``replay``."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        fn()  # compiles / allocates outside the capture
    torch.cuda.current_stream(dev).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


# ---------------------------------------------------------------------------------------------------- ceilings
@functools.lru_cache(maxsize=None)
def _copy_bw(dev: torch.device, size_bytes: int) -> float:
    n = size_bytes // 4
    src = torch.ones(n, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    iters = 20 if dev.type == "cuda" else 5
    s = time_cuda(lambda: dst.copy_(src), warmup=3, iters=iters, device=dev)
    return 2 * n * 4 / s


def measure_copy_bandwidth(device: torch.device | str | None = None, size_bytes: int | None = None) -> float:
    """Sustained device-memory bandwidth in bytes/s: a device-to-device copy of a large buffer, counting the
    bytes read **and** written (``2 · size_bytes / time``). This is the ceiling memory-bound kernels are
    compared with.

    Args:
        device: CUDA (default when available) or CPU.
        size_bytes: buffer size; default 1 GiB on CUDA (far beyond L2), 64 MiB on the CPU.
    """
    dev = _dev(device)
    if size_bytes is None:
        size_bytes = (1 << 30) if dev.type == "cuda" else (64 << 20)
    return _copy_bw(dev, int(size_bytes))


def _fp8_dtypes() -> tuple[torch.dtype, ...]:
    return tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


@functools.lru_cache(maxsize=None)
def _mm_rate(dev: torch.device, dtype: torch.dtype, n: int) -> float:
    g = torch.Generator(device=dev).manual_seed(0)
    if dtype in _fp8_dtypes():
        if not hasattr(torch, "_scaled_mm"):
            return math.nan
        a = torch.randn(n, n, device=dev, generator=g).to(dtype)
        b = torch.randn(n, n, device=dev, generator=g).to(dtype).t()  # column-major second operand
        one = torch.ones((), device=dev, dtype=torch.float32)

        def fn() -> Any:
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        try:
            fn()
        except (RuntimeError, NotImplementedError, TypeError):
            return math.nan
    else:
        a = torch.randn(n, n, device=dev, generator=g).to(dtype)
        b = torch.randn(n, n, device=dev, generator=g).to(dtype)

        def fn() -> Any:
            return a @ b

    iters = 20 if dev.type == "cuda" else 3
    s = time_cuda(fn, warmup=3, iters=iters, device=dev)
    return 2.0 * n**3 / s


def measure_matmul_rate(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16, n: int | None = None
) -> float:
    """Sustained dense GEMM rate in flop/s (``2 · n³ / time`` of an ``n × n × n`` product).

    ``dtype`` is the operand type: ``torch.bfloat16`` / ``float16`` / ``float32`` use ``a @ b``; FP8
    (``torch.float8_e4m3fn`` / ``float8_e5m2``) uses ``torch._scaled_mm`` with unit scales and a BF16 output.
    Returns ``math.nan`` where the device/build cannot run that dtype (e.g. FP8 before Hopper); ``roofline_row``
    then ignores the compute ceiling.

    Args:
        device: CUDA (default when available) or CPU.
        dtype: operand dtype.
        n: matrix size; default 8192 on CUDA, 512 on the CPU.
    """
    dev = _dev(device)
    if n is None:
        n = 8192 if dev.type == "cuda" else 512
    return _mm_rate(dev, dtype, int(n))


def roofline_row(
    name: str,
    seconds: float,
    bytes: float,  # noqa: A002 - the natural name in a roofline table
    flops: float,
    copy_bw: float,
    mm_rate: float,
    **extra: Any,
) -> dict[str, Any]:
    """One benchmark figure with its roofline.

    Args:
        name: what was measured (op and shape).
        seconds: measured time of one call.
        bytes: bytes the op must move to/from device memory (its minimum traffic).
        flops: floating-point operations it must do (2 per multiply-add).
        copy_bw: ``measure_copy_bandwidth`` (bytes/s).
        mm_rate: ``measure_matmul_rate`` for the op's GEMM dtype (flop/s); ``nan`` / ``0`` ignores compute.
        extra: more columns copied into the row (shape parameters, dtype, …).

    Returns:
        ``dict`` with ``name``, ``us`` (measured µs), ``bytes``, ``flops``, ``gbps`` (achieved GB/s),
        ``tflops`` (achieved TFLOP/s), ``memory_us`` / ``compute_us`` (time at each ceiling), ``roofline_us``
        (the larger), ``bound`` (``"memory"`` / ``"compute"``), ``roofline_frac`` (``roofline_us / us``), then
        ``extra``.
    """
    if not seconds > 0:
        raise ValueError(f"{name}: seconds must be > 0, got {seconds}")
    mem_s = bytes / copy_bw if copy_bw and math.isfinite(copy_bw) and copy_bw > 0 else 0.0
    cmp_s = flops / mm_rate if mm_rate and math.isfinite(mm_rate) and mm_rate > 0 else 0.0
    roof = max(mem_s, cmp_s)
    return {
        "name": name,
        "us": seconds * 1e6,
        "bytes": int(bytes),
        "flops": int(flops),
        "gbps": bytes / seconds / 1e9,
        "tflops": flops / seconds / 1e12,
        "memory_us": mem_s * 1e6,
        "compute_us": cmp_s * 1e6,
        "roofline_us": roof * 1e6,
        "bound": "compute" if cmp_s > mem_s else "memory",
        "roofline_frac": roof / seconds,
        **extra,
    }


# ---------------------------------------------------------------------------------------------------- environment
def git_commit(path: str | os.PathLike[str] | None = None) -> str | None:
    """Short commit hash of the checkout holding ``path`` (default: this package), ``+dirty`` when the tree has
    changes; ``None`` outside a git checkout or without git. Read-only (``git rev-parse`` / ``git status``)."""
    where = os.fspath(path) if path is not None else os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10
        )
        if head.returncode:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=where, capture_output=True, text=True,
            timeout=10,
        )
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: torch.device | str | None = None) -> dict[str, Any]:
    """Where and when a benchmark ran: ``device`` (GPU name, or the CPU), ``device_type``, ``torch``,
    ``triton`` (``None`` if not installed), ``cuda`` (toolkit torch was built with), ``python``, ``date`` (UTC,
    ISO 8601), ``commit`` (``git_commit()``), ``dsv4`` version."""
    from .. import __version__

    dev = _dev(device)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    else:
        name = platform.processor() or platform.machine() or "cpu"
    try:
        import triton  # noqa: PLC0415

        triton_version: str | None = triton.__version__
    except Exception:  # noqa: BLE001 - any import failure means "no usable triton"
        triton_version = None
    return {
        "device": name,
        "device_type": dev.type,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "dsv4": __version__,
    }
