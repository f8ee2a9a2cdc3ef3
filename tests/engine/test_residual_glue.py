"""The engine's glue around its layers: the residual add and input norm between them (``Engine.residual``,
``dsv4.engine.residual``) and the hidden states inside the decode graphs (``DecodeGraphs.hidden_in_graph``).

Every step checks the stack against its own kept tensors: layer l's input ``x_l`` is the norm of the caller's ``h``
plus the outputs ``y_0 … y_{l−1}`` (the torch glue: bit for bit; the Triton kernel: within one step of the
activation dtype), the stack's output is that sum bit for bit, and the caller's ``h`` is never written. On the CPU
the torch glue runs as is and the Triton kernel in the interpreter (a subprocess: ``TRITON_INTERPRET=1`` must be set
before any kernel is decorated); the ``gpu`` tests run a Triton engine and compare its decode-graph replays with
eager runs of the same padded batches, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dsv4
from dsv4.engine import Engine, EngineConfig, Request, make_requests
from dsv4.engine.graphs import copy_step_batch, pad_step_batch
from dsv4.engine.hidden import TokenHidden, is_graph_safe
from dsv4.engine.residual import TorchResidualStep, TritonResidualStep
from dsv4.reference.primitives import rms_norm
from support.bf16 import bf16_step
from support.interpreter import interpreted, module_in_the_interpreter

TINY = dsv4.ModelConfig.preset("tiny")
WEIGHTS = {li: dsv4.AttentionWeights.random(TINY, li, seed=10 + li) for li in range(TINY.num_layers)}


def _engine(device: str, numerics: str = "official", hidden=None, **config) -> Engine:
    cfg = EngineConfig(device=device, numerics=numerics, max_running=4, max_batched_tokens=256, block_size=64,
                       **config)
    return Engine(TINY, config=cfg, weights=WEIGHTS, hidden=hidden)


def _check_glue(eng: Engine, h_in: torch.Tensor, h_out: torch.Tensor, kept: dict, exact_x: bool) -> None:
    """The stack's x per layer and its output against the torch glue over the kept ``y``s (see the module
    docstring). ``h_in``: the caller's input as it was before the step."""
    act, eps = eng.numerics.act_dtype, eng.cfg.norm_eps
    h = h_in
    for li in eng.layer_ids:
        x, y, _ = kept[li]
        want = rms_norm(h, None, eps).to(act)
        assert x.dtype == act and x.shape == want.shape
        if exact_x:
            assert torch.equal(x, want), f"layer {li}: x is not the torch glue's"
        elif act == torch.bfloat16:
            over = (x.float() - want.float()).abs() > bf16_step(want.float())
            assert not over.any(), f"layer {li}: x more than one BF16 step from the torch glue"
        else:
            assert torch.allclose(x, want, rtol=4e-6, atol=0), f"layer {li}: x beyond a few fp32 ulps"
        h = h + y.float()
    assert torch.equal(h_out, h), "the stack's output is not h + Σ y bit for bit"


def _run_checked(eng: Engine, reqs, steps: int, exact_x: bool) -> int:
    """``steps`` steps of ``reqs`` through ``forward_layers`` (every layer kept), each checked; returns the steps
    run."""
    eng.submit(reqs)
    done = 0
    while eng.scheduler.has_work and done < steps:
        plan = eng.scheduler.schedule()
        if plan is None:
            eng.scheduler.skip_step()
            continue
        batch = eng.cache.prepare_forward(plan.plan)
        ids = eng.step_token_ids(plan.plan, [eng.scheduler.running[rid].num_computed for rid, _ in plan.plan])
        h_in = eng.hidden(ids.to(eng.device))
        h0 = h_in.clone()
        h, kept = eng.forward_layers(batch, h_in, eng.layer_ids)
        assert torch.equal(h_in, h0), "forward_layers wrote the caller's h"
        _check_glue(eng, h0, h, kept, exact_x)
        eng.scheduler.commit(plan)
        done += 1
    return done


# ----------------------------------------------------------------------------------------- CPU
def test_cpu_engine_keeps_the_torch_glue_bit_for_bit() -> None:
    eng = _engine("cpu")
    assert isinstance(eng.residual, TorchResidualStep)
    assert _run_checked(eng, make_requests(2, "uniform:8:24", 2, seed=1), steps=3, exact_x=True) == 3


def test_the_default_hidden_source_is_graph_safe_and_a_callback_is_not() -> None:
    assert is_graph_safe(_engine("cpu").hidden) and is_graph_safe(TokenHidden(8))
    assert not is_graph_safe(lambda ids: torch.zeros(ids.shape[0], 8))


