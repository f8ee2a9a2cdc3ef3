"""Continuous batching with chunked prefill under a token budget (host side only; no tensors).

Each ``schedule()`` builds one step's plan, in this order:

1. **decode**: every running request past its prompt gets ``min(decode_tokens, remaining)`` tokens, least
   recently scheduled first, while the token budget lasts;
2. **prefill** of running requests whose prompt is not done (admission order), one chunk each, as large as the
   remaining budget allows (and ``max_prefill_chunk``);
3. **admission** of waiting requests, first come first served, while budget, state slots, ``max_running`` and
   cache blocks allow; each admitted request gets its first prefill chunk in the same step.

Admission reserves the blocks a request needs for its *whole* length (``prompt_len + gen_len``), counting what
running requests still have to grow into, so a running request never meets a full cache: requests wait instead
of failing, and ``HybridCache.prepare_forward`` never raises ``CacheFullError``. A request that could not fit
even in an empty cache is rejected when it is added (``RequestTooLargeError``). FCFS without skipping: a large
request at the head of the queue is not starved by smaller ones behind it.

Plan order (= token order in the step): decodes first, then prefill chunks.

With prefix caching (``SchedulerConfig.prefix_caching``, a cache with ``prefix_states``), a request is added to the
cache with its prompt's token ids and starts at the cached prefix it hits (``Request.cached_tokens``); its
admission reserves only the blocks it will allocate (plus the cached ones it takes out of the evictable pool), and
a request waits while a running request computes a longer prefix of its prompt than the cache holds
(``dsv4.engine.prefix_plan``). Cached prefix blocks no running request uses count as available: the cache evicts
them when blocks are needed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..cache import HybridCache, blocks_for_tokens
from .prefix_plan import PrefixPlanner
from .requests import Request

__all__ = ["RequestTooLargeError", "ScheduledStep", "Scheduler", "SchedulerConfig"]


class RequestTooLargeError(ValueError):
    """The request can never run with this cache (too long for ``max_position`` or for the whole pool)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling limits.

    Attributes:
        max_batched_tokens: token budget of one step (decode + prefill tokens).
        max_running: most requests admitted at once (default: the cache's free state slots).
        decode_tokens: tokens per decode step per request (1; 2–4 model speculative / MTP decoding).
        max_prefill_chunk: largest prefill chunk of one request in one step (default: the budget).
        prefix_caching: add requests with their prompts' token ids, reuse cached prefixes, hold admissions for a
            prefix another request is computing (the cache needs ``prefix_states`` > 0).
    """

    max_batched_tokens: int = 2048
    max_running: int | None = None
    decode_tokens: int = 1
    max_prefill_chunk: int | None = None
    prefix_caching: bool = False

    def __post_init__(self) -> None:
        if self.max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens must be >= 1, got {self.max_batched_tokens}")
        if not 1 <= self.decode_tokens <= 4:
            raise ValueError(f"decode_tokens must be in 1..4, got {self.decode_tokens}")
        if self.max_running is not None and self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.max_prefill_chunk is not None and self.max_prefill_chunk < 1:
            raise ValueError(f"max_prefill_chunk must be >= 1, got {self.max_prefill_chunk}")


@dataclass
class ScheduledStep:
    """One step's plan.

    Attributes:
        step: engine step number.
        plan: ``[(request_id, num_new)]`` in token order (decodes first, then prefill chunks).
        num_decode_tokens / num_prefill_tokens: tokens of each phase in the step.
        decode_ids: requests decoding in this step (prefix of ``plan``).
        admitted: requests admitted in this step.
    """

    step: int
    plan: list[tuple[str, int]]
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    decode_ids: list[str] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens

    @property
    def is_decode_only(self) -> bool:
        return self.num_prefill_tokens == 0 and self.num_decode_tokens > 0


class Scheduler:
    """Continuous-batching scheduler over a ``HybridCache`` (which it uses for slots and block accounting).

    Args:
        cache: the cache the engine runs on. The scheduler calls ``add_request`` on admission and ``release``
            when a request finishes; the engine calls ``prepare_forward`` with the plan.
        config: limits.
    """

    def __init__(self, cache: HybridCache, config: SchedulerConfig | None = None) -> None:
        self.cache = cache
        self.config = config or SchedulerConfig()
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self.finished: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.step_no = 0
        self._blocked_reason: str | None = None
        if self.config.prefix_caching and not cache.prefix.enabled:
            raise ValueError("prefix_caching needs a cache with prefix_states > 0")
        self.prefix = PrefixPlanner(cache) if self.config.prefix_caching else None

    # ------------------------------------------------------------------ capacity
    def blocks_needed(self, num_tokens: int) -> int:
        """Pool blocks a request of ``num_tokens`` tokens holds."""
        return blocks_for_tokens(num_tokens, self.cache.min_ratio, self.cache.block_size)

    def reserved_blocks(self) -> int:
        """Blocks running requests will still allocate before they finish."""
        return sum(
            max(self.blocks_needed(r.total_len) - len(self.cache.block_table(r.request_id)), 0)
            for r in self.running.values()
        )

    def available_blocks(self) -> int:
        """Free (or evictable cached) blocks not promised to running requests."""
        return self.cache.num_reclaimable_blocks - self.reserved_blocks()

    @property
    def max_running(self) -> int:
        """Admission limit on concurrently running requests."""
        slots = len(self.running) + self.cache.num_free_slots
        return slots if self.config.max_running is None else min(self.config.max_running, slots)

    # ------------------------------------------------------------------ requests
    def add(self, request: Request) -> None:
        """Queue a request (it waits until it has arrived and fits).

        Raises:
            ValueError: duplicate id.
            RequestTooLargeError: it could never run with this cache.
        """
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        cfg = self.cache.cfg
        if request.total_len > cfg.max_position:
            raise RequestTooLargeError(
                f"request {request.request_id!r}: {request.prompt_len} + {request.gen_len} tokens exceeds "
                f"max_position {cfg.max_position}"
            )
        if self.prefix is not None and request.token_ids is None:
            raise ValueError(f"request {request.request_id!r}: prefix caching needs the prompt's token ids")
        usable = self.cache.num_reclaimable_blocks + sum(len(self.cache.block_table(r)) for r in self.running)
        need = self.blocks_needed(request.total_len)
        if need > usable:
            raise RequestTooLargeError(
                f"request {request.request_id!r} needs {need} pool blocks for {request.total_len} tokens but the "
                f"cache has {usable} for requests in all; give the cache more memory"
            )
        if request.number < 0:
            request.number = len(self.requests)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.prefix is not None:
            self.prefix.add(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def blocked_reason(self) -> str | None:
        """Why the head of the queue was not admitted in the last step (``None`` if it was, or none waited)."""
        return self._blocked_reason

    # ------------------------------------------------------------------ one step
    def schedule(self) -> ScheduledStep | None:
        """The next step's plan (admitting requests into the cache), or ``None`` when nothing can run now
        (no work, or every waiting request has yet to arrive)."""
        cfg = self.config
        budget = cfg.max_batched_tokens
        step = ScheduledStep(step=self.step_no, plan=[])
        if self.prefix is not None:
            self.cache.publish_prefixes()  # the last step ran: its prefixes can be hit from now on
        # 1. decode
        decoders = sorted(
            (r for r in self.running.values() if not r.in_prefill), key=lambda r: (r.last_scheduled, r.number)
        )
        for r in decoders:
            n = min(cfg.decode_tokens, r.remaining, budget)
            if n <= 0:
                break
            step.plan.append((r.request_id, n))
            step.decode_ids.append(r.request_id)
            step.num_decode_tokens += n
            budget -= n
        # 2. prefill of running requests
        chunk_cap = cfg.max_prefill_chunk or cfg.max_batched_tokens
        for r in self.running.values():
            if budget <= 0:
                break
            if r.in_prefill:
                n = min(r.remaining_prompt, budget, chunk_cap)
                step.plan.append((r.request_id, n))
                step.num_prefill_tokens += n
                budget -= n
        # 3. admission (FCFS; with prefix caching, requests waiting for an in-flight prefix are passed over)
        self._blocked_reason = None
        avail: int | None = None  # computed when a request is first considered (nothing waits in steady decode)
        passed: list[Request] = []
        while self.waiting and budget > 0:
            if avail is None:
                avail = self.available_blocks()
            r = self.waiting[0]
            if r.arrival_step > self.step_no:
                self._blocked_reason = "not arrived"
                break
            if len(self.running) >= self.max_running:
                self._blocked_reason = "max running requests"
                break
            need = self.blocks_needed(r.total_len)
            if self.prefix is not None:
                owner = self.prefix.waits_for(r, self.running.values())
                if owner is not None:
                    self._blocked_reason = f"waiting for the prefix request {owner!r} is computing"
                    passed.append(self.waiting.popleft())
                    continue
                path = self.prefix.hit(r)
                need += sum(n.users == 0 for n in path) - (len(path) if self.cache.min_ratio else 0)
            if need > avail:
                self._blocked_reason = f"cache full ({avail} blocks free after reservations, {need} needed)"
                break
            self.waiting.popleft()
            self.cache.add_request(r.request_id, r.token_ids if self.prefix is not None else None)
            r.cached_tokens = r.num_computed = self.cache.num_tokens(r.request_id)
            self.running[r.request_id] = r
            r.admitted_step = self.step_no
            avail -= need
            n = min(r.remaining_prompt, budget, chunk_cap)
            step.plan.append((r.request_id, n))
            step.admitted.append(r.request_id)
            step.num_prefill_tokens += n
            budget -= n
        self.waiting.extendleft(reversed(passed))
        if not step.plan:
            return None
        return step

    def commit(self, step: ScheduledStep, now_s: float | None = None) -> list[Request]:
        """Advance the requests of a step that ran; release the finished ones (cache blocks and slot).
        Returns the requests that finished."""
        done = []
        for rid, n in step.plan:
            r = self.running[rid]
            was_prefill = r.in_prefill
            r.num_computed += n
            r.last_scheduled = step.step
            if was_prefill and not r.in_prefill:
                r.prefill_done_step = step.step
                r.first_token_s = now_s
            if r.done:
                r.finished_step = step.step
                r.finished_s = now_s
                self.cache.release(rid)
                if self.prefix is not None:
                    self.prefix.remove(rid)
                del self.running[rid]
                self.finished.append(r)
                done.append(r)
        self.step_no += 1
        return done

    def skip_step(self) -> None:
        """Advance the step counter without running anything (waiting requests have not arrived yet)."""
        self.step_no += 1
