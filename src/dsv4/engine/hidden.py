"""Where token hidden states come from.

Embeddings, MoE and the LM head are out of scope, so the engine asks a *hidden-state source* for the input of
every token it feeds: ``source(token_ids) -> x``, with

* ``token_ids``: int64 ``[T]`` each token's id (prompt tokens as submitted, generated ones from
  ``generated_token_ids``);
* returns float32 ``[T, hidden]`` on the same device.

A source must be a pure function of the token id — a seeded embedding table — so identical prompts (and identical
prompt prefixes) feed identical hidden states: what prefix caching relies on. The spot check uses the engine's
own recorded inputs, so any deterministic callback works.

A source that sets ``graph_safe = True`` (``is_graph_safe``) is run *inside* the engine's decode graphs, so that a
replayed step costs the host only the copy of its token ids: it must be a fixed sequence of device ops on
``token_ids`` — no host synchronisation, no Python state that changes from call to call (a replay repeats what
the capture recorded), and any tensor it creates once and keeps must be created on an eager call (the graphs call
it eagerly before capturing). ``TokenHidden`` and ``HashHidden`` are; any other source runs eagerly before each
replay and its output is copied into the graph's static input.

``TokenHidden`` (the default) is counter-based: a 32-bit integer hash of ``(seed, token id, channel)`` turned into
a standard normal by Box–Muller. It needs no table; the integer part is exact everywhere, the floating-point part
(``log``, ``cos``) is the device's math library. On CUDA it is one Triton launch (``kernels.project.hashed_normal``,
equal bit for bit to the torch ops on the same GPU) that writes each value once, as a real embedding lookup
would cost; elsewhere a few torch ops per value. ``HashHidden`` is the same keyed by ``(request number,
position)`` (every token of every request distinct; kept for callers that want that).

Generated tokens need ids too (there is no LM head to sample them): ``generated_token_ids`` draws them from
``(seed, request number, position)``, so they differ between requests and never depend on chunking.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

__all__ = ["HashHidden", "HiddenSource", "TokenHidden", "generated_token_ids", "hash32", "is_graph_safe"]

_M32 = 0xFFFFFFFF
_HAVE_TRITON = importlib.util.find_spec("triton") is not None


class HiddenSource(Protocol):
    def __call__(self, token_ids: Tensor) -> Tensor: ...


def hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mix (``x ^= x >> 16; x *= 0x45d9f3b`` twice, then ``x ^= x >> 16``) on int64 tensors
    holding values in ``[0, 2³²)``; all products stay below 2⁶³, so CPU and CUDA agree bit for bit."""
    x = x & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def _channel_keys(cache: dict[torch.device, Tensor], hidden_size: int, device: torch.device) -> Tensor:
    """int64 ``[2·hidden]`` per-channel hash keys (one set per device, computed once)."""
    chan = cache.get(device)
    if chan is None:
        chan = cache[device] = hash32(torch.arange(2 * hidden_size, device=device, dtype=torch.int64) * 0x9E3779B1)
    return chan


def _standard_normal(keys: Tensor, chan: Tensor, hidden_size: int) -> Tensor:
    """Box–Muller over 24-bit uniforms hashed from ``keys`` int64 ``[T]`` × ``chan``: float32 ``[T, hidden]``."""
    bits = hash32(keys[:, None] ^ chan[None, :])  # [T, 2d] uniform 32-bit
    u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)  # (0, 1), 24 bits: exact in float32
    u1, u2 = u[:, :hidden_size], u[:, hidden_size:]
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)


class _HashedNormal:
    """Shared state of the counter-based sources: ``hidden_size``, ``seed`` and the per-device channel keys (made
    on the first call on a device; graph-safe after it)."""

    graph_safe = True

    def __init__(self, hidden_size: int, seed: int = 0) -> None:
        self.hidden_size = int(hidden_size)
        self.seed = int(seed)
        self._chan: dict[torch.device, Tensor] = {}

    def _normal(self, keys: Tensor) -> Tensor:
        """float32 ``[T, hidden]`` standard normals of ``keys`` int64 ``[T]`` (on their device): one Triton launch
        on CUDA (``kernels.project.hashed_normal``, the torch ops' values bit for bit), the torch ops elsewhere."""
        chan = _channel_keys(self._chan, self.hidden_size, keys.device)
        if keys.is_cuda and _HAVE_TRITON:
            from ..kernels.project.hashed_normal import hashed_normal

            return hashed_normal(keys, chan, self.hidden_size)
        return _standard_normal(keys, chan, self.hidden_size)


class TokenHidden(_HashedNormal):
    """Deterministic standard-normal hidden states from ``(seed, token id, channel)``: a seeded embedding.

    Args:
        hidden_size: d.
        seed: mixes into every value.
    """

    def __call__(self, token_ids: Tensor) -> Tensor:
        """``token_ids`` int64 ``[T]`` → float32 ``[T, hidden]`` on the same device."""
        ids = token_ids.long()
        return self._normal(hash32(hash32(ids * 0x2545F491 + (self.seed & _M32)) ^ ((ids >> 32) & _M32)))


class HashHidden(_HashedNormal):
    """Deterministic standard-normal hidden states from ``(seed, request number, position, channel)``.

    Args:
        hidden_size: d.
        seed: mixes into every value.
    """

    def __call__(self, request_numbers: Tensor, positions: Tensor) -> Tensor:
        return self._normal(hash32(hash32(request_numbers.long() * 0x632BE5AB + (self.seed & _M32)) ^ (positions.long() & _M32)))


def is_graph_safe(source: Callable[..., Tensor]) -> bool:
    """Whether the hidden-state ``source`` declares itself graph-safe (``graph_safe = True``; module docstring)."""
    return getattr(source, "graph_safe", False) is True


def generated_token_ids(seed: int, number: int, positions: Tensor, vocab: int) -> Tensor:
    """Ids of a request's generated tokens (no LM head in scope): int64 ``[n]`` in ``[0, vocab)``, a hash of
    ``(seed, request number, position)`` for each of ``positions`` int64 ``[n]``."""
    key = hash32(torch.full_like(positions, (number * 0x632BE5AB + seed * 0x9E3779B1 + 0x7F4A7C15) & _M32))
    return hash32(key ^ (positions & _M32)) % vocab


def as_source(fn: Callable[[Tensor], Tensor] | None, hidden_size: int, seed: int) -> Callable[[Tensor], Tensor]:
    """``fn`` or the default ``TokenHidden(hidden_size, seed)``."""
    return fn if fn is not None else TokenHidden(hidden_size, seed)
