"""When ``topk.radix_topk``'s ``"bisect"`` runs the Gluon kernel (``topk_sm90``): the shape rule, and never off
Hopper (no GPU needed; the kernel itself is tested against the Triton one on the GPU:
``test_gpu_indexer.test_gpu_bisect_gluon_same_bits_as_triton``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dsv4.kernels.indexer import topk, topk_bisect_sm90 as topk_sm90  # noqa: E402


@pytest.mark.parametrize("columns,warps,expected", [
    (1024, 4, True),     # 8 columns per thread
    (2048, 8, True),
    (8192, 16, True),    # 16 per thread
    (16384, 16, True),   # 32 per thread
    (32768, 16, False),  # 64 per thread: the Triton kernel
    (512, 4, False),     # 4 per thread
])
def test_applies_by_columns_per_thread(columns: int, warps: int, expected: bool) -> None:
    assert topk_sm90.applies(16, columns, columns, columns, warps) is expected


def test_applies_needs_bf16_and_whole_vectors() -> None:
    assert not topk_sm90.applies(32, 8192, 8192, 8192, 16)  # FP32 scores
    assert not topk_sm90.applies(16, 8190, 8190, 8192, 16)  # rows not a multiple of 8 columns
    assert not topk_sm90.applies(16, 8192, 8196, 8192, 16)  # row stride not a multiple of 8


def test_never_on_the_cpu() -> None:
    assert not topk_sm90.available(torch.device("cpu"))


def test_bisect_variants_name_the_kernel() -> None:
    assert topk.VARIANTS["bisect_triton"] == dict(algorithm="bisect", gluon=False)
    assert "gluon" not in topk.VARIANTS["bisect"]
