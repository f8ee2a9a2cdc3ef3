"""dsv4.engine: lengths, hidden states, the continuous-batching scheduler, the runner and its spot check."""

from __future__ import annotations

import random
import time
import types

import pytest
import torch

import dsv4
from dsv4.engine import (
    Engine,
    EngineConfig,
    HashHidden,
    LengthSpec,
    TokenHidden,
    Request,
    RequestTooLargeError,
    Scheduler,
    SchedulerConfig,
    make_requests,
    spot_check,
)
from dsv4.engine.graphs import copy_step_batch, default_batch_sizes, pad_step_batch, reserve_pad

TINY = dsv4.ModelConfig.preset("tiny")


# ------------------------------------------------------------------------------------------------ requests, hidden
def test_length_specs() -> None:
    rng = random.Random(0)
    assert LengthSpec.parse("512").sample(rng) == 512 and str(LengthSpec.parse("fixed:512")) == "512"
    u = LengthSpec.parse("uniform:10:20")
    assert all(10 <= u.sample(rng) <= 20 for _ in range(200)) and str(u) == "uniform:10:20"
    assert all(v >= 1 for v in (LengthSpec.parse("normal:3:50").sample(rng) for _ in range(200)))
    assert {LengthSpec.parse("choice:4,8").sample(rng) for _ in range(100)} == {4, 8}
    assert LengthSpec.parse("lognormal:100:0.5").max_value > 100
    assert LengthSpec.parse("0", minimum=0).sample(rng) == 0
    for bad in ("uniform:5", "uniform:9:3", "fast:3", "abc", "0"):
        with pytest.raises(ValueError):
            LengthSpec.parse(bad)
    reqs = make_requests(5, "uniform:10:20", "choice:0,3", seed=1)
    assert [r.request_id for r in reqs] == [f"req{i}" for i in range(5)]
    assert reqs == make_requests(5, "uniform:10:20", "choice:0,3", seed=1)
    assert all(r.total_len <= 12 for r in make_requests(5, 100, 100, max_total=12))
    with pytest.raises(ValueError):
        Request("x", 0, 3)


def test_token_hidden_is_a_pure_function_of_the_token_id() -> None:
    h = TokenHidden(TINY.hidden_size, seed=3)
    ids = torch.tensor([5, 9, 5, 129_279, 2**40 + 5])
    x = h(ids)
    assert x.shape == (5, TINY.hidden_size) and x.dtype == torch.float32
    assert torch.equal(x[0], x[2]) and torch.equal(x[1], h(torch.tensor([9]))[0])  # same id, same vector
    assert not torch.equal(x[0], x[1]) and not torch.equal(x[0], x[4])  # ids 2^40 apart differ too
    assert not torch.equal(x, TokenHidden(TINY.hidden_size, seed=4)(ids))
    big = h(torch.arange(4000) * 7919)
    assert abs(big.mean().item()) < 0.01 and abs(big.std().item() - 1) < 0.01


def test_prompts_share_their_group_prefix() -> None:
    reqs = make_requests(6, "uniform:3:9", 2, seed=1, shared_prefix=20, prefix_groups=2, vocab=1000)
    for i, r in enumerate(reqs):
        assert len(r.token_ids) == r.prompt_len >= 23 and all(0 <= t < 1000 for t in r.token_ids)
        assert r.token_ids[:20] == reqs[i % 2].token_ids[:20]
    assert reqs[0].token_ids[:20] != reqs[1].token_ids[:20] and reqs[0].token_ids[20:] != reqs[2].token_ids[20:]
    assert [r.token_ids for r in make_requests(3, 5, 1, seed=2)] != [r.token_ids for r in make_requests(3, 5, 1, seed=3)]


