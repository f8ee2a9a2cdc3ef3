"""The acceptance workload's command-line options, shared by the host-work benchmarks (``bench_decode_host.py``,
``bench_warm_start_host.py``): V4-Flash, 64 requests of 8,192 prompt + 256 generated tokens, the engine's limits."""

from __future__ import annotations

import argparse

import dsv4


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """``--preset --requests --prompt-len --gen-len --max-running --max-batched-tokens --block-size``."""
    p.add_argument("--preset", default="v4-flash", choices=dsv4.ModelConfig.presets())
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", default="8192")
    p.add_argument("--gen-len", default="256")
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=256)
