"""Token-id bookkeeping of an engine's run: every submitted request's token ids (prompt, then generated), laid end
to end on the host so that a step's ids are one gather."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from .hidden import generated_token_ids
from .requests import Request, prompt_token_ids

__all__ = ["lay_out_token_ids", "request_token_ids", "step_token_ids"]


def request_token_ids(r: Request, seed: int, vocab: int) -> Tensor:
    """int64 ``[total_len]`` (CPU) every token id of ``r``: its prompt's (drawn from ``seed`` and stored in
    ``r.token_ids`` if it has none), then the generated ones (``dsv4.engine.hidden.generated_token_ids``)."""
    if r.token_ids is None:
        r.token_ids = prompt_token_ids(seed, r.number, r.prompt_len, vocab)
    gen = generated_token_ids(seed, r.number, torch.arange(r.prompt_len, r.total_len), vocab)
    return torch.cat((torch.tensor(r.token_ids, dtype=torch.int64), gen))


def lay_out_token_ids(ids: dict[str, Tensor]) -> tuple[Tensor, dict[str, int]]:
    """Lay every request's ids (``ids``: request id → int64 ``[total_len]``) end to end; ``ids``' entries become
    views of the result. Returns the int64 ``[Σ total_len]`` ids and request id → where its ids start there."""
    flat = torch.cat(list(ids.values())) if ids else torch.zeros(0, dtype=torch.int64)
    offsets, at = {}, 0
    for rid, t in ids.items():
        offsets[rid] = at
        ids[rid] = flat[at : at + len(t)]
        at += len(t)
    return flat, offsets


def step_token_ids(
    plan: Sequence[tuple[str, int]], starts: Sequence[int], ids: dict[str, Tensor],
    flat: Tensor | None, offsets: dict[str, int] | None,
) -> Tensor:
    """int64 ``[T]`` (CPU) the token ids of a step's tokens: ``plan``'s ``(request id, tokens)`` from ``starts`` on.
    ``ids``: request id → int64 ``[total_len]``; ``flat`` / ``offsets``: their layout (``lay_out_token_ids``), or
    ``None`` (a slice per request)."""
    if offsets is None or flat is None or any(rid not in offsets for rid, _ in plan):
        return torch.cat([ids[rid][s : s + n] for (rid, n), s in zip(plan, starts)])
    # one gather from the submitted requests' ids laid end to end (a slice per request costs more)
    B = len(plan)
    n = np.fromiter((k for _, k in plan), dtype=np.int64, count=B)
    lo = np.fromiter((offsets[rid] for rid, _ in plan), dtype=np.int64, count=B)
    hi = lo + np.fromiter((len(ids[rid]) for rid, _ in plan), dtype=np.int64, count=B)
    first = lo + np.asarray(starts, dtype=np.int64).reshape(B)
    if not B or bool((n < 0).any() or (first < lo).any() or (first + n > hi).any()):
        return torch.cat([ids[rid][s : s + k] for (rid, k), s in zip(plan, starts)])
    idx = np.repeat(first - (np.cumsum(n) - n), n) + np.arange(int(n.sum()), dtype=np.int64)
    return flat[torch.from_numpy(idx)]