def test_hash_hidden_is_a_pure_function_of_request_and_position() -> None:
    h = HashHidden(TINY.hidden_size, seed=3)
    nums = torch.tensor([0, 0, 0, 1, 1, 7])
    pos = torch.tensor([0, 1, 2, 0, 1, 5])
    x = h(nums, pos)
    assert x.shape == (6, TINY.hidden_size) and x.dtype == torch.float32
    assert torch.equal(x[4], h(torch.tensor([1]), torch.tensor([1]))[0])  # chunking does not matter
    assert not torch.equal(x[0], x[3]) and not torch.equal(x[0], x[1])
    assert not torch.equal(x, HashHidden(TINY.hidden_size, seed=4)(nums, pos))
    big = h(torch.arange(4000) % 13, torch.arange(4000))
    assert abs(big.mean().item()) < 0.01 and abs(big.std().item() - 1) < 0.01


# ------------------------------------------------------------------------------------------------ scheduler
def _drive(sched: Scheduler, cache: dsv4.HybridCache, max_steps: int = 10_000) -> list:
    """Run the scheduler with bookkeeping only (prepare_forward, no layers)."""
    steps = []
    for _ in range(max_steps):
        if not sched.has_work:
            break
        plan = sched.schedule()
        if plan is None:
            sched.skip_step()
            continue
        cache.prepare_forward(plan.plan)  # never raises: admission reserved the blocks
        steps.append((plan, len(sched.running), cache.num_free_blocks))
        sched.commit(plan)
    return steps


def test_scheduler_budget_decode_first_and_release() -> None:
    cache = dsv4.HybridCache(TINY, layers=[1, 2], max_requests=4, num_blocks=64, block_size=64)
    sched = Scheduler(cache, SchedulerConfig(max_batched_tokens=48, decode_tokens=2))
    reqs = make_requests(9, "uniform:1:100", "uniform:0:9", seed=2)
    for r in reqs:
        sched.add(r)
    steps = _drive(sched, cache)
    assert all(r.done and r.finished_step is not None for r in reqs)
    assert [r.request_id for r in sched.finished] and len(sched.finished) == 9
    for plan, running, _ in steps:
        assert 1 <= plan.num_tokens <= 48
        assert running <= 4
        kinds = [rid in plan.decode_ids for rid, _ in plan.plan]
        assert kinds == sorted(kinds, reverse=True)  # decodes first
        assert all(n <= 2 for rid, n in plan.plan if rid in plan.decode_ids)
    assert sum(p.num_prefill_tokens for p, _, _ in steps) == sum(r.prompt_len for r in reqs)
    assert sum(p.num_decode_tokens for p, _, _ in steps) == sum(r.gen_len for r in reqs)
    # everything released
    assert cache.active_requests == [] and cache.num_free_blocks == 64 and cache.num_free_slots == 4
    cache.check_invariants()


def test_scheduler_admission_waits_for_blocks_never_crashes() -> None:
    # 7 blocks of 64 tokens: a 300-token request needs 5 blocks (ratio 4), so only one runs at a time.
    cache = dsv4.HybridCache(TINY, layers=[1, 2], max_requests=4, num_blocks=7, block_size=64)
    sched = Scheduler(cache, SchedulerConfig(max_batched_tokens=128))
    reqs = [Request(f"r{i}", 290, 10) for i in range(3)] + [Request("small", 20, 4)]
    for r in reqs:
        sched.add(r)
    steps = _drive(sched, cache)
    assert all(r.done for r in reqs)
    assert max(running for _, running, _ in steps) <= 2  # one big + at most the small one
    assert reqs[1].admitted_step >= reqs[0].finished_step  # waited for the first to release its blocks
    assert reqs[3].admitted_step >= reqs[2].admitted_step  # FCFS: no skipping ahead of the queue head
    with pytest.raises(RequestTooLargeError, match="blocks"):
        sched.add(Request("huge", 1000, 0))
    with pytest.raises(RequestTooLargeError, match="max_position"):
        sched.add(Request("long", TINY.max_position, 1))
    with pytest.raises(ValueError, match="duplicate"):
        sched.add(Request("r0", 5, 1))