test_triton_glue_in_the_interpreter = module_in_the_interpreter(Path(__file__), "-k", "interpreted")


@interpreted
def test_triton_glue_in_a_cpu_engine_interpreted() -> None:
    """The Triton glue wired into a CPU engine (torch layers): a prefill step, then decode steps. (Its fp32
    activations are ``test_residual_norm``'s.)"""
    eng = _engine("cpu")
    eng.residual = TritonResidualStep(eng.numerics.act_dtype, eng.cfg.norm_eps)
    assert _run_checked(eng, make_requests(2, "uniform:8:24", 2, seed=2), steps=3, exact_x=False) == 3


# ----------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_triton_engine_glue_on_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    eng = _engine("cuda", backend="triton", cuda_graphs="off", warmup=False)
    assert isinstance(eng.residual, TritonResidualStep)
    assert _run_checked(eng, make_requests(3, "uniform:20:150", 4, seed=3), steps=100, exact_x=False) >= 5


@pytest.mark.gpu
def test_decode_graph_replay_is_the_eager_step_of_its_padded_batch() -> None:
    """Engines A (default hidden source: captured in the graphs) and C (the same source behind a plain callable: run
    before each replay) replay their decode steps as CUDA graphs; engine B runs each of those steps eagerly on the
    same padded batch (``pad_step_batch`` → a static batch, as the graphs do). Same requests, same weights: the
    outputs and every layer's kept x and y agree bit for bit, over decode steps whose bucket shrinks as requests
    finish."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    source = TokenHidden(TINY.hidden_size, 0)
    config = dict(backend="triton", cuda_graphs="on", warmup=False, seed=0)
    A = _engine("cuda", **config)
    B = _engine("cuda", **config)
    C = _engine("cuda", hidden=lambda ids: source(ids), **config)
    engines = (A, B, C)
    layers = A.layer_ids
    for eng in engines:  # decode buckets 4, 2 and 1 as the requests finish
        eng.submit([Request(f"r{i}", p, g) for i, (p, g) in enumerate(((40, 4), (130, 7), (70, 10)))])
    A.graphs.capture(layers)
    C.graphs.capture(layers)
    assert A.graphs.hidden_in_graph and not C.graphs.hidden_in_graph
    assert isinstance(A.residual, TritonResidualStep)
    statics: dict[int, object] = {}
    replays, buckets = 0, set()
    while A.scheduler.has_work:
        plans = [eng.scheduler.schedule() for eng in engines]
        if plans[0] is None:
            for eng in engines:
                eng.scheduler.skip_step()
            continue
        assert all(p.plan == plans[0].plan for p in plans)
        batches = [eng.cache.prepare_forward(p.plan) for eng, p in zip(engines, plans)]
        starts = [A.scheduler.running[rid].num_computed for rid, _ in plans[0].plan]
        ids = A.step_token_ids(plans[0].plan, starts).cuda()
        T = batches[0].num_tokens
        if A.graphs.can_run(plans[0], batches[0]):
            assert C.graphs.can_run(plans[2], batches[2])
            h_a, kept_a = A.graphs.run(batches[0], ids, layers)
            h_a, kept_a = h_a.clone(), {li: tuple(t.clone() for t in v) for li, v in kept_a.items()}
            h_c, kept_c = C.graphs.run(batches[2], ids, layers)
            c = A.graphs.bucket(len(plans[0].plan))
            buckets.add(c)
            g = B.graphs
            if c not in statics:
                statics[c] = g._static(c)
            padded = pad_step_batch(B.cache, batches[1].request_ids, batches[1].num_new, c, g.w, g.max_blocks,
                                    g.pad_slot, g.pad_block)
            copy_step_batch(statics[c], padded)
            ids_pad = torch.cat((ids, torch.zeros(statics[c].num_tokens - T, dtype=torch.int64, device="cuda")))
            h_b, kept_b = B.forward_layers(statics[c], B.hidden(ids_pad), layers)
            for name, h, kept in (("graph", h_a, kept_a), ("graph, hidden outside", h_c, kept_c)):
                assert torch.equal(h, h_b[:T]), f"{name}: output differs from the eager padded step"
                for li in layers:
                    for part, got, want in zip(("x", "y"), kept[li][:2], kept_b[li][:2]):
                        assert torch.equal(got, want[:T]), f"{name}: layer {li} {part} differs"
            replays += 1
        else:
            for eng, batch in zip(engines, batches):
                eng.forward_layers(batch, eng.hidden(ids))
        for eng, p in zip(engines, plans):
            eng.scheduler.commit(p)
    assert replays >= 9 and buckets == {1, 2, 4}, (replays, buckets)
