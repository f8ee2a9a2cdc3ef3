"""``dsv4.bench.kernel_profile``: what the profiling benchmarks (``profile_layer.py``, ``profile_step.py``) read
from the torch profiler — the union of kernel intervals against brute force, kernel names, the device events kept —
and where torch synchronises (on a GPU)."""

from __future__ import annotations

import random
import types

import pytest
import torch

from dsv4.bench.kernel_profile import device_events, kernel_totals, short_kernel_name, torch_sync_sites, union_us


def test_union_of_intervals_equals_a_brute_force_count() -> None:
    rng = random.Random(7)
    for _ in range(200):
        spans = [(s, s + rng.randint(0, 9)) for s in (rng.randint(0, 60) for _ in range(rng.randint(0, 12)))]
        covered = {t for s, e in spans for t in range(s, e)}  # unit cells [t, t + 1) inside some span
        assert union_us([(float(s), float(e)) for s, e in spans]) == len(covered)


def test_kernel_names_lose_templates_arguments_and_namespaces() -> None:
    assert short_kernel_name("void at::native::vectorized_elementwise_kernel<4, Op>(int, Op, Arr)") == \
        "vectorized_elementwise_kernel"
    assert short_kernel_name("_pipelined_kernel") == "_pipelined_kernel"
    assert short_kernel_name("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", width=9) == "nvjet_sm9"


def test_device_events_keep_timed_device_work_only() -> None:
    def ev(dev: str, t: float, note: bool = False):
        return types.SimpleNamespace(device_type=types.SimpleNamespace(name=dev), device_time_total=t,
                                     is_user_annotation=note, name=f"{dev}{t}")

    events = [ev("CUDA", 3.0), ev("CPU", 5.0), ev("CUDA", 0.0), ev("CUDA", 2.0, note=True), ev("CUDA", 1.5)]
    prof = types.SimpleNamespace(events=lambda: events)
    assert [e.name for e in device_events(prof)] == ["CUDA3.0", "CUDA1.5"]


def test_kernel_totals_count_and_sum_per_short_name_costliest_first() -> None:
    def ev(name: str, us: float):
        return types.SimpleNamespace(name=name, device_time_total=us)

    events = [ev("void ns::gemm<1>(int)", 5.0), ev("_norm_kernel", 1.0), ev("gemm<2>", 4.0), ev("_norm_kernel", 2.5)]
    assert kernel_totals(events) == [("gemm", 2, 9.0), ("_norm_kernel", 2, 3.5)]
    assert kernel_totals([]) == []


@pytest.mark.gpu
def test_gpu_sync_sites_name_the_synchronising_line() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.ones(4, device="cuda")
    assert not torch_sync_sites(lambda: (x * 2).sum())  # launches only
    sites = torch_sync_sites(lambda: (x.sum().item(), x.tolist()))
    assert sum(sites.values()) >= 2
