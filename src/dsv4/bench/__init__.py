"""Benchmark utilities shared by the kernel benchmarks (``benchmarks/bench_*.py``) and ``dsv4 bench``.

See ``dsv4.bench.roofline`` for the definitions. A kernel benchmark script exposes ``run(device, quick) ->
list[dict]`` whose rows come from ``roofline_row``; ``dsv4.bench.suite`` discovers and runs them.
"""

from .roofline import (
    environment,
    git_commit,
    measure_copy_bandwidth,
    measure_matmul_rate,
    roofline_row,
    time_cuda,
)

__all__ = [
    "environment",
    "git_commit",
    "measure_copy_bandwidth",
    "measure_matmul_rate",
    "roofline_row",
    "time_cuda",
]
