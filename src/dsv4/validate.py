"""Argument checks shared by the public entry points (config, weights, cache, layer, engine, reference, planner).

Each helper checks one argument and raises a ``TypeError`` (wrong kind of value: a bool or a float where an int is
expected, a dict where a ``ModelConfig`` is expected, ``None`` weights) or a ``ValueError`` (right kind, value out
of range; callers may pass a subclass such as ``InvalidPlanError``) whose message names the argument, the allowed
values and what was given. Nothing is converted silently: a float is never truncated to an int, a bool is never an
int.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

__all__ = [
    "describe",
    "require_bool",
    "require_choice",
    "require_device",
    "require_float_dtype",
    "require_instance",
    "require_int",
    "require_number",
]


def describe(value: object) -> str:
    """``"<type> <repr>"`` of a bad value, shortened (for messages)."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _range_text(minimum: float | None, maximum: float | None, open_min: bool = False) -> str:
    if minimum is not None and maximum is not None:
        return f"in {'(' if open_min else '['}{minimum}, {maximum}]"
    if minimum is not None:
        return f"{'>' if open_min else '>='} {minimum}"
    if maximum is not None:
        return f"<= {maximum}"
    return ""


def require_int(
    name: str,
    value: object,
    minimum: int | None = None,
    maximum: int | None = None,
    *,
    error: type[Exception] = ValueError,
    type_error: type[Exception] = TypeError,
) -> int:
    """``value`` as an ``int``: an integral number that is not a bool, within ``[minimum, maximum]``.

    Raises ``type_error`` for a non-integer (bool, float — even ``2.0`` —, str, None …) and ``error`` for an int
    out of range. Returns ``int(value)`` (numpy / torch integer scalars are accepted)."""
    allowed = " ".join(x for x in ("an int", _range_text(minimum, maximum)) if x)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise type_error(f"{name} must be {allowed}, got {describe(value)}")
    v = int(value)
    if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        raise error(f"{name} must be {allowed}, got {v}")
    return v


def require_number(
    name: str,
    value: object,
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    open_min: bool = False,
    error: type[Exception] = ValueError,
) -> float:
    """``value`` as a finite ``float``: a real number that is not a bool, within the range (``open_min``: the
    minimum itself is excluded). ``TypeError`` for a non-number, ``error`` for NaN, ±Inf or out of range."""
    allowed = " ".join(x for x in ("a finite number", _range_text(minimum, maximum, open_min)) if x)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {allowed}, got {describe(value)}")
    v = float(value)
    low_bad = minimum is not None and (v <= minimum if open_min else v < minimum)
    if not math.isfinite(v) or low_bad or (maximum is not None and v > maximum):
        raise error(f"{name} must be {allowed}, got {v!r}")
    return v


def require_bool(name: str, value: object) -> bool:
    """``value`` if it is a ``bool`` (``TypeError`` otherwise: ``0`` / ``"yes"`` are not accepted)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {describe(value)}")
    return value


def require_instance(name: str, value: object, cls: type | tuple[type, ...], hint: str = "") -> Any:
    """``value`` if it is an instance of ``cls``; ``TypeError`` naming ``name`` otherwise (``hint`` appended)."""
    if not isinstance(value, cls):
        names = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
        article = "an" if names[0].lower() in "aeiou" else "a"
        raise TypeError(f"{name} must be {article} {names}, got {describe(value)}" + (f"; {hint}" if hint else ""))
    return value


def require_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of the strings ``choices`` (``TypeError`` for a non-str, ``ValueError`` otherwise)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {list(choices)}, got {describe(value)}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def require_float_dtype(name: str, value: object) -> torch.dtype:
    """``value`` if it is a floating-point ``torch.dtype`` (float64/32/16, bfloat16)."""
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be a floating-point torch.dtype, got {describe(value)}")
    if not value.is_floating_point or value.itemsize < 2:
        raise ValueError(f"{name} must be a floating-point torch.dtype of 16 bits or more, got {value}")
    return value


def require_device(name: str, value: object) -> torch.device:
    """``value`` as a ``torch.device`` that exists here: ``"cpu"``, ``"cuda"`` / ``"cuda:N"`` with a CUDA device
    ``N`` present (the index filled in), or ``"meta"``. ``TypeError`` for a non-device, ``ValueError`` for an
    unknown device type or a device that is not available."""
    if isinstance(value, bool) or not isinstance(value, (str, torch.device, int)):
        raise TypeError(f"{name} must be a torch.device or a string like 'cpu' / 'cuda:0', got {describe(value)}")
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"{name} {value!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type in ("cpu", "meta"):
        return dev
    if dev.type != "cuda":
        raise ValueError(f"{name} {value!r}: device type {dev.type!r} is not supported; use 'cpu', 'cuda' or 'cuda:N'")
    if not torch.cuda.is_available():
        raise ValueError(f"{name} {value!r}: no CUDA device is available on this machine")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < count:
        raise ValueError(f"{name} {value!r}: this machine has {count} CUDA device(s) (cuda:0 … cuda:{count - 1})")
    return torch.device("cuda", index)
