"""Independent oracles shared by the reliability and cache tests: what the cache should hold (brute-force block
counts, byte accounting), a tie-aware comparison of layer outputs with the stateless reference
(``dsv4.reference.forward``), and bit-identity of outputs with an uninterrupted run."""

from __future__ import annotations

import math

import torch

import dsv4
from dsv4.cache import HybridCache
from dsv4.cache.integrity import canonical_ring_positions


def expected_blocks(num_tokens: int, m_min: int, block_size: int) -> int:
    """Brute force: distinct blocks holding the finest cached layer's complete entries (0 without one)."""
    if not m_min:
        return 0
    return len({(i * m_min) // block_size for i in range(num_tokens // m_min)})


def bytes_per_block(cache: HybridCache) -> int:
    """Pool bytes of one block over all layers, from the tensors themselves."""
    return sum(math.prod(t.shape[1:]) * t.element_size() for d in cache.pool.tensors.values() for t in d.values())


def bytes_per_slot(cache: HybridCache) -> int:
    """State bytes of one slot over all layers, from the tensors themselves."""
    return sum(math.prod(t.shape[1:]) * t.element_size() for d in cache.state.tensors.values() for t in d.values())


def plausible_random_row(
    cache: HybridCache, layer: int, name: str, like: torch.Tensor, num_tokens: int, g: torch.Generator
) -> torch.Tensor:
    """Random contents for one row of cache tensor ``name`` of ``layer`` (shaped like ``like``) that a cache of
    ``num_tokens`` tokens can hold, so ``restore_request``'s value checks accept a snapshot of it: ring positions as
    after ``num_tokens`` tokens, ring and pool pages full of random entries encoded in the layer's storage format
    (never NaN), float state standard normal."""
    if name == "ring_positions":
        return canonical_ring_positions(num_tokens, like.shape[0]).to(like.dtype)
    if like.dtype == torch.uint8:
        schema = cache.schemas[layer]
        storage = schema.index_storage if name == "index_pages" else schema.kv_storage
        n = storage.entries_per_page(like.shape[0])
        page = torch.zeros(1, like.shape[0], dtype=torch.uint8)
        storage.write(page, torch.zeros(n, dtype=torch.int64), torch.arange(n), torch.randn(n, storage.dim, generator=g))
        return page[0]
    return torch.randn(like.shape, generator=g).to(like.dtype)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    den = b.double().norm().item()
    return (a.double() - b.double()).norm().item() / den if den else (a.double() - b.double()).norm().item()


def pad_idx(idx: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(idx, (0, width - idx.shape[1]), value=-1)


def check_against_reference(
    w: dsv4.AttentionWeights,
    cfg: dsv4.ModelConfig,
    layer_idx: int,
    x: torch.Tensor,
    y: torch.Tensor,
    entry_idx: torch.Tensor,
    numerics: str,
    tol: float,
    max_tie_fraction: float = 0.25,
    rows: slice | None = None,
    tie_rel: float = 1e-5,
) -> None:
    """Assert that ``y`` / ``entry_idx`` (rows ``rows`` of the sequence ``x`` [S, d], run through the cache) equal
    ``dsv4.reference.forward`` of the whole sequence: the attended entries exactly, except CSA rows where the two
    top-k sets differ only by exact score ties (``reference.topk_differences``); ``y`` of the other rows to ``tol``
    relative error (Frobenius). ``tie_rel``: how close two index scores must be to count as a tie."""
    ref = dsv4.reference.forward(w, cfg, layer_idx, x, numerics)
    rows = rows if rows is not None else slice(0, x.shape[0])
    scores = ref.index_scores[rows] if ref.index_scores is not None else torch.zeros(y.shape[0], 1)
    differs, ties = dsv4.reference.topk_differences(scores, ref.entry_idx[rows], entry_idx, rel=tie_rel)
    if ref.index_scores is None:
        assert not differs.any(), f"layer {layer_idx}: attended entries differ at rows {differs.nonzero().flatten().tolist()}"
    else:
        bad = differs & ~ties
        assert not bad.any(), f"layer {layer_idx}: top-k differs beyond ties at rows {bad.nonzero().flatten().tolist()}"
    assert differs.float().mean().item() <= max_tie_fraction, f"layer {layer_idx}: too many tie rows"
    keep = ~differs
    if keep.any():
        err = rel_err(y[keep].float(), ref.y[rows][keep].float())
        assert err <= tol, f"layer {layer_idx}: relative error {err:.3g} > {tol}"


def assert_bit_identical(got, want, rows: slice, what: str) -> None:
    """``got`` (y, lse, entry_idx of some steps) equals rows ``rows`` of ``want`` (an uninterrupted run's) bit for
    bit; entry lists padded with −1 to the wider of the two first."""
    for name, g, w in zip(("y", "lse", "entry_idx"), got, want):
        w = w[rows]
        if name == "entry_idx":
            width = max(g.shape[1], w.shape[1])
            g = torch.nn.functional.pad(g, (0, width - g.shape[1]), value=-1)
            w = torch.nn.functional.pad(w, (0, width - w.shape[1]), value=-1)
        assert g.shape == w.shape and torch.equal(g, w), f"{what}: {name} differs from the uninterrupted run"
