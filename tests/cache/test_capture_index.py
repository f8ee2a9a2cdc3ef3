"""The index tensors of a step's prefix captures (``dsv4.cache.capture_index``), and a layer's capture doing no host
work that would synchronise with a GPU.

``build_capture_index`` is checked against the captures' definition enumerated one position at a time (random
steps, captures at every boundary inside them, windows reaching before the step); the capture op is checked to
build no tensor from host values and read none back (on the CPU: the calls themselves; on a GPU, marked ``gpu``:
no host-device synchronisation at all in a step with captures, ``torch.cuda.set_sync_debug_mode("error")``).
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.overrides import TorchFunctionMode

import dsv4
from dsv4.cache import HybridCache
from dsv4.cache.capture_index import build_capture_index
from dsv4.ops import torch_ops

from support.prefix import embedding, layer, prompt

TINY = dsv4.ModelConfig.preset("tiny")
pytestmark = pytest.mark.usefixtures("one_thread")


def expected(captures, num_new, starts, W, m):
    """The definition, one position at a time: ring (token, row) pairs and CSA previous-half rows."""
    cu = [sum(num_new[:b]) for b in range(len(num_new))]
    ring = [(cu[b] + p - starts[b], row) for b, P, row in captures for p in range(max(starts[b], P - W), P)]
    step, tail = [], []
    for i, (b, P, _) in enumerate(captures):
        for r in range(m):
            p = P - m + r
            if p >= starts[b]:
                step.append((i * m + r, cu[b] + p - starts[b]))
            else:
                tail.append((i * m + r, i, p % m))
    return ring, step, tail


@pytest.mark.parametrize("seed", range(20))
def test_index_matches_the_definition(seed: int) -> None:
    rng = random.Random(seed)
    bs, W, m = rng.choice([(4, 3, 4), (8, 20, 4), (16, 16, 8), (16, 40, 4)])
    B = rng.randint(1, 5)
    num_new = [rng.choice([1, 2, 3, 5, 9, 17, 40, 70]) for _ in range(B)]
    starts = [rng.randrange(0, 200) for _ in range(B)]
    captures, rows = [], iter(rng.sample(range(1000), 1000))
    for b in range(B):
        for P in range((starts[b] // bs + 1) * bs, starts[b] + num_new[b], bs):  # every boundary strictly inside
            if rng.random() < 0.8:
                captures.append((b, P, next(rows)))
    index = build_capture_index(captures, num_new, starts, W, [m], torch.device("cpu"))
    if not captures:
        assert index is None
        return
    ring, step, tail = expected(captures, num_new, starts, W, m)
    assert index.rows.tolist() == [row for _, _, row in captures]
    assert index.requests.tolist() == [b for b, _, _ in captures]
    assert list(zip(index.ring_tok.tolist(), index.ring_dst.tolist())) == ring
    half = index.prev[m]
    assert list(zip(half.step_dst.tolist(), half.step_tok.tolist())) == step
    assert list(zip(half.tail_dst.tolist(), half.tail_cap.tolist(), half.tail_row.tolist())) == tail
    assert all(t.dtype == torch.int64 for t in (index.rows, index.ring_tok, half.step_dst, half.tail_row))


class HostReads(TorchFunctionMode):
    """Counts the calls that, on a GPU, copy host values to the device or read device values back (each a host
    synchronisation there)."""

    NAMES = {"tensor", "as_tensor", "item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "cpu"}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.NAMES:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def test_capture_op_builds_and_reads_no_host_values(monkeypatch) -> None:
    """A step of two requests crossing several block boundaries (some of them within m tokens after the step's
    start, so the CSA tails are read): every layer captures, and the capture op makes none of those calls."""
    cfg = TINY.replace(name="tiny-w20", window=20)
    layers = (0, 1, 2, 3, 4)
    cache = HybridCache(cfg, layers=layers, block_size=16, num_blocks=32, max_requests=2, prefix_states=16)
    ids = {"a": prompt(1, 90), "b": prompt(2, 90)}
    for rid in ids:
        cache.add_request(rid, ids[rid])
    reads, captured = HostReads(), []
    real = torch_ops.capture_prefix_states

    def watched(step, x, kv):
        captured.append(len(step.batch.prefix_captures))
        with reads:
            real(step, x, kv)

    monkeypatch.setattr(torch_ops, "capture_prefix_states", watched)
    done = {"a": 0, "b": 0}
    for plan in ({"a": 14, "b": 30}, {"a": 40, "b": 37}):
        batch = cache.prepare_forward(plan, token_ids={r: ids[r][done[r] : done[r] + n] for r, n in plan.items()})
        x = embedding(cfg)[torch.tensor([t for r, n in plan.items() for t in ids[r][done[r] : done[r] + n]])]
        for li in layers:
            layer(cfg, li).forward(x, batch, cache)
        done = {r: done[r] + n for r, n in plan.items()}
    assert captured and min(captured) > 0 and len(captured) == 2 * len(layers)
    assert reads.calls == []
    cache.check_invariants()


@pytest.mark.gpu
def test_triton_step_with_captures_makes_no_host_sync() -> None:
    """Triton backend on a GPU: ``prepare_forward`` and every layer of a step whose requests cross block
    boundaries (so each layer captures prefix states) make no host-device synchronisation."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    layers = (0, 1, 2, 3, 4)
    cache = HybridCache(TINY, layers=layers, block_size=16, num_blocks=64, max_requests=2, prefix_states=32,
                        device="cuda")
    ids = {"a": prompt(1, 200), "b": prompt(2, 200)}
    for rid in ids:
        cache.add_request(rid, ids[rid])
    emb = embedding(TINY, "cuda")
    # as the engine runs them: no input check (its finiteness test is a documented sync), NaN flags on the device
    layers_ = {li: dsv4.Attention(layer(TINY, li, "triton", "cuda").weights, TINY, li, backend="triton",
                             check_inputs=False, nan_policy="flag") for li in layers}
    at = 0
    for checked in (False, True):  # the first step compiles the kernels and moves the weights
        plan = {"a": 37, "b": 37}
        step_ids = {r: ids[r][at : at + n] for r, n in plan.items()}
        x = emb[torch.tensor([t for r in plan for t in step_ids[r]], device="cuda")]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if checked else "default")
        try:
            batch = cache.prepare_forward(plan, token_ids=step_ids)
            assert batch.prefix_captures
            for li in layers:
                layers_[li].forward(x, batch, cache)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        at += 37
    torch.cuda.synchronize()
    cache.check_invariants()