def test_scheduler_arrivals() -> None:
    cache = dsv4.HybridCache(TINY, layers=[0], max_requests=2, num_blocks=0, block_size=64)
    sched = Scheduler(cache, SchedulerConfig(max_batched_tokens=16))
    late = Request("late", 4, 2, arrival_step=5)
    sched.add(Request("early", 4, 2))
    sched.add(late)
    _drive(sched, cache)
    assert late.admitted_step == 5 and late.done


def test_scheduler_prefix_caching_waits_for_the_shared_prefix() -> None:
    """Bookkeeping only: the first request of each group computes its shared prefix; the others wait until it has
    passed the prefix, then start from it (the cache snapshots the boundary inside the first one's chunk)."""
    cache = dsv4.HybridCache(TINY, layers=[1, 2], max_requests=8, num_blocks=64, block_size=64, prefix_states=8)
    sched = Scheduler(cache, SchedulerConfig(max_batched_tokens=400, prefix_caching=True))
    reqs = make_requests(6, "uniform:10:70", 2, seed=3, shared_prefix=150, prefix_groups=2)
    for r in reqs:
        sched.add(r)
    waited = False
    while sched.has_work:
        plan = sched.schedule()
        waited |= (sched.blocked_reason or "").startswith("waiting for the prefix request")
        cache.prepare_forward(plan.plan)
        sched.commit(plan)
    assert waited
    assert [r.cached_tokens for r in reqs] == [0, 0, 128, 128, 128, 128]
    for i in range(2, 6):  # admitted only once its group's first request had computed 128 tokens
        owner = reqs[i % 2]
        assert reqs[i].admitted_step > owner.admitted_step
    assert all(r.done for r in reqs) and cache.active_requests == []
    cache.check_invariants()


# ------------------------------------------------------------------------------------------------ engine
def test_engine_run_spot_check_and_figures() -> None:
    eng = Engine(TINY, config=EngineConfig(device="cpu", max_running=3, max_batched_tokens=64, block_size=64,
                                           decode_tokens=2, seed=1))
    reqs = make_requests(5, "uniform:8:64", "uniform:1:6", seed=3)
    eng.trace([reqs[0].request_id, reqs[4].request_id])
    stats = eng.run(reqs)
    s = stats.summary()
    assert s["requests_finished"] == 5
    assert s["prefill_tokens"] == sum(r.prompt_len for r in reqs)
    assert s["decode_tokens"] == sum(r.gen_len for r in reqs)
    assert s["prefill_tok_s"] > 0 and s["decode_tok_s"] > 0 and s["step_ms"]["decode"]["p50"] > 0
    assert 0 < s["cache_bytes_peak"] <= s["cache_bytes_allocated"]
    assert s["dense_bf16_bytes_at_peak"] == s["tokens_cached_at_peak"] * 4 * 1024
    assert max(r.num_requests for r in stats.steps) <= 3
    assert all(r.prefill_tokens + r.decode_tokens <= 64 for r in stats.steps)
    assert s["jit_kernels"] == 0 and s["jit_s"] == 0.0  # the torch backend compiles nothing
    assert s["prefill_tok_s_without_jit"] == s["prefill_tok_s"] and s["decode_tok_s_without_jit"] == s["decode_tok_s"]
    assert eng.cache.active_requests == []
    rows = spot_check(eng)
    assert len(rows) == 2 * TINY.num_layers
    assert all(r.passed for r in rows), [r for r in rows if not r.passed]
    from dsv4.engine.check import TOPK_SLACK

    assert all(r.tie_worst_gap <= TOPK_SLACK and (r.tie_rows > 0 or r.tie_worst_gap == 0) for r in rows)


