"""Validation of token ids, as ``HybridCache`` takes them (``add_request``, ``prepare_forward``, snapshots): a
sequence of ints or a 1-D integer tensor, each id in ``[0, 2⁶³)``, returned as an ``array('q')`` (the bytes the
prefix cache's chain keys hash, ``dsv4.cache.prefix_index``)."""

from __future__ import annotations

import numbers
from array import array
from typing import Sequence

import torch
from torch import Tensor

from .errors import InvalidPlanError

__all__ = ["as_token_ids"]

_MAX_TOKEN_ID = 2**63


def as_token_ids(token_ids: object, what: str = "token_ids") -> array:
    """Validate token ids (a sequence of ints or a 1-D integer tensor, each in ``[0, 2⁶³)``) → ``array('q')``.

    Raises:
        TypeError: not a sequence / tensor of ints.
        InvalidPlanError: a negative or too large id.
    """
    if isinstance(token_ids, Tensor):
        if token_ids.dim() != 1 or token_ids.dtype.is_floating_point or token_ids.dtype.is_complex \
                or token_ids.dtype == torch.bool:
            raise TypeError(f"{what} must be a 1-D integer tensor, got {token_ids.dtype} {list(token_ids.shape)}")
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= _MAX_TOKEN_ID):
            bad = int(token_ids.min()) if int(token_ids.min()) < 0 else int(token_ids.max())
            raise InvalidPlanError(f"{what}: token id {bad} out of range [0, 2**63)")
        return array("q", token_ids.tolist())
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise TypeError(f"{what} must be a sequence of ints, got {type(token_ids).__name__}")
    ids = list(token_ids)
    if all(issubclass(t, int) and t is not bool for t in set(map(type, ids))):  # plain ints: checked in C
        try:
            arr = array("q", ids)
        except OverflowError:  # ≥ 2⁶³ (or < −2⁶³): the loop below names it
            arr = None
        if arr is not None and (not arr or min(arr) >= 0):
            return arr
    for t in ids:
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise TypeError(f"{what} must be a sequence of ints, got an element {t!r} ({type(t).__name__})")
        if not 0 <= t < _MAX_TOKEN_ID:
            raise InvalidPlanError(f"{what}: token id {t} out of range [0, 2**63)")
    return array("q", ids)
