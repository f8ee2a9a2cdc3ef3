"""Validation of a step's plan for ``HybridCache.prepare_forward``: its form, its requests and new-token counts,
the step's token budget, and how many new pool blocks each request needs. Host checks only; nothing changes.

A plan maps request id → number of new tokens, as a mapping or a sequence of ``(request_id, num_new)`` pairs
(plan order = token order in the step).
"""

from __future__ import annotations

import numbers
from typing import Callable, Mapping, Sequence

from .errors import InvalidPlanError
from .records import RequestRecord
from .schema import blocks_for_tokens

__all__ = ["Plan", "check_int", "check_plan_requests", "normalise_plan"]

Plan = Mapping[str, int] | Sequence[tuple[str, int]]


def check_int(name: str, value: object, minimum: int) -> None:
    """``InvalidPlanError`` unless ``value`` is an int (not a bool) ``>= minimum``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise InvalidPlanError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise InvalidPlanError(f"{name} must be >= {minimum}, got {value}")


def normalise_plan(plan: Plan) -> list[tuple[str, int]]:
    """The plan's ``(request_id, num_new)`` pairs in plan order, as given (their values are checked by
    ``check_plan_requests``). ``InvalidPlanError`` when ``plan`` is neither a mapping nor a sequence of pairs, or
    is empty."""
    if isinstance(plan, Mapping):
        items = list(plan.items())
    elif isinstance(plan, Sequence) and not isinstance(plan, (str, bytes)):
        items = []
        for item in plan:
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise InvalidPlanError(f"plan entries must be (request_id, num_new) pairs, got {item!r}")
            items.append((item[0], item[1]))
    else:
        raise InvalidPlanError(
            f"plan must be a mapping or a sequence of (request_id, num_new) pairs, got {type(plan).__name__}"
        )
    if not items:
        raise InvalidPlanError("empty plan: schedule at least one request")
    return items


def check_plan_requests(
    items: Sequence[tuple[str, int]],
    record: Callable[[str], RequestRecord],
    *,
    max_position: int,
    max_step_tokens: int | None,
    min_ratio: int,
    block_size: int,
) -> list[int]:
    """Check each ``(request_id, num_new)`` of a normalised plan and return the new pool blocks each request needs
    (``blocks_for_tokens(end, min_ratio, block_size)`` minus the blocks it has), in plan order.

    ``record`` gives an active request's record (raising ``UnknownRequestError`` for any other id).

    Raises:
        InvalidPlanError: an id that is not a str or appears twice; a count that is not an int ``>= 1``; a request
            growing past ``max_position``; more than ``max_step_tokens`` new tokens in all.
        UnknownRequestError: an id that is not active (from ``record``).
    """
    seen: set[str] = set()
    needs: list[int] = []
    for rid, n in items:
        if not isinstance(rid, str):
            raise InvalidPlanError(f"plan keys are request ids (str), got {type(rid).__name__} {rid!r}")
        if rid in seen:
            raise InvalidPlanError(f"request {rid!r} appears more than once in the plan")
        seen.add(rid)
        rec = record(rid)
        if type(n) is not int and (not isinstance(n, numbers.Integral) or isinstance(n, bool)):
            raise InvalidPlanError(f"request {rid!r}: new-token count must be an int, got {type(n).__name__} {n!r}")
        if n < 1:
            raise InvalidPlanError(f"request {rid!r}: new-token count must be >= 1, got {n}")
        end = rec.num_tokens + int(n)
        if end > max_position:
            raise InvalidPlanError(
                f"request {rid!r}: {rec.num_tokens} cached + {n} new = {end} tokens exceeds "
                f"max_position {max_position}"
            )
        needs.append(blocks_for_tokens(end, min_ratio, block_size) - len(rec.blocks))
    step_tokens = sum(int(n) for _, n in items)
    if max_step_tokens is not None and step_tokens > max_step_tokens:
        raise InvalidPlanError(
            f"plan schedules {step_tokens} new tokens in all but max_step_tokens is {max_step_tokens}"
        )
    return needs
