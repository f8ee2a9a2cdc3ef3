"""Prefix caching on the GPU with the Triton backend (marked gpu; skipped without CUDA): a hit restores exactly
what a cold run holds at the prefix end — shared blocks' pages, the live state (rings, positions, CSA previous
halves) — and every layer's outputs for the rest equal the cold run's bit for bit (same chunks after the prefix).

Cases: every tiny layer in one cache (16- and 64-token blocks), and each V4-Flash layer kind alone with 256-token
blocks (window 128, ratios 4 / 128); the owner's and the hit's chunks end inside windows around the prefix end; the
owner keeps running (writing its own blocks) while the hit request runs, or is released before the hit. And a prefix
end inside the owner's step (the layers snapshot it): the captured window entries are the step's own bytes, the rest
agrees with a cold run to the chunking tolerance.
"""

from __future__ import annotations

from array import array

import pytest
import torch

import dsv4
from dsv4.cache import HybridCache
from dsv4.cache.prefix import PREFIX_STATE_NAMES

from support.prefix import Case, assert_same_outputs, block_pages, concat, embedding, layer, prompt, state_rows

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")
TINY = dsv4.ModelConfig.preset("tiny")
FLASH = dsv4.ModelConfig.preset("v4-flash")

CASES = [
    Case("tiny-all-bs16-P32", TINY, (0, 1, 2, 3, 4), 16, (7, 9, 16), (5, 3, 17, 1)),
    Case("tiny-all-bs64-P128", TINY, (0, 1, 2, 3, 4), 64, (50, 14, 64), (9, 40, 1, 2)),
    Case("flash-swa-P256", FLASH, (0,), 256, (100, 156), (30, 200, 1)),
    Case("flash-csa-P512", FLASH, (2,), 256, (300, 212), (129, 3, 1, 260)),
    Case("flash-hca-P512", FLASH, (3,), 256, (256, 256), (127, 1, 200, 2)),
]


def run(cache: HybridCache, rid: str, ids: list[int], chunks: list[int]) -> dict:
    parts, at = [], cache.num_tokens(rid)
    for n in chunks:
        batch = cache.prepare_forward({rid: n}, token_ids={rid: ids[at : at + n]})
        x = embedding(cache.cfg, "cuda")[torch.tensor(ids[at : at + n], device="cuda")]
        step = {}
        for li in cache.layer_indices:
            res = layer(cache.cfg, li, "triton", "cuda").forward_with_aux(x, batch, cache)
            step[li] = (res.y, res.lse, res.attended_entries().sort(dim=1).values)  # top-k order is not part of the result
        parts.append(step)
        at += n
    return concat(parts)


def make_cache(case: Case, **kw) -> HybridCache:
    return HybridCache(case.cfg, layers=case.layers, block_size=case.block_size, num_blocks=32, max_requests=3,
                       device="cuda", **kw)


@pytest.mark.parametrize("owner_released", [False, True], ids=["owner-running", "owner-released"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_hit_is_bit_identical_to_cold_run_triton(case: Case, owner_released: bool) -> None:
    ids = prompt(1, case.point) + prompt(2, sum(case.after))
    owner = prompt(1, case.point) + prompt(3, 40)
    k = case.point // case.block_size

    cold_cache = make_cache(case)
    cold_cache.add_request("c", ids)
    head = run(cold_cache, "c", ids, list(case.before))
    state, pages = state_rows(cold_cache, "c"), block_pages(cold_cache, "c", k)
    want = concat([head, run(cold_cache, "c", ids, list(case.after))])

    cache = make_cache(case, prefix_states=2)
    cache.add_request("owner", owner)
    run(cache, "owner", owner, list(case.before))
    if owner_released:
        cache.release("owner")
    cache.add_request("hit", ids)
    assert cache.cached_tokens("hit") == case.point
    for key, t in block_pages(cache, "hit", k).items():
        assert torch.equal(t, pages[key]), f"shared block pages {key}"
    for key, t in state_rows(cache, "hit").items():
        if key[1] in PREFIX_STATE_NAMES:
            assert torch.equal(t, state[key]), f"restored {key}"
    parts = []
    for n in case.after:
        parts.append(run(cache, "hit", ids, [n]))
        if not owner_released:
            run(cache, "owner", owner, [3])
    assert_same_outputs(concat(parts), want, slice(case.point, None), "Triton, after the hit")
    cache.check_invariants()


INSIDE = [  # (name, cfg, layers, block size, owner's chunks: the last one crosses P, P, the hit's chunks)
    ("tiny-all-P48", TINY, (0, 1, 2, 3, 4), 16, (7, 50), 48, (5, 20, 2)),
    ("flash-csa-P512", FLASH, (2,), 256, (100, 600), 512, (130, 1, 300)),
    ("flash-hca-P768", FLASH, (3,), 256, (900,), 768, (2, 129, 256)),
]


@pytest.mark.parametrize("name,cfg,layers,bs,owner_chunks,point,after", INSIDE, ids=[c[0] for c in INSIDE])
def test_hit_at_a_boundary_inside_a_step_triton(name, cfg, layers, bs, owner_chunks, point, after) -> None:
    """A boundary inside the owner's step, snapshotted by the layers: the window entries captured are the step's
    own bytes (equal to those that stay in the owner's ring), and the hit's continuation agrees with a cold run in
    the owner's chunks to the chunking tolerance of the GPU spot check (1e-2)."""
    owner = prompt(1, point) + prompt(3, 1000)[: sum(owner_chunks) - point]
    ids = prompt(1, point) + prompt(2, sum(after))
    end = sum(owner_chunks)
    cache = HybridCache(cfg, layers=layers, block_size=bs, num_blocks=32, max_requests=3, device="cuda", prefix_states=8)
    cache.add_request("owner", owner)
    run(cache, "owner", owner, list(owner_chunks))
    cache.add_request("hit", ids)
    assert cache.cached_tokens("hit") == point
    row = cache.prefix.lookup(array("q", ids))[-1].state_row
    W = cfg.window
    for li in layers:
        storage = cache.schemas[li].kv_storage
        for p in range(max(end - W, point - W, 0), point):
            q = torch.tensor([p % W], device="cuda")
            got = storage.read_bytes(cache.prefix.states.tensors[li]["ring"], torch.tensor([row], device="cuda"), q)
            want = storage.read_bytes(cache.state.tensors[li]["ring"], torch.tensor([cache.slot("owner")], device="cuda"), q)
            assert torch.equal(got, want), (li, p)
    got = run(cache, "hit", ids, list(after))
    cold = HybridCache(cfg, layers=layers, block_size=bs, num_blocks=32, max_requests=3, device="cuda")
    cold.add_request("c", ids)
    chunks = list(owner_chunks[:-1]) + [point + after[0] - (end - owner_chunks[-1])] + list(after[1:])
    want = run(cold, "c", ids, chunks)
    for li in layers:
        y, ref = got[li][0].double(), want[li][0][point:].double()
        assert (y - ref).norm() / ref.norm() < 1e-2, f"layer {li}"
    cache.check_invariants()