def test_engine_prefix_caching_computes_each_shared_prefix_once() -> None:
    """Two groups of three requests sharing a 128-token prefix: each group's first request computes it, the other
    four start from it. The spot check covers a hit request over its whole sequence (prefix rows from its group's
    first request) and passes; tracing a hit request alone is refused with a clear error."""
    def run(trace: list[str]) -> tuple[Engine, dict, list]:
        eng = Engine(TINY, config=EngineConfig(device="cpu", max_running=6, max_batched_tokens=256, block_size=64,
                                               prefix_caching=True, seed=1))
        reqs = make_requests(6, 20, 3, seed=2, shared_prefix=128, prefix_groups=2)
        eng.trace(trace)
        return eng, eng.run(reqs).summary(), reqs

    eng, s, reqs = run(["req0", "req4"])
    assert [r.cached_tokens for r in reqs] == [0, 0, 128, 128, 128, 128]
    assert s["prompt_tokens"] == 6 * 148 and s["prefix_cached_tokens"] == 4 * 128
    assert s["prefill_tokens"] == s["prompt_tokens"] - s["prefix_cached_tokens"]
    assert s["prefix_requests_hit"] == 4 and s["prefix_hit_rate"] == pytest.approx(512 / 888)
    assert s["prefix_cache_bytes_peak"] > 0 and s["prefix"]["state_rows"] == 12
    assert eng.traces["req4"].prefix_from == "req0"
    rows = spot_check(eng)
    assert len(rows) == 2 * TINY.num_layers and all(r.passed for r in rows), [r for r in rows if not r.passed]
    eng, _, _ = run(["req5"])
    with pytest.raises(RuntimeError, match="cached prefix of 128 tokens that no traced request computed"):
        spot_check(eng)


def test_engine_exact_numerics_layer_subset_and_user_hidden() -> None:
    calls = []

    def hidden(ids: torch.Tensor) -> torch.Tensor:
        calls.append(int(ids.numel()))
        return torch.sin((ids[:, None] % 1009) * 0.37 + torch.arange(TINY.hidden_size)[None, :] * 0.05)

    eng = Engine(TINY, layers=[2, 1], config=EngineConfig(device="cpu", numerics="exact", max_running=2,
                                                          max_batched_tokens=40, block_size=64), hidden=hidden)
    reqs = make_requests(3, "uniform:20:50", 5, seed=4)
    eng.trace([reqs[1].request_id])
    eng.run(reqs)
    assert sum(calls) == sum(r.total_len for r in reqs)
    rows = spot_check(eng)
    assert [r.layer for r in rows] == [2, 1] and all(r.passed and r.tol == 1e-4 for r in rows)


def test_engine_rejects_bad_configs() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        Engine(TINY, config=EngineConfig(device="cpu", backend="triton"))
    with pytest.raises(ValueError):
        Engine(TINY, layers=[0, 0], config=EngineConfig(device="cpu"))
    with pytest.raises(ValueError):
        EngineConfig(cuda_graphs="maybe")
    with pytest.raises(TypeError, match="side_stream"):
        EngineConfig(side_stream="off")
    with pytest.raises(ValueError, match="cuda_graphs='on'"):
        Engine(TINY, config=EngineConfig(device="cpu", cuda_graphs="on", block_size=64)).submit(make_requests(1, 4, 1))
    assert default_batch_sizes(64) == (1, 2, 4, 8, 16, 32, 64) and default_batch_sizes(6) == (1, 2, 4, 6)


def test_padded_decode_batch_matches_unpadded() -> None:
    """The CUDA-graph padding (pad rows in the pad slot, padded tables and emit lists) changes nothing for the
    real requests: same outputs, and the next (unpadded) step still agrees, so the cache state is the same too.
    The first step runs in a 6-row bucket (3 pad rows), the second in a full 3-row bucket (no pad row). Runs eagerly
    on the CPU, through a static batch written by ``copy_step_batch`` as the graph path does.

    oneDNN is off here: on CPUs with AMX it picks BF16 GEMM kernels by row count, so 3 rows and the same 3 rows
    inside 6 differ in the last bit (seen on a Sapphire Rapids CI machine); ATen's own kernels are row-invariant,
    which keeps the comparison bit for bit."""
    with torch.backends.mkldnn.flags(enabled=False):
        _padded_decode_batch_matches_unpadded()


