"""Property-based tests (hypothesis) of the allocator and the cache (issue 8 §1).

Three state machines run random workloads and check invariants after every step:

* ``AllocatorMachine`` — ``BlockAllocator`` against a model of reference counts: allocate / incref / decref,
  including failing calls (too many blocks, double free, invalid ids), which must change nothing.
* ``CacheMachine`` — ``HybridCache`` bookkeeping and data: add / prepare_forward / release / save / preempt /
  restore and failing calls, for random layer subsets, block sizes, pool sizes, slot counts and token budgets, with
  or without prefix caching. After a successful step it writes data where the layers would (the state rows of the
  scheduled requests, the blocks they write; random entries encoded in the storage formats, so restores accept
  them), and keeps its own copy: every active request's data must stay
  exactly what it wrote (so a block or slot handed to two owners, a lost page or a bad restore shows up), every
  failing call must leave the cache byte-for-byte unchanged and raise the error the model predicts, every block
  must be free or referenced exactly by the tables and prefix-cache entries that hold it, the free list complete,
  tables valid, and reused slots reset. Requests may come with token ids drawn from a few shared prompt families;
  for them the bytes written are a pure function of the token prefix they cover (as the layers' would be), so a
  prefix hit must restore exactly the bytes of that prefix — blocks and the live state (the tails reset) — and may
  only happen at a block boundary where a step with the same tokens ended.
* ``ForwardMachine`` — the real layers (SWA, CSA, HCA in one cache, torch backend, exact numerics) over random
  workloads with preemption (save/restore and drop/recompute), rejected inputs, failing plans and prefix caching
  (requests from shared prompt families, hidden states a function of the token id); every output is compared with
  the stateless reference of the request's whole sequence (a hit request's outputs from its prefix end on).

CI runs ``AllocatorMachine`` 250, ``CacheMachine`` 220 and ``ForwardMachine`` 40 workloads (510 in all,
derandomized). ``DSV4_PROPERTY_SCALE=k`` multiplies the counts; the ``slow`` test ``test_long_seeded_run`` runs
``CacheMachine`` for >= 20,000 steps (``DSV4_PROPERTY_STEPS``).
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar

import hypothesis.strategies as st
import pytest
import torch
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
from dsv4.cache.prefix import PREFIX_STATE_NAMES
from dsv4.layer import Attention

from support.oracle import (
    bytes_per_block,
    bytes_per_slot,
    check_against_reference,
    expected_blocks,
    plausible_random_row,
)

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


#: Shared prompt families: requests with token ids take a family's first tokens, then maybe another's.
FAMILIES = [torch.randint(0, 50, (MAX_POSITION,), generator=torch.Generator().manual_seed(f)).tolist() for f in range(3)]


@dataclass
class ReqModel:
    """What the model expects of one active request."""

    num_tokens: int = 0
    state: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # (layer, name) -> slot row
    pages: list[dict[tuple[int, str], torch.Tensor]] = field(default_factory=list)  # logical block -> pages
    ids: list[int] | None = None  # known token ids (None: added without)
    nonce: int = 0  # makes the bytes of positions without known ids unique to this request


def prefix_row(key: tuple, cache: HybridCache, layer: int, name: str, like: torch.Tensor, num_tokens: int
               ) -> torch.Tensor:
    """``plausible_random_row`` drawn from ``keyed_generator(key)``: a pure function of the token prefix in
    ``key`` (``num_tokens`` long) and of what is written."""
    return plausible_random_row(cache, layer, name, like, num_tokens, keyed_generator(key))


def keyed_generator(key: tuple) -> torch.Generator:
    """A generator seeded by ``key`` (a token prefix and what is written): the contents it draws are a pure function
    of the prefix, as the layers' would be."""
    seed = int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:7], "little")
    return torch.Generator().manual_seed(seed)


