"""What the ``dsv4`` commands share: argument types (one-line errors, exit status 2), the model config and layer
selection, JSON output, and when the command began (``_T_COMMAND``, reset by ``main``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..config import LayerKind, ModelConfig


_T_COMMAND = time.perf_counter()  # when main() began (reset there): the run reports its first step from it


def _pick_device(name: str) -> torch.device:
    """``--device``: ``auto`` (CUDA when available) or a device that exists here (one-line error otherwise)."""
    from ..engine.runner import pick_device

    try:
        return pick_device(name, arg="--device")
    except (TypeError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None


# ---------------------------------------------------------------- argument types (argparse: one-line errors, exit 2)
def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer (want an integer >= {minimum})") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is below the minimum: want an integer >= {minimum}")
        return v

    parse.__name__ = f"integer >= {minimum}"
    return parse


_positive_int = _int_at_least(1)


_nonneg_int = _int_at_least(0)


def _byte_size(text: str) -> int:
    from ..planner import parse_bytes

    try:
        return parse_bytes(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _device_arg(text: str) -> str:
    if text == "auto" or re.fullmatch(r"cpu|cuda(:\d+)?", text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a device: use auto, cpu, cuda or cuda:N")


def _output_file(option: str, path: str | None) -> None:
    """Fail before the work (one line) when ``path`` (a file the command writes at its end) cannot be written:
    its folder is missing, or it names a folder."""
    if path in (None, "", "-"):
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise SystemExit(f"error: {option} {path!r} is a folder; give a file path")
    if not os.path.isdir(folder):
        raise SystemExit(f"error: {option} {path!r}: folder {folder!r} does not exist (create it first)")
    if not os.access(folder, os.W_OK):
        raise SystemExit(f"error: {option} {path!r}: folder {folder!r} is not writable")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` only where there is a default to show and the help text does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text or "%(default)" in text:
            return text
        return super()._get_help_string(action)


def _load_config(args: argparse.Namespace, default_preset: str) -> ModelConfig:
    """``--config`` (a config.json or its directory), else ``--checkpoint``'s config.json, else ``--preset``."""
    path = getattr(args, "config", None)
    if path and not os.path.exists(path):
        raise SystemExit(f"error: --config {path!r} does not exist")
    try:
        if getattr(args, "config", None):
            return ModelConfig.from_hf(args.config)
        if getattr(args, "checkpoint", None) and not getattr(args, "preset", None):
            from ..checkpoint import config_from_checkpoint

            return config_from_checkpoint(args.checkpoint)
        return ModelConfig.preset(args.preset or default_preset)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"error: cannot load the model configuration: {e}") from None


def _parse_layers(spec: Sequence[str] | None, cfg: ModelConfig, default: str = "main") -> list[int]:
    """``main`` (0 … num_layers−1), ``all`` (MTP included), ``kinds`` (the first layer of each kind), or
    indices / ranges (``0 2 5-9``)."""
    spec = list(spec) if spec else [default]
    if len(spec) == 1 and spec[0] in ("main", "all", "kinds"):
        if spec[0] == "main":
            return list(range(cfg.num_layers))
        if spec[0] == "all":
            return list(range(cfg.num_attention_layers))
        seen: dict[LayerKind, int] = {}
        for i in range(cfg.num_layers):
            seen.setdefault(cfg.layer_kind(i), i)
        return sorted(seen.values())
    out: list[int] = []
    for tok in spec:
        for part in str(tok).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                if "-" in part[1:]:
                    a, b = part.split("-", 1)
                    out.extend(range(int(a), int(b) + 1))
                else:
                    out.append(int(part))
            except ValueError:
                raise SystemExit(f"error: bad layer spec {part!r} (use main, all, kinds, or indices like 0 2 5-9)") from None
    for i in out:
        if not 0 <= i < cfg.num_attention_layers:
            raise SystemExit(f"error: layer {i} out of range for {cfg.name} (0..{cfg.num_attention_layers - 1})")
    if len(set(out)) != len(out):
        raise SystemExit(f"error: repeated layers in {out}")
    return out


def _kinds_summary(cfg: ModelConfig, layers: Sequence[int]) -> str:
    counts = {k: sum(1 for i in layers if cfg.layer_kind(i) is k) for k in LayerKind}
    parts = [f"{n} {k.name}" for k, n in counts.items() if n]
    if layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 2:
        rng = f"{layers[0]}-{layers[-1]}"
    else:
        rng = ",".join(map(str, layers))
    return f"layers {rng} ({', '.join(parts)})"


def _mib(n: float) -> str:
    from ..planner import human_bytes

    return human_bytes(n)


def _emit_json(obj: Any, target: str | None) -> None:
    text = json.dumps(obj, indent=2, default=_json_default)
    if target in (None, "-"):
        print(text)
    else:
        with open(target, "w") as f:
            f.write(text + "\n")


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, (torch.device, torch.dtype)):
        return str(o)
    return str(o)


def _clean(o: Any) -> Any:
    """NaN/Inf → None, recursively (strict JSON)."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o
