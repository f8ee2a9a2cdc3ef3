"""Benchmark: tensor-parallel heads and a context-parallel cache (``dsv4.distributed``) on two GPUs against one.

Run it under ``torchrun`` with 2 processes (one GPU each; NCCL). Each part first runs the one-GPU configuration
on rank 0 alone (rank 1 waits), then the split on both ranks:

* ``tp`` — V4-Flash, every main layer, Triton backend, the engine (``dsv4.engine``): ``--tp-batch`` 64 requests
  of ``--tp-context`` 8,192 prompt tokens (real prefill), then ``--tp-gen`` decode steps; the figure is the
  decode-only step latency p50 (CUDA-graph replays with ``--graphs on``). TP=2: each GPU computes 32 of the 64
  heads, one all-reduce per layer. Rank 0 spot-checks one request of each run against ``dsv4.reference``
  (one layer of each kind, ``--check``).
* ``cp`` — V4-Pro, ``--cp-batch`` 8 requests at ``--cp-context`` ≈ 1M tokens, the cache advanced there
  synthetically (positions only: the pages hold zeros, which does not change the work of the kernels or the
  torch ops), then decode steps through ``--cp-layers`` (default one CSA and one HCA layer), eagerly: the torch
  backend (context parallelism runs the torch backend's ops) on one GPU and CP=2 for each ``--cp-window`` mode,
  and the Triton backend on one GPU for reference; plus the cache memory per GPU of every main layer at that
  size (allocated, and the planner's figure).

Prints one table and writes JSON (``--out``). Targets (issue 39, 2 × H200): TP=2 decode step ≤ 0.6× the one-GPU
step; CP=2 cache memory per GPU ≤ 0.55× and decode step ≤ 0.65×.

    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --out distributed.json          # 2 × H200
    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --parts tp                       # one part
    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --tp-preset tiny --cp-preset tiny \\
        --tp-numerics exact --tp-batch 4 --tp-context 128 --tp-gen 8 --cp-batch 2 --cp-context 2000 --cp-layers 1 2  # CPU
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import dsv4
from dsv4.cache import HybridCache, blocks_for_tokens
from dsv4.distributed import Parallel, init_from_env
from dsv4.engine import Engine, EngineConfig, make_requests, spot_check
from dsv4.planner import human_bytes, plan_parallel
from dsv4.reference.primitives import rms_norm


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["tp", "cp"], choices=("tp", "cp"))
    p.add_argument("--tp-preset", default="v4-flash", choices=dsv4.ModelConfig.presets())
    p.add_argument("--tp-batch", type=int, default=64)
    p.add_argument("--tp-context", type=int, default=8192, help="prompt tokens per request")
    p.add_argument("--tp-gen", type=int, default=256, help="tokens each request generates (as the acceptance run)")
    p.add_argument("--tp-numerics", default="official", choices=("official", "exact"))
    p.add_argument("--graphs", default="on", choices=("on", "off"), help="CUDA graphs for the TP part's decode steps")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="spot-check the TP part's runs against the reference on rank 0")
    p.add_argument("--cp-preset", default="v4-pro", choices=dsv4.ModelConfig.presets())
    p.add_argument("--cp-batch", type=int, default=8)
    p.add_argument("--cp-context", type=int, default=1_048_000, help="tokens per request before the decode steps")
    p.add_argument("--cp-layers", type=int, nargs="+", default=[2, 3], help="layers of the CP decode step")
    p.add_argument("--cp-windows", nargs="+", default=["split", "first"], choices=("split", "first"))
    p.add_argument("--cp-merge", default="sums", choices=("sums", "lse"))
    p.add_argument("--cp-steps", type=int, default=8, help="timed decode steps (after 2 untimed)")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", help="write the results as JSON here (rank 0)")
    return p.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _agree_max(value: float, device: torch.device) -> float:
    """The largest of every rank's ``value`` (a step is as slow as its slowest rank)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _block_size(cfg: dsv4.ModelConfig) -> int:
    return 256 if cfg.window >= 128 else 64


