"""The scheduler's view of shared prompt prefixes, for prefix caching (``dsv4.cache.prefix``).

A prefix can only be hit where a request's step *ended* on a block boundary (the cache snapshots the request
state there). So the scheduler, knowing every unfinished request's prompt, makes the steps end where hits will be
wanted and lets requests wait for a prefix that another request is computing:

* **chunk ends** (``chunk_end``): a prefill chunk stops at the first *fork point* inside it — a block boundary
  where the prefix another unfinished request can hit (whole blocks, at most its prompt minus one token) stops
  being shared — else at the last block boundary inside it (unless it is the prompt's last chunk), so every
  chunk end can be hit later (e.g. by a follow-up turn);
* **waiting for an in-flight prefix** (``waits_for``): a request whose prompt shares more whole blocks with a
  running request's unfinished prompt than the cache holds now is not admitted until that request has passed
  the shared part (its chunk then ends there: a fork point): it is then admitted with a hit instead of computing
  the same tokens a second time.

Prompts are compared by the cache's chain keys (one per whole block), counted over the unfinished requests.
"""

from __future__ import annotations

from array import array
from collections import Counter
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
        self.keys: dict[str, list[bytes]] = {}  # request id -> keys of its prompt's whole blocks
        self.caps: dict[str, int] = {}  # request id -> blocks a hit may take, (prompt_len - 1) // bs
        self.hittable: Counter[bytes] = Counter()  # key -> unfinished requests that may hit through it

    def add(self, r: Request) -> None:
        assert r.token_ids is not None
        ids = array("q", r.token_ids)
        keys = self.cache.prefix.chain_keys(ids, len(ids) // self.bs)
        self.keys[r.request_id] = keys
        self.caps[r.request_id] = cap = (len(ids) - 1) // self.bs
        self.hittable.update(keys[:cap])

    def remove(self, rid: str) -> None:
        keys = self.keys.pop(rid, None)
        if keys is not None:
            self.hittable.subtract(keys[: self.caps.pop(rid)])

    def _others(self, rid: str, j: int) -> int:
        """Other unfinished requests that may hit through ``rid``'s first ``j`` blocks."""
        keys = self.keys[rid]
        if j > len(keys) or j < 1:
            return 0
        return self.hittable[keys[j - 1]] - (self.caps[rid] >= j)

    def chunk_end(self, r: Request, start: int, end: int) -> int:
        """Where a prefill chunk of ``r`` covering ``[start, end)`` should end (see the module docstring)."""
        bs = self.bs
        for j in range(start // bs + 1, (end - 1) // bs + 1):  # boundaries strictly inside (start, end)
            others = self._others(r.request_id, j)
            if others and self._others(r.request_id, j + 1) < others:
                return j * bs
        aligned = (end // bs) * bs
        return aligned if end < r.prompt_len and aligned > start else end

    def hit(self, r: Request) -> list[PrefixNode]:
        """The cached prefix ``r`` would get if it were added now."""
        return self.cache.prefix.lookup_keys(self.keys[r.request_id][: self.caps[r.request_id]])

    def waits_for(self, r: Request, running: Iterable[Request]) -> str | None:
        """The id of a running request that is computing a longer prefix of ``r``'s prompt than the cache holds
        now (``r`` should wait for it), else ``None``."""
        have = len(self.hit(r)) * self.bs
        mine = self.keys[r.request_id][: self.caps[r.request_id]]
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
