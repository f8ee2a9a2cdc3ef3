"""The command line: dsv4 run (the engine job), plan, bench and check."""

from __future__ import annotations

import json
import textwrap

import pytest

import dsv4
from dsv4.cli import _parse_layers, main

TINY = dsv4.ModelConfig.preset("tiny")


def test_run_small_workload_prints_figures_and_passes(tmp_path, capsys) -> None:
    out = tmp_path / "run.json"
    rc = main(["run", "--device", "cpu", "--requests", "4", "--prompt-len", "uniform:16:60", "--gen-len", "3",
               "--max-running", "2", "--max-batched-tokens", "48", "--no-progress", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    for needle in ("prefill", "decode", "tokens/s", "p50", "dense BF16", "spot check: PASS"):
        assert needle in text, needle
    res = json.loads(out.read_text())
    s = res["summary"]
    assert res["check"] == "PASS" and res["config"] == "tiny" and res["backend"] == "torch"
    assert s["decode_tokens"] == 12 and s["requests_finished"] == 4 and s["prefill_tok_s"] > 0
    assert len(res["spot_check"]) == 2 * TINY.num_layers and all(r["passed"] for r in res["spot_check"])


def test_run_json_to_stdout_only(capsys) -> None:
    rc = main(["run", "--device", "cpu", "--requests", "2", "--prompt-len", "20", "--gen-len", "2",
               "--layers", "kinds", "--check-requests", "1", "--no-progress", "--json"])
    res = json.loads(capsys.readouterr().out)  # nothing but JSON on stdout
    assert rc == 0 and res["layers"] == [0, 1, 2] and len(res["spot_check"]) == 3
    assert res["side_stream"] is True  # the default; on the CPU no stage has a second stream to go to


def test_run_side_stream_off_reaches_every_step_plan(capsys, monkeypatch) -> None:
    streams = []
    plan_step = dsv4.Attention.plan_step

    def recording(self, batch, cache, **kw):
        streams.append(kw["streams"])
        return plan_step(self, batch, cache, **kw)

    monkeypatch.setattr(dsv4.Attention, "plan_step", recording)
    rc = main(["run", "--device", "cpu", "--requests", "2", "--prompt-len", "20", "--gen-len", "2", "--layers", "kinds",
               "--check-requests", "0", "--side-stream", "off", "--no-progress", "--json"])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and res["side_stream"] is False
    assert streams and not any(streams)  # every step planned with every launch on the engine's stream


def test_run_prefix_caching_prints_and_records_hits(tmp_path, capsys) -> None:
    out = tmp_path / "run.json"
    rc = main(["run", "--device", "cpu", "--requests", "4", "--prompt-len", "10", "--gen-len", "2", "--shared-prefix",
               "64", "--prefix-groups", "2", "--prefix-caching", "--block-size", "32", "--layers", "kinds",
               "--no-progress", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "prefix cache: hit rate" in text and "spot check: PASS" in text
    assert "req2: started from a cached prefix of 64 tokens; its rows 0-63 are req0's" in text
    res = json.loads(out.read_text())
    s, w = res["summary"], res["workload"]
    assert w["shared_prefix"] == 64 and w["prefix_groups"] == 2 and w["prefix_caching"] is True
    assert s["prompt_tokens"] == 4 * 74 and s["prefix_cached_tokens"] == 2 * 64 and s["prefix_requests_hit"] == 2
    assert s["prefill_tokens"] == 4 * 74 - 128 and s["prefix_cache_bytes_peak"] > 0


def test_plan_prefix_sharing(capsys, tmp_path) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--context", "5120", "--memory", "20GiB", "--shared-prefix", "4096", "--prefix-groups", "4",
                 "--json", str(out)]) == 0
    assert "prefix caching (official format)" in capsys.readouterr().out
    p = json.loads(out.read_text())["prefix"]
    assert p["shared_blocks"] == 16 and p["shared_tokens"] == 4096
    assert p["max_requests_shared"] > p["max_requests_private"] > 0
    assert p["bytes_per_prefix"] == 16 * 912192 + p["snapshot_bytes"]
    with pytest.raises(SystemExit, match="shared-prefix"):
        main(["plan", "--context", "100", "--shared-prefix", "200"])


def test_run_errors(capsys) -> None:
    with pytest.raises(SystemExit, match="length spec"):
        main(["run", "--device", "cpu", "--prompt-len", "uniform:9"])
    with pytest.raises(SystemExit, match="out of range"):
        main(["run", "--device", "cpu", "--layers", "17"])
    with pytest.raises(SystemExit, match="CUDA|cuda"):
        main(["run", "--device", "cpu", "--backend", "triton", "--requests", "1", "--no-progress"])


def test_parse_layers() -> None:
    assert _parse_layers(None, TINY) == [0, 1, 2, 3]
    assert _parse_layers(["all"], TINY) == [0, 1, 2, 3, 4]
    assert _parse_layers(["kinds"], TINY) == [0, 1, 2]
    assert _parse_layers(["0", "2-3"], TINY) == [0, 2, 3]
    assert _parse_layers(["1,3"], TINY) == [1, 3]


def test_plan_v4_pro_million_tokens_matches_spec(capsys, tmp_path) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--preset", "v4-pro", "--context", "1048576", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "assumptions" in text and "SPEC §7.3" in text and "5,031" in text
    res = json.loads(out.read_text())
    plans = {p["format"]: p for p in res["plans"]}
    off = plans["official"]
    assert off["bytes_per_token"] == pytest.approx(30 * (584 + 68) / 4 + 31 * 584 / 128)  # 5031.44 (SPEC §7.3)
    assert off["bytes_per_request"] == off["fixed_bytes_per_request"] + 4096 * off["pool_bytes_per_block"]
    assert 5.0e9 < off["bytes_per_request"] < 5.5e9  # ≈ 5.0 KB/token × 1M tokens + windows and tails
    assert plans["hopper"]["bytes_per_token"] == pytest.approx(30 * (584 + 132) / 4 + 31 * 584 / 128)
    assert plans["dense-bf16"]["bytes_per_request"] == 61 * 1024 * 1048576
    assert off["max_requests"] == (80 << 30) // off["bytes_per_request"]


def test_plan_plot(tmp_path, capsys) -> None:
    path = tmp_path / "mem.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit, match="matplotlib"):
            main(["plan", "--preset", "tiny", "--context", "4096", "--plot", str(path)])
        return
    assert main(["plan", "--preset", "tiny", "--context", "4096", "--plot", str(path)]) == 0
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_bench_discovers_scripts_and_reports_roofline(tmp_path, capsys) -> None:
    bdir = tmp_path / "benchmarks"
    bdir.mkdir()
    (bdir / "bench_toy.py").write_text(textwrap.dedent("""
        import torch
        from dsv4.bench import roofline_row, time_cuda

        def run(device, quick, roofline):
            x = torch.randn(256, 256, device=device)
            s = time_cuda(lambda: x @ x, warmup=1, iters=3, device=device)
            return [roofline_row("toy matmul", s, 3 * x.numel() * 4, 2 * 256**3, roofline.copy_bw, roofline.bf16_rate)]
    """))
    (bdir / "bench_broken.py").write_text("def run():\n    raise RuntimeError('boom')\n")
    out = tmp_path / "res"
    rc = main(["bench", "--device", "cpu", "--quick", "--dir", str(bdir), "--no-e2e", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 1  # the broken script is reported, the others still run
    assert "toy matmul" in text and "boom" in text and "roofline" in text
    files = sorted(p.name for p in out.iterdir())
    assert len(files) == 2 and files[0].endswith(".json") and files[1].endswith(".md")
    res = json.loads((out / files[0]).read_text())
    toy = next(s for s in res["sections"] if s["name"] == "bench_toy")
    row = toy["rows"][0]
    assert row["us"] > 0 and 0 < row["roofline_frac"] and row["bound"] in ("memory", "compute")
    assert {"device", "date", "commit", "torch"} <= set(res["environment"])


def test_bench_end_to_end_on_cpu(capsys) -> None:
    rc = main(["bench", "--device", "cpu", "--quick", "--only", "e2e", "--e2e-batch", "2", "--e2e-context", "40",
               "--e2e-gen", "3", "--e2e-layers", "kinds", "--out", "", "--json"])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0
    rows = res["sections"][0]["rows"]
    assert [r["name"].split()[0] for r in rows] == ["decode", "prefill"]
    assert all(r["us"] > 0 and r["roofline_frac"] > 0 for r in rows)


def test_run_from_checkpoint(tmp_path, capsys) -> None:
    pytest.importorskip("transformers")
    from support.hf import tiny_causal_lm

    tiny_causal_lm(seed=2).save_pretrained(tmp_path / "ckpt")
    rc = main(["run", "--checkpoint", str(tmp_path / "ckpt"), "--device", "cpu", "--requests", "2",
               "--prompt-len", "30", "--gen-len", "2", "--no-progress", "--json"])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and res["check"] == "PASS" and res["weights"] == str(tmp_path / "ckpt")
    assert res["config"] == "ckpt" and res["layers"] == [0, 1, 2, 3]


def test_check_subcommand(capsys) -> None:
    assert main(["check", "--seq-len", "40", "--layers", "1", "2", "--device", "cpu"]) == 0
    assert "PASS" in capsys.readouterr().out
