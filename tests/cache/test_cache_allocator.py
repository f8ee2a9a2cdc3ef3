"""Block allocator (dsv4.cache.allocator)."""

import random

import pytest

from dsv4.cache import BlockAllocator, CacheFullError


def test_random_alloc_free_keeps_invariants():
    rng = random.Random(0)
    for trial in range(20):
        a = BlockAllocator(rng.randint(0, 40))
        owned: list[list[int]] = []  # each entry: one reference to each of these blocks
        for _ in range(200):
            op = rng.random()
            if op < 0.45:
                n = rng.randint(0, 6)
                if n > a.num_free:
                    free_before = a.state()
                    with pytest.raises(CacheFullError):
                        a.allocate(n)
                    assert a.state() == free_before
                else:
                    got = a.allocate(n)
                    assert len(set(got)) == n
                    owned.append(got)
            elif op < 0.6 and owned:
                share = rng.choice(owned)
                a.incref(share)
                owned.append(list(share))
            elif owned:
                a.decref(owned.pop(rng.randrange(len(owned))))
            a.check_invariants()
            refs = {}
            for group in owned:
                for b in group:
                    refs[b] = refs.get(b, 0) + 1
            assert all(a.refcount(b) == refs.get(b, 0) for b in range(a.num_blocks))
            assert a.num_free == a.num_blocks - len(refs)
        for group in owned:
            a.decref(group)
        a.check_invariants()
        assert a.num_free == a.num_blocks


def test_lifo_and_fresh_order():
    a = BlockAllocator(4)
    assert a.allocate(2) == [0, 1]
    a.decref([0])
    assert a.allocate(1) == [0]  # last freed comes back first


def test_double_free_raises_and_changes_nothing():
    a = BlockAllocator(4)
    blocks = a.allocate(2)
    a.decref(blocks)
    snap = a.state()
    with pytest.raises(ValueError, match="double free.*free block 0"):
        a.decref([0])
    b = a.allocate(1)[0]
    snap = a.state()
    with pytest.raises(ValueError, match="double free"):
        a.decref([b, b])  # one reference, dropped twice
    assert a.state() == snap
    with pytest.raises(ValueError, match="incref of free block"):
        a.incref([3])
    with pytest.raises(ValueError, match="invalid block id 9"):
        a.decref([9])
    assert a.state() == snap
    a.check_invariants()


def test_exhaustion_takes_nothing():
    a = BlockAllocator(5)
    a.allocate(3)
    snap = a.state()
    with pytest.raises(CacheFullError, match="need 3 blocks but only 2 of 5 are free"):
        a.allocate(3)
    assert a.state() == snap and a.num_free == 2
    assert a.allocate(0) == []


def test_shared_block_freed_at_last_reference():
    a = BlockAllocator(2)
    [b] = a.allocate(1)
    a.incref([b])
    assert a.decref([b]) == [] and a.refcount(b) == 1 and a.num_free == 1
    assert a.decref([b]) == [b] and a.num_free == 2
    a.check_invariants()
