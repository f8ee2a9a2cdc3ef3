"""The attention plan's single rules on the CPU: which kernel (``plan.choose_kernel``), splits, key rows, merge.

The rule behind ``impl="auto"`` (measured on an H100 and an H200, ``benchmarks/RESULTS.md``): the Triton kernel off
Hopper; on Hopper, when the query and new-entry rows can be read as 16-byte words, the pipelined kernel for steps
without splits from ``PIPELINED_MIN_CHUNKS`` chunks per token, else the warp-specialized one from ``WS_MIN_CHUNKS``
chunks per split (``WS_MIN_CHUNKS_ALL`` for HCA); otherwise the serial Gluon kernel. Explicit choices are checked,
with clear errors.
"""

from __future__ import annotations

import dataclasses

import pytest

from dsv4.kernels.attention.args import rows_are_words
from dsv4.kernels.attention.plan import (PIPELINED_MIN_CHUNKS, WS_MIN_CHUNKS, WS_MIN_CHUNKS_ALL, choose_kernel,
                                         choose_merge, choose_splits, plan_attention, step_splits, use_bf16_keys)

LONG = WS_MIN_CHUNKS
LONG_ALL = WS_MIN_CHUNKS_ALL


@pytest.mark.parametrize("hopper, rows_in_words, chunks, want", [
    (False, True, LONG, "triton"),
    (False, False, 1, "triton"),
    (True, True, 1, "gluon"),
    (True, True, LONG - 1, "gluon"),
    (True, True, LONG, "gluon_ws"),
    (True, True, 10 * LONG, "gluon_ws"),
    (True, False, 10 * LONG, "gluon"),  # rows not 16-byte aligned: the serial kernel reads them as they are
])
def test_auto(hopper: bool, rows_in_words: bool, chunks: int, want: str) -> None:
    assert choose_kernel("auto", hopper, rows_in_words, chunks) == want


@pytest.mark.parametrize("chunks, all_entries, want", [
    (PIPELINED_MIN_CHUNKS, False, "gluon_pipelined"),
    (10 * LONG, True, "gluon_pipelined"),
    (PIPELINED_MIN_CHUNKS - 1, False, "gluon"),  # window-only steps (2 chunks) keep the serial kernel
    (PIPELINED_MIN_CHUNKS - 1, True, "gluon"),
])
def test_auto_unsplit(chunks: int, all_entries: bool, want: str) -> None:
    """A step without splits (its head blocks fill the GPU) takes the pipelined kernel from
    ``PIPELINED_MIN_CHUNKS`` chunks per token; with splits, or rows not 16-byte aligned, the rule above."""
    assert choose_kernel("auto", True, True, chunks, all_entries, unsplit=True) == want
    assert choose_kernel("auto", True, False, chunks, all_entries, unsplit=True) == "gluon"
    assert choose_kernel("auto", False, True, chunks, all_entries, unsplit=True) == "triton"
    split = choose_kernel("auto", True, True, chunks, all_entries, unsplit=False)
    assert split == ("gluon_ws" if chunks >= (LONG_ALL if all_entries else LONG) else "gluon")


@pytest.mark.parametrize("chunks, want", [(1, "gluon"), (LONG_ALL - 1, "gluon"), (LONG_ALL, "gluon_ws"),
                                          (LONG, "gluon_ws")])
def test_auto_all_entries(chunks: int, want: str) -> None:
    """HCA (every visible entry: contiguous chunks) takes the warp-specialized kernel from fewer chunks per split;
    CSA's entry lists keep ``WS_MIN_CHUNKS``."""
    assert LONG_ALL < LONG
    assert choose_kernel("auto", True, True, chunks, all_entries=True) == want
    assert choose_kernel("auto", True, True, chunks, all_entries=False) == ("gluon_ws" if chunks >= LONG else "gluon")
    assert choose_kernel("auto", False, True, chunks, all_entries=True) == "triton"
    assert choose_kernel("auto", True, False, chunks, all_entries=True) == "gluon"


@pytest.mark.parametrize("impl", ["triton", "gluon", "gluon_ws"])
def test_explicit_choices_are_kept(impl: str) -> None:
    assert choose_kernel(impl, True, True, 1) == impl
    assert choose_kernel(impl, True, True, 10 * LONG) == impl


