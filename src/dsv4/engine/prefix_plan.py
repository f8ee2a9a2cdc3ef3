"""The scheduler's view of shared prompt prefixes, for prefix caching (``dsv4.cache.prefix``).

The cache snapshots a request's state at every block boundary its steps reach (at a step's end, or inside it), so
any whole-block prefix a request has computed can be hit afterwards. What the scheduler adds is **waiting for an
in-flight prefix** (``waits_for``): a request whose prompt shares more whole blocks with a running request's
unfinished prompt than the cache holds now is not admitted until that request has passed the shared part; it is
then admitted with a hit instead of computing the same tokens a second time. Admission also needs the hit a request
would get now (``hit``), to reserve only the blocks it will allocate.

Prompts are compared by the cache's chain keys (one per whole block, ``PrefixCache.chain_keys``).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

from ..cache import HybridCache
from ..cache.prefix import PrefixNode
from .requests import Request

__all__ = ["PrefixPlanner"]


class PrefixPlanner:
    """Chain keys of the unfinished requests' prompts and the decisions taken from them.

    Args:
        cache: the cache (its block size and key function; its prefix cache answers lookups).
    """

    def __init__(self, cache: HybridCache) -> None:
        self.cache = cache
        self.bs = cache.block_size
        self.keys: dict[str, list[bytes]] = {}  # request id -> keys of the blocks a hit may take, (len − 1) // bs

    def add(self, r: Request) -> None:
        assert r.token_ids is not None
        ids = array("q", r.token_ids)
        self.keys[r.request_id] = self.cache.prefix.chain_keys(ids, (len(ids) - 1) // self.bs)

    def remove(self, rid: str) -> None:
        self.keys.pop(rid, None)

    def hit(self, r: Request) -> list[PrefixNode]:
        """The cached prefix ``r`` would get if it were added now."""
        return self.cache.prefix.lookup_keys(self.keys[r.request_id])

    def waits_for(self, r: Request, running: Iterable[Request]) -> str | None:
        """The id of a running request that is computing a longer prefix of ``r``'s prompt than the cache holds
        now (``r`` should wait for it), else ``None``."""
        mine = self.keys[r.request_id]
        have = len(self.hit(r)) * self.bs
        for o in running:
            theirs = self.keys.get(o.request_id)
            if theirs is None or not o.in_prefill:
                continue
            common = 0
            for a, b in zip(mine, theirs):
                if a != b:
                    break
                common += 1
            if common * self.bs > max(have, o.num_computed):
                return o.request_id
        return None
