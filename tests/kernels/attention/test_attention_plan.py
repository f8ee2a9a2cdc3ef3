"""``plan_attention``'s decisions for representative steps, on the CPU (``dsv4.kernels.attention.plan``).

The shapes are ``benchmarks/bench_attention.py``'s (Flash / Pro CSA, HCA at 128K and 1M context, window-only
layers; decode batches and 4K-token prefill chunks) on an H200-like device (132 multiprocessors, Hopper kernels) and
off Hopper. Each expected plan is worked out from the rules in ``plan``'s docstring: the most splits that keep
``tokens × head blocks × splits`` within one wave of 132 programs (at least 1 chunk per split for Gluon, 2 for
Triton), the pipelined kernel without splits from 8 chunks per token, the warp-specialized one from 32 chunks per
split (8 for HCA), BF16 key rows where they are at most 1/8 of the FP8 key bytes, clusters where they fit.
"""

from __future__ import annotations

import dataclasses

import pytest

from dsv4.kernels.attention.plan import AttentionPlan, plan_attention


def resident(n: int) -> int:
    """Resident clusters of ``n`` one-SM programs on a 132-SM GPU whose GPCs hold 7 clusters of more than 8 (an
    H200's answer for 10-16 — see ``benchmarks/cluster_occupancy.py``; illustrative for the other sizes)."""
    return 132 // n if n <= 8 else 7


H200 = dict(sm_count=132, sm90=True, resident_clusters=resident)
OFF_HOPPER = dict(sm_count=132, sm90=False)
# (heads, ratio, top-k (0: every visible entry), context before the step); window 128, blocks of 256 tokens
SHAPES = {
    "flash_csa": (64, 4, 512, 65536),
    "pro_csa": (128, 4, 1024, 65536),
    "hca_128k": (64, 128, 0, 131071),
    "hca_1m": (64, 128, 0, 1048575),
    "swa": (64, 0, 0, 65536),
}


def plan(shape: str, batch: int, new: int = 1, device: dict = H200, **requests) -> AttentionPlan:
    """The plan of ``batch`` requests × ``new`` tokens of ``shape`` (as ``ops.triton_attention`` asks for it)."""
    heads, ratio, topk, context = SHAPES[shape]
    visible = (context + new) // ratio if ratio else 0
    if not ratio:
        entries = dict(mode="window")
    elif topk:
        entries = dict(mode="list", num_compressed=min(topk, visible), max_visible=visible)
    else:
        entries = dict(mode="all", num_compressed=visible)
    return plan_attention(tokens=batch * new, requests=batch, heads=heads, window=128, ratio=ratio, block_size=256,
                          **entries, **device, **requests)


def decisions(p: AttentionPlan) -> tuple:
    return p.kernel, p.splits, p.chunks_per_split, p.keys, p.merge


@pytest.mark.parametrize("shape, batch, want", [
    # Flash CSA: 10 chunks per token (2 window + 8 top-k)
    ("flash_csa", 1, ("gluon", 10, 1, "fp8", "cluster")),
    ("flash_csa", 8, ("gluon", 10, 1, "fp8", "combine_kernel")),  # 8 clusters of 10 do not fit at once
    ("flash_csa", 64, ("gluon", 2, 5, "fp8", "cluster")),
    ("flash_csa", 128, ("gluon_pipelined", 1, 10, "fp8", "none")),  # the tokens fill the GPU: no splits
    # Pro CSA: 128 heads (two head blocks per token), 18 chunks
    ("pro_csa", 8, ("gluon", 6, 3, "fp8", "cluster")),  # 8 splits of 18 chunks: 3 each, so 6 splits
    ("pro_csa", 64, ("gluon_pipelined", 1, 18, "fp8", "none")),
    # HCA: every visible entry, 18 chunks at 128K, 130 at 1M
    ("hca_128k", 8, ("gluon", 9, 2, "fp8", "combine_kernel")),
    ("hca_128k", 64, ("gluon_ws", 2, 9, "fp8", "combine_kernel")),  # 9 chunks per split ≥ WS_MIN_CHUNKS_ALL
    ("hca_1m", 8, ("gluon_ws", 15, 9, "fp8", "combine_kernel")),
    ("hca_1m", 128, ("gluon_pipelined", 1, 130, "fp8", "none")),
    # window only: 2 chunks
    ("swa", 64, ("gluon", 2, 1, "fp8", "cluster")),
    ("swa", 128, ("gluon", 1, 2, "fp8", "none")),  # 2 chunks: below PIPELINED_MIN_CHUNKS
])
def test_decode_on_hopper(shape: str, batch: int, want: tuple) -> None:
    p = plan(shape, batch)
    assert decisions(p) == want
    assert (p.block_h, p.block_n) == (64, 64)
    assert p.items * p.splits <= 132 or p.splits == 1  # one wave
    assert p.persistent_programs == (min(p.items, 132) if p.kernel == "gluon_pipelined" else 0)


