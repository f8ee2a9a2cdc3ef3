"""Prefix caching (issue 37): a hit restores exactly what a cold run holds at the prefix end, and every layer's
outputs for the rest of the request equal the cold run's, bit for bit (torch backend, CPU, same chunks after the
prefix).

A "cold run" is a fresh cache running the prompt alone in the owner's chunks up to the prefix end P, then in the
hit's chunks. Inputs are token-determined (a fixed random embedding per token id), so equal token prefixes feed
equal hidden states. Cases cover every layer kind alone and all layers together, block sizes down to the finest
each kind allows, prefix ends inside and at the end of the SWA window (block-aligned prefix ends are always at the
end of every compression window: ``block_size`` is a multiple of every ratio), steps before and after P that end
inside compression windows, the owner continuing / released / preempted / evicted meanwhile, and the hit request
preempted and restored.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

import dsv4
from dsv4.cache import CacheFullError, HybridCache, IncompatibleSnapshotError, InvalidPlanError, PrefixSnapshot
from dsv4.cache.prefix import PREFIX_STATE_NAMES, as_token_ids

from support.oracle import check_against_reference
from support.prefix import (
    Case,
    Outputs,
    assert_same_outputs,
    block_pages,
    concat,
    embedding,
    layer,
    prompt,
    state_rows,
)

TINY = dsv4.ModelConfig.preset("tiny")
TINY_W20 = TINY.replace(name="tiny-w20", window=20)
pytestmark = pytest.mark.usefixtures("one_thread")


def run(cache: HybridCache, rid: str, ids: list[int], chunks: list[int], feed_ids: bool = True) -> Outputs:
    """Feed ``chunks`` of ``rid``'s tokens (from its cached count on) through every cached layer."""
    cfg = cache.cfg
    parts = []
    at = cache.num_tokens(rid)
    for n in chunks:
        batch = cache.prepare_forward({rid: n}, token_ids={rid: ids[at : at + n]} if feed_ids else None)
        x = embedding(cfg)[torch.tensor(ids[at : at + n])]
        step = {}
        for li in cache.layer_indices:
            res = layer(cfg, li).forward_with_aux(x, batch, cache)
            step[li] = (res.y, res.lse, res.attended_entries())
        parts.append(step)
        at += n
    return concat(parts)


CASES = [
    # SWA only (no pool: "blocks" are the hash granularity): P inside the 16-token window, at its end, past it
    Case("swa-P8-inside-window", TINY, (0,), 4, (3, 5), (1, 6, 2, 9)),
    Case("swa-P16-window-end", TINY, (0,), 8, (7, 9), (3, 1, 13)),
    Case("swa-P20-ring-wrapped", TINY, (0,), 5, (13, 2, 5), (16, 1, 2)),
    # CSA (ratio 4): blocks of 4 / 8 positions; chunks end inside CSA windows before and after P
    Case("csa-P12-inside-window", TINY, (1,), 4, (5, 7), (2, 1, 11, 3)),
    Case("csa-P16-window-end", TINY, (1,), 8, (3, 13), (6, 7, 4)),
    Case("csa-P28-ring-wrapped", TINY, (1,), 4, (9, 6, 13), (5, 1, 1, 10)),
    # HCA (ratio 16): blocks of 16; window 20 puts P inside the SWA window
    Case("hca-P16", TINY, (2,), 16, (11, 5), (7, 9, 17)),
    Case("hca-P32-w20-inside-window", TINY_W20, (2,), 16, (3, 20, 9), (15, 2, 16)),
    # every layer, MTP included
    Case("all-P16", TINY, (0, 1, 2, 3, 4), 16, (6, 10), (5, 3, 17, 1)),
    Case("all-P48-w20", TINY_W20, (0, 1, 2, 3, 4), 16, (17, 15, 16), (1, 20, 3)),
]


def make_cache(case: Case, **kw) -> HybridCache:
    kw.setdefault("num_blocks", 24)
    kw.setdefault("max_requests", 4)
    return HybridCache(case.cfg, layers=case.layers, block_size=case.block_size, **kw)