class CacheMachine(RuleBasedStateMachine):
    steps = 0
    restored_blocks = 0  # blocks brought back by successful restores (coverage statistic)

    prefix_hits = 0  # hits of restored prefix tokens (coverage statistic)

    @initialize(
        layers=st.sampled_from(LAYER_SETS),
        block_size=st.sampled_from([16, 32, 64]),
        num_blocks=st.integers(0, 16),
        max_requests=st.integers(1, 4),
        budget=st.one_of(st.none(), st.integers(1, 120)),
        seed=st.integers(0, 2**16),
        prefix_states=st.sampled_from([0, 1, 2, 4]),
    )
    def init(self, layers, block_size, num_blocks, max_requests, budget, seed, prefix_states) -> None:
        cfg = TINY.replace(max_position=MAX_POSITION)
        self.cache = HybridCache(
            cfg, layers=layers, max_requests=max_requests, num_blocks=num_blocks, block_size=block_size,
            max_step_tokens=budget, prefix_states=prefix_states,
        )
        self.g = torch.Generator().manual_seed(seed)
        self.model: dict[str, ReqModel] = {}
        self.saved: list[tuple[RequestSnapshot, ReqModel]] = []
        self.snapshot_points: set[tuple[int, ...]] = set()  # token prefixes at which a step ended on a boundary
        self.recent: list[list[int]] = []  # token ids of requests added so far (the last few)
        self.nonce = 0
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

    def prefix_key(self, req: ReqModel, end: int) -> tuple:
        """Whose bytes the request's data at ``end`` tokens is: its token prefix when the ids are known, else its
        own (nonce)."""
        if req.ids is not None and end <= len(req.ids):
            return tuple(req.ids[:end])
        return ("own", req.nonce, end)

    def write_like_the_layers(self, rid: str, first_block: int) -> None:
        """Bytes into the request's state rows and its blocks from ``first_block`` on (model keeps a copy): random
        for requests without token ids, else a function of the token prefix they cover."""
        c, req = self.cache, self.model[rid]
        slot, table = c.slot(rid), c.block_table(rid)
        keyed = req.ids is not None
        for li, d in c.state.tensors.items():
            for name, t in d.items():
                key = (self.prefix_key(req, req.num_tokens), li, name)
                row = (prefix_row(key, c, li, name, t[slot], req.num_tokens) if keyed
                       else plausible_random_row(c, li, name, t[slot], req.num_tokens, self.g))
                t[slot] = row
                req.state[(li, name)] = row
        while len(req.pages) < len(table):
            req.pages.append({})
        bs = c.block_size
        for j in range(max(first_block, 0), len(table)):
            for li, d in c.pool.tensors.items():
                for name, t in d.items():
                    end = min(req.num_tokens, (j + 1) * bs)
                    key = (self.prefix_key(req, end), j, li, name)
                    page = (prefix_row(key, c, li, name, t[table[j]], end) if keyed
                            else plausible_random_row(c, li, name, t[table[j]], req.num_tokens, self.g))
                    t[table[j]] = page
                    req.pages[j][(li, name)] = page
        end = req.num_tokens
        if keyed and end and end % bs == 0 and end <= len(req.ids):
            self.snapshot_points.add(tuple(req.ids[:end]))

    def owned(self) -> list[int]:
        return [b for rid in self.model for b in self.cache.block_table(rid)]

    def free_blocks_model(self) -> int:
        """Free blocks plus the cached prefix blocks no active request holds (evicted when blocks are needed)."""
        return self.cache.num_blocks - len(set(self.owned()))

    def predict_plan(self, plan, token_ids=None) -> type[BaseException] | None:
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
        for rid, ids in (token_ids or {}).items():
            req, n = self.model[rid], dict(items)[rid]
            known = req.ids or []
            start = req.num_tokens
            if len(ids) != n or start > len(known) or ids[: len(known) - start] != known[start : start + n]:
                return InvalidPlanError
        if need > self.free_blocks_model():
            return CacheFullError
        return None

    def run_plan(self, plan, token_ids=None) -> None:
        exc = self.predict_plan(plan, token_ids)
        if exc is not None:
            self.fails_unchanged(exc, lambda: self.cache.prepare_forward(plan, token_ids=token_ids))
            return
        items = list(plan.items()) if isinstance(plan, dict) else plan
        before = {rid: self.model[rid].num_tokens for rid, _ in items}
        batch = self.cache.prepare_forward(plan, token_ids=token_ids)
        assert batch.request_ids == [r for r, _ in items] and batch.num_new == [n for _, n in items]
        assert batch.start_positions == [before[r] for r, _ in items]
        for b, (rid, n) in enumerate(items):
            req = self.model[rid]
            if token_ids and rid in token_ids:
                known = req.ids or []
                req.ids = known + token_ids[rid][len(known) - req.num_tokens :]
            req.num_tokens += n
            table = self.cache.block_table(rid)
            assert batch.block_tables[b, : len(table)].tolist() == table
            assert (batch.block_tables[b, len(table) :] == -1).all()
            assert int(batch.slots[b]) == self.cache.slot(rid)
            self.write_like_the_layers(rid, before[rid] // self.cache.block_size)  # the blocks the step writes
        for b, point, row in batch.prefix_captures:  # as the layers would: the state at a boundary inside the step
            req = self.model[items[b][0]]
            assert req.ids is not None and before[items[b][0]] < point < req.num_tokens and point <= len(req.ids)
            for li, d in self.cache.prefix.states.tensors.items():
                for name, t in d.items():
                    t[row] = prefix_row((tuple(req.ids[:point]), li, name), self.cache, li, name, t[row], point)
            self.snapshot_points.add(tuple(req.ids[:point]))

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

    def draw_ids(self, data) -> list[int] | None:
        """No ids, or a family's first tokens, maybe followed by another family's (a shared prefix that ends), or
        those of a request already seen, made longer (a follow-up sharing its prompt)."""
        pick = data.draw(st.integers(0, 4))
        if not pick:
            return None
        if pick >= 3 and self.recent:
            ids = data.draw(st.sampled_from(self.recent))
            return (ids + FAMILIES[data.draw(st.integers(0, 2))][len(ids) :])[: data.draw(st.integers(1, MAX_POSITION))]
        length = data.draw(st.integers(1, MAX_POSITION))
        f, g = data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2))
        cut = data.draw(st.integers(0, length))
        return FAMILIES[f][:cut] + FAMILIES[g][cut:length]

    def add(self, data) -> None:
        rid = data.draw(st.sampled_from(IDS))
        ids = self.draw_ids(data)
        if rid in self.model:
            self.fails_unchanged(DuplicateRequestError, lambda: self.cache.add_request(rid, ids))
        elif len(self.model) == self.cache.max_requests:
            self.fails_unchanged(CacheFullError, lambda: self.cache.add_request(rid, ids))
        else:
            slot = self.cache.add_request(rid, ids)
            if ids:
                self.recent = (self.recent + [ids])[-4:]
            self.nonce += 1
            req = self.model[rid] = ReqModel(ids=ids, nonce=self.nonce)
            hit = self.cache.cached_tokens(rid)
            assert self.cache.num_tokens(rid) == hit
            if not hit:
                assert self.cache.state.is_reset(slot), "a reused slot was not reset"
                self.write_like_the_layers(rid, 0)
                return
            # a hit: whole blocks, at most len - 1 tokens, where a step with the same tokens ended; the blocks
            # and the live state hold that prefix's bytes, the tails their reset values
            bs = self.cache.block_size
            assert self.cache.prefix.enabled and hit % bs == 0 and 0 < hit < len(ids), hit
            assert tuple(ids[:hit]) in self.snapshot_points
            CacheMachine.prefix_hits += hit
            req.num_tokens = hit
            specs = {(li, s.name): s for li, ss in self.cache.state.specs.items() for s in ss}
            for (li, name), t in ((k, self.cache.state.tensors[k[0]][k[1]]) for k in specs):
                live = name in PREFIX_STATE_NAMES
                req.state[(li, name)] = (prefix_row((tuple(ids[:hit]), li, name), self.cache, li, name, t[slot], hit)
                                         if live
                                         else torch.full_like(t[slot], specs[(li, name)].fill))
            table = self.cache.block_table(rid)
            assert len(table) == expected_blocks(hit, self.m_min, bs)
            req.pages = [{(li, name): prefix_row((tuple(ids[: (j + 1) * bs]), j, li, name), self.cache, li, name,
                                                 t[table[j]], (j + 1) * bs)
                          for li, d in self.cache.pool.tensors.items() for name, t in d.items()}
                         for j in range(len(table))]

    def release(self, data) -> None:
        rid = self.draw_id(data)
        if rid not in self.model:
            self.fails_unchanged(UnknownRequestError, lambda: self.cache.release(rid))
        else:
            self.cache.release(rid)
            del self.model[rid]

    def step(self, data) -> None:
        """A plan over active requests (mostly valid; may exceed the pool, the budget or max_position), often
        ending a request's step on a block boundary; sometimes with the steps' token ids (known ones, extended by
        new ones)."""
        if not self.model:
            return self.add(data)
        rids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=4, unique=True))
        bs = self.cache.block_size
        plan = []
        for rid in rids:
            to_boundary = bs - self.model[rid].num_tokens % bs
            counts = st.one_of(st.integers(1, 4), st.integers(1, 20), st.integers(21, 70),
                               st.sampled_from([to_boundary, to_boundary + bs]))
            plan.append((rid, data.draw(counts)))
        token_ids = None
        if data.draw(st.booleans()):
            token_ids = {}
            for rid, n in plan:
                req = self.model[rid]
                known = req.ids or []
                if req.num_tokens <= len(known):
                    fresh = torch.randint(0, 50, (n,), generator=self.g).tolist()
                    token_ids[rid] = (known[req.num_tokens : req.num_tokens + n] + fresh)[:n]
        self.run_plan(dict(plan) if data.draw(st.booleans()) else plan, token_ids)

    def bad_step(self, data) -> None:
        """A plan with something wrong (unknown or repeated id, bad count, bad form, token ids that disagree with
        the known ones) — or by chance nothing."""
        known = [r for r, q in self.model.items() if q.ids and q.num_tokens < len(q.ids)]
        if known and data.draw(st.booleans()):
            rid = data.draw(st.sampled_from(sorted(known)))
            req = self.model[rid]
            n = min(3, len(req.ids) - req.num_tokens)
            wrong = [t + 1 for t in req.ids[req.num_tokens : req.num_tokens + n]]
            return self.run_plan({rid: n}, {rid: wrong})
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
        assert snap.token_ids == (None if req.ids is None else tuple(req.ids))
        self.saved.append((snap, ReqModel(req.num_tokens, dict(req.state), [dict(p) for p in req.pages],
                                          None if req.ids is None else list(req.ids), req.nonce)))
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
        free = self.free_blocks_model()
        copy = ReqModel(req.num_tokens, dict(req.state), [dict(p) for p in req.pages],
                        None if req.ids is None else list(req.ids), req.nonce)
        if rid in self.model:
            self.fails_unchanged(DuplicateRequestError, lambda: self.cache.restore_request(rid, snap))
        elif len(self.model) == self.cache.max_requests or snap.num_blocks - len(snap.prefix_nodes) > free:
            self.fails_unchanged(CacheFullError, lambda: self.cache.restore_request(rid, snap))
        elif snap.num_blocks > free:  # fits only if the cache still holds the prefix blocks it shared
            before = self.cache.snapshot()
            try:
                self.cache.restore_request(rid, snap)
            except CacheFullError:
                self.cache.assert_same(before)
                return
            self.model[rid] = copy
        else:
            self.cache.restore_request(rid, snap)
            self.model[rid] = copy
            CacheMachine.restored_blocks += snap.num_blocks

    # ---------------------------------------------------------------- invariants
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "cache"):
            return
        CacheMachine.steps += 1
        c = self.cache
        c.check_invariants()  # allocator, refcounts == table + prefix references, slots, free slots reset, prefix
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
        assert len(slots) == len(set(slots)), "a slot is owned twice"
        refcounts, free = c.allocator.state()
        cached = c.prefix.cached_blocks()
        refs = Counter(owned) + Counter(cached)
        assert sorted(free) == sorted(set(range(c.num_blocks)) - set(refs)), "free list incomplete"
        assert all(refcounts[b] == k for b, k in refs.items())
        for rid in self.model:  # only complete, cached blocks are shared; a request writes only its own
            table, n = c.block_table(rid), c.num_tokens(rid)
            assert all(refs[b] == 1 for b in table[n // c.block_size :]), f"{rid}: a shared block is writable"
            assert all(b in cached for b in table if refs[b] > 1), f"{rid}: a block shared outside the prefix cache"
        assert sorted(c.state.free_slots) == sorted(set(range(c.max_requests)) - set(slots))
        rows = c.prefix.states.num_rows - len(c.prefix.states.free_rows)
        assert c.memory_in_use() == (len(refs) * bytes_per_block(c) + len(slots) * bytes_per_slot(c)
                                     + rows * c.prefix_state_bytes)

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        for rid in list(self.model):
            self.cache.release(rid)
        self.cache.check_invariants()
        self.cache.clear_prefix_cache()
        assert not self.cache.prefix.nodes
        self.cache.check_invariants()
        assert self.cache.memory_in_use() == self.baseline == 0
        assert self.cache.num_free_blocks == self.cache.num_blocks
        assert self.cache.num_free_slots == self.cache.max_requests


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = machine_settings(220, 20)


# ================================================================================================ forward
FWD_LAYERS = (0, 1, 2)
FWD_LEN = 56  # tokens per request at most
FWD_BS = 16
#: Prompts of requests with token ids (prefix caching): two families; a token's hidden state is its embedding row.
FWD_FAMILIES = [torch.randint(0, 64, (FWD_LEN,), generator=torch.Generator().manual_seed(10 + f)).tolist() for f in range(2)]
FWD_EMBEDDING = torch.randn(64, TINY.hidden_size, generator=torch.Generator().manual_seed(9))


@dataclass
class FwdReq:
    x: torch.Tensor  # [FWD_LEN, d]
    ids: list[int] | None = None  # token ids (x = FWD_EMBEDDING[ids]) or None (x random)
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

    prefix_hits = 0  # tokens restored from the prefix cache (coverage statistic)

    @initialize(num_blocks=st.integers(3, 10), max_requests=st.integers(1, 3), budget=st.sampled_from([None, 24, 48]),
                prefix_states=st.sampled_from([0, 2, 2]))
    def init(self, num_blocks: int, max_requests: int, budget, prefix_states: int) -> None:
        self.cache = HybridCache(
            TINY, layers=FWD_LAYERS, max_requests=max_requests, num_blocks=num_blocks, block_size=FWD_BS,
            numerics="exact", max_step_tokens=budget, prefix_states=prefix_states,
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
        """Every recorded output of ``rid`` equals the reference forward of its tokens so far (positions a prefix
        hit restored were never computed for it: the others)."""
        req = self.reqs[rid]
        if req.done == 0 or not req.y:
            return
        for li in FWD_LAYERS:
            pos = sorted(p for p in req.y[li] if p < req.done)
            if not pos:
                continue
            y = torch.stack([req.y[li][p] for p in pos])
            width = max(req.idx[li][p].shape[0] for p in pos)
            idx = torch.stack([torch.nn.functional.pad(req.idx[li][p], (0, width - req.idx[li][p].shape[0]), value=-1) for p in pos])
            check_against_reference(self.weights[li], TINY, li, req.x[: req.done], y, idx, "exact", 1e-5, 0.5,
                                    rows=torch.tensor(pos))
            ForwardMachine.verified_tokens += len(pos)

    def add_to_cache(self, rid: str, req: FwdReq) -> None:
        """``add_request`` (with the token ids, if any); a hit starts the request at its prefix end."""
        self.cache.add_request(rid, req.ids)
        hit = self.cache.cached_tokens(rid)
        if hit:
            assert hit % FWD_BS == 0 and hit < FWD_LEN and self.cache.num_tokens(rid) == hit
            ForwardMachine.prefix_hits += hit
            req.done = hit

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
        """A request of random hidden states, or of token ids: a family's first tokens, then the other's."""
        rid = f"q{self.next_id}"
        self.next_id += 1
        if data.draw(st.integers(0, 2)):
            f, cut = data.draw(st.integers(0, 1)), data.draw(st.sampled_from([20, 36, 48, FWD_LEN]))
            ids = FWD_FAMILIES[f][:cut] + FWD_FAMILIES[1 - f][cut:]
            req = FwdReq(FWD_EMBEDDING[torch.tensor(ids)], ids)
        else:
            g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
            req = FwdReq(torch.randn(FWD_LEN, TINY.hidden_size, generator=g))
        self.add_to_cache(rid, req)
        self.reqs[rid] = req

    def step(self, data) -> None:
        """A plan over live requests; with some luck a layer first gets (and rejects) a NaN input."""
        live = sorted(r for r, q in self.reqs.items() if q.done < FWD_LEN)
        rids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=3, unique=True))
        plan = {}
        for r in rids:
            left = FWD_LEN - self.reqs[r].done
            to_boundary = FWD_BS - self.reqs[r].done % FWD_BS
            plan[r] = min(left, data.draw(st.one_of(st.integers(1, 4), st.integers(5, 40), st.just(to_boundary))))
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
        done, req.done = req.done, 0
        self.add_to_cache(rid, req)
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
        self.cache.clear_prefix_cache()
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