def prefill(shape: str, device: dict = H200, **requests) -> AttentionPlan:
    """A 4K-token prefill chunk of one request after 8K tokens (128K for HCA), as ``bench_attention.PREFILL``."""
    heads, ratio, topk, _ = SHAPES[shape]
    context = 131072 if ratio == 128 else 8192
    visible = (context + 4096) // ratio if ratio else 0
    entries = (dict(mode="list", num_compressed=topk, max_visible=visible) if topk
               else dict(mode="all", num_compressed=visible) if ratio else {})
    return plan_attention(tokens=4096, requests=1, heads=heads, window=128, ratio=ratio, block_size=256, **entries,
                          **device, **requests)


@pytest.mark.parametrize("shape, key_entries", [("flash_csa", 3072), ("pro_csa", 3072), ("hca_128k", 1056),
                                                ("swa", 0)])
def test_prefill_chunk_on_hopper(shape: str, key_entries: int) -> None:
    """A 4K-token prefill chunk: no splits, the step's keys dequantized once into BF16 rows (each serves thousands
    of queries), the pipelined kernel over them with one program per multiprocessor."""
    p = prefill(shape)
    assert (p.kernel, p.splits, p.keys, p.merge, p.key_entries) == ("gluon_pipelined", 1, "bf16", "none",
                                                                    key_entries)
    assert p.persistent_programs == 132


@pytest.mark.parametrize("shape, batch, want", [
    ("flash_csa", 1, ("triton", 5, 2, "fp8", "combine_kernel")),  # at least 2 chunks per Triton split
    ("flash_csa", 8, ("triton", 5, 2, "fp8", "combine_kernel")),
    ("flash_csa", 64, ("triton", 2, 5, "fp8", "combine_kernel")),
    ("flash_csa", 128, ("triton", 1, 10, "fp8", "none")),
    ("pro_csa", 64, ("triton", 1, 18, "fp8", "none")),
    ("hca_1m", 64, ("triton", 2, 65, "fp8", "combine_kernel")),
    ("swa", 8, ("triton", 1, 2, "fp8", "none")),  # 2 chunks: one split's worth
])
def test_decode_off_hopper(shape: str, batch: int, want: tuple) -> None:
    """Off Hopper the Triton kernel runs every step (FP8 pages, the combine kernel for splits)."""
    assert decisions(plan(shape, batch, device=OFF_HOPPER)) == want


def test_prefill_off_hopper_reads_the_pages() -> None:
    p = prefill("flash_csa", device=OFF_HOPPER)
    assert decisions(p) == ("triton", 1, 10, "fp8", "none") and p.persistent_programs == 0


def test_requests_off_hopper_are_refused_with_reasons() -> None:
    with pytest.raises(ValueError, match="compute capability 9.x"):
        plan("flash_csa", 8, device=OFF_HOPPER, impl="gluon")
    with pytest.raises(ValueError, match="keys='bf16' needs a Gluon kernel"):
        prefill("flash_csa", device=OFF_HOPPER, keys="bf16")
    with pytest.raises(ValueError, match="needs impl 'gluon'"):
        plan("flash_csa", 8, device=OFF_HOPPER, combine="cluster")
    with pytest.raises(ValueError, match="unknown impl"):
        plan("flash_csa", 8, impl="flash")


