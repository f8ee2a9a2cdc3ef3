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
    "CorruptSnapshotError",
    "StaleBatchError",
    "StepOrderError",
    "NonFiniteError",
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


class CorruptSnapshotError(IncompatibleSnapshotError):
    """``restore_request`` with a snapshot whose bytes or fields no longer match the checksum taken when it was
    saved, or whose values cannot be a cache's (NaN / Inf entries, ring positions that do not fit its tokens)."""


class StaleBatchError(ValueError):
    """A ``StepBatch`` that is not the cache's current step: prepared before a later mutating call
    (``add_request``, ``release``, ``restore_request``, ``preempt_request``, ``prepare_forward``), by another
    ``HybridCache``, or not by ``prepare_forward`` at all."""


class StepOrderError(RuntimeError):
    """Layers out of step with the cache: a layer running the same step twice, a new step (or another mutating
    call) while some cached layers have not run the current one, or a request whose cache lacks the data of
    tokens no layer ran."""


class NonFiniteError(FloatingPointError):
    """A layer step produced NaN / Inf (outputs, or values it would leave in the cache); with
    ``nan_policy="raise"`` the step's writes were rolled back before this was raised."""
