"""dsv4.planner (memory planner) and dsv4.bench.roofline (shared benchmark utilities) on the CPU."""

from __future__ import annotations

import math

import pytest
import torch

import dsv4
from dsv4.bench import environment, measure_copy_bandwidth, measure_matmul_rate, roofline_row, time_cuda
from dsv4.cache import plan_capacity
from dsv4.planner import context_grid, human_bytes, parse_bytes, plan_formats, request_bytes

FLASH = dsv4.ModelConfig.preset("v4-flash")


def test_parse_and_print_bytes() -> None:
    assert parse_bytes("80GiB") == 80 << 30 and parse_bytes("80 GB") == 80 * 10**9 and parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("4e9") == 4 * 10**9 and parse_bytes(17) == 17 and parse_bytes("1k") == 1024
    with pytest.raises(ValueError):
        parse_bytes("lots")
    assert human_bytes(1536) == "1.50 KiB" and human_bytes(12) == "12 B"


def test_flash_plan_per_kind_and_formats() -> None:
    plans = {p.format: p for p in plan_formats(FLASH, 8192, 80 << 30)}
    off = plans["official"]
    assert off.bytes_per_token == pytest.approx(21 * (584 + 68) / 4 + 20 * 584 / 128)  # 3514.25, SPEC §7.3
    kinds = {k.kind: k for k in off.kinds}
    assert (kinds["SWA"].layers, kinds["CSA"].layers, kinds["HCA"].layers) == (2, 21, 20)
    assert kinds["CSA"].kv_entry_bytes == 584 and kinds["CSA"].index_entry_bytes == 68
    assert kinds["SWA"].bytes_per_token == 0 and kinds["SWA"].state_bytes > 128 * 584
    assert plans["hopper"].kinds[1].index_entry_bytes == 132
    cap = plan_capacity(FLASH, 80 << 30, 8192)
    assert off.bytes_per_request == cap.bytes_per_request and off.max_requests == cap.max_requests
    assert plans["dense-bf16"].bytes_per_request == 8192 * 43 * 1024
    assert off.bytes_per_request < plans["hopper"].bytes_per_request < plans["exact"].bytes_per_request
    with pytest.raises(ValueError):
        plan_formats(FLASH, 10, 1, formats=["fp3"])


def test_request_bytes_curve() -> None:
    grid = context_grid(1 << 20)
    assert grid[0] == 1024 and grid[-1] == 1 << 20 and grid == sorted(set(grid))
    ys = [request_bytes(FLASH, L, "official") for L in grid]
    assert ys == sorted(ys)
    assert request_bytes(FLASH, 1 << 20, "dense-bf16") / ys[-1] > 10  # ~12x smaller than dense at 1M


def test_roofline_utilities_on_cpu() -> None:
    x = torch.randn(128, 128)
    s = time_cuda(lambda: x @ x, warmup=1, iters=3, device="cpu")
    assert 0 < s < 1
    bw = measure_copy_bandwidth("cpu", size_bytes=8 << 20)
    rate = measure_matmul_rate("cpu", torch.float32, n=128)
    assert bw > 1e8 and rate > 1e7
    fp8 = measure_matmul_rate("cpu", torch.float8_e4m3fn, n=64)
    assert fp8 > 0 or math.isnan(fp8)
    row = roofline_row("op", 2e-3, bytes=1e6, flops=4e9, copy_bw=1e9, mm_rate=1e12, B=8)
    assert row["us"] == pytest.approx(2000) and row["memory_us"] == pytest.approx(1000)
    assert row["compute_us"] == pytest.approx(4000) and row["bound"] == "compute"
    assert row["roofline_frac"] == pytest.approx(2.0) and row["B"] == 8 and row["gbps"] == pytest.approx(0.5)
    assert roofline_row("m", 1.0, 10, 10, 10, float("nan"))["bound"] == "memory"
    with pytest.raises(ValueError):
        roofline_row("bad", 0.0, 1, 1, 1, 1)
    env = environment("cpu")
    assert env["device_type"] == "cpu" and env["torch"] == torch.__version__ and "T" in env["date"]


def test_time_cuda_warmup_ms_is_cuda_only_on_cpu() -> None:
    calls = []
    s = time_cuda(lambda: calls.append(1), warmup=2, iters=3, device="cpu", warmup_ms=50.0)
    assert len(calls) == 5 and s >= 0  # the time-based warm-up applies to CUDA devices only


@pytest.mark.gpu
def test_time_cuda_warmup_ms_keeps_calling_on_cuda() -> None:
    """``warmup_ms`` keeps running ``fn`` untimed for that long before the timed calls (eager and graph replays)."""
    import time

    for graph in (False, True):
        runs = torch.zeros((), device="cuda")  # counts fn's executions on the device (graph replays included)
        t0 = time.perf_counter()
        time_cuda(lambda: runs.add_(1), warmup=2, iters=3, device="cuda", warmup_ms=30.0, graph=graph)
        assert time.perf_counter() - t0 >= 0.03
        # warm-up calls + timed calls + at least one 4-call round of the time-based warm-up (more in 30 ms)
        assert runs.item() >= 2 + 3 + 4, (graph, runs.item())
