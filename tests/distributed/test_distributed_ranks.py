"""Tensor and context parallelism on gloo ranks (2 and 4 processes, the tiny preset) against one process.

Each scenario runs the same steps (prefill chunks, mixed steps, 1–3-token decodes of three requests) through an
SWA, a CSA and an HCA layer with fresh random inputs, once in this process and once on every rank of a split
(``support.distributed``); every rank's outputs must equal the one-process outputs:

* exact numerics: within 1e-5 relative (only the order of FP32 sums differs: ``wo_b``'s partial products summed
  by the all-reduce, the softmax's sums split over the CP ranks);
* official numerics: TP and CP with the ``"sums"`` merge round every probability as one process does, but a
  different order of FP32 sums can still move a BF16 rounding, and the FP8 input quantization of ``wo_b`` turns
  that into a code one E4M3 step away (a few percent of one input element): each layer's outputs over all steps
  within 5e-3, the spot check's CPU tolerance, and each step's within 1e-2, the GPU spot check's (measured ≤ 3.6e-3
  on a 4-token decode step, 0 for TP); the ``"lse"`` merge rounds each rank's probabilities relative to its own
  maximum: within 2e-2 either way (measured 1.4e-2);
* CSA selections identical, except rows where the two differ only by entries of equal index score (the ReLU of
  the indexer gives exact zero scores: ties that ``torch.topk`` breaks either way); those rows are left out of
  the output comparison;
* HCA / SWA attended entries identical; outputs identical on every rank of a split; a CP rank's pool half the
  one-process pool.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.reference import topk_differences
from support.distributed import Scenario, launch, run_steps, tiny

LAYERS = (0, 1, 2)  # SWA, CSA, HCA
EXACT = dict(cfg=tiny(), layers=LAYERS, numerics="exact", fp8=False, seed=11)
OFFICIAL = dict(cfg=tiny(128), layers=LAYERS, numerics="official", fp8=True, seed=12)  # wo_b: 128 columns a rank

TWO_RANKS = (
    Scenario("tp2-exact", tp=2, **EXACT),
    Scenario("tp2-official", tp=2, **OFFICIAL),
    Scenario("cp2-exact", cp=2, **EXACT),
    Scenario("cp2-official", cp=2, **OFFICIAL),
    Scenario("cp2-exact-lse-first", cp=2, cp_merge="lse", cp_window="first", **EXACT),
    Scenario("cp2-official-lse", cp=2, cp_merge="lse", **OFFICIAL),
)
FOUR_RANKS = (
    Scenario("tp2cp2-exact", tp=2, cp=2, **EXACT),
    Scenario("tp2cp2-official", tp=2, cp=2, **OFFICIAL),
)


def tolerance(scn: Scenario) -> tuple[float, float]:
    """``(a layer's outputs over all steps, one step's)`` relative tolerances (module docstring)."""
    if scn.numerics == "exact":
        return 1e-5, 1e-5
    return (2e-2, 2e-2) if scn.cp_merge == "lse" and scn.cp > 1 else (5e-3, 1e-2)


def _worker(rank: int, scenarios: tuple[Scenario, ...], out_dir: str, check) -> None:
    """Every scenario's outputs into ``out_dir``, then ``check(rank)`` (it raises on failure, else a marker file)."""
    from dsv4.distributed import Parallel

    for scn in scenarios:
        parallel = Parallel.build(scn.tp, scn.cp, scn.cp_window, scn.cp_merge)
        torch.save(run_steps(scn, parallel), f"{out_dir}/{scn.name}-{rank}.pt")
    check(rank)
    open(f"{out_dir}/{check.__name__}-{rank}.ok", "w").close()