@pytest.mark.parametrize("impl, hopper, rows_in_words, message", [
    ("flash", True, True, "unknown impl"),
    ("gluon", False, True, "compute capability 9.x"),
    ("gluon_ws", False, True, "compute capability 9.x"),
    ("gluon_ws", True, False, "multiples of 8"),
])
def test_bad_choices(impl: str, hopper: bool, rows_in_words: bool, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        choose_kernel(impl, hopper, rows_in_words, LONG)


def test_errors_name_the_tensors() -> None:
    """Through ``sparse_attention_fwd`` (CPU tensors: no Hopper), the error names the device and strides."""
    import torch

    pytest.importorskip("triton")
    from dsv4.kernels.attention.launch import sparse_attention_fwd

    q = torch.zeros(1, 4, 512, dtype=torch.bfloat16)
    kv = torch.zeros(1, 512, dtype=torch.bfloat16)
    i64 = torch.zeros(1, dtype=torch.int64)
    i32 = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"compute capability 9\.x \(device cpu, q strides \(2048, 512, 1\)"):
        sparse_attention_fwd(q, kv, torch.zeros(1, 584 * 128, dtype=torch.uint8),
                             torch.zeros(1, 128, dtype=torch.int32), None, torch.zeros(1, 1, dtype=torch.int32), i32,
                             i64, torch.zeros(2, dtype=torch.int32), i64, i64, torch.zeros(4), torch.zeros(32), 1.0,
                             window=128, impl="gluon")


def test_rows_are_words() -> None:
    """Strides in multiples of 8 BF16 elements and 16-byte aligned bases; a view one element in is neither."""
    import torch

    q = torch.zeros(3, 4, 520, dtype=torch.bfloat16)
    kv = torch.zeros(3, 520, dtype=torch.bfloat16)
    assert rows_are_words(q[:, :, :512], kv[:, :512])
    assert not rows_are_words(q[:, :, 1:513], kv[:, :512])  # base 2 bytes in
    assert not rows_are_words(q[:, :, :512], kv[:, 4:516])  # base 8 bytes in
    odd = torch.zeros(3, 4 * 514, dtype=torch.bfloat16).view(3, 4, 514)[:, :, :512]  # head stride 514
    assert not rows_are_words(odd, kv[:, :512])


def test_cluster_combine_choice_off_gluon() -> None:
    """Split partials are merged in clusters only by the serial Gluon kernel, where the device holds every cluster
    of the step at once: other kernels (and ``combine="kernel"``, or one split) keep the combine kernel,
    ``combine="cluster"`` there is an error naming why, and an unknown ``combine`` is refused. (The driver's answer
    itself: GPU tests.)"""
    fits = lambda n: 7 if n > 8 else 15  # noqa: E731 (an H200's answer for one-SM programs: 7 clusters of 10-16)
    for impl in ("triton", "gluon_ws"):
        assert choose_merge("auto", impl, 10, 4, fits) == "combine_kernel"
        with pytest.raises(ValueError, match="needs impl 'gluon'"):
            choose_merge("cluster", impl, 10, 4, fits)
    assert choose_merge("kernel", "gluon", 10, 4, fits) == "combine_kernel"
    assert choose_merge("auto", "gluon", 1, 4, fits) == "none"
    assert choose_merge("cluster", "gluon", 1, 4, fits) == "none"  # nothing to merge: no error
    assert choose_merge("auto", "gluon", 16, 7, fits) == "cluster" and choose_merge("cluster", "gluon", 2, 15, fits)
    assert choose_merge("auto", "gluon", 16, 8, fits) == "combine_kernel"  # 8 clusters of 16 do not fit at once
    assert choose_merge("auto", "gluon", 4, 4, None) == "combine_kernel"  # residency unknown: no clusters
    assert choose_merge("auto", "gluon", 17, 1, fits) == "combine_kernel"
    with pytest.raises(ValueError, match="2-16 splits"):
        choose_merge("cluster", "gluon", 17, 1, fits)
    with pytest.raises(ValueError, match="does not hold all 8 clusters of 16"):
        choose_merge("cluster", "gluon", 16, 8, fits)
    with pytest.raises(ValueError, match="unknown combine"):
        choose_merge("bogus", "gluon", 10, 4, fits)


