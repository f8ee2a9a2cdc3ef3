"""Differential fuzz (issue 35): random workloads through the cache and the real layers, against the reference.

Each workload (seeded: ``random.Random(seed)``, one per seed) builds a ``HybridCache`` of the tiny preset's SWA,
CSA and HCA layers (torch backend, CPU) with a random pool size, slot count, block size, token budget and numerics
(``exact`` for three workloads in four, ``official`` for the rest), then takes random actions:

* add requests (random hidden states), run steps of random plans (prefill chunks and 1–4-token decodes, several
  requests per step), finish requests;
* preempt a request (``preempt_request``: save + release) and later restore it (``restore_request``), possibly
  into other blocks and another slot, possibly under another id;
* inject bad calls, each of which must raise its documented error and leave the cache byte-identical
  (``HybridCache.snapshot`` / ``assert_same``): NaN or misshapen inputs, finite inputs that overflow inside a layer
  (``NonFiniteError``, rolled back), a layer running a step twice, a stale batch, a new step while a step is
  partly run, plans with unknown ids or zero counts, corrupted snapshots, duplicate or unknown ids.

Every layer's output for every token a request ran is compared with ``dsv4.reference.forward`` of the request's
whole sequence (``support.oracle.check_against_reference``: exact numerics to 1e-5, official to 5e-3; CSA
top-k up to ties), when the request finishes, is preempted, or at the end of the workload.

``DSV4_FUZZ_WORKLOADS`` sets the number of workloads (default 200, the CI setting).
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

import dsv4
from dsv4.cache import (
    CacheFullError,
    CorruptSnapshotError,
    DuplicateRequestError,
    HybridCache,
    InvalidPlanError,
    NonFiniteError,
    RequestSnapshot,
    StaleBatchError,
    StepOrderError,
    UnknownRequestError,
)
from dsv4.layer import Attention

from support.oracle import check_against_reference

TINY = dsv4.ModelConfig.preset("tiny")
LAYERS = (0, 1, 2)  # SWA, CSA (ratio 4), HCA (ratio 16)
MAX_LEN = 64  # tokens per request at most
WORKLOADS = int(os.environ.get("DSV4_FUZZ_WORKLOADS", "200"))
TOLERANCE = {"exact": (1e-5, 1e-5), "official": (5e-3, 2**-5)}  # (relative error, top-k tie tolerance)

WEIGHTS = {li: dsv4.AttentionWeights.random(TINY, li, seed=900 + li) for li in LAYERS}

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass
class Req:
    """One request of a workload: its hidden states and what every layer returned for its tokens so far."""

    x: torch.Tensor  # [length, d]
    done: int = 0
    y: dict[int, list[torch.Tensor]] = field(default_factory=lambda: {li: [] for li in LAYERS})
    idx: dict[int, list[torch.Tensor]] = field(default_factory=lambda: {li: [] for li in LAYERS})

    @property
    def left(self) -> int:
        return self.x.shape[0] - self.done


class Workload:
    """One random workload (see the module docstring); ``stats`` counts what it did."""

    def __init__(self, seed: int, layers: dict[int, Attention]) -> None:
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.layers = layers
        self.numerics = "official" if seed % 4 == 3 else "exact"
        self.cache = HybridCache(
            TINY, layers=LAYERS, max_requests=self.rng.randint(1, 3), num_blocks=self.rng.randint(2, 8),
            block_size=self.rng.choice([16, 32]), numerics=self.numerics,
            max_step_tokens=self.rng.choice([None, 16, 40]),
        )
        self.live: dict[str, Req] = {}
        self.parked: dict[str, tuple[RequestSnapshot, Req]] = {}
        self.last_batch: dsv4.StepBatch | None = None
        self.next_id = 0
        self.stats: Counter[str] = Counter()

    # ---------------------------------------------------------------- checks
    def refused(self, exc: type[BaseException], call: Callable[[], object]) -> None:
        """``call`` raises exactly ``exc`` and changes nothing in the cache."""
        before = self.cache.snapshot()
        with pytest.raises(BaseException) as info:
            call()
        assert type(info.value) is exc, f"expected {exc.__name__}, got {type(info.value).__name__}: {info.value}"
        self.cache.assert_same(before)
        self.stats["bad calls"] += 1

    def verify(self, req: Req) -> None:
        """Every recorded output of ``req`` against the reference of its sequence so far."""
        if not req.done:
            return
        tol, tie = TOLERANCE[self.numerics]
        for li in LAYERS:
            y = torch.cat(req.y[li])
            width = max(i.shape[1] for i in req.idx[li])
            idx = torch.cat([torch.nn.functional.pad(i, (0, width - i.shape[1]), value=-1) for i in req.idx[li]])
            check_against_reference(WEIGHTS[li], TINY, li, req.x[: req.done], y, idx, self.numerics, tol, 0.5,
                                    tie_rel=tie)
        self.stats["tokens verified"] += req.done

    # ---------------------------------------------------------------- actions
    def run(self) -> Counter[str]:
        for _ in range(self.rng.randint(20, 34)):
            action = self.rng.choices(["add", "step", "preempt", "restore", "finish", "bad"], [3, 10, 1, 3, 1, 2])[0]
            getattr(self, action)()
        for rid in list(self.live):
            self.finish(rid)
        for _, req in self.parked.values():
            self.verify(req)
        self.cache.check_invariants()
        assert self.cache.memory_in_use() == 0
        self.stats["workloads"] += 1
        return self.stats

    def add(self) -> None:
        if self.cache.num_free_slots == 0:
            return self.bad()
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.cache.add_request(rid)
        self.live[rid] = Req(torch.randn(self.rng.randint(1, MAX_LEN), TINY.hidden_size, generator=self.gen))

    def plan(self) -> dict[str, int]:
        ready = [rid for rid, r in self.live.items() if r.left]
        chosen = self.rng.sample(ready, self.rng.randint(1, len(ready)))
        budget = self.cache.max_step_tokens or 10**9
        plan = {}
        for rid in chosen:
            n = min(self.live[rid].left, self.rng.choice([1, 2, 3, 4, self.rng.randint(5, 24)]), budget)
            if n:
                plan[rid] = n
                budget -= n
        return plan

    def step(self) -> None:
        if not any(r.left for r in self.live.values()):
            return self.add()
        plan = self.plan()
        before = self.cache.snapshot()
        try:
            batch = self.cache.prepare_forward(plan)
        except CacheFullError:  # the pool is full: nothing changed; finish someone to make room
            self.cache.assert_same(before)
            self.stats["full pool"] += 1
            return self.finish()
        x = torch.cat([self.live[rid].x[self.live[rid].done : self.live[rid].done + n] for rid, n in plan.items()])
        inject = self.rng.random() < 0.3
        for li in LAYERS:
            layer = self.layers[li]
            if inject:  # a refused call in the middle of the step (the step then goes on normally)
                self.inject_mid_step(li, layer, batch, x)
            res = layer.forward_with_aux(x, batch, self.cache)
            at = 0
            for rid, n in plan.items():
                self.live[rid].y[li].append(res.y[at : at + n])
                self.live[rid].idx[li].append(res.attended_entries()[at : at + n])
                at += n
        for rid, n in plan.items():
            self.live[rid].done += n
        if self.last_batch is not None and self.rng.random() < 0.3:  # an old batch is refused
            self.refused(StaleBatchError, lambda: self.layers[1](x[:0], self.last_batch, self.cache))
        self.last_batch = batch
        self.stats["steps"] += 1

    def inject_mid_step(self, li: int, layer: Attention, batch: dsv4.StepBatch, x: torch.Tensor) -> None:
        kind = self.rng.choice(["nan", "shape", "overflow", "twice", "prepare", "save"])
        if kind == "nan":
            bad = x.clone()
            bad[self.rng.randrange(x.shape[0]), self.rng.randrange(x.shape[1])] = float("nan")
            self.refused(ValueError, lambda: layer(bad, batch, self.cache))
        elif kind == "shape":
            self.refused(ValueError, lambda: layer(x[:, :-1], batch, self.cache))
        elif kind == "overflow":  # finite, but the projections overflow: rolled back
            self.refused(NonFiniteError, lambda: layer(x.sign() * 3e38, batch, self.cache))
        elif kind == "twice" and li > 0:
            self.refused(StepOrderError, lambda: self.layers[0](x, batch, self.cache))
        elif kind == "prepare" and li > 0:  # a new step while this one is partly run
            self.refused(StepOrderError, lambda: self.cache.prepare_forward({batch.request_ids[0]: 1}))
        elif kind == "save" and li > 0:
            self.refused(StepOrderError, lambda: self.cache.save_request(batch.request_ids[0]))

    def preempt(self) -> None:
        if not self.live:
            return self.step()
        rid = self.rng.choice(sorted(self.live))
        snap = self.cache.preempt_request(rid)
        self.parked[rid] = (snap, self.live.pop(rid))
        self.stats["preemptions"] += 1

    def restore(self) -> None:
        if not self.parked:
            return self.preempt()
        rid = self.rng.choice(sorted(self.parked))
        snap, req = self.parked[rid]
        new_id = rid if self.rng.random() < 0.5 else f"{rid}b"
        if self.cache.num_free_slots == 0 or snap.num_blocks > self.cache.num_free_blocks:
            self.refused(CacheFullError, lambda: self.cache.restore_request(new_id, snap))
            return
        self.cache.restore_request(new_id, snap)
        del self.parked[rid]
        self.live[new_id] = req
        self.stats["restores"] += 1

    def finish(self, rid: str | None = None) -> None:
        if rid is None:
            if not self.live:
                return
            rid = self.rng.choice(sorted(self.live))
        self.verify(self.live.pop(rid))
        self.cache.release(rid)

    def bad(self) -> None:
        """A refused call between steps."""
        c = self.cache
        kind = self.rng.choice(["unknown plan", "zero count", "release", "duplicate", "corrupt", "forged"])
        if kind == "unknown plan":
            self.refused(UnknownRequestError, lambda: c.prepare_forward({"nobody": 1}))
        elif kind == "zero count" and self.live:
            self.refused(InvalidPlanError, lambda: c.prepare_forward({next(iter(self.live)): 0}))
        elif kind == "release":
            self.refused(UnknownRequestError, lambda: c.release("nobody"))
        elif kind == "duplicate" and self.live:
            self.refused(DuplicateRequestError, lambda: c.add_request(next(iter(self.live))))
        elif kind in ("corrupt", "forged") and self.parked:
            snap = next(iter(self.parked.values()))[0]
            key = self.rng.choice(sorted(snap.state))
            t = snap.state[key].clone()
            flat = t.view(-1)
            if kind == "corrupt":  # one flipped bit anywhere: the checksum no longer matches
                flat.view(torch.uint8)[self.rng.randrange(flat.numel() * flat.element_size())] ^= 1
                bad = dataclasses.replace(snap, state={**snap.state, key: t})
            else:  # a request id changed after saving
                bad = dataclasses.replace(snap, request_id=snap.request_id + "x")
            self.refused(CorruptSnapshotError, lambda: c.restore_request("intruder", bad))


def test_differential_fuzz() -> None:
    """``WORKLOADS`` seeded workloads; every output checked against the reference, every bad call refused with
    the cache unchanged. The counts show the fuzz exercised what it claims."""
    layers = {li: Attention(w, TINY, li, backend="torch") for li, w in WEIGHTS.items()}
    total: Counter[str] = Counter()
    for seed in range(WORKLOADS):
        total += Workload(seed, layers).run()
    print("fuzz:", dict(sorted(total.items())))
    assert total["workloads"] == WORKLOADS >= 1
    scale = WORKLOADS / 200
    assert total["steps"] >= 1500 * scale and total["tokens verified"] >= 7000 * scale
    assert total["preemptions"] >= 300 * scale and total["restores"] >= 100 * scale
    assert total["bad calls"] >= 2000 * scale
