"""Where token hidden states come from.

Embeddings, MoE and the LM head are out of scope, so the engine asks a *hidden-state source* for the input of
every token it feeds: ``source(request_numbers, positions) -> x``, with

* ``request_numbers``: int64 ``[T]`` each token's ``Request.number``;
* ``positions``: int64 ``[T]`` each token's absolute position in its request;
* returns float32 ``[T, hidden]`` on the same device.

A source must be a pure function of ``(number, position)`` (the same token always gets the same vector, however
the steps are chunked); the spot check relies on it only through the engine's own recorded inputs, so any
deterministic callback works.

``HashHidden`` (the default) is counter-based: a 32-bit integer hash of ``(seed, number, position, channel)``
turned into a standard normal by Box–Muller. It runs on any device with identical results, needs no state, and
costs a few elementwise ops per value.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

__all__ = ["HashHidden", "HiddenSource", "hash32"]

_M32 = 0xFFFFFFFF


class HiddenSource(Protocol):
    def __call__(self, request_numbers: Tensor, positions: Tensor) -> Tensor: ...


def hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mix (``x ^= x >> 16; x *= 0x45d9f3b`` twice, then ``x ^= x >> 16``) on int64 tensors
    holding values in ``[0, 2³²)``; all products stay below 2⁶³, so CPU and CUDA agree bit for bit."""
    x = x & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


class HashHidden:
    """Deterministic standard-normal hidden states from ``(seed, request number, position, channel)``.

    Args:
        hidden_size: d.
        seed: mixes into every value.
    """

    def __init__(self, hidden_size: int, seed: int = 0) -> None:
        self.hidden_size = int(hidden_size)
        self.seed = int(seed)
        self._chan: dict[torch.device, Tensor] = {}

    def __call__(self, request_numbers: Tensor, positions: Tensor) -> Tensor:
        dev = positions.device
        chan = self._chan.get(dev)
        if chan is None:
            chan = self._chan[dev] = hash32(torch.arange(2 * self.hidden_size, device=dev, dtype=torch.int64) * 0x9E3779B1)
        tok = hash32(hash32(request_numbers.long() * 0x632BE5AB + (self.seed & _M32)) ^ (positions.long() & _M32))
        bits = hash32(tok[:, None] ^ chan[None, :])  # [T, 2d] uniform 32-bit
        u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)  # (0, 1), 24 bits: exact in float32
        u1, u2 = u[:, : self.hidden_size], u[:, self.hidden_size :]
        z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)
        return z


def as_source(fn: Callable[[Tensor, Tensor], Tensor] | None, hidden_size: int, seed: int) -> Callable[[Tensor, Tensor], Tensor]:
    """``fn`` or the default ``HashHidden(hidden_size, seed)``."""
    return fn if fn is not None else HashHidden(hidden_size, seed)