# ------------------------------------------------------------------------------------------------ TP: the engine
def tp_run(args: argparse.Namespace, device: torch.device, parallel: Parallel | None) -> dict[str, Any]:
    """One engine run (``parallel=None``: one GPU); decode step p50 and the spot check (rank 0)."""
    cfg = dsv4.ModelConfig.preset(args.tp_preset)
    layers = list(range(cfg.num_layers))
    B = args.tp_batch
    eng = Engine(cfg, layers, EngineConfig(
        backend="auto", device=str(device), numerics=args.tp_numerics, block_size=_block_size(cfg), max_running=B,
        max_batched_tokens=max(8192 if device.type == "cuda" else 512, B), weights="shared",
        cuda_graphs=args.graphs if device.type == "cuda" else "off", check_finite=False,
    ), parallel=parallel)
    reqs = make_requests(B, args.tp_context, args.tp_gen, seed=0)
    kinds = sorted({next(i for i in layers if cfg.layer_kind(i) is k) for k in {cfg.layer_kind(i) for i in layers}})
    if args.check:
        eng.trace([reqs[0].request_id], kinds)
    stats = eng.run(reqs)
    s = stats.summary()
    # decode-only steps of at least half the batch (requests finish prefill one 8K step apart, so a run whose
    # requests generate fewer tokens than there are requests never decodes all B at once)
    steps = [r for r in stats.steps if not r.prefill_tokens and r.num_requests >= B // 2]
    dec = [r.seconds for r in steps]
    out = {"decode_step_ms": 1e3 * statistics.median(dec) if dec else float("nan"), "decode_steps": len(dec),
           "decode_mean_batch": statistics.mean(r.num_requests for r in steps) if steps else float("nan"),
           "graph_steps": s["graph_steps"], "prefill_tok_s": s["prefill_tok_s"], "backend": eng.backend,
           "cache_bytes": s["cache_bytes_allocated"]}
    if parallel is not None:
        out["decode_step_ms"] = _agree_max(out["decode_step_ms"], device)
    rank0 = parallel is None or dist.get_rank() == 0
    if args.check and rank0:
        eng.graphs, eng.cache = None, None
        rows = spot_check(eng)
        out["spot_check"] = "PASS" if all(r.passed for r in rows) else "FAIL"
        out["spot_check_worst_rel_err"] = max(r.rel_err for r in rows)
        out["spot_check_rows"] = [{k: v for k, v in vars(r).items() if isinstance(v, (int, float, str, bool))}
                                  for r in rows]
    del eng
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------------------------ CP: a layer stack
class Stack:
    """``layers`` of ``cfg`` over one cache of ``batch`` requests advanced to ``context`` tokens (positions only),
    decoding one token per request and step: ``h ← h + attn_l(rms_norm(h))`` as the engine's stack."""

    def __init__(self, cfg: dsv4.ModelConfig, layers: list[int], batch: int, context: int, steps: int,
                 device: torch.device, backend: str, parallel: Parallel | None, numerics: str = "official",
                 all_layers_memory: bool = False) -> None:
        self.cfg, self.device = cfg, device
        cp = dict(cp_rank=parallel.cp_rank, cp_size=parallel.cp_size) if parallel is not None else {}
        cached = list(range(cfg.num_layers)) if all_layers_memory else layers
        m_min = min(cfg.ratio(li) for li in cached if cfg.ratio(li))
        bs = _block_size(cfg)
        blocks = batch * blocks_for_tokens(context + steps + 8, m_min, bs) + 8
        self.cache = HybridCache(cfg, cached, max_requests=batch, num_blocks=blocks, block_size=bs, device=device,
                                 numerics=numerics, **cp)
        self.plan = {f"r{r}": 1 for r in range(batch)}
        for rid in self.plan:
            self.cache.add_request(rid)
        self.cache.claim_step(self.cache.prepare_forward({rid: context for rid in self.plan}))
        self.layers = []
        if not all_layers_memory:
            shared: dict = {}
            for li in layers:
                kind = cfg.layer_kind(li)
                if kind not in shared:
                    shared[kind] = dsv4.AttentionWeights.random(cfg, li, seed=0, device=device)
                self.layers.append(dsv4.Attention(shared[kind], cfg, li, backend=backend, check_inputs=False,
                                                  nan_policy="off", parallel=parallel))
        g = torch.Generator(device=device).manual_seed(1)
        self.h0 = torch.randn(batch, cfg.hidden_size, generator=g, device=device)

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        batch = self.cache.prepare_forward(self.plan)
        plan = self.layers[0].plan_step(batch, self.cache)
        h = self.h0
        act = self.cache.numerics.act_dtype
        for layer in self.layers:
            h = h + layer(rms_norm(h, None, self.cfg.norm_eps).to(act), batch, self.cache, plan).float()
        return h

    def time_steps(self, n: int, parallel: Parallel | None) -> float:
        """Median ms of ``n`` decode steps after 2 untimed ones (the slowest rank's under a split)."""
        times = []
        for i in range(n + 2):
            _sync(self.device)
            if parallel is not None:
                dist.barrier()
            t0 = time.perf_counter()
            self.step()
            _sync(self.device)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        ms = 1e3 * statistics.median(times)
        return _agree_max(ms, self.device) if parallel is not None else ms


def _on_rank0(rank: int, fn, *args: Any) -> Any:
    """``fn(*args)`` on rank 0 alone (the one-GPU figure), the other rank waiting."""
    result = fn(*args) if rank == 0 else None
    dist.barrier()
    return result


def cp_part(args: argparse.Namespace, device: torch.device, rank: int) -> dict[str, Any]:
    cfg = dsv4.ModelConfig.preset(args.cp_preset)
    B, L, n = args.cp_batch, args.cp_context, args.cp_steps

    def memory(parallel: Parallel | None) -> int:
        """Bytes of the cache of every main layer for the batch (allocated)."""
        stack = Stack(cfg, [], B, L, n + 2, device, "torch", parallel, all_layers_memory=True)
        nbytes = stack.cache.memory_bytes()
        del stack
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return nbytes

    def decode(backend: str, parallel: Parallel | None) -> float:
        stack = Stack(cfg, list(args.cp_layers), B, L, n + 2, device, backend, parallel)
        ms = stack.time_steps(n, parallel)
        del stack
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return ms

    out: dict[str, Any] = {"preset": cfg.name, "batch": B, "context": L, "layers": args.cp_layers,
                           "merge": args.cp_merge}
    out["cache_bytes_one_gpu"] = _on_rank0(rank, memory, None)
    out["decode_ms_one_gpu_torch"] = _on_rank0(rank, decode, "torch", None)
    if device.type == "cuda":
        out["decode_ms_one_gpu_triton"] = _on_rank0(rank, decode, "triton", None)
    out["cache_bytes_per_gpu"] = int(_agree_max(memory(Parallel.build(1, 2, "split", args.cp_merge)), device))
    for mode in args.cp_windows:
        out[f"decode_ms_cp2_{mode}"] = decode("torch", Parallel.build(1, 2, mode, args.cp_merge))
    plan = plan_parallel(cfg, L, 80 << 30, None, 1, 2, "official", _block_size(cfg))
    out["planner_request_bytes_per_gpu"], out["planner_request_bytes_one_gpu"] = plan.request_per_gpu, plan.request_one_gpu
    return out


def tp_part(args: argparse.Namespace, device: torch.device, rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {"preset": args.tp_preset, "batch": args.tp_batch, "context": args.tp_context,
                           "gen": args.tp_gen, "graphs": args.graphs}
    out["one_gpu"] = _on_rank0(rank, tp_run, args, device, None)
    out["tp2"] = tp_run(args, device, Parallel.build(2, 1))
    return out


def table(res: dict[str, Any]) -> list[str]:
    """The results as text rows: one GPU, two GPUs, their ratio and the target."""
    rows = [f"{'':<66}{'one GPU':>12}{'2 GPUs':>12}{'ratio':>8}{'target':>9}"]

    def row(label: str, one: float, two: float, target: str, fmt=lambda v: f"{v:.2f} ms") -> None:
        ratio = two / one if one else float("nan")
        rows.append(f"{label:<66}{fmt(one):>12}{fmt(two):>12}{ratio:>8.2f}{target:>9}")

    if "tp" in res:
        t = res["tp"]
        row(f"{t['preset']} decode step B={t['batch']} at {t['context']:,}, TP=2 ({t['tp2']['backend']})",
            t["one_gpu"]["decode_step_ms"], t["tp2"]["decode_step_ms"], "<= 0.60")
        rows.append(f"  spot check: one GPU {t['one_gpu'].get('spot_check', '-')}, TP=2 {t['tp2'].get('spot_check', '-')};"
                    f" CUDA-graph steps {t['one_gpu']['graph_steps']} / {t['tp2']['graph_steps']}")
    if "cp" in res:
        c = res["cp"]
        row(f"{c['preset']} cache per GPU, all main layers, B={c['batch']} x {c['context']:,}",
            c["cache_bytes_one_gpu"], c["cache_bytes_per_gpu"], "<= 0.55", human_bytes)
        for key in [k for k in c if k.startswith("decode_ms_cp2_")]:
            row(f"{c['preset']} decode B={c['batch']} at {c['context']:,}, layers {c['layers']}, CP=2, window "
                f"{key.rsplit('_', 1)[1]}", c["decode_ms_one_gpu_torch"], c[key], "<= 0.65")
        rows.append(f"  (CP: torch backend on both sides, merge {c['merge']}"
                    + (f"; one GPU with the Triton backend: {c['decode_ms_one_gpu_triton']:.2f} ms)"
                       if "decode_ms_one_gpu_triton" in c else ")"))
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    _, device = init_from_env(1, 1, args.device, timeout_s=3600)  # the default group; each part builds its splits
    # (a rank waits at a barrier while the other runs the one-GPU figure: minutes, JIT compiles included)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit(f"run under torchrun with 2 processes (got {world})")
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if "tp" in args.parts:
        res["tp"] = tp_part(args, device, rank)
    if "cp" in args.parts:
        res["cp"] = cp_part(args, device, rank)
    if rank == 0:
        from dsv4.bench.roofline import git_commit

        res["commit"] = git_commit()
        print(f"dsv4 distributed benchmark — {res['device']} x {world}, torch {res['torch']}, {res['commit']}")
        print("\n".join(table(res)))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=2, default=str)
            print(f"written to {args.out}")
    dist.barrier()  # rank 1 must not tear the group down while rank 0 still writes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
