"""The indexer's launch plan (``dsv4.kernels.indexer.plan``): the documented rules of the scores' kernel and grid and
of the top-k's algorithm, on an H200-like device (132 SMs, sm_90 with Gluon), off Hopper and in the interpreter, for
decode steps at 8K–128K context and prefill chunks. Pure host code: no GPU, no kernel runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4.kernels.indexer import scores_plan, topk_plan
from dsv4.kernels.indexer.plan import IndexerPlan, plan_indexer
from dsv4.kernels.indexer.scores_plan import plan_scores
from dsv4.kernels.indexer.topk_plan import bisect_sm90_fits, plan_topk

H200 = dict(sm_count=132, sm90=True)
OFF_HOPPER = dict(sm_count=132, sm90=False)
FLASH = dict(k=512, heads=64, key_format="mxfp4", score_dtype=torch.bfloat16, ratio=4, block_size=256,
             entries_per_page=64)


def _decode(batch: int, context: int, **device) -> IndexerPlan:
    """A decode step of ``batch`` requests at ``context`` tokens (Flash indexer, CSA ratio 4)."""
    return plan_indexer(tokens=batch, requests=batch, max_new=1, entries=context // 4, **FLASH, **device)


def _prefill(requests: int, context: int, chunk: int = 4096, **device) -> IndexerPlan:
    """``requests`` prefill chunks of ``chunk`` tokens ending at ``context``."""
    return plan_indexer(tokens=requests * chunk, requests=requests, max_new=chunk, entries=context // 4, **FLASH,
                        **device)


# ------------------------------------------------------------------------------------------------ top-k
@pytest.mark.parametrize("context,algorithm,gluon", [
    (8192, "bisect", True), (32768, "bisect", True), (65536, "bisect", True), (131072, "filter", False)])
def test_h200_decode_topk(context: int, algorithm: str, gluon: bool) -> None:
    """64 rows (decode B=64) on Hopper: the Gluon "bisect" up to 16,384 columns (64K context), "filter" beyond."""
    t = _decode(64, context, **H200).topk
    assert (t.algorithm, t.gluon, t.rows, t.columns) == (algorithm, gluon, 64, context // 4)
    if algorithm == "bisect":
        assert t.scratch() == {} and t.block == context // 4
    else:  # 2 programs per row (132 // 64), each one 16,384-column register block
        assert (t.programs_per_row, t.chunk, t.block, t.num_warps) == (2, 16384, 16384, 16)
        assert t.scratch() == {"header": ((64, 4), True), "candidates": ((64, 32768), False)}


@pytest.mark.parametrize("context,algorithm", [(8192, "bisect"), (32768, "bisect"), (65536, "filter"),
                                               (131072, "filter")])
def test_off_hopper_decode_topk(context: int, algorithm: str) -> None:
    """Off Hopper the Triton "bisect" takes decode rows up to 8,192 columns only."""
    t = _decode(64, context, **OFF_HOPPER).topk
    assert (t.algorithm, t.gluon) == (algorithm, False)


@pytest.mark.parametrize("rows,algorithm", [(8, "split"), (31, "split"), (32, "bisect"), (132, "bisect"),
                                            (133, "bisect")])
def test_decode_rows_threshold(rows: int, algorithm: str) -> None:
    """``FILTER_MIN_ROWS`` (32) to one row per SM: the decode rule; fewer: "split"; more: the prefill rule."""
    assert topk_plan.FILTER_MIN_ROWS == 32
    assert _decode(rows, 32768, **H200).topk.algorithm == algorithm
    t = _decode(rows, 131072, **H200).topk  # 32,768 columns: "filter" for decode rows, "bisect" in Triton beyond
    assert (t.algorithm, t.gluon) == {8: ("split", False), 31: ("split", False), 32: ("filter", False),
                                      132: ("filter", False), 133: ("bisect", False)}[rows]


def test_split_few_rows() -> None:
    """8 rows of 32,768 columns: "split", each row over 66 programs (4 per SM) of 512 columns (whole 1,024-column
    steps: 33 programs), 8-bit passes, a zeroed workspace of 2 histograms + 2 counters per row."""
    t = _decode(8, 131072, **H200).topk
    assert (t.algorithm, t.block, t.radix_bits, t.num_warps) == ("split", 1024, 8, 4)
    assert (t.chunk, t.programs_per_row) == (1024, 32)
    assert t.scratch() == {"workspace": ((8, 2 * 256 + 2), False)}


@pytest.mark.parametrize("context,algorithm,gluon", [
    (8192, "bisect", True), (32768, "bisect", True), (65536, "bisect", True), (131072, "bisect", False),
    (262144, "split", False)])
def test_h200_prefill_topk(context: int, algorithm: str, gluon: bool) -> None:
    """4,096 rows (a 4K-token chunk): "bisect" up to 32,768 columns — in Gluon up to 16,384 (8–32 columns per
    thread) —, "split" beyond."""
    t = _prefill(1, context, **H200).topk
    assert (t.algorithm, t.gluon) == (algorithm, gluon)


def test_fp32_scores_never_take_the_gluon_bisect() -> None:
    t = plan_topk(64, 16384, 512, torch.float32, **H200)
    assert (t.algorithm, t.gluon, t.key_bits) == ("filter", False, 32)
    assert t.scratch()["candidates"] == ((64, 16384), False)
    t = plan_topk(4096, 8192, 512, torch.float32, **H200)
    assert (t.algorithm, t.gluon) == ("bisect", False)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        plan_topk(64, 8192, 512, torch.float16, **H200)


@pytest.mark.parametrize("columns,expected", [
    (1024, True),     # 8 columns per thread (4 warps)
    (2048, True),     # 8 (8 warps)
    (8192, True),     # 16 (16 warps)
    (16384, True),    # 32
    (600, True),      # a 1,024-column block, whole 8-column vectors
    (32768, False),   # 64 per thread: the Triton kernel
    (512, False),     # 4 per thread
    (8190, False),    # not whole vectors
])
def test_gluon_bisect_by_columns_per_thread(columns: int, expected: bool) -> None:
    assert bisect_sm90_fits(16, columns) is expected
    assert not bisect_sm90_fits(32, columns)  # FP32 scores
    t = plan_topk(4096, columns, 512, torch.bfloat16, **H200)
    assert t.gluon is expected
    assert not plan_topk(4096, columns, 512, torch.bfloat16, **OFF_HOPPER).gluon


def test_fallbacks_of_an_asked_algorithm() -> None:
    """"bisect" beyond 32,768 columns runs "filter" (or "split" beyond one row per SM); "filter" beyond one row per
    SM runs "split" — except in the interpreter, which runs a row's programs one after another."""
    assert plan_topk(64, 65536, 512, torch.bfloat16, algorithm="bisect", **H200).algorithm == "filter"
    assert plan_topk(200, 65536, 512, torch.bfloat16, algorithm="bisect", **H200).algorithm == "split"
    assert plan_topk(200, 8192, 512, torch.bfloat16, algorithm="filter", **H200).algorithm == "split"
    t = plan_topk(200, 8192, 512, torch.bfloat16, algorithm="filter", sm_count=4, sm90=False, interpreted=True)
    assert (t.algorithm, t.programs_per_row) == ("filter", 1)
    with pytest.raises(ValueError, match="unknown algorithm"):
        plan_topk(64, 8192, 512, torch.bfloat16, algorithm="row", **H200)


