"""``dsv4 bench``: discover and run the kernel benchmark scripts and the end-to-end benchmark.

Kernel benchmarks are the scripts ``benchmarks/bench_*.py`` of the checkout (not an installed package). Each
exposes one of these functions (first match wins), called with the keyword arguments it accepts among
``device`` (``torch.device``), ``quick`` (``bool``: small shapes for a smoke run) and ``roofline``
(``dsv4.bench.Roofline``: the measured ceilings, so every script uses the same ones)::

    run(...) / bench(...) / benchmark(...) / rows(...)  ->  list[dict]   # rows from dsv4.bench.roofline_row

Rows must at least have ``name`` and ``us``; ``roofline_frac`` and the other ``roofline_row`` columns are
reported when present. A script that fails is reported (with its error) and the others still run. A script that
declares ``REQUIRES_CUDA = True`` at module level (read from its source, without importing it) is skipped on a
device other than CUDA, and reported as skipped.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import math
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .roofline import environment, measure_copy_bandwidth, measure_matmul_rate

__all__ = ["Roofline", "default_benchmarks_dir", "find_benchmarks", "format_table", "run_benchmark_file", "run_suite"]

ENTRY_POINTS = ("run", "bench", "benchmark", "rows")


@dataclass(frozen=True)
class Roofline:
    """The device ceilings measured once per ``dsv4 bench`` run (bytes/s, flop/s; FP8 ``nan`` where unsupported)."""

    copy_bw: float
    bf16_rate: float
    fp8_rate: float

    @classmethod
    def measure(cls, device: torch.device) -> Roofline:
        fp8 = getattr(torch, "float8_e4m3fn", None)
        return cls(
            copy_bw=measure_copy_bandwidth(device),
            bf16_rate=measure_matmul_rate(device, torch.bfloat16),
            fp8_rate=measure_matmul_rate(device, fp8) if fp8 is not None else float("nan"),
        )

    def as_dict(self) -> dict[str, float]:
        return {"copy_bw_bytes_s": self.copy_bw, "bf16_flop_s": self.bf16_rate, "fp8_flop_s": self.fp8_rate}


def default_benchmarks_dir() -> str | None:
    """``benchmarks/`` of the source checkout this package runs from (``src/dsv4/bench`` → ``../../../benchmarks``),
    or of the current directory; ``None`` if neither exists."""
    here = os.path.dirname(os.path.abspath(__file__))
    for cand in (os.path.join(here, "..", "..", "..", "benchmarks"), os.path.join(os.getcwd(), "benchmarks")):
        if os.path.isdir(cand):
            return os.path.normpath(cand)
    return None


def find_benchmarks(directory: str | None, only: Sequence[str] | None = None) -> list[str]:
    """``bench_*.py`` files in ``directory`` (sorted), optionally only those whose stem contains one of ``only``."""
    if directory is None or not os.path.isdir(directory):
        return []
    files = sorted(f for f in os.listdir(directory) if f.startswith("bench_") and f.endswith(".py"))
    if only:
        files = [f for f in files if any(o in f[:-3] for o in only)]
    return [os.path.join(directory, f) for f in files]


def requires_cuda(path: str) -> bool:
    """Whether the script at ``path`` declares ``REQUIRES_CUDA = True`` at module level (parsed, not imported)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return False
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "REQUIRES_CUDA" for t in node.targets):
            return isinstance(node.value, ast.Constant) and node.value.value is True
    return False


def _entry(module: Any) -> Callable[..., Any] | None:
    for name in ENTRY_POINTS:
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    return None


def run_benchmark_file(path: str, device: torch.device, quick: bool, roofline: Roofline) -> list[dict[str, Any]]:
    """Import ``path`` (with its directory on ``sys.path``, so sibling helpers import) and run its entry point."""
    name = "dsv4_bench_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    d = os.path.dirname(os.path.abspath(path))
    added = d not in sys.path
    if added:
        sys.path.insert(0, d)
    try:
        spec.loader.exec_module(module)
        fn = _entry(module)
        if fn is None:
            raise AttributeError(f"{os.path.basename(path)} defines none of {ENTRY_POINTS}")
        params = inspect.signature(fn).parameters
        kwargs: dict[str, Any] = {}
        accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        for k, v in (("device", device), ("quick", quick), ("roofline", roofline)):
            if k in params or accepts_any:
                kwargs[k] = v
        rows = fn(**kwargs)
    finally:
        if added:
            sys.path.remove(d)
    rows = list(rows or [])
    for r in rows:
        if not isinstance(r, dict) or "name" not in r:
            raise TypeError(f"{os.path.basename(path)}: every row must be a dict with a 'name', got {r!r}")
    return rows


