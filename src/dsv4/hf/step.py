"""One model step of a transformers batch as dsv4 requests: which tokens are real, and at which positions.

transformers feeds a model ``B`` rows of ``S`` new columns per step. Each row is one dsv4 request that holds only
its **real** tokens: padding never enters the cache, and a row's positions count from its first real token. The
2D ``attention_mask`` says which columns are real; it covers every column the rows have had so far (``P`` past
columns + the ``S`` new ones), and ``generate()`` keeps it that way. Batches must be left-padded: in every row
all pads come before the first real token (``0 … 0 1 … 1``), so a row's real new tokens are its last ``c_b``
columns. Finished rows that ``generate()`` keeps feeding (pad tokens with mask 1) are real tokens like any other.

``row_tokens`` checks the step's inputs against what the cache holds and against each other, and returns a
``RowTokens``; any disagreement raises ``InconsistentInputError`` naming the row and the numbers, before anything
changes. Host syncs: one small transfer for the mask statistics, one for the position check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

__all__ = ["InconsistentInputError", "RowTokens", "row_tokens"]


class InconsistentInputError(ValueError):
    """A step's ``attention_mask`` / ``position_ids`` / ``cache_position`` disagree with the cache or each other."""


@dataclass(frozen=True)
class RowTokens:
    """The real tokens of one model step.

    Attributes:
        batch_size: ``B`` rows.
        num_columns: ``S`` new columns per row.
        past_columns: ``P`` columns the rows had before this step (pads included).
        past_tokens: ``[B]`` real tokens each row's request holds before this step (its next position).
        new_tokens: ``[B]`` real tokens among each row's new columns (``c_b``, 0 … S): its last ``c_b`` columns.
    """

    batch_size: int
    num_columns: int
    past_columns: int
    past_tokens: tuple[int, ...]
    new_tokens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        """``T``: real tokens of the step in all rows."""
        return sum(self.new_tokens)

    def rows(self) -> list[int]:
        """Rows with at least one real token this step, in row order (the dsv4 plan order)."""
        return [b for b, c in enumerate(self.new_tokens) if c]

    def token_index(self, device: torch.device | str) -> Tensor:
        """int64 ``[T]``: flat index ``b·S + s`` into the step's ``[B·S]`` columns of each real token, row by row
        and in column order within a row (the order ``HybridCache.prepare_forward`` lays the tokens out)."""
        S = self.num_columns
        real = torch.arange(S)[None, :] >= S - torch.tensor(self.new_tokens, dtype=torch.int64)[:, None]
        return real.reshape(-1).nonzero().reshape(-1).to(device)


