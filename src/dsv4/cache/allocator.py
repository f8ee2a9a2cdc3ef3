"""Host-side block allocator: a LIFO free list and per-block reference counts.

A block is either *free* (refcount 0, exactly once in the free list) or *in use* (refcount ≥ 1, not in the
free list). Reference counts > 1 mean the block is shared (e.g. a common prefix); it returns to the free list
when the last reference is dropped. Every method validates its whole argument before changing anything.
"""

from __future__ import annotations

import numbers
from collections import Counter
from typing import Iterable

from .errors import CacheFullError

__all__ = ["BlockAllocator"]


class BlockAllocator:
    """Free list + reference counts over ``num_blocks`` pool blocks (ids ``0 … num_blocks−1``)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = int(num_blocks)
        self._refcount: list[int] = [0] * self.num_blocks
        # LIFO: the end of the list is the top; low ids come out first on a fresh allocator.
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))

    # ---------------------------------------------------------------- queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return self._refcount[block]

    # ---------------------------------------------------------------- mutation
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (refcount → 1). Raises ``CacheFullError`` before taking anything if fewer than
        ``n`` are free."""
        if not isinstance(n, numbers.Integral) or isinstance(n, bool):
            raise ValueError(f"number of blocks to allocate must be an int, got {type(n).__name__} {n!r}")
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise CacheFullError(f"need {n} blocks but only {len(self._free)} of {self.num_blocks} are free")
        taken = [self._free.pop() for _ in range(n)]
        for b in taken:
            self._refcount[b] = 1
        return taken

    def incref(self, blocks: Iterable[int]) -> None:
        """Add one reference to each listed block (a block listed k times gets k). Blocks must be in use."""
        blocks = list(blocks)
        for b in blocks:
            self._check_id(b)
            if self._refcount[b] == 0:
                raise ValueError(f"incref of free block {b}")
        for b in blocks:
            self._refcount[b] += 1

    def decref(self, blocks: Iterable[int]) -> list[int]:
        """Drop one reference from each listed block; blocks reaching 0 return to the free list. Returns the
        blocks freed. Dropping more references than a block has (e.g. freeing a free block) raises
        ``ValueError`` and changes nothing."""
        blocks = list(blocks)
        for b in blocks:
            self._check_id(b)
        for b, k in Counter(blocks).items():
            if self._refcount[b] < k:
                state = "a free block" if self._refcount[b] == 0 else f"block with refcount {self._refcount[b]}"
                raise ValueError(f"double free: dropping {k} reference(s) of {state} {b}")
        freed = []
        for b in blocks:
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._free.append(b)
                freed.append(b)
        return freed

    free = decref

    # ---------------------------------------------------------------- checks / copies
    def check_invariants(self) -> None:
        """Every block is free with refcount 0 exactly once in the free list, or in use (refcount > 0) and not in
        the free list. Raises ``AssertionError`` naming the first violation."""
        in_free = Counter(self._free)
        for b, k in in_free.items():
            if not 0 <= b < self.num_blocks:
                raise AssertionError(f"free list holds out-of-range block {b}")
            if k != 1:
                raise AssertionError(f"block {b} is {k} times in the free list")
        for b, rc in enumerate(self._refcount):
            if rc < 0:
                raise AssertionError(f"block {b} has negative refcount {rc}")
            if (rc == 0) != (b in in_free):
                raise AssertionError(f"block {b}: refcount {rc} but {'' if b in in_free else 'not '}in the free list")

    def state(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(refcounts, free list)`` — a hashable copy for snapshots."""
        return tuple(self._refcount), tuple(self._free)

    def _check_id(self, b: int) -> None:
        if not isinstance(b, numbers.Integral) or isinstance(b, bool) or not 0 <= b < self.num_blocks:
            raise ValueError(f"invalid block id {b!r} (num_blocks={self.num_blocks})")

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self.num_blocks}, free={self.num_free})"
