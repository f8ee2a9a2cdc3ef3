"""Benchmark: the host work of ``dsv4 run``'s start before its first step, piece by piece (issue 36, warm start).

The acceptance workload by default: V4-Flash, every main layer, 64 requests of 8,192 prompt + 256 generated tokens,
64 running, an 8,192-token step budget, block size 256 (``dsv4 run``'s GPU defaults). Timed on this machine's CPU,
without a GPU: where the run would use CUDA, the cache lives on the ``meta`` device and the engine is a host
stand-in (no weights, no layers; decode steps use CUDA graphs as with the Triton backend on CUDA). Pieces, each the
median of ``--repeat`` runs:

* imports, each in a fresh interpreter: ``torch``; ``dsv4.cli`` (what ``python -m dsv4.cli`` imports before its
  clock starts); ``triton`` + ``dsv4.ops.triton_ops`` (what a Triton-backend engine imports while it is built);
* CLI arguments, model configuration, ``EngineConfig`` and ``make_requests``;
* ``plan_step_shapes``: the replay of the run's scheduling on a ``meta``-device cache, and ``step_shapes`` with the
  stored replay missing (replay + store) and present (key + read + validate); the key's digest alone;
* ``graph_shapes``, the warm-up manifest's source digest (kernels + ops);
* ``submit``'s host work: the run's cache built on ``meta``, every request's token ids.

Not timed here (need a GPU): CUDA initialisation, the weights, the warm-up's load pass, the cache's allocation,
graph capture.

    python benchmarks/bench_warm_start_host.py                 # the acceptance workload
    python benchmarks/bench_warm_start_host.py --threads 1     # one intra-op thread (less noise on a busy machine)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch

import dsv4
from host_workload import add_workload_args
from dsv4.bench.roofline import time_cuda
from dsv4.cache.schema import resolve_layers
from dsv4.engine import Engine, EngineConfig, LengthSpec, make_requests
from dsv4.engine.shape_store import step_shapes_key
from dsv4.engine.source_digest import source_digest
from dsv4.engine.warmup import graph_shapes, plan_step_shapes, stored_step_shapes as step_shapes
from dsv4.numerics import resolve_numerics

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")

_IMPORTS = {
    "import torch": "import torch",
    "import dsv4.cli (torch included)": "import dsv4.cli",
    "import triton + dsv4.ops.triton_ops": "import torch, dsv4; t0 = time.perf_counter(); "
                                            "import triton, dsv4.ops.triton_ops",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_workload_args(p)
    p.add_argument("--repeat", type=int, default=3, help="runs of each piece (the median is shown)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--no-imports", action="store_true", help="skip the import timings (fresh interpreters)")
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args(argv)


def host_engine(cfg: dsv4.ModelConfig, config: EngineConfig) -> Engine:
    """An ``Engine`` without weights or layers, for its host-side planning only: what ``plan_step_shapes``,
    ``step_shapes`` and ``submit``'s host work read of it, decode steps as CUDA graphs (as on CUDA with Triton)."""
    eng = Engine.__new__(Engine)
    eng.cfg, eng.config, eng.device, eng.parallel = cfg, config, torch.device("cpu"), None
    eng.numerics, eng.layer_ids = resolve_numerics(config.numerics), resolve_layers(cfg, None)
    eng._want_graphs = lambda: True  # type: ignore[method-assign]
    eng._ids = {}
    return eng


def _median(fn: Callable[[], Any], repeat: int) -> float:
    """Median host seconds of ``fn()`` over ``repeat`` calls, no warm-up call."""
    return time_cuda(fn, warmup=0, iters=repeat, device="cpu")


def _import_seconds(code: str, repeat: int) -> float:
    """Median seconds of ``code`` in a fresh interpreter (from the ``t0`` it sets, else its start)."""
    prog = f"import time; t0 = time.perf_counter(); {code}; print(time.perf_counter() - t0)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([_SRC, os.environ.get("PYTHONPATH", "")])}
    return statistics.median(float(subprocess.run([sys.executable, "-c", prog], env=env, check=True,
                                                  capture_output=True, text=True).stdout) for _ in range(repeat))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows: list[tuple[str, float]] = []
    if not args.no_imports:
        rows += [(name, _import_seconds(code, args.repeat)) for name, code in _IMPORTS.items()]

    def front() -> tuple[dsv4.ModelConfig, EngineConfig, list]:
        from dsv4.cli import build_parser

        build_parser().parse_args(["run", "--preset", args.preset])
        cfg = dsv4.ModelConfig.preset(args.preset)
        econf = EngineConfig(backend="auto", device="cpu", block_size=args.block_size, max_running=args.max_running,
                             max_batched_tokens=args.max_batched_tokens, warmup=True)
        reqs = make_requests(args.requests, LengthSpec.parse(args.prompt_len, 1), LengthSpec.parse(args.gen_len, 0),
                             seed=0)
        return cfg, econf, reqs

    rows.append(("CLI arguments, config, EngineConfig, make_requests", _median(front, args.repeat)))
    cfg, econf, reqs = front()
    eng = host_engine(cfg, econf)
    rows.append(("plan_step_shapes (the replay)", _median(lambda: plan_step_shapes(eng, reqs), args.repeat)))
    rows.append(("step_shapes_key (digest, package sources)", _median(lambda: step_shapes_key(eng, reqs), args.repeat)))
    with tempfile.TemporaryDirectory() as d:
        def miss() -> None:
            stored = os.path.join(d, "dsv4-warmup")
            for f in os.listdir(stored) if os.path.isdir(stored) else []:
                os.unlink(os.path.join(stored, f))
            assert not step_shapes(eng, reqs, d)[2]

        rows.append(("step_shapes, nothing stored (replay + store)", _median(miss, args.repeat)))
        rows.append(("step_shapes, stored (key + read + validate)",
                     _median(lambda: step_shapes(eng, reqs, d)[2] or sys.exit("the stored entry was not used"),
                             args.repeat)))
        eager, buckets, _ = step_shapes(eng, reqs, d)
    rows.append(("graph_shapes", _median(lambda: graph_shapes(eng, reqs, buckets), args.repeat)))
    rows.append(("manifest source digest (kernels + ops)",
                 _median(lambda: source_digest("kernels", "ops"), args.repeat)))
    rows.append(("submit: the cache (meta) + every request's token ids",
                 _median(lambda: (eng.build_cache(reqs, device=torch.device("meta")),
                                  [eng._assign_token_ids(r) for r in reqs]), args.repeat)))

    print(f"dsv4 {dsv4.__version__} warm-start host pieces — {args.preset}, {args.requests} x {args.prompt_len} + "
          f"{args.gen_len}, torch {torch.__version__} on {torch.get_num_threads()} thread(s), {os.cpu_count()} CPUs; "
          f"{len(eager)} eager step shapes, graph buckets {buckets}; median of {args.repeat}")
    print(f"{'piece':<56}{'seconds':>10}")
    for name, s in rows:
        print(f"{name:<56}{s:>10.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"version": dsv4.__version__, "preset": args.preset, "threads": torch.get_num_threads(),
                       "cpus": os.cpu_count(), "eager_shapes": len(eager), "graph_buckets": buckets,
                       "seconds": dict(rows)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
