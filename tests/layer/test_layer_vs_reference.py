"""dsv4.Attention over the HybridCache (torch backend) against the stateless reference."""

import random

import pytest
import torch

import dsv4
from dsv4.cache import HybridCache
from dsv4.layer import Attention

TINY = dsv4.ModelConfig.preset("tiny")  # window 16, CSA 4, HCA 16, top-k 8
LAYERS = {"swa": 0, "csa": 1, "hca": 2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run_chunked(w, cfg, layer_idx, x, chunks, numerics, block_size=32, num_blocks=64):
    """Run ``x`` through the cache in the given chunking; returns outputs [S, d] and selected entries [S, K]."""
    cache = HybridCache(cfg, layers=[layer_idx], max_requests=2, num_blocks=num_blocks, block_size=block_size, numerics=numerics)
    layer = Attention(w, cfg, layer_idx, backend="torch")
    cache.add_request("r")
    outs, idx, at = [], [], 0
    for n in chunks:
        batch = cache.prepare_forward({"r": n})
        res = layer.forward_with_aux(x[at : at + n], batch, cache)
        outs.append(res.y)
        idx.append(res.attended_entries())
        at += n
    cache.check_invariants()
    width = max(i.shape[1] for i in idx)
    idx = torch.cat([torch.nn.functional.pad(i, (0, width - i.shape[1]), value=-1) for i in idx])
    return torch.cat(outs), idx


def tie_rows(ref, got_idx: torch.Tensor) -> torch.Tensor:
    """Rows whose selected set differs from the reference's; asserts every difference is a tie (both sets select
    the same multiset of reference index scores). Returns a bool mask [S]."""
    if ref.index_scores is None:  # HCA/SWA: no indexer, so no ties: the attended entries must be identical
        differs, _ = dsv4.reference.topk_differences(torch.zeros(got_idx.shape[0], 1), ref.entry_idx, got_idx)
        assert not differs.any(), f"attended entries differ at tokens {differs.nonzero().squeeze(1).tolist()}"
        return differs
    differs, ties = dsv4.reference.topk_differences(ref.index_scores, ref.entry_idx, got_idx)
    assert torch.equal(differs, ties), f"top-k differs beyond ties at tokens {(differs & ~ties).nonzero().squeeze(1).tolist()}"
    return differs


CHUNKINGS = {
    "ones": [1] * 70,
    "mixed": [37, 5, 128, 1, 1, 300],
    "one": [472],
    "spec": [3, 4, 2, 1, 4, 4, 3, 2, 40, 1, 2, 3, 4],
}


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("chunking", list(CHUNKINGS))
def test_exact_chunked_equals_reference(kind: str, chunking: str) -> None:
    li = LAYERS[kind]
    chunks = CHUNKINGS[chunking]
    S = sum(chunks)
    w = dsv4.AttentionWeights.random(TINY, li, seed=11)
    x = torch.randn(S, TINY.hidden_size, generator=torch.Generator().manual_seed(S))
    ref = dsv4.reference.forward(w, TINY, li, x, "exact")
    got, idx = run_chunked(w, TINY, li, x, chunks, "exact")
    ties = tie_rows(ref, idx)
    assert ties.float().mean() < 0.05
    assert rel_err(got[~ties], ref.y[~ties]) <= 1e-5


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("chunking", ["ones", "mixed", "one"])
def test_official_chunked_matches_reference(kind: str, chunking: str) -> None:
    li = LAYERS[kind]
    chunks = CHUNKINGS[chunking]
    S = sum(chunks)
    w = dsv4.AttentionWeights.random(TINY, li, seed=5)
    x = torch.randn(S, TINY.hidden_size, generator=torch.Generator().manual_seed(S + 1))
    ref = dsv4.reference.forward(w, TINY, li, x, "official")
    got, idx = run_chunked(w, TINY, li, x, chunks, "official")
    ties = tie_rows(ref, idx)
    err = rel_err(got[~ties].float(), ref.y[~ties].float())
    print(kind, chunking, err, int(ties.sum()))
    assert err <= 1e-3  # 0 where the ops are the same; BF16 GEMMs over other row blocks may round differently


def test_many_requests_in_one_step_equal_running_alone() -> None:
    """>= 8 requests at different positions, prefill chunks mixed with 1-4 token decodes, every layer kind."""
    rng = random.Random(0)
    n_req = 9
    for li in LAYERS.values():
        w = dsv4.AttentionWeights.random(TINY, li, seed=li)
        layer = Attention(w, TINY, li)
        lengths = [rng.randint(20, 90) for _ in range(n_req)]
        xs = [torch.randn(L, TINY.hidden_size, generator=torch.Generator().manual_seed(100 * li + r)) for r, L in enumerate(lengths)]
        # Alone: each request by itself, in one chunk (exact numerics: the reference to 1e-5).
        alone = [dsv4.reference.forward(w, TINY, li, xs[r], "exact") for r in range(n_req)]
        cache = HybridCache(TINY, layers=[li], max_requests=n_req, num_blocks=128, block_size=16, numerics="exact")
        done = [0] * n_req
        got = [[] for _ in range(n_req)]
        idx = [[] for _ in range(n_req)]
        for r in range(n_req):
            cache.add_request(f"r{r}")
        while any(d < L for d, L in zip(done, lengths)):
            plan = {}
            for r in rng.sample(range(n_req), n_req):
                left = lengths[r] - done[r]
                if left and rng.random() < 0.8:
                    plan[f"r{r}"] = min(left, rng.choice([1, 2, 3, 4, rng.randint(5, 40)]))
            if not plan:
                continue
            batch = cache.prepare_forward(plan)
            x = torch.cat([xs[int(rid[1:])][done[int(rid[1:])] : done[int(rid[1:])] + n] for rid, n in plan.items()])
            res = layer.forward_with_aux(x, batch, cache)
            at = 0
            for rid, n in plan.items():
                r = int(rid[1:])
                got[r].append(res.y[at : at + n])
                idx[r].append(res.attended_entries()[at : at + n])
                at += n
                done[r] += n
        for r in range(n_req):
            y = torch.cat(got[r])
            width = max(i.shape[1] for i in idx[r])
            ix = torch.cat([torch.nn.functional.pad(i, (0, width - i.shape[1]), value=-1) for i in idx[r]])
            ties = tie_rows(alone[r], ix)
            assert rel_err(y[~ties], alone[r].y[~ties]) <= 1e-5, (li, r)
        for r in range(n_req):
            cache.release(f"r{r}")
        cache.check_invariants()
        assert cache.num_free_blocks == cache.num_blocks and cache.num_free_slots == n_req


def test_reused_slot_sees_no_trace_of_previous_owner() -> None:
    for li in LAYERS.values():
        w = dsv4.AttentionWeights.random(TINY, li, seed=3)
        layer = Attention(w, TINY, li)
        cache = HybridCache(TINY, layers=[li], max_requests=1, num_blocks=32, block_size=16, numerics="official")
        first = torch.randn(45, TINY.hidden_size)
        cache.add_request("old")
        layer(first, cache.prepare_forward({"old": 45}), cache)
        cache.release("old")
        x = torch.randn(23, TINY.hidden_size)
        cache.add_request("new")  # gets the same (only) slot and the same blocks back
        outs = [layer(x[i : i + 1], cache.prepare_forward({"new": 1}), cache) for i in range(23)]
        fresh = HybridCache(TINY, layers=[li], max_requests=1, num_blocks=32, block_size=16, numerics="official")
        fresh.add_request("new")
        want = [layer(x[i : i + 1], fresh.prepare_forward({"new": 1}), fresh) for i in range(23)]
        assert torch.equal(torch.cat(outs), torch.cat(want))
