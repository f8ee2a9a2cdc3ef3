"""``dsv4 run --tp/--cp`` under torchrun (2 gloo processes on the CPU, the engine on the tiny preset, rank 0's
spot check against ``dsv4.reference``) and ``dsv4 plan --tp/--cp`` (per-GPU memory)."""

from __future__ import annotations

import json

import pytest

from dsv4.cli import main
from dsv4.planner import attention_weight_bytes, plan_formats
from support.distributed import free_port
from support.interpreter import run_python
import dsv4


def test_plan_per_gpu(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--preset", "v4-pro", "--context", "1048576", "--tp", "2", "--cp", "2", "--json", str(out)]) == 0
    assert "parallel: tp 2 x cp 2 = 4 GPUs" in capsys.readouterr().out
    res = json.loads(out.read_text())
    p = res["parallel"]
    assert p["request_per_gpu"] <= 0.55 * p["request_one_gpu"]
    assert p["weights_per_gpu"] < 0.6 * p["weights_one_gpu"]
    assert p["max_requests_per_gpu"] >= 2 * p["max_requests_one_gpu"]
    cfg = dsv4.ModelConfig.preset("v4-pro")
    one = {q.format: q for q in plan_formats(cfg, 1048576, 80 << 30)}
    official = next(q for q in res["plans"] if q["format"] == "official")  # the table is per GPU: half the pool
    ratio = official["pool_bytes_per_block"] / one["official"].pool_bytes_per_block
    assert 0.5 <= ratio <= 0.52  # half the entries; a page of one HCA entry pads a little more
    assert official["fixed_bytes_per_request"] == one["official"].fixed_bytes_per_request
    with pytest.raises(SystemExit, match="divisible by 3"):
        main(["plan", "--preset", "tiny", "--tp", "3"])


def test_attention_weight_bytes_counts_what_the_engine_holds():
    """The planner's count against the tensors of the tiny layers as the engine holds them (FP8 projections with
    their scales, BF16 matrices, FP32 vectors), whole and as TP shards."""
    from dsv4.engine.weights import engine_weights as _engine_weights

    cfg = dsv4.ModelConfig.preset("tiny")
    cfg128 = __import__("dataclasses").replace(cfg, o_lora_rank=128)
    for c, tp in ((cfg, 1), (cfg128, 2)):
        held = 0
        for li in range(c.num_layers):
            w = _engine_weights(dsv4.AttentionWeights.random(c, li).shard(0, tp), dsv4.Numerics.official().act_dtype,
                                __import__("torch").device("cpu"))
            held += sum(t.numel() * t.element_size() for _, t in w.named_tensors())
        assert attention_weight_bytes(c, None, tp) == held


def test_run_needs_torchrun():
    with pytest.raises(SystemExit, match="torchrun"):
        main(["run", "--tp", "2"])


@pytest.mark.parametrize("split", [
    ["--tp", "2", "--numerics", "exact"],
    ["--cp", "2", "--prefix-caching", "--shared-prefix", "64", "--prefix-groups", "1"],
], ids=["tp2-exact", "cp2-official-prefix-caching"])
def test_run_under_torchrun(split, tmp_path):
    out = tmp_path / "run.json"
    res = run_python(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                      "--master-port", str(free_port()), "-m", "dsv4.cli", "run", *split, "--requests", "3",
                      "--prompt-len", "uniform:40:120", "--gen-len", "3", "--no-progress", "--json", str(out)],
                     interpret=False, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["check"] == "PASS" and r["parallel"] == {"tp": 2 if "--tp" in split else 1, "cp": 2 if "--cp" in split else 1}
    assert {row["kind"] for row in r["spot_check"]} == {"SWA", "CSA", "HCA"}
    if "--prefix-caching" in split:
        assert r["summary"]["prefix_cached_tokens"] > 0


def test_distributed_benchmark_smoke(tmp_path):
    """``benchmarks/bench_distributed.py`` on the CPU (tiny sizes), so the two-GPU run does not fail on a detail:
    both parts, every figure in its JSON, the TP part's spot checks PASS. (CPU times mean nothing here.)"""
    from support import REPO_ROOT

    out = tmp_path / "dist.json"
    res = run_python(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                      "--master-port", str(free_port()), str(REPO_ROOT / "benchmarks" / "bench_distributed.py"),
                      "--tp-preset", "tiny", "--cp-preset", "tiny", "--tp-numerics", "exact", "--tp-batch", "3",
                      "--tp-context", "64", "--tp-gen", "4", "--cp-batch", "2", "--cp-context", "600", "--cp-layers",
                      "1", "2", "--cp-steps", "2", "--out", str(out)], interpret=False, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["tp"]["one_gpu"]["spot_check"] == r["tp"]["tp2"]["spot_check"] == "PASS"
    assert r["tp"]["tp2"]["decode_step_ms"] > 0 and r["cp"]["decode_ms_cp2_split"] > 0
    assert r["cp"]["cache_bytes_per_gpu"] < r["cp"]["cache_bytes_one_gpu"]