def test_requests_on_hopper() -> None:
    """Requests override the rules where they can run: a kernel, a split count, the key source, the merge."""
    assert decisions(plan("flash_csa", 8, impl="triton")) == ("triton", 5, 2, "fp8", "combine_kernel")
    assert decisions(plan("flash_csa", 8, impl="gluon_ws")) == ("gluon_ws", 10, 1, "fp8", "combine_kernel")
    assert decisions(plan("flash_csa", 8, num_splits=3)) == ("gluon", 3, 4, "fp8", "cluster")
    assert decisions(plan("flash_csa", 8, combine="kernel", num_splits=3))[4] == "combine_kernel"
    assert decisions(plan("flash_csa", 8, keys="bf16")) == ("gluon", 10, 1, "bf16", "combine_kernel")
    assert decisions(plan("flash_csa", 128, keys="bf16")) == ("gluon_pipelined", 1, 10, "bf16", "none")
    assert decisions(prefill("flash_csa", keys="fp8")) == ("gluon_pipelined", 1, 10, "fp8", "none")
    assert decisions(prefill("flash_csa", impl="gluon")) == ("gluon", 1, 10, "bf16", "none")
    with pytest.raises(ValueError, match="does not hold all 8 clusters of 10"):
        plan("flash_csa", 8, combine="cluster")


def test_unaligned_rows_keep_the_serial_kernel() -> None:
    """Without 16-byte q / kv_new rows neither the warp-specialized nor the pipelined kernel, nor BF16 rows."""
    assert decisions(plan("hca_1m", 128, rows_in_words=False)) == ("gluon", 1, 130, "fp8", "none")
    assert decisions(prefill("flash_csa", rows_in_words=False)) == ("gluon", 1, 10, "fp8", "none")
    with pytest.raises(ValueError, match="16-byte words"):
        plan("hca_1m", 8, rows_in_words=False, impl="gluon_ws")


def test_cluster_residency_is_asked_only_where_it_decides() -> None:
    """The device fact behind a cluster merge (the driver's answer on a GPU) is asked only for a split step of the
    serial kernel, and for its split count."""
    asked: list[int] = []

    def spy(n: int) -> int:
        asked.append(n)
        return resident(n)

    device = dict(H200, resident_clusters=spy)
    for shape, batch in (("flash_csa", 128), ("hca_1m", 8), ("flash_csa", 1), ("pro_csa", 8)):
        plan(shape, batch, device=device)
    assert asked == [10, 6]


def test_plan_is_a_pure_value() -> None:
    """The same numbers give the same (frozen, hashable) plan; no tensor, position or device is consulted."""
    a, b = plan("hca_128k", 8), plan("hca_128k", 8)
    assert a == b and hash(a) == hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.splits = 3  # type: ignore[misc]
    assert plan_attention(tokens=0, requests=0, heads=64, window=128, **H200).items == 0


def test_describe() -> None:
    text = plan("flash_csa", 8).describe()
    assert text.startswith("attention gluon: 8 tokens × 1 head block of 64")
    assert "lists of 512 entries" in text and "10 splits × 1 chunk of 64 keys" in text and "combine kernel" in text
    text = prefill("flash_csa").describe()
    assert "BF16 rows (128 + 3072 per request)" in text and "132 persistent programs" in text
    assert "\n" not in text


def test_geometry_for_the_kernels() -> None:
    p = plan("hca_1m", 8)
    assert p.constexprs == dict(WINDOW=128, RATIO=128, BLOCK_SIZE=256, PAGE_ENTRIES=2, MODE=2, SPLIT=True)
    assert p.grid == (8, 15) and p.combine_blocks == (16, 1)
    q = plan("swa", 128, device=OFF_HOPPER)
    assert q.constexprs == dict(WINDOW=128, RATIO=1, BLOCK_SIZE=256, PAGE_ENTRIES=1, MODE=0, SPLIT=False)
    p = plan("flash_csa", 128)
    assert p.grid == (128,)