def test_bf16_key_rows_choice() -> None:
    """``keys="auto"`` dequantizes a step's keys once into BF16 rows only where those rows are at most 1/8 of the
    FP8 key bytes the step reads (prefill chunks, not decode), on Hopper with a known bound on the visible entries;
    ``"bf16"`` where that cannot run is an error naming why; an unknown ``keys`` is refused."""
    # a 4K-token prefill chunk of one request (8K context: 3,072 entries) vs a 64-request decode step
    assert use_bf16_keys("auto", "auto", True, 4096, 1, 128, 3072, 640)
    assert not use_bf16_keys("auto", "auto", True, 64, 64, 128, 2048, 640)
    assert not use_bf16_keys("auto", "auto", True, 4096, 1, 128, None, 640)  # CSA without max_visible
    assert not use_bf16_keys("auto", "auto", False, 4096, 1, 128, 3072, 640)  # no Hopper / unaligned rows
    assert not use_bf16_keys("auto", "gluon_ws", True, 4096, 1, 128, 3072, 640)
    assert not use_bf16_keys("fp8", "auto", True, 4096, 1, 128, 3072, 640)
    assert use_bf16_keys("bf16", "gluon", True, 64, 64, 128, 2048, 640)  # forced: applies anywhere it can run
    with pytest.raises(ValueError, match="needs a Gluon kernel"):
        use_bf16_keys("bf16", "triton", True, 4096, 1, 128, 3072, 640)
    with pytest.raises(ValueError, match="max_visible"):
        use_bf16_keys("bf16", "auto", True, 4096, 1, 128, None, 640)
    with pytest.raises(ValueError, match="unknown keys"):
        use_bf16_keys("int8", "auto", True, 4096, 1, 128, 3072, 640)


def test_pipelined_kernel_is_an_explicit_choice_on_hopper_only() -> None:
    """``impl="gluon_pipelined"`` is a known kernel, checked like the others (Hopper, 16-byte rows)."""
    with pytest.raises(ValueError, match="compute capability 9"):
        choose_kernel("gluon_pipelined", False, True, 10)
    with pytest.raises(ValueError, match="16-byte words"):
        choose_kernel("gluon_pipelined", True, False, 10)
    assert choose_kernel("gluon_pipelined", True, True, 10) == "gluon_pipelined"


def test_pipelined_fp8_pages_need_a_short_window() -> None:
    """Over FP8 pages the pipelined kernel looks up window chunks only in an item's prologue: a plan for a longer
    window is refused with a clear error before anything launches (``impl="auto"`` never picks it there)."""
    geometry = dict(tokens=4, requests=4, heads=64, ratio=4, block_size=256, mode="list", num_compressed=512,
                    sm_count=132, sm90=True)
    with pytest.raises(ValueError, match="windows of at most 256"):
        plan_attention(window=320, impl="gluon_pipelined", keys="fp8", **geometry)
    assert plan_attention(window=320, **geometry).kernel != "gluon_pipelined"
    plan = plan_attention(window=256, impl="gluon_pipelined", keys="fp8", **geometry)
    with pytest.raises(ValueError, match="windows of at most 256"):
        dataclasses.replace(plan, window=320, chunks_per_split=plan.chunks_per_split + 1)


def test_pipelined_kernel_takes_no_splits() -> None:
    """The pipelined kernel's persistent programs share a step's items: ``step_splits`` gives it one split whatever
    ``num_splits`` asks (a split without chunks broke its warpgroups' protocol on the GPU), and a plan with splits
    is refused; the other kernels split as asked or as ``choose_splits`` says."""
    for num_splits in (None, 1, 5, 9):
        assert step_splits("gluon_pipelined", num_splits, 8, 18, 132, 1) == (1, 18)
    assert step_splits("gluon", 9, 8, 7, 132, 1) == (7, 1)  # one chunk each: no empty split
    assert step_splits("gluon", 5, 8, 18, 132, 1) == (5, 4)
    assert step_splits("auto", None, 8, 18, 132, 1) == choose_splits(8, 18, 132, 1)
    plan = plan_attention(tokens=4, requests=4, heads=64, window=128, ratio=4, block_size=256, mode="list",
                          num_compressed=512, sm_count=132, sm90=True, impl="gluon_pipelined", num_splits=5)
    assert (plan.splits, plan.chunks_per_split, plan.persistent_programs) == (1, 10, 4)
    with pytest.raises(ValueError, match="takes no splits"):
        dataclasses.replace(plan, splits=2, chunks_per_split=5, merge="combine_kernel")
