"""Shared input validation for the ``dsv4.formats`` codecs.

Every quantizer / encoder converts its input with :func:`as_float32`, every decoder checks its byte tensors with
:func:`check_uint8`.  All failures raise ``ValueError`` with a message that starts with the public function's name.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

__all__ = ["as_float32", "check_last_dim", "check_uint8", "check_little_endian", "check_block"]


def check_little_endian(fn: str) -> None:
    """Raise ``ValueError`` unless the host is little-endian (the byte layouts reinterpret multi-byte values)."""
    if sys.byteorder != "little":
        raise ValueError(f"{fn}: the byte layouts assume a little-endian host, got {sys.byteorder!r}")


def check_last_dim(x: Tensor, fn: str, *, size: int | None = None, multiple: int | None = None) -> None:
    """Raise ``ValueError`` unless ``x.shape[-1] == size`` and/or ``x.shape[-1] % multiple == 0``."""
    if x.dim() == 0:
        raise ValueError(f"{fn}: expected a tensor with at least one dimension, got a 0-d tensor")
    n = x.shape[-1]
    if size is not None and n != size:
        raise ValueError(f"{fn}: last dimension must be {size}, got shape {tuple(x.shape)}")
    if multiple is not None and n % multiple != 0:
        raise ValueError(f"{fn}: last dimension {n} is not a multiple of the block size {multiple}")


def check_block(block: int, fn: str) -> None:
    """Raise ``ValueError`` unless ``block`` is a positive int."""
    if not isinstance(block, int) or block <= 0:
        raise ValueError(f"{fn}: block must be a positive int, got {block!r}")


def as_float32(x: Tensor, fn: str, *, check: bool = True, size: int | None = None,
               multiple: int | None = None) -> Tensor:
    """Validate a floating input and return it as float32 (same shape and device).

    Args:
        x: tensor of any floating dtype (fp32, bf16, fp16, fp64, ...), any shape with at least one dim.
        fn: name of the calling public function, used in error messages.
        check: when True also verify that every value is finite *after* the conversion to fp32 (this host-syncs).
        size / multiple: optional constraints on the last dimension.

    Returns:
        float32 tensor with ``x``'s shape (``x`` itself when it already is fp32).
    """
    if not isinstance(x, Tensor):
        raise ValueError(f"{fn}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"{fn}: expected a floating-point tensor, got dtype {x.dtype}")
    check_last_dim(x, fn, size=size, multiple=multiple)
    x32 = x.float()
    if check and not bool(torch.isfinite(x32).all()):
        raise ValueError(f"{fn}: input contains NaN or Inf (after conversion to float32)")
    return x32


def check_uint8(t: Tensor, fn: str, name: str = "codes", *, size: int | None = None,
                multiple: int | None = None) -> None:
    """Raise ``ValueError`` unless ``t`` is a uint8 tensor with the required last dimension."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.uint8:
        raise ValueError(f"{fn}: {name} must have dtype torch.uint8, got {t.dtype}")
    if t.dim() == 0:
        raise ValueError(f"{fn}: {name} must have at least one dimension")
    n = t.shape[-1]
    if size is not None and n != size:
        raise ValueError(f"{fn}: {name} last dimension must be {size}, got shape {tuple(t.shape)}")
    if multiple is not None and n % multiple != 0:
        raise ValueError(f"{fn}: {name} last dimension {n} is not a multiple of {multiple}")
