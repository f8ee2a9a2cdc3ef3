"""``check_invariants``: the whole-cache consistency check behind ``HybridCache.check_invariants`` (tests, fuzzing
and debugging; host sync)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from .schema import blocks_for_tokens

if TYPE_CHECKING:
    from .manager import HybridCache

__all__ = ["check_invariants"]


def check_invariants(cache: HybridCache) -> None:
    """Raise ``AssertionError`` on the first broken invariant of ``cache``: allocator consistency; every block's
    refcount equals the number of table references to it plus one if a cached prefix holds it (so no block is freed
    while referenced); tables have exactly the blocks their token counts need; slots are unique and disjoint from
    the free list; free slots hold reset state (host sync); the prefix cache's own invariants — chains, users,
    snapshot rows, no cached block in a request's writable blocks, and every cached block's bytes unchanged since it
    was first checked (no write into a shared block; ``PrefixCache.check_invariants``)."""
    cache.allocator.check_invariants()
    refs: Counter[int] = Counter()
    for rid, rec in cache._requests.items():
        want = blocks_for_tokens(rec.num_tokens, cache.min_ratio, cache.block_size)
        if len(rec.blocks) != want:
            raise AssertionError(f"request {rid!r}: {len(rec.blocks)} blocks for {rec.num_tokens} tokens, want {want}")
        if len(set(rec.blocks)) != len(rec.blocks):
            raise AssertionError(f"request {rid!r}: repeated block in table {rec.blocks}")
        if not 0 <= rec.num_tokens <= cache.cfg.max_position:
            raise AssertionError(f"request {rid!r}: num_tokens {rec.num_tokens} out of range")
        refs.update(rec.blocks)
    refs.update(cache.prefix.cached_blocks())
    refcounts, _ = cache.allocator.state()
    for b, rc in enumerate(refcounts):
        if refs[b] != rc:
            raise AssertionError(f"block {b}: refcount {rc} but referenced by {refs[b]} table / prefix entries")
    used_slots = [rec.slot for rec in cache._requests.values()]
    free_slots = cache.state.free_slots
    if len(set(used_slots)) != len(used_slots):
        raise AssertionError(f"two requests share a state slot: {used_slots}")
    if set(used_slots) & set(free_slots) or len(set(free_slots)) != len(free_slots):
        raise AssertionError(f"slot bookkeeping broken: used {used_slots}, free {list(free_slots)}")
    if len(used_slots) + len(free_slots) != cache.max_requests:
        raise AssertionError(f"{len(used_slots)} used + {len(free_slots)} free != {cache.max_requests} slots")
    for s in free_slots:
        if not cache.state.is_reset(s):
            raise AssertionError(f"free state slot {s} does not hold its reset values")
    cache.prefix.check_invariants()