@functools.cache
def cold(case: Case) -> tuple[Outputs, dict, dict]:
    """The cold run: outputs of all tokens, and the state rows and prefix block pages right after position P."""
    cache = make_cache(case)
    ids = hit_prompt(case)
    cache.add_request("c")
    head = run(cache, "c", ids, list(case.before), feed_ids=False)
    state, pages = state_rows(cache, "c"), block_pages(cache, "c", case.point // case.block_size)
    tail = run(cache, "c", ids, list(case.after), feed_ids=False)
    return concat([head, tail]), state, pages


def hit_prompt(case: Case) -> list[int]:
    return prompt(1, case.point) + prompt(2, sum(case.after))


def owner_prompt(case: Case) -> list[int]:
    """Shares the first P tokens with the hit's prompt, then differs (the owner writes its own blocks after P)."""
    return prompt(1, case.point) + prompt(3, 40)


def check_restored(cache: HybridCache, rid: str, case: Case) -> None:
    """What the hit restored equals the cold run at P: shared blocks' pages and the live state, bit for bit; the
    compressor tails (not live at a block boundary) hold their reset values."""
    _, state, pages = cold(case)
    k = case.point // case.block_size
    assert cache.cached_tokens(rid) == cache.num_tokens(rid) == case.point
    assert len(cache.block_table(rid)) == (k if cache.min_ratio else 0)
    for key, t in block_pages(cache, rid, k).items():
        assert torch.equal(t, pages[key]), f"shared block pages {key} differ from the cold run"
    got = state_rows(cache, rid)
    specs = {(li, s.name): s for li, ss in cache.state.specs.items() for s in ss}
    for key, t in got.items():
        if key[1] in PREFIX_STATE_NAMES:
            assert torch.equal(t, state[key]), f"restored {key} differs from the cold run at P"
        else:
            assert bool((t == specs[key].fill).all()), f"{key} is not at its reset value"


# ------------------------------------------------------------------------------------------------ bit-identity
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_hit_is_bit_identical_to_cold_run(case: Case) -> None:
    want, _, _ = cold(case)
    assert want[case.layers[0]][0].abs().amax() > 0
    cache = make_cache(case, prefix_states=3)
    ids = hit_prompt(case)
    cache.add_request("owner", owner_prompt(case))
    run(cache, "owner", owner_prompt(case), list(case.before))
    cache.add_request("hit", ids)  # publishes the owner's step that ended at P, then hits it
    check_restored(cache, "hit", case)
    cache.check_invariants()
    k = case.point // case.block_size
    if cache.min_ratio:
        assert cache.block_table("hit") == cache.block_table("owner")[:k]
    # both continue, interleaved step by step: the owner writes its own blocks after P, the hit its own
    parts = []
    for n in case.after:
        parts.append(run(cache, "hit", ids, [n]))
        run(cache, "owner", owner_prompt(case), [3])
        cache.check_invariants()
    assert_same_outputs(concat(parts), want, slice(case.point, None), "after the hit")
    for rid in ("owner", "hit"):
        cache.release(rid)
    cache.check_invariants()


@pytest.mark.parametrize("case", [CASES[4], CASES[7], CASES[9]], ids=lambda c: c.name)
@pytest.mark.parametrize("meanwhile", ["released", "preempted", "evicted-deeper"])
def test_owner_gone_meanwhile(case: Case, meanwhile: str) -> None:
    """The owner finishes (released), is preempted, or the longer prefixes chained on P are evicted before the
    hit: the prefix at P still restores bit-identically."""
    want, _, _ = cold(case)
    k = case.point // case.block_size
    cache = make_cache(case, prefix_states=4, num_blocks=k + 6)
    owner = owner_prompt(case)
    cache.add_request("owner", owner)
    run(cache, "owner", owner, list(case.before) + [case.block_size])  # a deeper snapshot at P + block_size
    if meanwhile == "released":
        cache.release("owner")
    elif meanwhile == "preempted":
        cache.preempt_request("owner")
    else:
        cache.release("owner")
        cache.add_request("big")  # takes every free block, then the unused cached block past P
        cache.prepare_forward({"big": cache.num_free_blocks * case.block_size + cache.min_ratio})
        nodes = sorted(n.depth for n in cache.prefix.nodes.values())
        assert nodes == list(range(1, k + 1)), nodes  # the deeper node went first; the prefix at P is whole
        cache.release("big")
    cache.check_invariants()
    assert cache.prefix_cache_bytes() > 0
    ids = hit_prompt(case)
    cache.add_request("hit", ids)
    check_restored(cache, "hit", case)
    got = run(cache, "hit", ids, list(case.after))
    assert_same_outputs(got, want, slice(case.point, None), f"owner {meanwhile}")
    cache.release("hit")
    cache.check_invariants()


@pytest.mark.parametrize("case", [CASES[5], CASES[9]], ids=lambda c: c.name)
@pytest.mark.parametrize("prefix_kept", [True, False], ids=["prefix-kept", "prefix-evicted"])
def test_hit_request_preempted_and_restored(case: Case, prefix_kept: bool) -> None:
    """A request that hit is preempted mid-way; an intruder takes blocks; it is restored — re-sharing the cached
    prefix blocks if the cache still holds them, else into private copies — and continues bit-identically."""
    want, _, _ = cold(case)
    k = case.point // case.block_size
    cache = make_cache(case, prefix_states=2, num_blocks=3 * k + 8)
    owner = owner_prompt(case)
    cache.add_request("owner", owner)
    run(cache, "owner", owner, list(case.before))
    cache.release("owner")
    ids = hit_prompt(case)
    cache.add_request("hit", ids)
    got = [run(cache, "hit", ids, list(case.after[:1]))]
    snap = cache.preempt_request("hit")
    assert snap.token_ids == tuple(ids) and len(snap.prefix_nodes) >= (k if cache.min_ratio else 0)
    if not prefix_kept:
        cache.clear_prefix_cache()
        assert not cache.prefix.nodes
    cache.add_request("intruder")
    run(cache, "intruder", prompt(9, 30), [cache.block_size + 1], feed_ids=False)
    cache.restore_request("hit", snap)
    table = cache.block_table("hit")
    cached = cache.prefix.cached_blocks()
    if cache.min_ratio:
        assert (set(table[:k]) <= cached) == prefix_kept
    cache.check_invariants()
    got.append(run(cache, "hit", ids, list(case.after[1:])))
    assert_same_outputs(concat(got), want, slice(case.point, None), "after preempt + restore")
    for rid in ("hit", "intruder"):
        cache.release(rid)
    cache.check_invariants()


@pytest.mark.parametrize("li", [1, 2], ids=["csa", "hca"])
def test_tails_are_not_live_at_a_block_boundary(li: int) -> None:
    """Why a snapshot may leave the compressor tails out: at a block boundary every window is closed and every
    tail row is written before it is read. Random values in the tails there change no output bit."""
    case = Case("tails", TINY, (li,), 16, (5, 6, 5), (3, 13, 1, 9))
    outs = []
    for scribble in (False, True):
        cache = make_cache(case)
        cache.add_request("a")
        ids = hit_prompt(case)
        run(cache, "a", ids, list(case.before), feed_ids=False)
        if scribble:
            g = torch.Generator().manual_seed(4)
            for name, t in cache.state.tensors[li].items():
                if name not in PREFIX_STATE_NAMES:
                    t[cache.slot("a")] = torch.randn(t[0].shape, generator=g) * 100
        outs.append(run(cache, "a", ids, list(case.after), feed_ids=False))
    assert_same_outputs(outs[1], outs[0], slice(None), "with scribbled tails")


# ------------------------------------------------------------------------------------------------ bookkeeping
CSA = CASES[4]  # layers (1,), block size 8


def test_lineage_concurrent_cold_runs_and_row_lru() -> None:
    """Two requests computing the same prefix cold at once: the second finds the first's nodes holding other
    blocks and publishes nothing (a prefix is never assembled from two computations). With one snapshot row, a
    newer snapshot evicts the older one, and the stateless nodes behind it go too."""
    cache = make_cache(CSA, prefix_states=1, max_requests=6)
    ids = prompt(1, 40)
    for rid in ("a", "b"):
        cache.add_request(rid, ids)
    run(cache, "a", ids, [16])
    run(cache, "b", ids, [16])
    cache.add_request("probe", ids)  # publishes both steps, then hits a's snapshot at 16
    assert cache.cached_tokens("probe") == 16
    assert cache.prefix.requests["b"].diverged and not cache.prefix.requests["a"].diverged
    assert cache.block_table("probe") == cache.block_table("a")[:2] != cache.block_table("b")[:2]
    other = prompt(2, 40)
    cache.add_request("c", other)
    run(cache, "c", other, [8, 8])  # the only row goes to c's newest snapshot (16)...
    cache.release("probe")
    cache.check_invariants()
    cache.add_request("probe2", ids + [1])
    assert cache.cached_tokens("probe2") == 0  # ... a's is gone (a still uses its nodes: they stay, stateless)
    cache.add_request("probe3", other)
    assert cache.cached_tokens("probe3") == 16
    for rid in ("a", "b", "c", "probe2", "probe3"):
        cache.release(rid)
    cache.check_invariants()
    assert {n.depth for n in cache.prefix.nodes.values()} == {1, 2}  # c's chain, with its snapshot at 16


def test_block_lru_evicts_unused_prefixes_oldest_first() -> None:
    cache = make_cache(CSA, prefix_states=4, num_blocks=6)
    old, new = prompt(1, 17), prompt(2, 17)
    for rid, ids in (("old", old), ("new", new)):
        cache.add_request(rid, ids)
        run(cache, rid, ids, [16, 1])
        cache.release(rid)
    assert cache.num_free_blocks == 2 and cache.num_reclaimable_blocks == 6
    cache.add_request("x")
    cache.prepare_forward({"x": 8 * 4})  # needs 4 blocks: the 2 free, then old's 2 (least recently used)
    assert cache.prefix.lookup(as_token_ids(old)) == [] and len(cache.prefix.lookup(as_token_ids(new))) == 2
    cache.add_request("n2", new)
    assert cache.cached_tokens("n2") == 16
    cache.check_invariants()
    before = cache.snapshot()
    with pytest.raises(CacheFullError, match="new blocks"):  # n2's blocks are in use: not evictable
        cache.prepare_forward({"x": 2 * 8})
    cache.assert_same(before)
    cache.release("n2")
    cache.prepare_forward({"x": 2 * 8})  # now they are
    assert not cache.prefix.nodes
    cache.release("x")
    cache.check_invariants()


@pytest.mark.parametrize("states", [16, 4])
def test_every_boundary_a_step_crosses_gets_a_snapshot(states: int) -> None:
    """Bookkeeping: one step of two requests crossing five block boundaries plans a snapshot row for each (at most
    half the rows per step, the deepest first); after publication each is its node's snapshot."""
    cache = make_cache(CSA, prefix_states=states)  # blocks of 8
    a, b = prompt(1, 40), prompt(2, 40)
    cache.add_request("a", a)
    cache.add_request("b", b)
    batch = cache.prepare_forward({"a": 26, "b": 17})
    planned = sorted((rid, p) for rid, p, _ in ((("a", "b")[i], p, r) for i, p, r in batch.prefix_captures))
    want = [("a", 8), ("a", 16), ("a", 24), ("b", 8), ("b", 16)]
    assert planned == (want if states == 16 else [("a", 16), ("a", 24)])
    assert len({r for _, _, r in batch.prefix_captures}) == len(planned)
    cache.publish_prefixes()
    snapshotted = sorted((rid, n.depth * 8) for rid, ids in (("a", a), ("b", b))
                         for n in cache.prefix.lookup(as_token_ids(ids)) if n.state_row is not None)
    assert set(planned) <= set(snapshotted)
    cache.check_invariants()


def test_write_into_a_cached_block_is_caught() -> None:
    """The invariants and prepare_forward's guard can fail: a forged table that would write into a cached block,
    and bytes changed in a cached block, are both reported."""
    cache = make_cache(CSA, prefix_states=2)
    ids = prompt(1, 30)
    cache.add_request("a", ids)
    run(cache, "a", ids, [16, 2])
    cache.release("a")
    cache.check_invariants()  # records the cached blocks' digests
    cached = sorted(cache.prefix.cached_blocks())
    cache.add_request("b")
    cache.prepare_forward({"b": 5})
    rec = cache._requests["b"]
    real, rec.blocks = rec.blocks, [cached[0]]  # forged: b's writable block is a cached one
    with pytest.raises(AssertionError, match="write into cached prefix blocks"):
        cache.prepare_forward({"b": 1})
    with pytest.raises(AssertionError, match="referenced by 2 table / prefix entries"):
        cache.check_invariants()
    with pytest.raises(AssertionError, match="writable blocks"):
        cache.prefix.check_invariants()
    rec.blocks = real
    cache.check_invariants()
    pages = cache.pool.tensors[1]["kv_pages"]
    pages[cached[1], 7] ^= 1
    with pytest.raises(AssertionError, match="written after it was cached"):
        cache.prefix.check_invariants()


def test_token_ids_checked_and_hit_capped() -> None:
    cache = make_cache(CSA, prefix_states=2)
    ids = prompt(1, 24)
    cache.add_request("a", ids)
    run(cache, "a", ids, [16])
    with pytest.raises(InvalidPlanError, match="disagree with its known tokens at position 17"):
        cache.prepare_forward({"a": 4}, token_ids={"a": ids[16:17] + [ids[17] + 1] + ids[18:20]})
    with pytest.raises(InvalidPlanError, match="3 token ids for 4 new tokens"):
        cache.prepare_forward({"a": 4}, token_ids={"a": ids[16:19]})
    # the whole cached prompt: at least its last token is computed (its output starts the generation)
    cache.add_request("same", ids[:16])
    assert cache.cached_tokens("same") == 8  # the whole prompt is cached, but its last token is computed
    cache.add_request("longer", ids[:17])
    assert cache.cached_tokens("longer") == 16
    # ids beyond the prompt (generated tokens) extend the known ids and publish the blocks they fill
    run(cache, "a", ids + prompt(5, 8), [8, 8])
    cache.add_request("gen", ids + prompt(5, 8) + [3])
    assert cache.cached_tokens("gen") == 32


def exported(case: Case) -> PrefixSnapshot | None:
    """The prefix of ``case`` exported from a cache where a released owner computed it."""
    src = make_cache(case, prefix_states=2)
    owner = owner_prompt(case)
    src.add_request("owner", owner)
    run(src, "owner", owner, list(case.before))
    src.release("owner")
    return src.export_prefix(hit_prompt(case))


def test_export_import_into_another_cache() -> None:
    case = CASES[9]
    want, _, _ = cold(case)
    snap = exported(case)
    assert snap is not None and snap.num_blocks == case.point // case.block_size
    dst = make_cache(case, prefix_states=1, num_blocks=9, max_requests=2)
    dst.add_request("busy")
    run(dst, "busy", prompt(7, 20), [20], feed_ids=False)
    assert dst.import_prefix(snap) == case.point
    assert dst.import_prefix(snap) == 0  # already cached
    ids = hit_prompt(case)
    dst.add_request("hit", ids)
    check_restored(dst, "hit", case)
    assert_same_outputs(run(dst, "hit", ids, list(case.after)), want, slice(case.point, None), "after import")
    dst.check_invariants()
    other = HybridCache(case.cfg, layers=case.layers, block_size=case.block_size, num_blocks=9, numerics="exact",
                        prefix_states=1)
    before = other.snapshot()
    with pytest.raises(IncompatibleSnapshotError, match="another geometry: numerics 'official' != 'exact'"):
        other.import_prefix(snap)
    other.assert_same(before)


def test_import_after_a_step_computing_the_same_prefix() -> None:
    """The last step of a request that computed the snapshot's prefix is published by ``import_prefix`` itself: the
    import then finds that prefix cached and adds nothing (it used to overwrite the request's nodes)."""
    case = CASES[9]
    snap = exported(case)
    dst = make_cache(case, prefix_states=2)
    dst.add_request("twin", owner_prompt(case))
    run(dst, "twin", owner_prompt(case), [case.point])  # one step: its blocks are not published yet
    assert not dst.prefix.nodes
    assert dst.import_prefix(snap) == 0
    dst.check_invariants()
    dst.add_request("hit", hit_prompt(case))
    assert dst.cached_tokens("hit") == case.point
    k = case.point // case.block_size
    assert dst.block_table("hit")[:k] == dst.block_table("twin")[:k]


def test_memory_accounting() -> None:
    plain = HybridCache(TINY, layers=[0, 1, 2], max_requests=2, memory_bytes=1 << 20, block_size=16)
    with_prefix = HybridCache(TINY, layers=[0, 1, 2], max_requests=2, memory_bytes=1 << 20, block_size=16,
                              prefix_states=3)
    row, slot, block = with_prefix.prefix_state_bytes, plain.state.bytes_per_slot, plain.pool.bytes_per_block
    assert row == with_prefix.prefix.states.bytes_per_row > 0
    assert plain.num_blocks == ((1 << 20) - 2 * slot) // block
    assert with_prefix.num_blocks == ((1 << 20) - 2 * slot - 3 * row) // block
    assert with_prefix.memory_bytes() == with_prefix.num_blocks * block + 2 * slot + 3 * row <= 1 << 20
    # the live state at a block boundary is what the snapshot holds: far less than a whole state slot
    assert row < with_prefix.state.bytes_per_slot


# ------------------------------------------------------------------------------------------------ inside a step
@dataclass(frozen=True)
class Inside:
    """The owner's last chunk crosses the prefix end P (no step ends there); the hit continues with ``after``."""

    name: str
    cfg: dsv4.ModelConfig
    layers: tuple[int, ...]
    block_size: int
    owner_chunks: tuple[int, ...]
    point: int
    after: tuple[int, ...]


INSIDE = [
    Inside("swa-P12", TINY, (0,), 4, (3, 20), 12, (2, 9, 1)),
    Inside("csa-P24", TINY, (1,), 8, (5, 30), 24, (3, 6, 11)),
    Inside("hca-P32", TINY, (2,), 16, (40,), 32, (7, 17, 1)),
    Inside("all-P48-w20", TINY_W20, (0, 1, 2, 3, 4), 16, (7, 50), 48, (5, 20, 2)),
]


@pytest.mark.parametrize("numerics", ["exact", "official"])
@pytest.mark.parametrize("case", INSIDE, ids=lambda c: c.name)
def test_hit_at_a_boundary_inside_a_step(case: Inside, numerics: str) -> None:
    """Every block boundary a step crosses is snapshotted by the layers inside the step, so a later request hits
    there too. The window entries captured are the step's own (bit-equal to those that stay in the owner's ring);
    a cold run cannot stop at P, so the rest is checked against the reference (exact numerics) and against a cold
    run in the owner's chunks (official numerics, chunking tolerance)."""
    P, bs = case.point, case.block_size
    owner = prompt(1, P) + prompt(3, 60)
    ids = prompt(1, P) + prompt(2, sum(case.after))
    kw = dict(layers=case.layers, block_size=bs, num_blocks=24, max_requests=3, numerics=numerics)
    cache = HybridCache(case.cfg, prefix_states=8, **kw)
    cache.add_request("owner", owner)
    run(cache, "owner", owner, list(case.owner_chunks))
    end = sum(case.owner_chunks)
    assert P % bs == 0 and end - case.owner_chunks[-1] < P < end
    cache.publish_prefixes()
    node = cache.prefix.lookup(as_token_ids(ids))[-1]
    assert node.depth * bs == P and node.state_row is not None
    W = case.cfg.window
    for li in case.layers:  # positions P−W … P−1 that also stay in the owner's ring: the same bytes
        snap, live = cache.prefix.states.tensors[li], cache.state.tensors[li]
        storage = cache.schemas[li].kv_storage
        for p in range(max(end - W, P - W, 0), P):
            q = torch.tensor([p % W])
            got = storage.read_bytes(snap["ring"], torch.tensor([node.state_row]), q)
            want = storage.read_bytes(live["ring"], torch.tensor([cache.slot("owner")]), q)
            assert torch.equal(got, want) and int(snap["ring_positions"][node.state_row, p % W]) == p
    cache.add_request("hit", ids)
    assert cache.cached_tokens("hit") == P
    got = run(cache, "hit", ids, list(case.after))
    cache.check_invariants()
    x = embedding(case.cfg)[torch.tensor(ids)]
    if numerics == "exact":
        for li in case.layers:
            check_against_reference(layer(case.cfg, li).weights, case.cfg, li, x, got[li][0], got[li][2], "exact", 1e-5,
                                    rows=slice(P, len(ids)))
        return
    cold = HybridCache(case.cfg, **kw)
    cold.add_request("c")
    chunks = list(case.owner_chunks[:-1]) + [P + case.after[0] - (end - case.owner_chunks[-1])] + list(case.after[1:])
    want = run(cold, "c", ids, chunks, feed_ids=False)
    for li in case.layers:
        y, ref = got[li][0].double(), want[li][0][P:].double()
        assert (y - ref).norm() / ref.norm() < 5e-3, f"layer {li}: continuation differs beyond chunking tolerance"