def _check_mask(mask: Tensor, B: int, P: int, S: int, past_tokens: Sequence[int]) -> list[int]:
    """Validate the 2D padding mask ``[B, P+S]``; returns each row's real new-token count."""
    if not isinstance(mask, Tensor):
        raise InconsistentInputError(f"attention_mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dim() != 2:
        raise InconsistentInputError(
            f"attention_mask must be the 2D padding mask [batch, columns] (1 = real token, 0 = pad), got "
            f"{mask.dim()}D shape {list(mask.shape)}; dsv4 builds its own causal / window / compressed masks"
        )
    if tuple(mask.shape) != (B, P + S):
        raise InconsistentInputError(
            f"attention_mask has shape {list(mask.shape)} but the step needs [{B}, {P + S}]: {B} rows, the {P} "
            f"columns the cache has seen plus the {S} new ones (pass the mask of the whole sequence so far)"
        )
    binary = (mask == 0) | (mask == 1)
    m = mask.to(torch.int64)
    # a 1 followed by a 0: right padding or a hole
    hole = (m[:, 1:] < m[:, :-1]).any(-1) if P + S > 1 else torch.zeros(B, dtype=torch.bool, device=m.device)
    stats = torch.stack([(~binary).any(-1).long(), hole.long(), m[:, :P].sum(-1), m[:, P:].sum(-1)], dim=1).tolist()
    new = []
    for b, (non_binary, has_hole, past_real, new_real) in enumerate(stats):
        if non_binary:
            raise InconsistentInputError(f"attention_mask row {b} holds values other than 0 and 1")
        if has_hole:
            raise InconsistentInputError(
                f"attention_mask row {b} has a 0 after a 1 (right padding or a hole): dsv4 serves left-padded "
                "rows only — every pad before the row's first real token"
            )
        if past_real != past_tokens[b]:
            raise InconsistentInputError(
                f"attention_mask row {b} marks {past_real} of the {P} past columns as real tokens but the cache "
                f"holds {past_tokens[b]} tokens for that row"
            )
        new.append(int(new_real))
    return new


def _check_positions(position_ids: Tensor, plan: RowTokens) -> None:
    """Every real token's ``position_ids`` entry must be its request's position (pads are not checked)."""
    B, S = plan.batch_size, plan.num_columns
    if not isinstance(position_ids, Tensor) or position_ids.dim() != 2 or position_ids.shape[-1] != S or (
        position_ids.shape[0] not in (1, B)
    ):
        shape = list(position_ids.shape) if isinstance(position_ids, Tensor) else type(position_ids).__name__
        raise InconsistentInputError(f"position_ids must be [{B}, {S}] or [1, {S}], got {shape}")
    dev = position_ids.device
    col = torch.arange(S, device=dev)[None, :]
    new = torch.tensor(plan.new_tokens, device=dev)[:, None]
    start = torch.tensor(plan.past_tokens, device=dev)[:, None] - (S - new)  # position of column 0 if it were real
    real = col >= S - new
    bad = ((position_ids.expand(B, S) != start + col) & real).any(-1).tolist()
    if any(bad):
        b = bad.index(True)
        got = position_ids.expand(B, S)[b, S - plan.new_tokens[b] :].tolist()
        want = list(range(plan.past_tokens[b], plan.past_tokens[b] + plan.new_tokens[b]))
        raise InconsistentInputError(
            f"position_ids row {b}: its real tokens are at positions {got} but the row's request is at {want} "
            "(positions count real tokens from the row's first one)"
        )


def row_tokens(
    batch_size: int,
    num_columns: int,
    past_columns: int,
    past_tokens: Sequence[int],
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    cache_position: Tensor | None = None,
) -> RowTokens:
    """The real tokens of one step, checked against the cache.

    Args:
        batch_size, num_columns: ``B`` rows of ``S`` new columns (``input_ids.shape``).
        past_columns: ``P``, columns the cache has consumed so far (``Cache.get_seq_length()``).
        past_tokens: ``[B]`` real tokens each row's request holds.
        attention_mask: ``[B, P+S]`` 0/1 (any dtype); ``None`` = every column real (then no row may hold pads).
        position_ids: ``[B, S]`` or ``[1, S]`` integer; ``None`` = not checked. Real tokens must sit at their
            request's positions (``generate()``'s ``cumsum(mask) − 1``).
        cache_position: ``[S]`` integer column indices (older transformers); must be ``P … P+S−1``.
    Raises:
        InconsistentInputError: naming the row and the numbers.
    """
    B, S, P = int(batch_size), int(num_columns), int(past_columns)
    if S < 1:
        raise InconsistentInputError("the step has no columns (input of sequence length 0)")
    if len(past_tokens) != B:
        raise InconsistentInputError(
            f"the cache holds {len(past_tokens)} rows but this step has {B} (a cache serves one batch; batch changes "
            "such as num_return_sequences on a used cache need a new cache)"
        )
    if cache_position is not None:
        got = cache_position.reshape(-1).to("cpu", torch.int64) if isinstance(cache_position, Tensor) else None
        if got is None or not torch.equal(got, torch.arange(P, P + S)):
            raise InconsistentInputError(
                f"cache_position must be the new columns {P} … {P + S - 1} (the cache has seen {P} columns), "
                f"got {cache_position.tolist() if isinstance(cache_position, Tensor) else cache_position!r}"
            )
    if attention_mask is None:
        padded = [b for b, n in enumerate(past_tokens) if n != P]
        if padded:
            raise InconsistentInputError(
                f"no attention_mask, but row {padded[0]} holds {past_tokens[padded[0]]} real tokens of the {P} past "
                "columns (it was padded): pass the attention_mask of the whole sequence"
            )
        new = [S] * B
    else:
        new = _check_mask(attention_mask, B, P, S, past_tokens)
    plan = RowTokens(B, S, P, tuple(int(n) for n in past_tokens), tuple(new))
    if position_ids is not None:
        _check_positions(position_ids, plan)
    return plan
