"""Property-based tests (hypothesis) of the allocator and the cache (issue 8 §1).

Three state machines run random workloads and check invariants after every step:

* ``AllocatorMachine`` — ``BlockAllocator`` against a model of reference counts: allocate / incref / decref,
  including failing calls (too many blocks, double free, invalid ids), which must change nothing.
* ``CacheMachine`` — ``HybridCache`` bookkeeping and data: add / prepare_forward / release / save / preempt /
  restore and failing calls, for random layer subsets, block sizes, pool sizes, slot counts and token budgets. After
  a successful step it writes random data where the layers would (the state rows of the scheduled requests, their
  new and last blocks; random entries encoded in the storage formats, so restores accept them), and keeps its own copy: every active request's data must stay exactly what it wrote (so a
  block or slot handed to two owners, a lost page or a bad restore shows up), every failing call must leave the
  cache byte-for-byte unchanged and raise the error the model predicts, every block must be owned exactly once or
  free, the free list complete, tables valid, refcounts consistent, and reused slots reset.
* ``ForwardMachine`` — the real layers (SWA, CSA, HCA in one cache, torch backend, exact numerics) over random
  workloads with preemption (save/restore and drop/recompute), rejected inputs and failing plans; every output is
  compared with the stateless reference of the request's whole sequence.

CI runs ``AllocatorMachine`` 250, ``CacheMachine`` 220 and ``ForwardMachine`` 40 workloads (510 in all,
derandomized). ``DSV4_PROPERTY_SCALE=k`` multiplies the counts; the ``slow`` test ``test_long_seeded_run`` runs
``CacheMachine`` for >= 20,000 steps (``DSV4_PROPERTY_STEPS``).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar

import hypothesis.strategies as st
import pytest
import torch
from cache_oracle import (
    bytes_per_block,
    bytes_per_slot,
    check_against_reference,
    expected_blocks,
    one_thread,  # noqa: F401  (fixture)
    plausible_random_row,
)
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

import dsv4
from dsv4.cache import (
    BlockAllocator,
    CacheFullError,
    DuplicateRequestError,
    HybridCache,
    InvalidPlanError,
    RequestSnapshot,
    UnknownRequestError,
)
from dsv4.layer import Attention

TINY = dsv4.ModelConfig.preset("tiny")
SCALE = float(os.environ.get("DSV4_PROPERTY_SCALE", "1"))


pytestmark = pytest.mark.usefixtures("one_thread")


def machine_settings(examples: int, steps: int) -> settings:
    return settings(
        max_examples=max(1, int(examples * SCALE)),
        stateful_step_count=steps,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )


# ================================================================================================ allocator
class AllocatorMachine(RuleBasedStateMachine):
    """``BlockAllocator`` vs a model: ``rc[b]`` references per block."""

    steps = 0

    @initialize(n=st.integers(0, 12))
    def init(self, n: int) -> None:
        self.alloc = BlockAllocator(n)
        self.n = n
        self.rc = [0] * n

    def used(self) -> list[int]:
        return [b for b in range(self.n) if self.rc[b] > 0]

    def unchanged_after(self, exc: type[BaseException], fn) -> None:
        before = self.alloc.state()
        with pytest.raises(exc):
            fn()
        assert self.alloc.state() == before

    @rule(k=st.integers(0, 14))
    def allocate(self, k: int) -> None:
        free = self.rc.count(0)
        if k > free:
            self.unchanged_after(CacheFullError, lambda: self.alloc.allocate(k))
            return
        got = self.alloc.allocate(k)
        assert len(got) == k == len(set(got)), got
        for b in got:
            assert self.rc[b] == 0, f"allocated block {b} was in use"
            self.rc[b] = 1

    @rule(data=st.data())
    def incref(self, data) -> None:
        used = self.used()
        if not used:
            return
        blocks = data.draw(st.lists(st.sampled_from(used), max_size=4))
        self.alloc.incref(blocks)
        for b in blocks:
            self.rc[b] += 1

    @rule(data=st.data())
    def decref(self, data) -> None:
        used = self.used()
        if not used:
            return
        blocks = data.draw(st.lists(st.sampled_from(used), max_size=5))
        over = any(k > self.rc[b] for b, k in Counter(blocks).items())
        if over:
            self.unchanged_after(ValueError, lambda: self.alloc.decref(blocks))
            return
        freed = self.alloc.decref(blocks)
        for b in blocks:
            self.rc[b] -= 1
        assert sorted(freed) == sorted(b for b in set(blocks) if self.rc[b] == 0)

    @rule(b=st.one_of(st.integers(-3, 16), st.sampled_from([1.0, True, None, "0"])), op=st.sampled_from(["incref", "decref", "refcount"]))
    def bad_or_free_id(self, b, op: str) -> None:
        valid = isinstance(b, int) and not isinstance(b, bool) and 0 <= b < self.n
        if valid and op == "refcount":
            assert self.alloc.refcount(b) == self.rc[b]
            return
        if valid and self.rc[b] > 0:
            return
        self.unchanged_after(ValueError, lambda: getattr(self.alloc, op)(b if op == "refcount" else [b]))

    @rule(k=st.sampled_from([-1, 1.5, True]))
    def bad_count(self, k) -> None:
        self.unchanged_after(ValueError, lambda: self.alloc.allocate(k))

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "alloc"):
            return
        AllocatorMachine.steps += 1
        self.alloc.check_invariants()
        refcounts, free = self.alloc.state()
        assert list(refcounts) == self.rc
        assert sorted(free) == [b for b in range(self.n) if self.rc[b] == 0]
        assert self.alloc.num_free == len(free) and self.alloc.num_used == self.n - len(free)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = machine_settings(250, 30)


# ================================================================================================ cache
IDS = ["r0", "r1", "r2", "r3", "r4"]
LAYER_SETS = [(0,), (1,), (2,), (0, 1, 2), (2, 1), (0, 1, 2, 3, 4)]
MAX_POSITION = 160  # small, so plans run into it


@dataclass
class ReqModel:
    """What the model expects of one active request."""

    num_tokens: int = 0
    state: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # (layer, name) -> slot row
    pages: list[dict[tuple[int, str], torch.Tensor]] = field(default_factory=list)  # logical block -> pages


class CacheMachine(RuleBasedStateMachine):
    steps = 0
    restored_blocks = 0  # blocks brought back by successful restores (coverage statistic)

    @initialize(
        layers=st.sampled_from(LAYER_SETS),
        block_size=st.sampled_from([16, 32, 64]),
        num_blocks=st.integers(0, 16),
        max_requests=st.integers(1, 4),
        budget=st.one_of(st.none(), st.integers(1, 120)),
        seed=st.integers(0, 2**16),
    )
    def init(self, layers, block_size, num_blocks, max_requests, budget, seed) -> None:
        cfg = TINY.replace(max_position=MAX_POSITION)
        self.cache = HybridCache(
            cfg, layers=layers, max_requests=max_requests, num_blocks=num_blocks, block_size=block_size,
            max_step_tokens=budget,
        )
        self.g = torch.Generator().manual_seed(seed)
        self.model: dict[str, ReqModel] = {}
        self.saved: list[tuple[RequestSnapshot, ReqModel]] = []
        self.baseline = self.cache.memory_in_use()
        assert self.baseline == 0
        self.m_min = min((cfg.ratio(i) for i in layers if cfg.ratio(i)), default=0)

    # ---------------------------------------------------------------- helpers
    def fails_unchanged(self, exc: type[BaseException], fn) -> None:
        before = self.cache.snapshot()
        with pytest.raises(BaseException) as info:
            fn()
        assert type(info.value) is exc, f"expected {exc.__name__}, got {type(info.value).__name__}: {info.value}"
        self.cache.assert_same(before)

    def write_like_the_layers(self, rid: str, first_block: int) -> None:
        """Random bytes into the request's state rows and its blocks from ``first_block`` on (model keeps a copy)."""
        c, req = self.cache, self.model[rid]
        slot, table = c.slot(rid), c.block_table(rid)
        for li, d in c.state.tensors.items():
            for name, t in d.items():
                row = plausible_random_row(c, li, name, t[slot], req.num_tokens, self.g)
                t[slot] = row
                req.state[(li, name)] = row
        while len(req.pages) < len(table):
            req.pages.append({})
        for j in range(max(first_block, 0), len(table)):
            for li, d in c.pool.tensors.items():
                for name, t in d.items():
                    page = plausible_random_row(c, li, name, t[table[j]], req.num_tokens, self.g)
                    t[table[j]] = page
                    req.pages[j][(li, name)] = page

    def free_blocks_model(self) -> int:
        return self.cache.num_blocks - sum(len(r.pages) for r in self.model.values())

    def predict_plan(self, plan) -> type[BaseException] | None:
        """The documented validation order (docs/errors.md), from the model alone."""
        if not isinstance(plan, (dict, list)) or not plan:
            return InvalidPlanError
        items = list(plan.items()) if isinstance(plan, dict) else plan
        seen, need, total = set(), 0, 0
        for rid, n in items:
            if not isinstance(rid, str) or rid in seen:
                return InvalidPlanError
            seen.add(rid)
            if rid not in self.model:
                return UnknownRequestError
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                return InvalidPlanError
            end = self.model[rid].num_tokens + n
            if end > MAX_POSITION:
                return InvalidPlanError
            need += expected_blocks(end, self.m_min, self.cache.block_size) - len(self.model[rid].pages)
            total += n
        if self.cache.max_step_tokens is not None and total > self.cache.max_step_tokens:
            return InvalidPlanError
        if need > self.free_blocks_model():
            return CacheFullError
        return None

    def run_plan(self, plan) -> None:
        exc = self.predict_plan(plan)
        if exc is not None:
            self.fails_unchanged(exc, lambda: self.cache.prepare_forward(plan))
            return
        items = list(plan.items()) if isinstance(plan, dict) else plan
        before = {rid: (self.model[rid].num_tokens, len(self.model[rid].pages)) for rid, _ in items}
        batch = self.cache.prepare_forward(plan)
        assert batch.request_ids == [r for r, _ in items] and batch.num_new == [n for _, n in items]
        assert batch.start_positions == [before[r][0] for r, _ in items]
        for b, (rid, n) in enumerate(items):
            self.model[rid].num_tokens += n
            table = self.cache.block_table(rid)
            assert batch.block_tables[b, : len(table)].tolist() == table
            assert (batch.block_tables[b, len(table) :] == -1).all()
            assert int(batch.slots[b]) == self.cache.slot(rid)
            self.write_like_the_layers(rid, before[rid][1] - 1)  # the old last block and every new one

    # ---------------------------------------------------------------- actions (one weighted rule drives them)
    ACTIONS = ("step",) * 6 + ("add",) * 3 + ("release", "save", "save", "restore", "restore", "bad_step")

    @rule(data=st.data(), action=st.sampled_from(ACTIONS))
    def act(self, data, action: str) -> None:
        getattr(self, action)(data)

    def draw_id(self, data) -> str:
        """Mostly an active id (when there is one), else any id of the pool (maybe unknown)."""
        if self.model and data.draw(st.integers(0, 4)):
            return data.draw(st.sampled_from(sorted(self.model)))
        return data.draw(st.sampled_from(IDS))

    def add(self, data) -> None:
        rid = data.draw(st.sampled_from(IDS))
        if rid in self.model:
            self.fails_unchanged(DuplicateRequestError, lambda: self.cache.add_request(rid))
        elif len(self.model) == self.cache.max_requests:
            self.fails_unchanged(CacheFullError, lambda: self.cache.add_request(rid))
        else:
            slot = self.cache.add_request(rid)
            assert self.cache.state.is_reset(slot), "a reused slot was not reset"
            self.model[rid] = ReqModel()
            self.write_like_the_layers(rid, 0)

    def release(self, data) -> None:
        rid = self.draw_id(data)
        if rid not in self.model:
            self.fails_unchanged(UnknownRequestError, lambda: self.cache.release(rid))
        else:
            self.cache.release(rid)
            del self.model[rid]

    def step(self, data) -> None:
        """A plan over active requests (mostly valid; may exceed the pool, the budget or max_position)."""
        if not self.model:
            return self.add(data)
        rids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=4, unique=True))
        counts = st.one_of(st.integers(1, 4), st.integers(1, 20), st.integers(21, 70))
        plan = [(rid, data.draw(counts)) for rid in rids]
        self.run_plan(dict(plan) if data.draw(st.booleans()) else plan)

    def bad_step(self, data) -> None:
        """A plan with something wrong (unknown or repeated id, bad count, bad form) — or by chance nothing."""
        ids = st.one_of(st.sampled_from(IDS), st.sampled_from([3, None]))
        counts = st.one_of(st.integers(-2, 3), st.sampled_from([2.0, True, "1", None]))
        plan = data.draw(st.lists(st.tuples(ids, counts), max_size=4))
        self.run_plan(plan)

    def save(self, data) -> None:
        """save_request (cache unchanged) or preempt_request (save + release)."""
        rid, release = self.draw_id(data), data.draw(st.booleans())
        if rid not in self.model:
            self.fails_unchanged(UnknownRequestError, lambda: self.cache.save_request(rid))
            return
        before = self.cache.snapshot()
        snap = self.cache.preempt_request(rid) if release else self.cache.save_request(rid)
        req = self.model[rid]
        assert snap.num_tokens == req.num_tokens and snap.num_blocks == len(req.pages)
        self.saved.append((snap, ReqModel(req.num_tokens, dict(req.state), [dict(p) for p in req.pages])))
        self.saved = self.saved[-3:]
        if release:
            del self.model[rid]
        else:
            self.cache.assert_same(before)

    def restore(self, data) -> None:
        if not self.saved:
            return self.save(data)
        snap, req = data.draw(st.sampled_from(self.saved))
        rid = data.draw(st.sampled_from(IDS))
        if rid in self.model:
            self.fails_unchanged(DuplicateRequestError, lambda: self.cache.restore_request(rid, snap))
        elif len(self.model) == self.cache.max_requests or snap.num_blocks > self.free_blocks_model():
            self.fails_unchanged(CacheFullError, lambda: self.cache.restore_request(rid, snap))
        else:
            self.cache.restore_request(rid, snap)
            self.model[rid] = ReqModel(req.num_tokens, dict(req.state), [dict(p) for p in req.pages])
            CacheMachine.restored_blocks += snap.num_blocks

    # ---------------------------------------------------------------- invariants
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "cache"):
            return
        CacheMachine.steps += 1
        c = self.cache
        c.check_invariants()  # allocator, refcounts == table references, slots, free slots reset
        assert set(c.active_requests) == set(self.model)
        owned: list[int] = []
        slots = []
        for rid, req in self.model.items():
            table = c.block_table(rid)
            assert c.num_tokens(rid) == req.num_tokens
            assert len(table) == len(req.pages) == expected_blocks(req.num_tokens, self.m_min, c.block_size)
            owned += table
            slots.append(c.slot(rid))
            for key, row in req.state.items():
                assert torch.equal(c.state.tensors[key[0]][key[1]][c.slot(rid)], row), f"{rid}: state {key} lost"
            for j, pages in enumerate(req.pages):
                for key, page in pages.items():
                    assert torch.equal(c.pool.tensors[key[0]][key[1]][table[j]], page), f"{rid}: block {j} {key} lost"
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert len(slots) == len(set(slots)), "a slot is owned twice"
        refcounts, free = c.allocator.state()
        assert sorted(free) == sorted(set(range(c.num_blocks)) - set(owned)), "free list incomplete"
        assert all(refcounts[b] == 1 for b in owned)
        assert sorted(c.state.free_slots) == sorted(set(range(c.max_requests)) - set(slots))
        assert c.memory_in_use() == len(owned) * bytes_per_block(c) + len(slots) * bytes_per_slot(c)

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        for rid in list(self.model):
            self.cache.release(rid)
        self.cache.check_invariants()
        assert self.cache.memory_in_use() == self.baseline == 0
        assert self.cache.num_free_blocks == self.cache.num_blocks
        assert self.cache.num_free_slots == self.cache.max_requests


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = machine_settings(220, 20)