def _padded_decode_batch_matches_unpadded() -> None:
    weights = {li: dsv4.AttentionWeights.random(TINY, li, seed=10 + li) for li in range(TINY.num_layers)}
    engines, pads = [], []
    for _ in range(2):
        eng = Engine(TINY, config=EngineConfig(device="cpu", max_running=4, max_batched_tokens=512, block_size=64,
                                               decode_tokens=4, cache_memory=4 << 20), weights=weights)
        eng.submit(make_requests(3, "uniform:20:40", 12, seed=5))
        pads.append(reserve_pad(eng.cache, Engine.PAD_REQUEST))
        engines.append(eng)
    assert pads[0] == pads[1]
    for eng in engines:  # prefill everything
        while any(r.in_prefill for r in eng.scheduler.requests.values()):
            eng.step()
    pad_slot, pad_block = pads[0]
    statics: dict[int, object] = {}
    for step, rows in enumerate((6, 3, None)):
        outs = []
        for k, eng in enumerate(engines):
            plan = eng.scheduler.schedule()
            assert plan.is_decode_only and len(plan.plan) == 3 and all(n == 4 for _, n in plan.plan)
            batch = eng.cache.prepare_forward(plan.plan)
            ids = eng.step_token_ids(plan.plan, [eng.scheduler.running[rid].num_computed for rid, _ in plan.plan])
            if k == 1 and rows is not None:  # padded: 3 requests in a bucket of `rows` rows, wide tables
                b = pad_step_batch(eng.cache, batch.request_ids, batch.num_new, rows, 4, 8, pad_slot, pad_block)
                assert b.block_tables.shape == (rows, 8) and b.num_tokens == 4 * rows
                if hasattr(b, "emit_pad_request"):  # fixed-capacity emit metadata for graph-safe kernels
                    assert all(b.emit_pad_request[m].shape[0] == rows * -(-4 // m) for m in b.ratios)
                # as the graph path does: copy into a static batch built once from pad rows only
                if rows not in statics:
                    statics[rows] = pad_step_batch(eng.cache, [], [], rows, 4, 8, pad_slot, pad_block)
                copy_step_batch(statics[rows], b)
                pad_ids = torch.zeros(4 * rows - batch.num_tokens, dtype=torch.int64)
                h, _ = eng.forward_layers(statics[rows], eng.hidden(torch.cat((ids, pad_ids))))
                h = h[: batch.num_tokens]
            else:
                h, _ = eng.forward_layers(batch, eng.hidden(ids))
            eng.scheduler.commit(plan)
            outs.append(h)
        assert torch.equal(outs[1], outs[0])  # bit-identical on the CPU (torch backend)
    for eng in engines:
        eng.cache.check_invariants()


@pytest.mark.gpu
def test_engine_on_cuda_default_backend_and_graphs() -> None:
    eng = Engine(TINY, config=EngineConfig(device="cuda", max_running=4, max_batched_tokens=128, block_size=64))
    reqs = make_requests(6, "uniform:16:200", 24, seed=6)
    eng.trace([reqs[0].request_id, reqs[3].request_id])
    stats = eng.run(reqs)
    if eng.graph_safe:
        assert stats.summary()["graph_steps"] > 0
    rows = spot_check(eng)
    assert all(r.passed for r in rows), [r for r in rows if not r.passed]


@pytest.mark.gpu
def test_engine_steps_never_synchronise_with_the_gpu() -> None:
    """Every step of a CUDA run — admissions, prefill chunks beside decode rows, graph-replayed decode steps,
    releases — runs under ``torch.cuda.set_sync_debug_mode("error")``: the host never waits for the GPU inside a
    step, so it prepares the next step while the GPU runs this one."""
    eng = Engine(TINY, config=EngineConfig(device="cuda", max_running=4, max_batched_tokens=96, block_size=64))
    eng.run(make_requests(3, "uniform:40:150", 6, seed=2))  # compiles, captures and allocates outside the check
    step = eng.step
    steps = []

    def checked_step(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            rec = step(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        steps.append(rec)
        return rec

    eng.step = checked_step
    stats = eng.run(make_requests(7, "uniform:40:150", 12, seed=3))
    kinds = {s.kind for s in stats.steps}
    assert {"mixed", "decode"} <= kinds and any(s.graph for s in stats.steps), kinds  # admissions while decoding
    assert len([s for s in steps if s is not None]) == len(stats.steps)


def test_run_stats_take_jit_compile_time_out() -> None:
    """Steps that compiled Triton kernels: ``jit_s`` sums their compile seconds and the ``*_without_jit`` throughputs
    divide by the remaining time."""
    from dsv4.engine.runner import RunStats, StepRecord

    steps = [StepRecord(0, 1, 100, 0, 2.0, False, 100, 1, jit_seconds=1.5, jit_kernels=3),
             StepRecord(1, 1, 100, 0, 0.5, False, 200, 1),
             StepRecord(2, 1, 0, 1, 0.2, True, 201, 1, jit_seconds=0.1, jit_kernels=1),
             StepRecord(3, 1, 0, 1, 0.1, True, 202, 1)]
    s = RunStats(steps, [], wall_s=2.8, setup_s=0.0, graph_capture_s=0.0, cache_bytes_allocated=1,
                 num_layers=1).summary()
    assert s["jit_s"] == pytest.approx(1.6) and s["jit_kernels"] == 4
    assert s["prefill_tok_s"] == pytest.approx(200 / 2.5) and s["prefill_tok_s_without_jit"] == pytest.approx(200 / 1.0)
    assert s["decode_tok_s"] == pytest.approx(2 / 0.3) and s["decode_tok_s_without_jit"] == pytest.approx(2 / 0.2)


def test_jit_clock_times_compiles_between_the_hooks_and_restores_them() -> None:
    """``JitClock`` counts a compile from Triton's pre-compile hook to its post-compile hook, calls hooks that were
    installed before it, and puts them back on exit (the hooks are driven by hand: no GPU here)."""
    knobs = pytest.importorskip("triton").knobs
    from dsv4.engine.jit_clock import JitClock

    rt = knobs.runtime
    seen = []
    before, after = (lambda **kw: seen.append("before")), (lambda **kw: seen.append("after"))
    saved = (rt.jit_cache_hook, rt.jit_post_compile_hook)
    rt.jit_cache_hook, rt.jit_post_compile_hook = before, after
    try:
        with JitClock() as clock:
            assert clock.active
            for name in ("_a_kernel", "_b_kernel"):
                fn = types.SimpleNamespace(name=name)
                assert not rt.jit_cache_hook(key="k", fn=fn, repr=f"{name}[num_warps=4](x: *fp32)")  # falsy: compiles
                time.sleep(0.01)
                rt.jit_post_compile_hook(key="k", fn=fn)
        assert clock.kernels == 2 and clock.seconds >= 0.02
        assert [n for n, _ in clock.records] == ["_a_kernel", "_b_kernel"]
        assert clock.specs == ["_a_kernel[num_warps=4](x: *fp32)", "_b_kernel[num_warps=4](x: *fp32)"]
        assert all(s >= 0.01 for _, s in clock.records) and sum(s for _, s in clock.records) == clock.seconds
        assert seen == ["before", "after"] * 2
        assert (rt.jit_cache_hook, rt.jit_post_compile_hook) == (before, after)
    finally:
        rt.jit_cache_hook, rt.jit_post_compile_hook = saved
