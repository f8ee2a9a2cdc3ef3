"""Prefix-cache test helpers: token-determined inputs (a fixed random embedding per token id), the layers they run
through, a case (the owner's chunks up to the prefix end and the hit's after it), outputs compared bit for bit, and
a request's state rows and block pages. Shared by the prefix-cache tests on the CPU (torch backend) and on the GPU
(Triton backend)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

import dsv4
from dsv4.cache import HybridCache
from dsv4.layer import Attention

from support.oracle import assert_bit_identical

VOCAB = 97
Outputs = dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # layer -> (y, lse, entry_idx)


@dataclass(frozen=True)
class Case:
    name: str
    cfg: dsv4.ModelConfig
    layers: tuple[int, ...]
    block_size: int
    before: tuple[int, ...]  # the owner's (and the cold run's) chunks up to the prefix end P = sum(before)
    after: tuple[int, ...]  # the hit's (and the cold run's) chunks after P

    @property
    def point(self) -> int:
        return sum(self.before)


@functools.cache
def embedding(cfg: dsv4.ModelConfig, device: str = "cpu") -> torch.Tensor:
    """[VOCAB, d] the hidden state of each token id (drawn on the CPU, the same on every device)."""
    return torch.randn(VOCAB, cfg.hidden_size, generator=torch.Generator().manual_seed(5)).to(device)


@functools.cache
def layer(cfg: dsv4.ModelConfig, li: int, backend: str = "torch", device: str = "cpu") -> Attention:
    """Layer ``li`` with random weights (seeded by ``li``, drawn on ``device``) on ``backend``."""
    return Attention(dsv4.AttentionWeights.random(cfg, li, seed=60 + li, device=device), cfg, li, backend=backend)


def prompt(seed: int, n: int) -> list[int]:
    """``n`` random token ids, determined by ``seed``."""
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def concat(parts: list[Outputs]) -> Outputs:
    """Outputs of consecutive steps as one (entry_idx padded with −1 to the widest)."""
    out = {}
    for li in parts[0]:
        ys, lses, idx = zip(*(p[li] for p in parts))
        width = max(i.shape[1] for i in idx)
        out[li] = (torch.cat(ys), torch.cat(lses),
                   torch.cat([torch.nn.functional.pad(i, (0, width - i.shape[1]), value=-1) for i in idx]))
    return out


def assert_same_outputs(got: Outputs, want: Outputs, rows: slice, what: str) -> None:
    """Every layer's y, lse and entry_idx bit-identical to the cold run's ``rows``."""
    for li in want:
        assert_bit_identical(got[li], want[li], rows, f"{what} (layer {li}; 'uninterrupted' = the cold run)")


def state_rows(cache: HybridCache, rid: str) -> dict[tuple[int, str], torch.Tensor]:
    """Copies of ``rid``'s state row in every state tensor, by (layer, tensor name)."""
    slot = cache.slot(rid)
    return {(li, name): t[slot].clone() for li, d in cache.state.tensors.items() for name, t in d.items()}


def block_pages(cache: HybridCache, rid: str, k: int) -> dict[tuple[int, str], torch.Tensor]:
    """Copies of the pages of ``rid``'s first ``k`` blocks in every pool tensor, by (layer, tensor name)."""
    table = cache.block_table(rid)[:k]
    return {(li, name): t[table].clone() for li, d in cache.pool.tensors.items() for name, t in d.items()}