# ================================================================================================ forward
FWD_LAYERS = (0, 1, 2)
FWD_LEN = 56  # tokens per request at most


@dataclass
class FwdReq:
    x: torch.Tensor  # [FWD_LEN, d]
    done: int = 0  # tokens run so far
    y: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)  # layer -> position -> y row
    idx: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)  # layer -> position -> entry_idx row


class ForwardMachine(RuleBasedStateMachine):
    steps = 0
    forward_steps = 0  # steps that ran the layers
    verified_tokens = 0  # token outputs compared with the reference (per layer)
    weights: ClassVar[dict[int, dsv4.AttentionWeights]] = {
        li: dsv4.AttentionWeights.random(TINY, li, seed=70 + li) for li in FWD_LAYERS
    }
    layers: ClassVar[dict[int, Attention]] = {li: Attention(w, TINY, li, backend="torch") for li, w in weights.items()}

    @initialize(num_blocks=st.integers(3, 10), max_requests=st.integers(1, 3), budget=st.sampled_from([None, 24, 48]))
    def init(self, num_blocks: int, max_requests: int, budget) -> None:
        self.cache = HybridCache(
            TINY, layers=FWD_LAYERS, max_requests=max_requests, num_blocks=num_blocks, block_size=16,
            numerics="exact", max_step_tokens=budget,
        )
        self.reqs: dict[str, FwdReq] = {}
        self.parked: dict[str, tuple[RequestSnapshot | None, FwdReq]] = {}  # preempted: snapshot or None (recompute)
        self.next_id = 0

    # ---------------------------------------------------------------- helpers
    def run_step(self, plan: dict[str, int], nan_layer: int | None = None) -> None:
        batch = self.cache.prepare_forward(plan)
        x = torch.cat([self.reqs[r].x[self.reqs[r].done : self.reqs[r].done + n] for r, n in plan.items()])
        for li, layer in self.layers.items():
            if li == nan_layer:
                bad = x.clone()
                bad[-1, 0] = float("nan")
                before = self.cache.snapshot()
                with pytest.raises(ValueError, match="NaN or Inf"):
                    layer(bad, batch, self.cache)
                self.cache.assert_same(before)
            res = layer.forward_with_aux(x, batch, self.cache)
            at = 0
            for r, n in plan.items():
                req = self.reqs[r]
                for k in range(n):
                    req.y.setdefault(li, {})[req.done + k] = res.y[at + k]
                    req.idx.setdefault(li, {})[req.done + k] = res.attended_entries()[at + k]
                at += n
        for r, n in plan.items():
            self.reqs[r].done += n
        ForwardMachine.forward_steps += 1

    def verify(self, rid: str) -> None:
        """Every recorded output of ``rid`` equals the reference forward of its tokens so far."""
        req = self.reqs[rid]
        if req.done == 0:
            return
        for li in FWD_LAYERS:
            y = torch.stack([req.y[li][p] for p in range(req.done)])
            width = max(req.idx[li][p].shape[0] for p in range(req.done))
            idx = torch.stack([torch.nn.functional.pad(req.idx[li][p], (0, width - req.idx[li][p].shape[0]), value=-1) for p in range(req.done)])
            check_against_reference(self.weights[li], TINY, li, req.x[: req.done], y, idx, "exact", 1e-5, 0.5)
            ForwardMachine.verified_tokens += req.done

    # ---------------------------------------------------------------- actions (one weighted rule drives them)
    ACTIONS = ("step",) * 6 + ("add",) * 2 + ("preempt", "resume", "resume", "finish")

    @rule(data=st.data(), action=st.sampled_from(ACTIONS))
    def act(self, data, action: str) -> None:
        """One action: mostly steps. Inapplicable actions fall back to adding a request or stepping."""
        if action == "preempt" and not self.reqs or action == "finish" and not self.reqs:
            action = "step"
        if action == "resume" and not self.parked:
            action = "step"
        if action == "step" and not any(r.done < FWD_LEN for r in self.reqs.values()):
            action = "add"
        if action == "add" and self.cache.num_free_slots == 0:
            return
        getattr(self, action)(data)

    def add(self, data) -> None:
        rid = f"q{self.next_id}"
        self.next_id += 1
        self.cache.add_request(rid)
        g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
        self.reqs[rid] = FwdReq(torch.randn(FWD_LEN, TINY.hidden_size, generator=g))

    def step(self, data) -> None:
        """A plan over live requests; with some luck a layer first gets (and rejects) a NaN input."""
        live = sorted(r for r, q in self.reqs.items() if q.done < FWD_LEN)
        rids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=3, unique=True))
        plan = {}
        for r in rids:
            left = FWD_LEN - self.reqs[r].done
            plan[r] = min(left, data.draw(st.one_of(st.integers(1, 4), st.integers(5, 40))))
        nan = data.draw(st.one_of(st.none(), st.none(), st.sampled_from(FWD_LAYERS)))
        try:
            before = self.cache.snapshot()
            self.run_step(plan, nan_layer=nan)
        except (CacheFullError, InvalidPlanError):
            self.cache.assert_same(before)

    def preempt(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        if data.draw(st.booleans()):
            snap = self.cache.preempt_request(rid)
        else:  # drop: its outputs so far are checked now, the recomputed ones replace them later
            self.verify(rid)
            self.cache.release(rid)
            snap = None
        self.parked[rid] = (snap, self.reqs.pop(rid))

    def resume(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.parked)))
        snap, req = self.parked[rid]
        if snap is not None:
            try:
                self.cache.restore_request(rid, snap)
            except CacheFullError:
                return
            self.reqs[rid] = self.parked.pop(rid)[1]
            return
        # recompute from the tokens, in prefill chunks as large as the token budget allows; the recomputed outputs
        # replace the recorded ones (which were checked when the request was dropped) and are checked later
        if self.cache.num_free_slots == 0:
            return
        self.cache.add_request(rid)
        done, req.done = req.done, 0
        self.reqs[rid] = req
        chunk = self.cache.max_step_tokens or FWD_LEN
        while req.done < done:
            try:
                before = self.cache.snapshot()
                self.run_step({rid: min(chunk, done - req.done)})
            except CacheFullError:
                self.cache.assert_same(before)
                self.verify(rid)
                self.cache.release(rid)
                req.done = done
                del self.reqs[rid]
                return
        del self.parked[rid]

    def finish(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self.verify(rid)
        self.cache.release(rid)
        del self.reqs[rid]

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "cache"):
            return
        ForwardMachine.steps += 1
        self.cache.check_invariants()
        assert set(self.cache.active_requests) == set(self.reqs)
        for rid, req in self.reqs.items():
            assert self.cache.num_tokens(rid) == req.done

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        for rid in list(self.reqs):
            self.verify(rid)
            self.cache.release(rid)
        self.cache.check_invariants()
        assert self.cache.memory_in_use() == 0 and self.cache.num_free_blocks == self.cache.num_blocks


TestForwardMachine = ForwardMachine.TestCase
TestForwardMachine.settings = machine_settings(40, 15)


# ================================================================================================ long run
@pytest.mark.slow
def test_long_seeded_run() -> None:
    """>= 20,000 CacheMachine steps (``DSV4_PROPERTY_STEPS``), derandomized (seeded); ``pytest -m slow``."""
    from hypothesis.stateful import run_state_machine_as_test

    target = int(os.environ.get("DSV4_PROPERTY_STEPS", "20000"))
    examples = max(1, target // 25)
    while True:
        CacheMachine.steps = 0
        run_state_machine_as_test(CacheMachine, settings=settings(machine_settings(examples, 50), max_examples=examples))
        print(f"CacheMachine: {examples} workloads, {CacheMachine.steps} steps")
        if CacheMachine.steps >= target:
            break
        examples *= 2
