"""Command line: ``dsv4 run`` (the main job), ``dsv4 plan``, ``dsv4 bench``, ``dsv4 check``.

* ``dsv4 run`` — the engine: a stack of attention layers (every main layer of a preset by default) over the
  paged hybrid cache, many requests through a continuous-batching scheduler (chunked prefill + decode). Prints
  prefill / decode throughput, step-latency percentiles, cache memory against a dense BF16 cache, and a spot
  check of a few requests against ``dsv4.reference`` (PASS/FAIL; exit code 1 on FAIL). Defaults: the tiny
  preset on the CPU (about a minute on a laptop), a V4-Flash workload on a GPU.
* ``dsv4 plan`` — the memory planner: bytes per token and per request by layer kind and storage format, what
  fits a memory budget; ``--plot`` draws memory against context length.
* ``dsv4 bench`` — kernel benchmarks (``benchmarks/bench_*.py``) and the end-to-end decode benchmark, as a table
  and JSON with roofline fractions.
* ``dsv4 check`` — every layer of a preset through the reference (both numerics) and through the cache, one
  sequence, checked against the reference (the former ``dsv4 run``).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence

from .. import __version__
from ..config import ModelConfig
from . import common
from .bench import cmd_bench
from .check import cmd_check
from .common import _HelpFormatter, _byte_size, _device_arg, _nonneg_int, _parse_layers, _positive_int
from .plan import cmd_plan
from .run import cmd_run

__all__ = ["build_parser", "cmd_bench", "cmd_check", "cmd_plan", "cmd_run", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4", description="DeepSeek-V4 hybrid attention: reference, cache, kernels, runner")
    p.add_argument("--version", action="version", version=f"dsv4 {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    fmt = _HelpFormatter

    def model_args(q: argparse.ArgumentParser, preset_help: str) -> None:
        q.add_argument("--preset", default=None, choices=ModelConfig.presets(), help=preset_help)
        q.add_argument("--config", help="HF / official config.json (or its directory) instead of a preset")

    def json_arg(q: argparse.ArgumentParser) -> None:
        q.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                       help="machine-readable JSON: to stdout alone (no PATH), or written to PATH next to the text "
                            "(its folder must exist)")

    def run_args(r: argparse.ArgumentParser) -> None:
        model_args(r, "model preset (default: tiny on the CPU, v4-flash on a GPU)")
        r.add_argument("--layers", nargs="+", help="main (default) | all (MTP included) | kinds | indices, e.g. 0 2 5-9")
        r.add_argument("--requests", type=_positive_int, help="number of requests (default: 16 CPU / 64 GPU)")
        r.add_argument("--prompt-len", help="prompt length: N, uniform:LO:HI, normal:MEAN:STD, lognormal:MEDIAN:SIGMA, "
                                            "choice:A,B (default: uniform:64:384 CPU / 8192 GPU); prompt + generated "
                                            "tokens must fit the model's max_position")
        r.add_argument("--gen-len", help="generated tokens, same syntax (default: 32 CPU / 256 GPU)")
        r.add_argument("--arrival-every", type=_nonneg_int, default=0, metavar="STEPS",
                       help="request i arrives at step i*STEPS (0: all at the start)")
        r.add_argument("--max-running", type=_positive_int, help="requests running at once (default: 8 CPU / 64 GPU)")
        r.add_argument("--max-batched-tokens", type=_positive_int,
                       help="token budget per step (default: 512 CPU / 8192 GPU)")
        r.add_argument("--max-prefill-chunk", type=_positive_int,
                       help="largest prefill chunk per request per step (default: the token budget)")
        r.add_argument("--decode-tokens", type=int, default=1, choices=(1, 2, 3, 4),
                       help="tokens per decode step per request (2-4: speculative / MTP decoding)")
        r.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"),
                       help="attention backend (auto: triton on a CUDA GPU, else torch)")
        r.add_argument("--device", type=_device_arg, default="auto", help="auto | cpu | cuda | cuda:N")
        r.add_argument("--numerics", default="official", choices=("official", "exact"),
                       help="official: FP8 / MXFP4 cache and BF16 activations as DeepSeek; exact: FP32 everywhere")
        r.add_argument("--block-size", type=_positive_int,
                       help="tokens per pool block, a multiple of every compression ratio (default 256; 64 for windows "
                            "under 128, e.g. the tiny preset)")
        r.add_argument("--cache-memory", type=_byte_size, metavar="BYTES",
                       help="cache budget, e.g. 20GiB or 4e9 (default: enough for --max-running requests of the longest "
                            "length; smaller budgets make requests wait)")
        r.add_argument("--cuda-graphs", default="auto", choices=("auto", "on", "off"),
                       help="decode steps as CUDA graph replays (auto: when the backend is graph-safe)")
        r.add_argument("--side-stream", default="on", choices=("on", "off"),
                       help="on CUDA, run each layer's writes and ring commit on a second stream beside its GEMMs "
                            "(the same results; off: one stream)")
        r.add_argument("--weights", default="random", choices=("random", "shared"),
                       help="random per layer, or one random set per layer kind shared by its layers")
        r.add_argument("--checkpoint", help="HF-format safetensors checkpoint directory (official or transformers names)")
        r.add_argument("--prefix-caching", action="store_true",
                       help="reuse cached prompt prefixes: shared whole blocks + the state snapshot at their end")
        r.add_argument("--shared-prefix", type=_nonneg_int, default=0, metavar="N",
                       help="every prompt starts with N tokens shared by its prefix group, then --prompt-len of its own")
        r.add_argument("--prefix-groups", type=_positive_int, default=1, metavar="G",
                       help="request i belongs to prefix group i %% G (with --shared-prefix)")
        r.add_argument("--prefix-states", type=_positive_int, metavar="N",
                       help="state snapshots the prefix cache keeps (default: 2 x --max-running)")
        r.add_argument("--seed", type=_nonneg_int, default=0, help="seed of the weights, lengths and hidden states")
        r.add_argument("--tp", type=_positive_int, default=1,
                       help="tensor-parallel ranks (query heads split; run under torchrun with tp x cp processes)")
        r.add_argument("--cp", type=_positive_int, default=1,
                       help="context-parallel ranks (every request's compressed pool split; torch backend; under torchrun)")
        r.add_argument("--check-requests", type=_nonneg_int, default=2,
                       help="requests spot-checked against the reference (0: none)")
        r.add_argument("--check-layers", nargs="+", help="layers spot-checked (default: all if <= 8 layers, else kinds)")
        r.add_argument("--threads", type=_positive_int, help="CPU threads for torch (default: torch's; 1 helps on a busy machine)")
        r.add_argument("--no-progress", action="store_true", help="no progress bars")
        r.add_argument("--explain", action="store_true",
                       help="print the launch plan of the first prefill, decode and mixed step (kernels, splits, grids)")
        json_arg(r)
        r.add_argument("--warmup", default="auto", choices=("auto", "on", "off"),
                       help="compile every kernel the run launches before its first step, in parallel over the CPU "
                            "cores (auto: with the triton backend)")
        r.add_argument("--triton-cache", metavar="DIR",
                       help="Triton's on-disk kernel cache (default: $TRITON_CACHE_DIR, else ~/.triton/cache)")

    r = sub.add_parser("run", help="the main job: the engine over many requests, figures, spot check vs the reference",
                       formatter_class=fmt)
    run_args(r)
    r.set_defaults(func=cmd_run, warmup_only=False)
    w = sub.add_parser("warmup", help="compile a workload's kernels into the on-disk cache (for deployment images); "
                                      "takes run's arguments", formatter_class=fmt)
    run_args(w)
    w.set_defaults(func=cmd_run, warmup_only=True)

    pl = sub.add_parser("plan", help="memory planner: bytes per token / request, capacity of a memory budget",
                        formatter_class=fmt)
    model_args(pl, "model preset (default: v4-flash)")
    pl.add_argument("--context", type=_positive_int, help="tokens per request (default: 1M, or the preset's max_position)")
    pl.add_argument("--memory", type=_byte_size, default="80GiB", help="cache memory budget (e.g. 80GiB, 141GB)")
    pl.add_argument("--layers", nargs="+", help="main (default) | all | kinds | indices")
    pl.add_argument("--block-size", type=_positive_int, default=256, help="tokens per pool block")
    pl.add_argument("--formats", nargs="+", help="official hopper exact prototype dense-bf16 "
                                                 "(default: official hopper exact dense-bf16)")
    pl.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                    help="with prefix caching: the first N tokens of every request are shared within its group")
    pl.add_argument("--prefix-groups", type=int, default=1, metavar="G", help="groups sharing a prefix")
    pl.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel GPUs (heads split; cache replicated)")
    pl.add_argument("--cp", type=_positive_int, default=1,
                    help="context-parallel GPUs (every request's compressed pool split): the tables are per GPU")
    pl.add_argument("--plot", metavar="PNG", help="draw per-request memory against context length (needs matplotlib)")
    pl.add_argument("--plot-max-context", type=_positive_int, help="right end of the plot (default: max_position)")
    json_arg(pl)
    pl.set_defaults(func=cmd_plan)

    b = sub.add_parser("bench", help="kernel + end-to-end benchmarks with roofline fractions (table + JSON); kernel "
                                     "benchmarks need a CUDA GPU", formatter_class=fmt)
    b.add_argument("--device", type=_device_arg, default="auto",
                   help="auto | cpu | cuda | cuda:N (on the CPU only the end-to-end benchmark runs)")
    b.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"), help="end-to-end backend")
    b.add_argument("--quick", action="store_true", help="small shapes (smoke run)")
    b.add_argument("--dir", help="directory of bench_*.py scripts (default: the checkout's benchmarks/)")
    b.add_argument("--only", nargs="+", help="run only benchmarks whose name contains one of these (e2e: the engine)")
    b.add_argument("--no-e2e", action="store_true", help="skip the end-to-end benchmark")
    b.add_argument("--e2e-preset", choices=ModelConfig.presets(),
                   help="preset of the end-to-end stack (default: v4-flash on a GPU, tiny on the CPU)")
    b.add_argument("--e2e-layers", nargs="+", help="layers of the end-to-end stack (default: main)")
    b.add_argument("--e2e-batch", type=_positive_int, nargs="+", help="decode batch sizes (default 1 8 64 GPU / 1 4 CPU)")
    b.add_argument("--e2e-context", type=_positive_int, nargs="+", help="context lengths (default 4096 GPU / 128 CPU)")
    b.add_argument("--e2e-gen", type=_positive_int, help="decode steps per request (default: 32, 8 with --quick)")
    b.add_argument("--out", default=None,
                   help="directory for bench-<date>.json / .md (default: a new temporary directory; '' = none)")
    json_arg(b)
    b.set_defaults(func=cmd_bench)

    c = sub.add_parser("check", help="every layer of a preset through the reference and the cache, one sequence",
                       formatter_class=fmt)
    c.add_argument("--preset", default=None, choices=ModelConfig.presets(), help="model preset (default: tiny)")
    c.add_argument("--config", help="HF config.json (or its directory) instead of a preset")
    c.add_argument("--seq-len", type=_positive_int, default=300, help="tokens per sequence")
    c.add_argument("--layers", type=_nonneg_int, nargs="+", help="layer indices (default: all, MTP block included)")
    c.add_argument("--device", type=_device_arg, default="auto", help="auto | cpu | cuda | cuda:N")
    c.add_argument("--seed", type=_nonneg_int, default=0, help="seed of the weights and inputs")
    c.add_argument("--json", action="store_true", help="print machine-readable JSON only")
    c.set_defaults(func=cmd_check)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Bad input ends in one line naming the value and what is allowed (``SystemExit``: exit
    status 2 for argument errors, 1 otherwise), never a traceback."""
    from ..cache import CacheFullError
    from ..checkpoint import CheckpointError

    common._T_COMMAND = time.perf_counter()
    args = build_parser().parse_args(argv)
    if getattr(args, "triton_cache", None):  # before any kernel compiles; Triton reads it at each lookup
        os.makedirs(args.triton_cache, exist_ok=True)
        os.environ["TRITON_CACHE_DIR"] = os.path.abspath(args.triton_cache)
    try:
        return args.func(args)
    except (CheckpointError, CacheFullError, ValueError, TypeError, OSError) as e:
        raise SystemExit(f"error: {type(e).__name__}: {e}") from None
