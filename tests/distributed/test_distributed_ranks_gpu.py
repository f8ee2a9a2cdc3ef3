"""Tensor and context parallelism on two GPUs (NCCL), the tiny preset with 128-column ``wo_b`` groups, official
numerics, against one GPU: TP=2 on the Triton backend, CP=2 on the torch backend (the sharded pool's ops). Needs
two CUDA devices; skipped otherwise.

Tolerances are the GPU spot check's (1e-2 relative: cuBLAS / kernel reduction orders differ between a rank's and
the whole layer's shapes); CSA selections must agree up to near-ties of the index scores (the one-GPU run's
scores recomputed by the torch ops: within 2^-7 of each other where the Triton indexer chose)."""

from __future__ import annotations

import pytest
import torch

from dsv4.reference import topk_differences
from support.distributed import Scenario, launch, run_steps, tiny

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

OFFICIAL = dict(cfg=tiny(128), layers=(0, 1, 2), numerics="official", fp8=True, seed=21, cuda=True)
SCENARIOS = (
    Scenario("gpu-tp2-triton", tp=2, backend="triton", **OFFICIAL),
    Scenario("gpu-cp2-torch", cp=2, backend="torch", **OFFICIAL),
    Scenario("gpu-cp2-torch-lse", cp=2, backend="torch", cp_merge="lse", **OFFICIAL),
)


def _worker(rank: int, out_dir: str) -> None:
    from dsv4.distributed import Parallel

    for scn in SCENARIOS:
        torch.save(run_steps(scn, Parallel.build(scn.tp, scn.cp, scn.cp_window, scn.cp_merge)),
                   f"{out_dir}/{scn.name}-{rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu-ranks")
    launch(_worker, 2, str(out), timeout=600, backend="nccl")
    res = {b: run_steps(Scenario("single", backend=b, **OFFICIAL)) for b in ("triton", "torch")}
    for scn in SCENARIOS:
        res[scn.name] = [torch.load(out / f"{scn.name}-{r}.pt") for r in range(2)]
    return res


@pytest.mark.parametrize("scn", SCENARIOS, ids=lambda s: s.name)
def test_two_gpus_match_one(results, scn):
    single = results[scn.backend]
    for rank, got in enumerate(results[scn.name]):
        for key, y in single["y"].items():
            keep = torch.ones(y.shape[0], dtype=torch.bool)
            if key in single["scores"]:
                differs, ties = topk_differences(single["scores"][key], single["idx"][key], got["idx"][key],
                                                 rel=2.0**-7)
                assert torch.equal(differs, ties), (scn.name, rank, key)
                keep = ~differs
            else:
                assert torch.equal(single["idx"][key], got["idx"][key]), (scn.name, rank, key)
            a, b = got["y"][key][keep].double(), y[keep].double()
            assert float((a - b).norm() / b.norm()) <= 1e-2, (scn.name, rank, key)
    assert all(torch.equal(a, b) for a, b in zip(results[scn.name][0]["y"].values(), results[scn.name][1]["y"].values()))