@pytest.mark.parametrize("change, message", [
    (dict(kernel="gluon_ws", keys="bf16", key_entries=16384), "BF16 key rows are read by"),
    (dict(kernel="triton", merge="cluster"), "clusters merge the splits of 'gluon'"),
    (dict(merge="none"), "merge 'none' with 10 splits"),
    (dict(splits=12), "12 splits of 1 chunks for 10 chunks"),
    (dict(block_n=32), "take 64 heads and 64 keys"),
    (dict(kernel="gluon_pipelined", merge="combine_kernel"), "takes no splits"),
    (dict(persistent_programs=3), "persistent programs for 'gluon'"),
    (dict(mode="window"), "mode 'window' with 512"),
])
def test_replaced_plans_are_checked(change: dict, message: str) -> None:
    """Tests and benchmarks force plans with ``dataclasses.replace``; a plan no launcher could run is refused."""
    base = plan("flash_csa", 1)
    assert decisions(base) == ("gluon", 10, 1, "fp8", "cluster")
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(base, **change)


def test_replace_forces_a_kernel() -> None:
    """A forced plan keeps the step's geometry: here the Triton kernel with the serial kernel's splits."""
    base = plan("flash_csa", 8)
    forced = dataclasses.replace(base, kernel="triton")
    assert forced.grid == base.grid and forced.merge == "combine_kernel"
    pipelined = dataclasses.replace(plan("pro_csa", 64), persistent_programs=7)
    assert pipelined.grid == (7,)


def test_launcher_checks_a_given_plan() -> None:
    """``sparse_attention_fwd(plan=...)`` refuses, before anything runs, a plan made for another step, a plan
    together with requests, a Gluon plan off Hopper; the retired variants are no longer keywords."""
    pytest.importorskip("triton")
    import torch

    from dsv4.kernels.attention.launch import plan_for, sparse_attention_fwd

    T, H, W = 2, 4, 16
    q, kv = torch.zeros(T, H, 512, dtype=torch.bfloat16), torch.zeros(T, 512, dtype=torch.bfloat16)
    tables = torch.zeros(T, 1, dtype=torch.int32)
    step = (q, kv, torch.zeros(T, 584 * W, dtype=torch.uint8), torch.full((T, W), -1, dtype=torch.int32), None,
            tables, torch.arange(T, dtype=torch.int32), torch.zeros(T, dtype=torch.int64),
            torch.arange(T + 1, dtype=torch.int32), torch.zeros(T, dtype=torch.int64), torch.arange(T),
            torch.zeros(H), torch.zeros(32), 1.0)
    plan = plan_for(q, kv, tables, window=W)
    assert plan.kernel == "triton" and plan.mode == "window"
    with pytest.raises(ValueError, match="the plan is for"):
        sparse_attention_fwd(*step, window=W, plan=dataclasses.replace(plan, tokens=3))
    with pytest.raises(ValueError, match="the plan is for"):
        sparse_attention_fwd(*step, window=2 * W, plan=plan)
    with pytest.raises(ValueError, match="a plan or requests"):
        sparse_attention_fwd(*step, window=W, plan=plan, impl="triton")
    with pytest.raises(ValueError, match="compute capability 9.x"):
        sparse_attention_fwd(*step, window=W, plan=dataclasses.replace(plan, kernel="gluon", block_h=64))
    for retired in (dict(prefetch=True), dict(dequant="bits"), dict(split_policy="fill"), dict(bf16_math=False)):
        with pytest.raises(TypeError, match="unexpected keyword"):
            sparse_attention_fwd(*step, window=W, **retired)


def test_cluster_residency_probe_arguments() -> None:
    """``sm90_serial.resident_clusters`` compiles one cluster specialisation without tensors (a GPU asks the driver
    about it): every argument of the kernel is accounted for, pointers by their dtype."""
    pytest.importorskip("triton.experimental.gluon")
    import torch

    from dsv4.kernels.attention import sm90_serial

    kernel = sm90_serial._sparse_attention_sm90_kernel
    runtime = [p.name for p in kernel.params if not p.is_constexpr]
    constexprs = [p.name for p in kernel.params if p.is_constexpr]
    assert sorted(constexprs) == sorted(sm90_serial._PROBE_CONSTEXPRS)
    args = sm90_serial._probe_args()
    assert len(args) == len(runtime)
    for name, arg in zip(runtime, args):
        assert isinstance(arg, torch.dtype) == name.endswith("_ptr"), name
