"""HybridCache lifecycle, StepBatch contents and error atomicity (dsv4.cache.manager / batch)."""

import random

import pytest
import torch

from dsv4.cache import (
    CacheFullError,
    DuplicateRequestError,
    HybridCache,
    InvalidPlanError,
    UnknownRequestError,
    visible_entries,
)
from dsv4.config import ModelConfig

TINY = ModelConfig.preset("tiny")  # window 16, CSA 4, HCA 16, layers (SWA, CSA, HCA, CSA, MTP SWA)


def dirty_slot(cache: HybridCache, slot: int) -> None:
    """Simulate the ops writing state: scribble over every state tensor of ``slot``."""
    for d in cache.state.tensors.values():
        for t in d.values():
            t[slot] = 7


class Model:
    """Independent host-side model of what the cache should hold (for brute-force checks)."""

    def __init__(self, cache: HybridCache):
        self.cache = cache
        self.tokens: dict[str, int] = {}
        self.entries: dict[tuple[int, int, int], tuple[str, int]] = {}  # (m, block, slot) -> (request, entry)

    def check_batch(self, plan: list[tuple[str, int]], batch) -> None:
        c = self.cache
        bs = c.block_size
        assert batch.request_ids == [r for r, _ in plan]
        assert batch.num_new == [n for _, n in plan]
        assert batch.start_positions == [self.tokens[r] for r, _ in plan]
        tok_req, pos, slots = [], [], []
        for b, (r, n) in enumerate(plan):
            s = self.tokens[r]
            for t in range(s, s + n):
                tok_req.append(b)
                pos.append(t)
                slots.append(c.slot(r))
        assert batch.num_tokens == len(pos) and batch.max_new == max(n for _, n in plan)
        assert batch.token_request.tolist() == tok_req and batch.token_request.dtype == torch.int32
        assert batch.positions.tolist() == pos and batch.positions.dtype == torch.int64
        assert batch.token_slots.tolist() == slots
        assert batch.slots.tolist() == [c.slot(r) for r, _ in plan]
        cu = [0]
        for _, n in plan:
            cu.append(cu[-1] + n)
        assert batch.cu_seqlens.tolist() == cu and batch.cu_seqlens.dtype == torch.int32
        assert batch.start_pos.tolist() == [self.tokens[r] for r, _ in plan]
        assert batch.end_pos.tolist() == [self.tokens[r] + n for r, n in plan]
        # block tables: -1 padded to the longest table, each row = that request's table
        tables = [c.block_table(r) for r, _ in plan]
        width = max(len(t) for t in tables)
        assert batch.block_tables.shape == (len(plan), width) and batch.block_tables.dtype == torch.int32
        for b, t in enumerate(tables):
            assert batch.block_tables[b].tolist() == t + [-1] * (width - len(t))
        # SWA ring: slot = pos % window; keep = among the request's last `window` positions of the step
        win = TINY.window
        assert batch.ring_slots.tolist() == [p % win for p in pos]
        keep = [p >= self.tokens[plan[b][0]] + plan[b][1] - win for b, p in zip(tok_req, pos)]
        assert batch.ring_keep.tolist() == keep
        assert batch.ring_rows.tolist() == [t for t, k in enumerate(keep) if k]
        assert len(keep) == 0 or batch.ring_rows.dtype == torch.int64
        for b in range(len(plan)):  # the kept ring slots of one request are distinct
            kept = [p % win for bb, p, k in zip(tok_req, pos, keep) if bb == b and k]
            assert len(kept) == len(set(kept))

        assert set(batch.entries_before) == set(c.ratios)
        for m in c.ratios:
            emit = []  # brute force: an entry is emitted by the step that processes its window's last token
            for b, (r, n) in enumerate(plan):
                for t in range(self.tokens[r], self.tokens[r] + n):
                    if (t + 1) % m == 0:
                        emit.append((b, (t + 1) // m - 1))
            table = lambda b: tables[b]  # noqa: E731
            assert batch.num_emit[m] == len(emit)
            assert batch.emit_request[m].tolist() == [b for b, _ in emit]
            assert batch.emit_entry[m].tolist() == [i for _, i in emit]
            assert batch.emit_position[m].tolist() == [i * m for _, i in emit]
            assert batch.emit_block[m].tolist() == [table(b)[(i * m) // bs] for b, i in emit]
            assert batch.emit_slot[m].tolist() == [((i * m) % bs) // m for _, i in emit]
            per_req = [sum(1 for bb, _ in emit if bb == b) for b in range(len(plan))]
            assert batch.entries_to_emit[m].tolist() == per_req
            assert batch.entries_before[m].tolist() == [self.tokens[r] // m for r, _ in plan]
            assert batch.entries_after[m].tolist() == [(self.tokens[r] + n) // m for r, n in plan]
            # visible entries: count of windows i whose last token (i+1)·m − 1 is at or before t
            vis = []
            for b, p in zip(tok_req, pos):
                vis.append(sum(1 for i in range(p // m + 2) if (i + 1) * m - 1 <= p))
            assert batch.visible_entries[m].tolist() == vis
            assert torch.equal(visible_entries(batch.positions, m), batch.visible_entries[m])
            # no two live entries share a (block, slot) of the same layer ratio
            for b, i in emit:
                key = (m, table(b)[(i * m) // bs], ((i * m) % bs) // m)
                assert key not in self.entries, f"entry collision at {key}"
                self.entries[key] = (plan[b][0], i)
        for r, n in plan:
            self.tokens[r] += n

    def release(self, r: str) -> None:
        self.entries = {k: v for k, v in self.entries.items() if v[0] != r}
        del self.tokens[r]


def expected_blocks(num_tokens: int, m_min: int, bs: int) -> int:
    """Brute force: distinct blocks holding the finest layer's complete entries."""
    if not m_min:
        return 0
    return len({(i * m_min) // bs for i in range(num_tokens // m_min)})


@pytest.mark.parametrize(
    "layers,block_size,seed",
    [(None, 16, 0), (range(5), 256, 1), ([0], 16, 2), ([2], 32, 3), ([3, 2], 16, 4)],
)
def test_random_lifecycle(layers, block_size, seed):
    rng = random.Random(seed)
    cache = HybridCache(TINY, layers=layers, max_requests=4, num_blocks=40, block_size=block_size)
    model = Model(cache)
    cache.check_invariants()
    next_id = 0
    for step in range(60):
        # add / release
        if rng.random() < 0.3 and cache.num_free_slots:
            rid = f"r{next_id}"
            next_id += 1
            slot = cache.add_request(rid)
            assert cache.state.is_reset(slot)
            model.tokens[rid] = 0
        if rng.random() < 0.15 and cache.active_requests:
            rid = rng.choice(cache.active_requests)
            slot = cache.slot(rid)
            cache.release(rid)
            model.release(rid)
            assert slot in cache.state.free_slots
        active = cache.active_requests
        if not active:
            continue
        chosen = rng.sample(active, rng.randint(1, len(active)))
        plan = [(r, rng.choice([1, 1, 2, 3, 4, rng.randint(5, 40), rng.randint(41, 300)])) for r in chosen]
        snap = cache.snapshot()
        try:
            batch = cache.prepare_forward(plan)
        except CacheFullError:
            cache.assert_same(snap)
            # release the longest request to make room
            victim = max(active, key=cache.num_tokens)
            cache.release(victim)
            model.release(victim)
            cache.check_invariants()
            continue
        model.check_batch(plan, batch)
        for r in active:
            assert cache.num_tokens(r) == model.tokens[r]
            assert len(cache.block_table(r)) == expected_blocks(model.tokens[r], cache.min_ratio, block_size)
        for r, _ in plan:
            dirty_slot(cache, cache.slot(r))  # ops would now write the state of scheduled requests
        cache.check_invariants()
    for r in cache.active_requests:
        cache.release(r)
    cache.check_invariants()
    assert cache.num_free_blocks == cache.num_blocks and cache.num_free_slots == cache.max_requests
    assert cache.memory_in_use() == 0


def test_reused_slot_is_reset():
    cache = HybridCache(TINY, layers=range(5), max_requests=2, num_blocks=8)
    slot = cache.add_request("a")
    cache.prepare_forward({"a": 50})
    dirty_slot(cache, slot)
    cache.release("a")
    slot2 = cache.add_request("b")
    assert slot2 == slot  # LIFO slot reuse
    for layer in range(5):
        lc = cache.layer(layer)
        assert (lc.ring_positions[slot] == -1).all() and not lc.ring[slot].any()
        for name, t in lc.state.items():
            if name.endswith("_kv"):
                assert (t[slot] == 0).all(), name
            if name.endswith("_gate"):
                assert (t[slot] == float("-inf")).all(), name
    assert set(cache.layer(1).state) >= {"tail_kv", "tail_gate", "prev_kv", "prev_gate", "index_tail_kv",
                                          "index_tail_gate", "index_prev_kv", "index_prev_gate"}
    assert cache.layer(1).state["tail_kv"].shape == (2, 4, 1024)
    assert cache.layer(2).state["tail_gate"].shape == (2, 16, 512)
    cache.check_invariants()


def test_layer_view_and_memory():
    cache = HybridCache(TINY, layers=range(5), max_requests=3, num_blocks=5)
    csa, hca, swa = cache.layer(1), cache.layer(2), cache.layer(4)
    assert csa.kv_pages.shape == (5, csa.schema.kv_page_bytes) and csa.index_pages.shape == (5, 64 * 68)
    assert hca.kv_pages.shape == (5, hca.schema.kv_page_bytes) and hca.index_pages is None
    assert swa.kv_pages is None and swa.ring.shape == (3, swa.schema.ring_page_bytes)
    assert swa.ring_positions.dtype == torch.int32 and swa.ring_positions.shape == (3, 16)
    # tensors are shared with the cache (views, not copies)
    csa.kv_pages[0, 0] = 1
    assert cache.pool.kv_pages(1)[0, 0] == 1
    with pytest.raises(KeyError, match="layer 7 is not cached"):
        HybridCache(TINY, layers=[1], num_blocks=1).layer(7)
    total = sum(t.numel() * t.element_size() for d in cache.state.tensors.values() for t in d.values())
    total += sum(t.numel() * t.element_size() for d in cache.pool.tensors.values() for t in d.values())
    assert cache.memory_bytes() == total
    assert cache.memory_in_use() == 0
    cache.add_request("a")
    cache.prepare_forward({"a": 300})  # 300 // 4 * 4 = 300 → 2 blocks of 256
    per_block = sum(s.pool_bytes_per_block for s in cache.schemas.values())
    per_slot = sum(s.state_bytes_per_request for s in cache.schemas.values())
    assert cache.block_table("a") == [0, 1]
    assert cache.memory_in_use() == 2 * per_block + per_slot
    assert "HybridCache(tiny" in repr(cache) and "2/5" in repr(cache)


def test_memory_bytes_constructor():
    per = HybridCache(TINY, max_requests=2, num_blocks=1)
    per_block = sum(s.pool_bytes_per_block for s in per.schemas.values())
    fixed = per.state.nbytes()
    c = HybridCache(TINY, max_requests=2, memory_bytes=fixed + 3 * per_block + per_block - 1)
    assert c.num_blocks == 3 and c.memory_bytes() <= fixed + 4 * per_block
    with pytest.raises(InvalidPlanError, match="cannot hold the fixed state of 2 slots"):
        HybridCache(TINY, max_requests=2, memory_bytes=fixed - 1)
    with pytest.raises(InvalidPlanError, match="exactly one of num_blocks / memory_bytes"):
        HybridCache(TINY, num_blocks=1, memory_bytes=10**9)
    with pytest.raises(InvalidPlanError, match="exactly one"):
        HybridCache(TINY)
    swa_only = HybridCache(TINY, layers=[0, 4], max_requests=2, memory_bytes=10**8)
    assert swa_only.num_blocks == 0
    swa_only.add_request("a")
    b = swa_only.prepare_forward({"a": 1000})
    assert b.block_tables.shape == (1, 0) and b.ratios == () and swa_only.block_table("a") == []


def test_decode_steps_emit_at_window_close():
    cache = HybridCache(TINY, layers=[1, 2], max_requests=1, num_blocks=4, block_size=16)
    cache.add_request("a")
    emitted = {4: [], 16: []}
    for t in range(40):
        b = cache.prepare_forward([("a", 1)])
        for m in (4, 16):
            emitted[m] += b.emit_entry[m].tolist()
            assert b.visible_entries[m].tolist() == [(t + 1) // m]
            assert b.num_emit[m] == int((t + 1) % m == 0)
    assert emitted[4] == list(range(10)) and emitted[16] == [0, 1]
    assert len(cache.block_table("a")) == 3  # 40 tokens, 10 CSA entries × 4 = 40 positions → 3 blocks of 16


# ------------------------------------------------------------------------------------------ errors are atomic
def busy_cache() -> HybridCache:
    cache = HybridCache(TINY, layers=range(5), max_requests=3, num_blocks=4, block_size=16)
    cache.add_request("a")
    cache.add_request("b")
    cache.prepare_forward({"a": 30, "b": 7})
    dirty_slot(cache, cache.slot("a"))
    cache.layer(1).kv_pages.random_(0, 256, generator=torch.Generator().manual_seed(0))
    return cache


@pytest.mark.parametrize(
    "plan,exc,msg",
    [
        ({}, InvalidPlanError, "empty plan"),
        ([], InvalidPlanError, "empty plan"),
        ({"zz": 1}, UnknownRequestError, "unknown request 'zz'"),
        ({"a": 1, "zz": 1}, UnknownRequestError, "unknown request 'zz'"),
        ([("a", 1), ("b", 2), ("a", 1)], InvalidPlanError, "request 'a' appears more than once"),
        ({"a": 0}, InvalidPlanError, "request 'a': new-token count must be >= 1, got 0"),
        ({"b": 1, "a": -3}, InvalidPlanError, "must be >= 1, got -3"),
        ({"a": 2.0}, InvalidPlanError, "must be an int, got float"),
        ({"a": True}, InvalidPlanError, "must be an int, got bool"),
        ({"a": "3"}, InvalidPlanError, "must be an int, got str"),
        ({"a": 1, "b": TINY.max_position}, InvalidPlanError, "exceeds max_position 65536"),
        ([("a", 1, 2)], InvalidPlanError, "pairs"),
        ("a", InvalidPlanError, "mapping or a sequence"),
        ({"a": 16, "b": 100}, CacheFullError, "step needs 7 new blocks .* only 1 of 4 are free"),
    ],
)
def test_prepare_forward_errors_leave_cache_unchanged(plan, exc, msg):
    cache = busy_cache()
    snap = cache.snapshot()
    with pytest.raises(exc, match=msg):
        cache.prepare_forward(plan)
    cache.assert_same(snap)
    assert cache.equal_to_snapshot(snap)
    cache.check_invariants()


def test_request_errors_leave_cache_unchanged():
    cache = busy_cache()
    snap = cache.snapshot()
    with pytest.raises(DuplicateRequestError, match="request 'a' is already active"):
        cache.add_request("a")
    with pytest.raises(UnknownRequestError, match="unknown request 'nope'"):
        cache.release("nope")
    with pytest.raises(UnknownRequestError):
        cache.num_tokens("nope")
    with pytest.raises(TypeError, match="request ids are str"):
        cache.add_request(3)
    cache.assert_same(snap)
    cache.add_request("c")
    snap = cache.snapshot()
    with pytest.raises(CacheFullError, match="cannot add request 'd': all 3 state slots are in use"):
        cache.add_request("d")
    cache.assert_same(snap)
    cache.check_invariants()


def test_snapshot_detects_changes():
    cache = busy_cache()
    snap = cache.snapshot()
    cache.layer(2).state["tail_kv"][0, 0, 0] = 1.5
    assert not cache.equal_to_snapshot(snap)
    with pytest.raises(AssertionError, match="state', 2, 'tail_kv"):
        cache.assert_same(snap)
    cache2 = busy_cache()
    snap2 = cache2.snapshot()
    cache2.prepare_forward({"b": 1})
    assert "request records" in " ".join(cache2.differences(snap2))


def test_exact_fill_of_pool_then_full():
    cache = HybridCache(TINY, layers=[1], max_requests=2, num_blocks=2, block_size=16)
    cache.add_request("a")
    cache.prepare_forward({"a": 35})  # 8 entries × 4 = 32 positions → 2 blocks; 3 pending tokens need none
    assert cache.num_free_blocks == 0 and cache.num_tokens("a") == 35
    snap = cache.snapshot()
    with pytest.raises(CacheFullError, match="needs 1 new blocks .*'a': 1.* only 0 of 2"):
        cache.prepare_forward({"a": 1})  # token 35 closes window 8 → entry at position 32 → block 2
    cache.assert_same(snap)
    cache.release("a")
    assert cache.num_free_blocks == 2