def run_suite(
    device: torch.device,
    quick: bool = False,
    directory: str | None = None,
    only: Sequence[str] | None = None,
    e2e: bool = True,
    e2e_kwargs: dict[str, Any] | None = None,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run every discovered kernel benchmark and (optionally) the end-to-end one.

    Returns ``{"environment", "roofline", "sections": [{"name", "file", "rows", "error"}]}``.
    """
    env = environment(device)
    say(f"measuring the roofline on {env['device']} …")
    roof = Roofline.measure(device)
    sections: list[dict[str, Any]] = []
    directory = directory if directory is not None else default_benchmarks_dir()
    files = find_benchmarks(directory, only)
    if not files:
        say(f"no kernel benchmarks found (benchmarks/bench_*.py under {directory!r})")
    for path in files:
        name = os.path.splitext(os.path.basename(path))[0]
        if device.type != "cuda" and requires_cuda(path):
            sections.append({"name": name, "file": path, "rows": [], "error": None,
                             "skipped": f"needs a CUDA GPU (this run is on {device})"})
            say(f"skipping {name}: needs a CUDA GPU")
            continue
        say(f"running {name} …")
        try:
            rows = run_benchmark_file(path, device, quick, roof)
            sections.append({"name": name, "file": path, "rows": rows, "error": None})
        except Exception as e:  # noqa: BLE001 - report and go on with the others
            sections.append({"name": name, "file": path, "rows": [], "error": f"{type(e).__name__}: {e}",
                             "traceback": traceback.format_exc()})
            say(f"  {name} failed: {type(e).__name__}: {e}")
    if e2e and (not only or any("e2e" in o for o in only)):
        from .e2e import run_e2e

        say("running end-to-end decode benchmark …")
        try:
            rows = run_e2e(device, roof, quick=quick, **(e2e_kwargs or {}))
            sections.append({"name": "e2e", "file": None, "rows": rows, "error": None})
        except Exception as e:  # noqa: BLE001
            sections.append({"name": "e2e", "file": None, "rows": [], "error": f"{type(e).__name__}: {e}",
                             "traceback": traceback.format_exc()})
            say(f"  e2e failed: {type(e).__name__}: {e}")
    return {"environment": env, "roofline": roof.as_dict(), "sections": sections}


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if abs(v) >= 1e5 or (abs(v) < 1e-2 and v != 0):
            return f"{v:.3g}"
        return f"{v:.2f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def format_table(result: dict[str, Any]) -> str:
    """A Markdown table per section: name, µs, GB/s, TFLOP/s, bound, roofline fraction (plus any error)."""
    env, roof = result["environment"], result["roofline"]
    def scaled(x: Any, unit: float) -> Any:
        return None if x is None or (isinstance(x, float) and math.isnan(x)) else x / unit

    lines = [
        f"device: {env['device']} · torch {env['torch']} · triton {env['triton']} · {env['date']} · commit {env['commit']}",
        (f"roofline: copy {_fmt(scaled(roof['copy_bw_bytes_s'], 1e9))} GB/s · BF16 GEMM "
         f"{_fmt(scaled(roof['bf16_flop_s'], 1e12))} TFLOP/s · FP8 GEMM {_fmt(scaled(roof['fp8_flop_s'], 1e12))} TFLOP/s"),
        "",
    ]
    for sec in result["sections"]:
        lines.append(f"### {sec['name']}")
        if sec.get("skipped"):
            lines.append(f"skipped: {sec['skipped']}")
            lines.append("")
            continue
        if sec["error"]:
            lines.append(f"error: {sec['error']}")
            lines.append("")
            continue
        tok = any("tokens_per_s" in r for r in sec["rows"])
        lines.append("| name | µs | GB/s | TFLOP/s | bound | roofline |" + (" tok/s |" if tok else ""))
        lines.append("|---|---:|---:|---:|---|---:|" + ("---:|" if tok else ""))
        for r in sec["rows"]:
            frac = r.get("roofline_frac")
            frac = None if frac is None or (isinstance(frac, float) and math.isnan(frac)) else frac
            lines.append(
                f"| {r['name']} | {_fmt(r.get('us', float('nan')))} | {_fmt(r.get('gbps', float('nan')))} | "
                f"{_fmt(r.get('tflops', float('nan')))} | {r.get('bound', '')} | "
                f"{'' if frac is None else f'{100 * frac:.0f}%'} |"
                + (f" {r['tokens_per_s']:,.0f} |" if tok and isinstance(r.get("tokens_per_s"), (int, float)) else
                   (" |" if tok else ""))
            )
        lines.append("")
    return "\n".join(lines)


def write_results(result: dict[str, Any], json_path: str | None, table_path: str | None) -> None:
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2, default=str)
    if table_path:
        with open(table_path, "w") as f:
            f.write(format_table(result) + "\n")