def test_topk_bound_groups_and_fill() -> None:
    """The lower bound's groups: a power of two ≤ 64 with at least k groups per row; the −1 fill in k slots."""
    assert plan_topk(64, 8192, 512, torch.bfloat16, **H200).group == 16
    assert plan_topk(64, 32768, 512, torch.bfloat16, **H200).group == 64
    assert plan_topk(64, 8192, 2, torch.bfloat16, **H200).group == 64
    assert plan_topk(64, 8192, 512, torch.bfloat16, **H200).fill == 512
    assert plan_topk(64, 8192, 100, torch.bfloat16, **H200).fill == 128


# ------------------------------------------------------------------------------------------------ scores
@pytest.mark.parametrize("context,per_split,splits", [(8192, 8, 4), (32768, 8, 16), (65536, 8, 32),
                                                      (131072, 16, 32)])
def test_h200_decode_scores(context: int, per_split: int, splits: int) -> None:
    """Decode B=64 on Hopper: the Gluon kernel, one query per program, 64-key tiles, 128 registers; about 16
    programs per SM (33 splits per request) but at least 8 tiles per program."""
    s = _decode(64, context, **H200).scores
    assert (s.kernel, s.queries_per_program, s.block_n, s.num_warps, s.max_registers) == ("sm90", 1, 64, 4, 128)
    assert (s.tiles, s.tiles_per_split, s.splits, s.chunks) == (context // 256, per_split, splits, 1)
    assert s.grid == (splits, 1, 64)


@pytest.mark.parametrize("context,per_split,splits", [(8192, 1, 32), (32768, 4, 32), (131072, 16, 32)])
def test_off_hopper_decode_scores(context: int, per_split: int, splits: int) -> None:
    """Off Hopper: the Triton kernel, one query per program, 64-key tiles, 4 warps, 3 stages, a split's pages in
    registers (pages of 64 entries: a tile per page), at most 32 tiles per program."""
    s = _decode(64, context, **OFF_HOPPER).scores
    assert (s.kernel, s.queries_per_program, s.block_n, s.num_warps, s.num_stages) == ("triton", 1, 64, 4, 3)
    assert s.page_vector and s.max_registers == 0 and s.inline_ptx
    assert (s.tiles_per_split, s.splits) == (per_split, splits)


def test_page_vector_caps_tiles_per_program() -> None:
    """One request at 1M context off Hopper: 4,096 tiles over 2,112 wanted programs would be 2 each; with 8 SMs
    they would be 16; with one SM 256, capped at 32 (the registers holding a split's pages)."""
    s = plan_indexer(tokens=1, requests=1, max_new=1, entries=1 << 18, **FLASH, sm_count=1, sm90=False).scores
    assert (s.tiles_per_split, s.splits) == (scores_plan.MAX_TILES_PER_SPLIT, 128)


def test_prefill_scores() -> None:
    """A 4K-token chunk at 32K: Gluon 4 queries per program (N = 256), uncapped registers; Triton 4 queries, 128-key
    tiles, 8 warps (tiles of 128 keys span two 64-entry pages: no page vector)."""
    s = _prefill(1, 32768, **H200).scores
    assert (s.kernel, s.queries_per_program, s.max_registers, s.chunks) == ("sm90", 4, 0, 1024)
    assert (s.tiles, s.tiles_per_split, s.splits) == (128, 43, 3)
    t = _prefill(1, 32768, **OFF_HOPPER).scores
    assert (t.kernel, t.queries_per_program, t.block_n, t.num_warps, t.page_vector) == ("triton", 4, 128, 8, False)
    assert (t.tiles, t.tiles_per_split, t.splits) == (64, 22, 3)


@pytest.mark.parametrize("max_new,qt,registers", [(1, 1, 128), (2, 2, 168), (3, 4, 0), (4, 4, 0), (4096, 4, 0)])
def test_gluon_queries_per_program(max_new: int, qt: int, registers: int) -> None:
    s = plan_indexer(tokens=64 * max_new, requests=64, max_new=max_new, entries=8192, **FLASH, **H200).scores
    assert (s.queries_per_program, s.max_registers) == (qt, registers)


def test_heads_pad_and_gluon_limits() -> None:
    """4 heads pad to 16 (QT up to 4 → N = 64); 128 heads: one query per program; above 256 padded heads, or pages
    that are not a multiple of 64 entries: the Triton kernel."""
    base = dict(FLASH, heads=4)
    s = plan_indexer(tokens=4096, requests=1, max_new=4096, entries=8192, **base, **H200).scores
    assert (s.head_pad, s.kernel, s.queries_per_program) == (16, "sm90", 4)
    s = plan_indexer(tokens=4096, requests=1, max_new=4096, entries=8192, **dict(FLASH, heads=128), **H200).scores
    assert (s.head_pad, s.kernel, s.queries_per_program) == (128, "sm90", 1)
    s = plan_indexer(tokens=1, requests=1, max_new=1, entries=8192, **dict(FLASH, heads=300), **H200).scores
    assert s.kernel == "triton"
    s = plan_indexer(tokens=1, requests=1, max_new=1, entries=8192, **dict(FLASH, entries_per_page=32), **H200).scores
    assert (s.kernel, s.page_vector) == ("triton", False)


def test_key_formats() -> None:
    """FP8 keys take the Triton kernel on Hopper too; FP32 keys keep ``QT · HP`` ≤ 128 and 2 stages; a format without
    a kernel (nvfp4, or None) plans no scores."""
    s = plan_indexer(tokens=64, requests=64, max_new=1, entries=8192, **dict(FLASH, key_format="fp8"), **H200).scores
    assert (s.kernel, s.key_format) == ("triton", "fp8")
    s = plan_indexer(tokens=4096, requests=1, max_new=4096, entries=8192, **dict(FLASH, key_format="fp32"),
                     **H200).scores
    assert (s.kernel, s.queries_per_program, s.num_stages) == ("triton", 2, 2)
    for fmt in ("nvfp4", None):
        p = plan_indexer(tokens=64, requests=64, max_new=1, entries=8192, **dict(FLASH, key_format=fmt), **H200)
        assert p.scores is None and p.topk.algorithm == "bisect"
        assert "torch" in p.describe()
    with pytest.raises(ValueError, match="no scores kernel"):
        plan_scores(key_format="nvfp4", heads=64, requests=1, max_new=1, entries=8, ratio=4, block_size=256,
                    entries_per_page=64, **H200)


def test_nothing_to_score() -> None:
    """No entries yet (a first step shorter than the ratio) or no tokens: no scores launch; the top-k still plans
    over a one-column buffer."""
    p = plan_indexer(tokens=64, requests=64, max_new=1, entries=0, **FLASH, **H200)
    assert not p.scores.launches and p.scores.grid[0] == 0 and p.topk.columns == 1
    assert "nothing to launch" in p.describe()
    p = plan_indexer(tokens=0, requests=0, max_new=0, entries=0, **FLASH, **H200)
    assert not p.scores.launches and p.topk.rows == 0


def test_interpreter_plans() -> None:
    """The interpreter: the Triton kernels with their plain-integer paths and host-bound loops, 4 SMs; never Gluon."""
    p = plan_indexer(tokens=64, requests=64, max_new=1, entries=8192, **FLASH, sm_count=4, sm90=False,
                     interpreted=True)
    assert p.scores.kernel == "triton" and not p.scores.inline_ptx and p.scores.interpreted
    assert p.topk.interpreted and not p.topk.gluon
    with pytest.raises(ValueError, match="interpreter"):
        plan_indexer(tokens=64, requests=64, max_new=1, entries=8192, **FLASH, sm_count=4, sm90=True,
                     interpreted=True)


def test_plan_is_frozen_and_described() -> None:
    """A frozen value, equal for equal shapes (nothing else goes in); ``describe`` gives one line per launch."""
    p = _decode(64, 131072, **H200)
    assert p == _decode(64, 131072, **H200)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.topk.k = 8  # type: ignore[misc]
    lines = p.describe().splitlines()
    assert len(lines) == 2
    assert "Gluon" in lines[0] and "grid 32 × 1 × 64" in lines[0]
    assert "filter" in lines[1] and "header [64, 4] kept zero" in lines[1]


def test_indexer_plan_from_a_batch() -> None:
    """``ops.triton_indexer.indexer_plan`` reads a step's shapes: the score buffer's width is the top-k's columns."""
    pytest.importorskip("triton")
    import dsv4
    from dsv4.cache import HybridCache
    from dsv4.ops import triton_indexer as ti

    cfg = dsv4.ModelConfig.preset("tiny")
    cache = HybridCache(cfg, layers=[1], max_requests=2, num_blocks=16, block_size=32, device="cpu")
    cache.add_request("a")
    batch = cache.prepare_forward({"a": 70})
    layer = cache.layer(1)
    plan = ti.indexer_plan(layer, batch, 4, cfg.index_topk, cfg.index_n_heads, torch.bfloat16)
    assert (plan.topk.rows, plan.topk.columns) == tuple(ti.score_buffer(layer, batch, 4, torch.bfloat16).shape)
    assert plan.scores.requests == 1 and plan.scores.max_new == 70 and plan.scores.entries == batch.addressable_entries(4)
    assert plan.scores.kernel == "triton" and plan.scores.head_pad == 16
