"""Step accounting: binds every ``StepBatch`` to the cache state it was prepared for, and counts the layers that
run it (host side only: a few integer compares per layer and step, no device work).

The cache keeps a *generation*, bumped by every mutating call (``add_request``, ``release``, ``restore_request``,
``preempt_request``, ``prepare_forward``). ``prepare_forward`` stamps its batch with a ``StepTicket`` (the cache's
identity and the new generation), so a batch is *current* until the next mutating call. A layer may write a step
only through its current batch, once per layer:

* a batch prepared before a later mutating call, by another cache, or not by ``prepare_forward`` at all →
  ``StaleBatchError`` (its slots and blocks may belong to other requests by now);
* a layer running a step twice → ``StepOrderError`` (the ring and compressor tails would take the tokens twice).

A step is *complete* when every cached layer has run it. While it is *partly run* (some layers did, others did
not), only the remaining layers and ``release`` may touch the cache: a new ``prepare_forward``, ``add_request``,
``restore_request``, ``save_request`` / ``preempt_request`` of one of its requests raise ``StepOrderError``.
A step that *no* layer ran is a positions-only step (cache tests and benchmarks use it to advance positions):
when the next mutating call supersedes it, its requests are marked as lacking the data of those positions, and a
layer asked to run a later step of such a request raises ``StepOrderError`` (release it and recompute, or
restore a snapshot). ``HybridCache.claim_step`` records layers as run for a step whose data is written by other
means (a CUDA-graph replay, which runs no Python; or a caller that fills the cache itself).

CUDA graphs: the static batch a graph is captured on holds only pad rows (``pad_step_batch`` with no requests)
and carries a *pad* ticket, which layers run without accounting; copying a step into it (``StepBatch.copy_``)
hands it that step's ticket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Sequence

from .errors import StaleBatchError, StepOrderError

if TYPE_CHECKING:
    from .batch import StepBatch
    from .records import RequestRecord

__all__ = ["StepLedger", "StepTicket"]

STEP, PAD = "step", "pad"


@dataclass(frozen=True)
class StepTicket:
    """What a ``StepBatch`` is bound to.

    Attributes:
        owner: the identity token of the ``HybridCache`` that prepared it.
        generation: the cache's generation right after ``prepare_forward`` (the batch is current while the cache
            still has it); −1 for pad tickets.
        step: the step's number (1, 2, … per cache), for messages.
        kind: ``"step"`` (a prepared step) or ``"pad"`` (a CUDA-graph static batch of pad rows only).
    """

    owner: object
    generation: int
    step: int
    kind: str = STEP


@dataclass
class _OpenStep:
    """The latest prepared step: its ticket, requests (id → (start, end) positions), the layers that ran it, and
    the data problems of its requests when it was prepared (request id → description)."""

    ticket: StepTicket
    requests: dict[str, tuple[int, int]]
    num_new: tuple[int, ...]
    run: set[int] = field(default_factory=set)
    missing: dict[str, str] = field(default_factory=dict)


class StepLedger:
    """The step accounting of one ``HybridCache`` (see the module docstring).

    Attributes:
        layers: the cached layer indices (every one must run every step).
        generation: bumped by every mutating call of the cache.
        steps: steps prepared so far.
        last_change: the latest mutating call, for messages (e.g. ``"release('b')"``).
    """

    def __init__(self, layers: Iterable[int]) -> None:
        self.owner = object()
        self.layers = frozenset(layers)
        self.generation = 0
        self.steps = 0
        self.last_change = "the cache was created"
        self._open: _OpenStep | None = None

    # ---------------------------------------------------------------- state
    def state(self) -> tuple:
        """A comparable summary (snapshots): generation, steps, and the open step's number and layers run."""
        op = self._open
        return (self.generation, self.steps, None if op is None else (op.ticket.step, frozenset(op.run)))

    def _partial(self) -> _OpenStep | None:
        op = self._open
        return op if op is not None and op.run and not self.layers <= op.run else None

    def _describe(self, op: _OpenStep) -> str:
        reqs = ", ".join(f"{rid!r} {s}..{e - 1}" for rid, (s, e) in op.requests.items())
        return f"step {op.ticket.step} ({reqs})"

    def _not_run(self, op: _OpenStep) -> list[int]:
        return sorted(self.layers - op.run)

    # ---------------------------------------------------------------- mutating calls of the cache
    def check_mutation(self, action: str, request_id: str | None = None) -> None:
        """``StepOrderError`` if ``action`` may not run now: the current step is partly run and ``action`` is not a
        ``release`` (for ``save`` / ``preempt``: only when ``request_id`` is one of the step's requests)."""
        op = self._partial()
        if op is None or action == "release":
            return
        if action in ("save", "preempt") and request_id not in op.requests:
            return
        raise StepOrderError(
            f"cannot {action} now: {self._describe(op)} ran in layers {sorted(op.run)} but not yet in "
            f"{self._not_run(op)}; run those layers on its batch first (or release its requests)"
        )

    def commit_mutation(self, action: str, records: dict[str, RequestRecord]) -> None:
        """After a mutating call succeeded: supersede the open step (its requests still active are marked as
        lacking the data of its positions unless every layer ran it) and bump the generation."""
        op = self._open
        if op is not None and not self.layers <= op.run:
            why = "no layer ran it" if not op.run else f"layers {self._not_run(op)} did not run it"
            for rid, (s, e) in op.requests.items():
                rec = records.get(rid)
                if rec is not None and rec.missing is None:
                    rec.missing = f"positions {s}..{e - 1} were prepared in step {op.ticket.step} but {why}"
        self._open = None
        self.generation += 1
        self.last_change = action

    def open_step(self, records: dict[str, RequestRecord], plan: Sequence[tuple[str, int]]) -> StepTicket:
        """Register the step ``prepare_forward`` just committed (call right after ``commit_mutation``); returns
        the ticket for its batch. ``plan``: (request id, new tokens), plan order; ``records`` already advanced."""
        self.steps += 1
        ticket = StepTicket(self.owner, self.generation, self.steps)
        requests = {rid: (records[rid].num_tokens - n, records[rid].num_tokens) for rid, n in plan}
        missing = {rid: records[rid].missing for rid, _ in plan if records[rid].missing is not None}
        self._open = _OpenStep(ticket, requests, tuple(n for _, n in plan), missing=missing)
        return ticket

    def pad_ticket(self, step: int) -> StepTicket:
        """A ticket layers run without accounting (CUDA-graph static batches; ``HybridCache.repeatable``)."""
        return StepTicket(self.owner, -1, step, PAD)

    # ---------------------------------------------------------------- layers running a step
    def check(self, batch: StepBatch, layers: Iterable[int]) -> _OpenStep | None:
        """Raise unless every layer of ``layers`` may write ``batch``'s step now; returns the open step (``None``
        for a pad batch, which is not accounted). Changes nothing."""
        ticket = getattr(batch, "ticket", None)
        if ticket is None:
            raise StaleBatchError(
                "batch was not prepared by HybridCache.prepare_forward (a StepBatch built directly is not bound to "
                "any cache state); prepare the step with the cache the layer writes"
            )
        if ticket.owner is not self.owner:
            raise StaleBatchError(f"batch of step {ticket.step} was prepared by another HybridCache, not this one")
        if ticket.kind == PAD:
            return None
        op = self._open
        if op is None or ticket.generation != self.generation or op.ticket.generation != ticket.generation:
            raise StaleBatchError(
                f"batch of step {ticket.step} is stale: the cache changed since it was prepared (latest change: "
                f"{self.last_change}); its slots and blocks may belong to other requests now — prepare a new step"
            )
        again = sorted(set(layers) & op.run)
        if again:
            raise StepOrderError(f"layer {again[0]} already ran step {ticket.step}; a layer runs each step once")
        unknown = sorted(set(layers) - self.layers)
        if unknown:
            raise StepOrderError(f"layers {unknown} are not cached (cached layers: {sorted(self.layers)})")
        if op.missing:
            rid, why = next(iter(op.missing.items()))
            raise StepOrderError(
                f"request {rid!r} lacks cache data ({why}), so step {ticket.step} cannot run on it; release it "
                f"(and recompute it from its tokens, or restore a snapshot saved before)"
            )
        return op

    def claim(self, batch: StepBatch, layers: Iterable[int]) -> list[int]:
        """``check``, then record ``layers`` as having run the step; returns the layers recorded (empty for a pad
        batch), which ``unclaim`` takes back (a layer whose writes were rolled back)."""
        layers = list(layers)
        op = self.check(batch, layers)
        if op is None:
            return []
        op.run.update(layers)
        return layers

    def unclaim(self, batch: StepBatch, layers: Iterable[int]) -> None:
        """Take back ``claim`` of ``layers`` for the still-current ``batch`` (after a rollback)."""
        op = self._open
        ticket = getattr(batch, "ticket", None)
        if op is not None and ticket is not None and ticket.generation == op.ticket.generation:
            op.run.difference_update(layers)

    def remaining(self) -> list[int]:
        """Cached layers that have not run the open step (all of them when there is none)."""
        return self._not_run(self._open) if self._open is not None else sorted(self.layers)

    # ---------------------------------------------------------------- snapshots and graphs
    def unwritten(self, request_id: str) -> str | None:
        """Why ``request_id``'s cache lacks data of the open step (``None`` if it is not in an incomplete step)."""
        op = self._open
        if op is None or request_id not in op.requests or self.layers <= op.run:
            return None
        s, e = op.requests[request_id]
        return f"positions {s}..{e - 1} were prepared in step {op.ticket.step} but no layer had run it when it was saved"

    def graph_ticket(self, request_ids: Sequence[str], num_new: Sequence[int]) -> StepTicket:
        """The ticket of a padded CUDA-graph batch: a pad ticket when it holds no request, else the open step's
        (``request_ids`` / ``num_new`` must be exactly that step's, in plan order)."""
        if not request_ids:
            return StepTicket(self.owner, -1, 0, PAD)
        op = self._open
        if op is None or list(op.requests) != list(request_ids) or op.num_new != tuple(num_new):
            raise StaleBatchError(
                f"a padded batch of requests {list(request_ids)} is not the cache's current step "
                f"({'none' if op is None else list(op.requests)}); call prepare_forward with their plan first"
            )
        return op.ticket
