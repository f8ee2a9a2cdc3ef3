"""Errors raised by the cache. Every message names the request id and the numbers involved.

All of them are raised *before* anything changes: a failed call leaves the cache exactly as it was.
"""

from __future__ import annotations

__all__ = [
    "CacheFullError",
    "UnknownRequestError",
    "DuplicateRequestError",
    "InvalidPlanError",
    "IncompatibleSnapshotError",
]


class CacheFullError(RuntimeError):
    """Not enough free pool blocks or state slots for the request(s)."""


class UnknownRequestError(KeyError):
    """A request id that was never added (or was already released)."""

    def __str__(self) -> str:  # KeyError would repr() the message; keep it readable
        return str(self.args[0]) if self.args else ""


class DuplicateRequestError(ValueError):
    """``add_request`` / ``restore_request`` with an id that is already active."""


class InvalidPlanError(ValueError):
    """A malformed step plan (empty, bad counts, repeated ids, positions past ``max_position``) or cache geometry."""


class IncompatibleSnapshotError(ValueError):
    """``restore_request`` with a ``RequestSnapshot`` taken from a cache of another geometry (config, layers,
    block size, numerics) or whose tensors do not have the shapes and dtypes this cache stores."""