def _grid(rank: int) -> None:
    """4 processes: tp × cp groups of the dp × cp × tp grid (TP innermost), and 2 TP-only replicas."""
    import torch.distributed as dist

    from dsv4.distributed import Parallel

    def members(group) -> list[int]:
        ranks = torch.zeros(4, dtype=torch.int64)
        ranks[rank] = 1
        dist.all_reduce(ranks, group=group)
        return ranks.nonzero().flatten().tolist()

    both = Parallel.build(2, 2)
    assert (both.tp_rank, both.cp_rank) == (rank % 2, rank // 2)
    assert members(both.tp_group) == [rank - rank % 2, rank - rank % 2 + 1]
    assert members(both.cp_group) == [rank % 2, rank % 2 + 2]
    replicas = Parallel.build(2, 1)
    assert replicas.cp_group is None and members(replicas.tp_group) == [rank - rank % 2, rank - rank % 2 + 1]
    with pytest.raises(ValueError, match="multiple of 3"):
        Parallel.build(3, 1)


def _refusals(rank: int) -> None:
    """What a rank refuses before it writes anything: another rank's weights, a cache of another CP share, numerics
    whose FP8 ``wo_b`` a TP split would cut inside a 128-block, the Triton backend over a sharded pool."""
    import dsv4
    from dsv4.cache import HybridCache
    from dsv4.distributed import Parallel

    cfg = tiny()
    tp, cp = Parallel.build(2, 1), Parallel.build(1, 2)
    w = dsv4.AttentionWeights.random(cfg, 1, seed=0, fp8=False)
    with pytest.raises(ValueError, match=f"shard {1 - rank} of 2 but this rank is {rank} of 2"):
        dsv4.Attention(w.shard(1 - rank, 2), cfg, 1, parallel=tp)
    with pytest.raises(ValueError, match="torch backend"):
        dsv4.Attention(w, cfg, 1, backend="triton", parallel=cp)
    for parallel, layer, cache_cp, numerics in ((cp, dsv4.Attention(w, cfg, 1, parallel=cp), (0, 1), "exact"),
                                               (tp, dsv4.Attention(w.shard(rank, 2), cfg, 1, parallel=tp), (0, 1),
                                                "official")):
        cache = HybridCache(cfg, layers=[1], num_blocks=8, block_size=64, numerics=numerics, cp_rank=cache_cp[0],
                            cp_size=cache_cp[1])
        cache.add_request("a")
        batch = cache.prepare_forward({"a": 20})
        snap = cache.snapshot()
        with pytest.raises(ValueError, match="context-parallel share 0 of 1|not whole 128-blocks"):
            layer(torch.randn(20, cfg.hidden_size), batch, cache)
        cache.assert_same(snap)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """``{scenario name: [rank 0's outputs, rank 1's, …]}`` and ``{"single-" + numerics: one process's}``."""
    out = tmp_path_factory.mktemp("ranks")
    launch(_worker, 2, TWO_RANKS, str(out), _refusals, timeout=240)
    launch(_worker, 4, FOUR_RANKS, str(out), _grid, timeout=240)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = {f"single-{kw['numerics']}": run_steps(Scenario("single", **kw)) for kw in (EXACT, OFFICIAL)}
    finally:
        torch.set_num_threads(threads)
    for scn in TWO_RANKS + FOUR_RANKS:
        res[scn.name] = [torch.load(out / f"{scn.name}-{r}.pt") for r in range(scn.tp * scn.cp)]
    res["refusals"] = [(out / f"_refusals-{r}.ok").exists() for r in range(2)]
    res["grid"] = [(out / f"_grid-{r}.ok").exists() for r in range(4)]
    return res


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("scn", TWO_RANKS + FOUR_RANKS, ids=lambda s: s.name)
def test_every_layer_kind_matches_one_process(results, scn):
    single = results[f"single-{scn.numerics}"]
    tol_layer, tol = tolerance(scn)
    tie_rows = 0
    for rank, got in enumerate(results[scn.name]):
        kept: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for key, y in single["y"].items():
            step, layer = key
            keep = torch.ones(y.shape[0], dtype=torch.bool)
            want_idx, got_idx = single["idx"][key], got["idx"][key]
            if key in single["scores"]:  # CSA: the same selection, or one that differs by exact ties only
                differs, ties = topk_differences(single["scores"][key], want_idx, got_idx, rel=0.0)
                assert torch.equal(differs, ties), (scn.name, rank, key, torch.nonzero(differs & ~ties).flatten())
                keep = ~differs
                tie_rows += int(differs.sum())
            else:
                assert torch.equal(want_idx, got_idx), (scn.name, rank, key)
            assert _rel(got["y"][key][keep], y[keep]) <= tol, (scn.name, rank, key, _rel(got["y"][key][keep], y[keep]))
            kept.setdefault(layer, []).append((got["y"][key][keep], y[keep]))
            heads = got["lse"][key].shape[1]  # a TP rank's lse: its heads (rank = cp_rank · tp + tp_rank)
            want_lse = single["lse"][key][:, (rank % scn.tp) * heads : (rank % scn.tp + 1) * heads]
            assert _rel(got["lse"][key][keep], want_lse[keep]) <= max(tol, 1e-6), (scn.name, rank, key)
        for layer, pairs in kept.items():
            rel = _rel(torch.cat([g for g, _ in pairs]), torch.cat([w for _, w in pairs]))
            assert rel <= tol_layer, (scn.name, rank, layer, rel)
    assert tie_rows <= 4 * len(results[scn.name])  # a few exact ties at most, never a systematic difference


@pytest.mark.parametrize("scn", TWO_RANKS + FOUR_RANKS, ids=lambda s: s.name)
def test_ranks_agree_bit_for_bit(results, scn):
    first, *others = results[scn.name]
    for other in others:
        for key, y in first["y"].items():
            assert torch.equal(y, other["y"][key]), (scn.name, key)
            assert torch.equal(first["idx"][key], other["idx"][key]), (scn.name, key)


def test_ranks_refuse_mismatched_weights_caches_and_numerics(results):
    assert results["refusals"] == [True, True]


def test_groups_form_the_rank_grid(results):
    assert results["grid"] == [True] * 4


@pytest.mark.parametrize("scn", [s for s in TWO_RANKS + FOUR_RANKS if s.cp > 1], ids=lambda s: s.name)
def test_context_parallel_pool_is_shared(results, scn):
    single = results[f"single-{scn.numerics}"]["pool_bytes"]
    for got in results[scn.name]:
        assert got["pool_bytes"] <= 0.55 * single, (got["pool_bytes"], single)
