"""A run's step shapes (``StepShape``), stored: ``plan_step_shapes``' result kept on disk, so that a warm start
skips the replay (``dsv4.engine.warmup.stored_step_shapes`` reads and writes the entries).

The replay (``dsv4.engine.warmup.plan_step_shapes``) schedules a whole run on the host. Its result depends only on
what it reads — the model configuration, the stack's layers, the numerics, the engine's limits (everything in
``EngineConfig`` but the fields in ``_NOT_REPLAYED``), whether decode steps run as CUDA graphs, the context-parallel
split, the requests (all but their token ids) — and on the code that schedules and plans the cache.
``step_shapes_key`` keys an entry by a SHA-256 digest of all of these, of the ``.py`` sources of the whole ``dsv4``
package (any code change misses) and of the dsv4 and torch versions; the entry lives next to the warm-up manifests::

    <Triton cache dir>/dsv4-warmup/shapes-<key[:32]>.json
    {"schema": "dsv4-step-shapes/1", "key": "<64 hex>", "eager": [[[n, ...], width], ...], "buckets": [c, ...],
     "sha256": "<64 hex: the digest of the canonical JSON of the four fields above>"}

An entry is trusted only if it parses, has exactly this schema, names the expected key, its checksum holds and its
shapes are possible for this engine and these requests (``load_step_shapes``); anything else — a torn or truncated
write, a hand-edited or copied file, an older format — is ignored: the replay runs and rewrites the entry
(atomically, by rename). What an entry says only decides which kernels compile before the first step and which
decode graphs are captured: a wrong but well-formed one costs compiles inside steps or eager decode steps, never a
wrong result.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import __version__
from .graphs import decode_table_width
from .source_digest import source_digest

__all__ = ["SCHEMA", "StepShape", "entry_path", "load_step_shapes", "step_shapes_key", "store_step_shapes"]

SCHEMA = "dsv4-step-shapes/1"

#: ``EngineConfig`` fields the replay does not read (the device and the backend enter as whether decode steps run
#: as CUDA graphs, ``Engine._want_graphs``).
_NOT_REPLAYED = frozenset({"backend", "device", "weights", "seed", "check_finite", "vocab", "overlap_host", "warmup"})


@dataclass(frozen=True)
class StepShape:
    """One step's fixed-shape geometry: its requests' new-token counts (plan order) and its block-table width."""

    num_new: tuple[int, ...]
    width: int

    def key(self, ratios: Sequence[int]) -> tuple:
        """What the kernels' specialisations depend on (``ops.plan.StepPlan``'s inputs and the integers Triton
        specialises on): tokens, requests, most new tokens per request, block-table width and, per compression
        ratio ``m``, the emit capacity ``Σ_b ⌈num_new[b] / m⌉``."""
        return (sum(self.num_new), len(self.num_new), max(self.num_new), self.width,
                tuple(sum(-(-n // m) for n in self.num_new) for m in ratios))



def step_shapes_key(engine, requests: Sequence) -> str:
    """64 hex digits: the digest of everything ``plan_step_shapes(engine, requests)`` depends on (module
    docstring)."""
    c, p = engine.config, engine.parallel
    limits = [(f.name, getattr(c, f.name)) for f in dataclasses.fields(c) if f.name not in _NOT_REPLAYED]
    reqs = [tuple(getattr(r, f.name) for f in dataclasses.fields(r) if f.name != "token_ids") for r in requests]
    h = hashlib.sha256(source_digest())
    h.update(repr((SCHEMA, __version__, torch.__version__, dataclasses.astuple(engine.cfg), list(engine.layer_ids),
                   repr(engine.numerics), limits, engine._want_graphs(),
                   None if p is None else (p.cp_rank, p.cp_size), reqs)).encode())
    return h.hexdigest()


def entry_path(key: str, directory: str) -> str:
    """Where the entry of ``key`` lives in the cache directory ``directory``."""
    return os.path.join(directory, "dsv4-warmup", f"shapes-{key[:32]}.json")


def _checksum(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _is_int(x: Any, lo: int, hi: int) -> bool:
    return type(x) is int and lo <= x <= hi


def _parse(entry: Any, key: str, engine, requests: Sequence, sizes: Sequence[int]
           ) -> tuple[list[StepShape], list[int]] | None:
    """The shapes an entry holds, or ``None`` unless it is whole, of this schema and key, and possible: every step
    of at most ``max_running`` requests and ``max_batched_tokens`` tokens, none longer than the longest request,
    block tables no wider than the longest request's, no two eager shapes with the same kernel key, the buckets
    ascending and among ``sizes``."""
    if not isinstance(entry, dict) or set(entry) != {"schema", "key", "eager", "buckets", "sha256"}:
        return None
    body = {k: entry[k] for k in ("schema", "key", "eager", "buckets")}
    if entry["schema"] != SCHEMA or entry["key"] != key or entry["sha256"] != _checksum(body):
        return None
    c, cfg = engine.config, engine.cfg
    ratios = sorted({cfg.ratio(li) for li in engine.layer_ids if cfg.ratio(li)})
    longest = max(r.total_len for r in requests)
    max_width = decode_table_width(longest, ratios[0] if ratios else 0, c.block_size)
    eager, keys = [], set()
    if not isinstance(entry["eager"], list):
        return None
    for item in entry["eager"]:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], list)
                and 1 <= len(item[0]) <= c.max_running and _is_int(item[1], 0, max_width)
                and all(_is_int(n, 1, longest) for n in item[0]) and sum(item[0]) <= c.max_batched_tokens):
            return None
        shape = StepShape(tuple(item[0]), item[1])
        if shape.key(ratios) in keys:
            return None
        keys.add(shape.key(ratios))
        eager.append(shape)
    buckets = entry["buckets"]
    if not (isinstance(buckets, list) and all(type(b) is int and b in sizes for b in buckets)
            and buckets == sorted(set(buckets))):
        return None
    return eager, list(buckets)


def load_step_shapes(path: str, key: str, engine, requests: Sequence, sizes: Sequence[int]
                     ) -> tuple[list[StepShape], list[int]] | None:
    """``(eager step shapes, graph buckets)`` from the entry at ``path`` if it is valid for ``key``, ``engine`` and
    ``requests`` (module docstring; ``sizes``: the decode batch sizes the engine can capture, none without
    graphs), else ``None``."""
    try:
        with open(path, encoding="utf-8") as f:
            entry = json.load(f)
    except (OSError, ValueError):  # missing, unreadable, not JSON / not UTF-8
        return None
    return _parse(entry, key, engine, requests, sizes)


def store_step_shapes(path: str, key: str, eager: Sequence[StepShape], buckets: Sequence[int]) -> None:
    """Write the entry of ``key`` at ``path`` atomically (a temporary file renamed over it); a cache directory that
    cannot be written only costs the next run a replay."""
    body = {"schema": SCHEMA, "key": key, "eager": [[list(s.num_new), s.width] for s in eager],
            "buckets": list(buckets)}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".shapes-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({**body, "sha256": _checksum(body)}, f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass

