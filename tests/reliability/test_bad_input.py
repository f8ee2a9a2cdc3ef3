"""Bad input (issue 8 §2): every row of the table in docs/errors.md is one case here, and the other way round.

For each row the test makes the documented call(s) on a busy cache (three requests' worth of real data in every
layer kind, a step prepared), checks that the error is of exactly the documented class with the documented text
in its message, and that the cache is byte-for-byte unchanged (``HybridCache.snapshot`` / ``assert_same``). The
table is parsed from the doc, so the table and the tests cannot drift apart: a row without a case, a case without
a row, or a different error class or message fails.

Also here: the NaN/Inf policy with ``check_inputs=False`` (damage stays inside the request that had the NaN), and
retrying a step after a rejected input.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import dsv4
from dsv4.formats.block_fp8 import BlockFp8Weight
from dsv4.cache import (
    CacheFullError,
    CorruptSnapshotError,
    DuplicateRequestError,
    HybridCache,
    IncompatibleSnapshotError,
    InvalidPlanError,
    NonFiniteError,
    RequestSnapshot,
    StaleBatchError,
    StepOrderError,
    UnknownRequestError,
    plan_capacity,
)
from dsv4.config import InvalidConfigError
from dsv4.engine import Engine, EngineConfig
from dsv4.engine.graphs import pad_step_batch
from dsv4.layer import Attention
from dsv4.planner import parse_bytes, plan_formats

from support import REPO_ROOT

TINY = dsv4.ModelConfig.preset("tiny")
pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS = (0, 1, 2)  # SWA, CSA (ratio 4), HCA (ratio 16)
DOC = REPO_ROOT / "docs" / "errors.md"
ERRORS: dict[str, type[BaseException]] = {
    e.__name__: e
    for e in (
        CacheFullError, DuplicateRequestError, IncompatibleSnapshotError, InvalidPlanError, UnknownRequestError,
        CorruptSnapshotError, StaleBatchError, StepOrderError, NonFiniteError, InvalidConfigError,
        ValueError, TypeError, KeyError, IndexError, SystemExit,
    )
}
try:  # checkpoint loading (dsv4.checkpoint) may not exist yet in every checkout
    from dsv4.checkpoint import CheckpointError

    ERRORS["CheckpointError"] = CheckpointError
except ImportError:  # pragma: no cover
    CheckpointError = None


@dataclasses.dataclass(frozen=True)
class Row:
    id: str
    entry: str
    bad_input: str
    error: str
    message: str


def doc_rows() -> dict[str, Row]:
    """The error table of docs/errors.md: ``| id | entry point | bad input | error | message contains |``."""
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\|\s*([A-Z]\d+)\s*\|(.*)\|\s*$", line)
        if not m:
            continue
        cells = [c.strip() for c in m.group(2).split("|")]
        assert len(cells) == 4, f"row {m.group(1)} must have 5 cells: {line}"
        entry, bad, error, msg = cells
        msg_m = re.fullmatch(r"`([^`]+)`", msg)
        assert msg_m, f"row {m.group(1)}: message cell must be one `code span`, got {msg!r}"
        err_m = re.fullmatch(r"`(\w+)`", error)
        assert err_m, f"row {m.group(1)}: error cell must be one `ClassName`, got {error!r}"
        assert m.group(1) not in rows, f"row id {m.group(1)} twice"
        rows[m.group(1)] = Row(m.group(1), entry, bad, err_m.group(1), msg_m.group(1))
    return rows


# ------------------------------------------------------------------------------------------------ environment
@dataclasses.dataclass
class Env:
    """A busy cache: requests a (30 tokens), b (7), c (1) run through layers 0-2; then step {a: 3, b: 1} prepared
    (``batch``) but not run. 3 of 4 blocks (16 positions each) are in use, all 3 slots; ``max_step_tokens`` = 64."""

    cache: HybridCache
    layers: dict[int, Attention]
    batch: dsv4.StepBatch
    snap: RequestSnapshot  # a snapshot of request "a" taken before the step
    tmp: Path = Path(".")  # a scratch folder (files some cases write)

    def x(self, **kw) -> torch.Tensor:
        return torch.randn(self.batch.num_tokens, TINY.hidden_size, **kw)


@pytest.fixture(scope="module")
def weights() -> dict[int, dsv4.AttentionWeights]:
    return {li: dsv4.AttentionWeights.random(TINY, li, seed=20 + li) for li in LAYERS}


@pytest.fixture
def env(weights, tmp_path) -> Env:
    e = make_env(weights)
    e.tmp = tmp_path
    return e


def make_env(weights: dict[int, dsv4.AttentionWeights]) -> Env:
    """Deterministic: two calls build byte-identical caches."""
    torch.manual_seed(0)
    cache = HybridCache(TINY, layers=LAYERS, max_requests=3, num_blocks=4, block_size=16, max_step_tokens=64)
    layers = {li: Attention(w, TINY, li, backend="torch") for li, w in weights.items()}
    for rid in "abc":
        cache.add_request(rid)
    batch = cache.prepare_forward({"a": 30, "b": 7, "c": 1})
    x = torch.randn(batch.num_tokens, TINY.hidden_size)
    for layer in layers.values():
        layer(x, batch, cache)
    snap = cache.save_request("a")
    batch = cache.prepare_forward({"a": 3, "b": 1})
    assert cache.num_free_blocks == 1
    return Env(cache, layers, batch, snap)


def forward_each_layer(env: Env, x_fn: Callable[[Env], object], batch: object = None) -> list[Callable[[], object]]:
    """One call per layer kind: ``layer(x, batch, cache)``."""
    return [lambda li=li: env.layers[li](x_fn(env), env.batch if batch is None else batch, env.cache) for li in LAYERS]


def with_nan(env: Env) -> torch.Tensor:
    x = env.x()
    x[1, 5] = float("nan")
    return x


def with_inf(env: Env) -> torch.Tensor:
    x = env.x()
    x[0, 0] = float("-inf")
    return x


def other_geometry_snapshot(env: Env) -> RequestSnapshot:
    other = HybridCache(TINY, layers=LAYERS, max_requests=1, num_blocks=4, block_size=32)
    other.add_request("z")
    other.prepare_forward({"z": 5})
    return other.save_request("z")


def misshapen_snapshot(env: Env) -> RequestSnapshot:
    state = dict(env.snap.state)
    state[(1, "tail_kv")] = state[(1, "tail_kv")][:, :-1]
    return dataclasses.replace(env.snap, state=state)


def missing_tensor_snapshot(env: Env) -> RequestSnapshot:
    pages = {k: v for k, v in env.snap.pages.items() if k != (1, "index_pages")}
    return dataclasses.replace(env.snap, pages=pages)


def free_one_slot(env: Env) -> None:
    env.cache.release("c")


def with_token_ids(env: Env) -> None:
    """Frees request c's slot for request "t", added with token ids 7, 8, 9 (no step run yet)."""
    env.cache.release("c")
    env.cache.add_request("t", [7, 8, 9])


def exported_prefix(numerics: str = "official") -> dsv4.cache.PrefixSnapshot:
    """A one-block prefix exported from a cache of the env's geometry (or other numerics), bookkeeping only."""
    other = HybridCache(TINY, layers=LAYERS, max_requests=1, num_blocks=4, block_size=16, numerics=numerics,
                        prefix_states=1)
    ids = list(range(20))
    other.add_request("z", ids)
    other.prepare_forward({"z": 16})
    other.publish_prefixes()
    snap = other.export_prefix(ids)
    assert snap is not None and snap.num_blocks == 1
    return snap


def cp_share_step(env: Env) -> tuple:
    """``(x, batch, cache)`` of a step over context-parallel share 1 of 2 of a cache like the env's (a fresh one)."""
    cache = HybridCache(TINY, layers=LAYERS, max_requests=1, num_blocks=4, block_size=32, cp_rank=1, cp_size=2)
    cache.add_request("a")
    batch = cache.prepare_forward({"a": 20})
    return torch.randn(20, TINY.hidden_size), batch, cache


def weights_with(li: int, **changes) -> dsv4.AttentionWeights:
    w = dsv4.AttentionWeights.random(TINY, li, seed=0)
    return dataclasses.replace(w, **changes)


def nan_weights() -> dsv4.AttentionWeights:
    w = dsv4.AttentionWeights.random(TINY, 2, seed=0)
    w.compressor.ape[0, 3] = float("nan")
    return w


def cfg_with(**changes) -> Callable[[], object]:
    return lambda: TINY.replace(**changes)


def hf_dict(**changes) -> dict:
    d = TINY.to_hf_dict()
    d.update(changes)
    return d


def bad_json_config(env: Env) -> Callable[[], object]:
    path = env.tmp / "config.json"
    path.write_text('{"hidden_size": 128,,}')
    return lambda: dsv4.ModelConfig.from_hf(path)


def layer_calls(env: Env, batch: object = None, x: Callable[[Env], torch.Tensor] | None = None) -> list[Callable[[], object]]:
    """``layer(x, batch, cache)`` for every layer kind (``batch`` default: the env's current one)."""
    return forward_each_layer(env, x or (lambda e: e.x()), batch)


def stale_after(env: Env, change: Callable[[Env], object]) -> list[Callable[[], object]]:
    """Keep the env's batch, make a mutating call, then run every layer on the old batch."""
    old = env.batch
    change(env)
    return layer_calls(env, old)


def partly_run(env: Env) -> None:
    """Layer 0 runs the env's current step; layers 1 and 2 have not."""
    env.layers[0](env.x(), env.batch, env.cache)


def other_cache_batch(env: Env) -> dsv4.StepBatch:
    other = HybridCache(TINY, layers=LAYERS, max_requests=3, num_blocks=4, block_size=16, max_step_tokens=64)
    for rid in "ab":
        other.add_request(rid)
    return other.prepare_forward({"a": 3, "b": 1})


def missing_data_calls(env: Env) -> list[Callable[[], object]]:
    """The env's step is never run; the next step of the same requests is refused by every layer."""
    batch = env.cache.prepare_forward({"a": 1, "b": 1})
    return [lambda li=li: env.layers[li](torch.randn(2, TINY.hidden_size), batch, env.cache) for li in LAYERS]


def restored_mid_step_calls(env: Env) -> list[Callable[[], object]]:
    """``b`` is saved between prepare_forward and the layers (its snapshot lacks the step's data), restored as ``b2``."""
    snap = env.cache.save_request("b")
    env.cache.release("c")
    env.cache.restore_request("b2", snap)
    batch = env.cache.prepare_forward({"b2": 1})
    return [lambda li=li: env.layers[li](torch.randn(1, TINY.hidden_size), batch, env.cache) for li in LAYERS]


def fresh_layer(env: Env, li: int, **kw) -> Attention:
    return Attention(copy.deepcopy(env.layers[li].weights), TINY, li, backend="torch", **kw)


def nan_weights_after_build(env: Env) -> list[Callable[[], object]]:
    calls = []
    for li in LAYERS:
        layer = fresh_layer(env, li)
        wkv = layer.weights.wkv  # after construction (which checked the weights): a NaN block scale, or element
        (wkv.scale if isinstance(wkv, BlockFp8Weight) else wkv)[0, 0] = float("nan")
        calls.append(lambda layer=layer: layer(env.x(), env.batch, env.cache))
    return calls


def overflowing_x(env: Env) -> torch.Tensor:
    return env.x().sign() * 3e38  # finite float32, but the projections overflow


def nan_x_unchecked(env: Env) -> list[Callable[[], object]]:
    return [lambda li=li: fresh_layer(env, li, check_inputs=False)(with_nan(env), env.batch, env.cache) for li in LAYERS]


def forged(snap: RequestSnapshot, **changes) -> RequestSnapshot:
    """A snapshot with ``changes`` and a freshly computed checksum (what a forger, or a bug, could produce)."""
    s = dataclasses.replace(snap, **changes)
    return dataclasses.replace(s, checksum=s.digest())


def with_tensor(snap: RequestSnapshot, group: str, key: tuple, fn: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    d = dict(getattr(snap, group))
    d[key] = fn(d[key].clone())
    return d


def set_(t: torch.Tensor, index: tuple, value: float) -> torch.Tensor:
    t[index] = value
    return t


def flipped_bit_snapshot(env: Env) -> RequestSnapshot:
    pages = with_tensor(env.snap, "pages", (1, "kv_pages"), lambda t: t.bitwise_xor_(set_(torch.zeros_like(t), (0, 5), 1)))
    return dataclasses.replace(env.snap, pages=pages)


def nan_page_snapshot(env: Env) -> RequestSnapshot:
    return forged(env.snap, pages=with_tensor(env.snap, "pages", (1, "kv_pages"), lambda t: set_(t, (0, 0), 0x7F)))


def restore_calls(env: Env, snap_fn: Callable[[Env], object]) -> list[Callable[[], object]]:
    free_one_slot(env)
    return [lambda: env.cache.restore_request("a2", snap_fn(env))]


# Each case: env -> list of zero-argument calls, every one of which must raise the row's error.
# A case may prepare the environment (e.g. free a slot) before returning its calls; the cache snapshot is taken
# after the case returns, so only the failing calls themselves must leave the cache unchanged.
CASES: dict[str, Callable[[Env], list[Callable[[], object]]]] = {
    # ---- HybridCache construction
    "C1": lambda e: [lambda: HybridCache(TINY, num_blocks=4, memory_bytes=10**8), lambda: HybridCache(TINY)],
    "C2": lambda e: [lambda: HybridCache(TINY, max_requests=4, memory_bytes=1000)],
    "C3": lambda e: [lambda: HybridCache(TINY, layers=[2], num_blocks=4, block_size=24)],
    "C4": lambda e: [lambda: HybridCache(TINY, num_blocks=-1), lambda: HybridCache(TINY, num_blocks=2.5)],
    "C5": lambda e: [lambda: HybridCache(TINY, num_blocks=4, max_requests=0)],
    "C6": lambda e: [lambda: HybridCache(TINY, num_blocks=4, max_step_tokens=0)],
    "C7": lambda e: [lambda: HybridCache(TINY, layers=[0, 9], num_blocks=4)],
    "C8": lambda e: [lambda: HybridCache(TINY, layers=[1, 1], num_blocks=4)],
    "C9": lambda e: [lambda: HybridCache(TINY, num_blocks=4, block_size=64, cp_rank=2, cp_size=2)],
    "C10": lambda e: [lambda: HybridCache(TINY, layers=[2], num_blocks=4, block_size=64, cp_size=8)],
    # ---- requests
    "R1": lambda e: [lambda: e.cache.add_request("a")],
    "R2": lambda e: [lambda: e.cache.add_request(7), lambda: e.cache.add_request(None)],
    "R3": lambda e: [lambda: e.cache.add_request("d")],
    "R4": lambda e: [lambda: e.cache.release("zz"), lambda: e.cache.release(["a"])],
    "R5": lambda e: (e.cache.release("c"), [lambda: e.cache.release("c")])[1],
    # ---- plans (prepare_forward)
    "P1": lambda e: [lambda: e.cache.prepare_forward({}), lambda: e.cache.prepare_forward([])],
    "P2": lambda e: [lambda: e.cache.prepare_forward("a"), lambda: e.cache.prepare_forward(3)],
    "P3": lambda e: [lambda: e.cache.prepare_forward([("a", 1, 2)]), lambda: e.cache.prepare_forward(["a"])],
    "P4": lambda e: [lambda: e.cache.prepare_forward([(1, 1)])],
    "P5": lambda e: [lambda: e.cache.prepare_forward({"a": 1, "zz": 1})],
    "P6": lambda e: [lambda: e.cache.prepare_forward([("a", 1), ("b", 1), ("a", 2)])],
    "P7": lambda e: [lambda: e.cache.prepare_forward({"a": 0}), lambda: e.cache.prepare_forward({"b": 1, "a": -3})],
    "P8": lambda e: [lambda n=n: e.cache.prepare_forward({"a": n}) for n in (2.0, True, "3", None)],
    "P9": lambda e: [lambda: e.cache.prepare_forward({"b": 1, "a": TINY.max_position - 32})],
    "P10": lambda e: [lambda: e.cache.prepare_forward({"a": 40, "b": 24}), lambda: e.cache.prepare_forward({"c": 40})],
    "P11": lambda e: [lambda: e.cache.prepare_forward({"a": 30, "b": 35}), lambda: e.cache.prepare_forward({"c": 65})],
    # ---- Attention.forward (every layer kind)
    "A1": lambda e: forward_each_layer(e, lambda e: torch.randn(e.batch.num_tokens - 1, TINY.hidden_size)),
    "A2": lambda e: forward_each_layer(e, lambda e: torch.randn(e.batch.num_tokens, TINY.hidden_size + 1)),
    "A3": lambda e: forward_each_layer(e, lambda e: e.x()[None]),
    "A4": lambda e: forward_each_layer(e, lambda e: e.x().to(torch.int32)),
    "A5": lambda e: forward_each_layer(e, lambda e: e.x(dtype=torch.float64)),
    "A6": lambda e: forward_each_layer(e, lambda e: e.x(device="meta")),
    "A7": lambda e: forward_each_layer(e, with_nan),
    "A8": lambda e: forward_each_layer(e, with_inf),
    "A9": lambda e: forward_each_layer(e, lambda e: e.x().tolist()),
    "A10": lambda e: forward_each_layer(e, lambda e: e.x(), batch={"a": 3, "b": 1}),
    "A11": lambda e: [
        lambda: Attention(dsv4.AttentionWeights.random(TINY, 3, seed=0), TINY, 3)(e.x(), e.batch, e.cache)
    ],
    "A12": lambda e: [
        lambda li=li: Attention(e.layers[li].weights, TINY.replace(name="tiny-k4", index_topk=4), li)(e.x(), e.batch, e.cache)
        for li in LAYERS
    ],
    "A13": lambda e: [
        lambda li=li: Attention(e.layers[li].weights, TINY, li, backend="triton")(e.x(), e.batch, e.cache) for li in LAYERS
    ],
    "A14": lambda e: [lambda li=li: e.layers[li](*cp_share_step(e)) for li in LAYERS],
    # ---- Attention construction (weights)
    "W1": lambda e: [lambda: Attention(dsv4.AttentionWeights.random(TINY, 1, seed=0), TINY, 0)],
    "W6": lambda e: [lambda: Attention(dsv4.AttentionWeights.random(TINY, 1, seed=0, fp8=False).shard(0, 2), TINY, 1)],
    "W7": lambda e: [lambda: dsv4.AttentionWeights.random(TINY, 1, seed=0).shard(0, 2)],
    "W8": lambda e: [lambda: dsv4.AttentionWeights.random(TINY, 1, seed=0, fp8=False).shard(0, 3)],
    "W2": lambda e: [lambda: Attention(weights_with(1, compressor=None), TINY, 1)],
    "W3": lambda e: [
        lambda: Attention(dsv4.AttentionWeights.random(TINY, 0, seed=0), dsv4.ModelConfig.preset("v4-flash"), 0),
        lambda: Attention(weights_with(0, wkv=torch.zeros(512, 129)), TINY, 0),
    ],
    "W4": lambda e: [lambda: Attention(nan_weights(), TINY, 2)],
    "W5": lambda e: [lambda: Attention(dsv4.AttentionWeights.random(TINY, 0, seed=0), TINY, 0, backend="cuda-magic")],
    # ---- preemption
    "S1": lambda e: [lambda: e.cache.save_request("zz"), lambda: e.cache.preempt_request("zz")],
    "S2": lambda e: [lambda: e.cache.restore_request("b", e.snap)],
    "S3": lambda e: [lambda: e.cache.restore_request("a2", e.snap)],
    "S4": lambda e: (free_one_slot(e), [lambda: e.cache.restore_request("a2", e.snap)])[1],
    "S5": lambda e: (free_one_slot(e), [lambda: e.cache.restore_request("z", other_geometry_snapshot(e))])[1],
    "S6": lambda e: (free_one_slot(e), [lambda: e.cache.restore_request("a2", misshapen_snapshot(e))])[1],
    "S7": lambda e: (free_one_slot(e), [lambda: e.cache.restore_request("a2", missing_tensor_snapshot(e))])[1],
    "S8": lambda e: (free_one_slot(e), [lambda: e.cache.restore_request("a2", {"num_tokens": 3})])[1],
    # ---- ModelConfig
    "G1": lambda e: [cfg_with(num_heads=-4), cfg_with(num_heads=0)],
    "G2": lambda e: [cfg_with(num_heads=4.0)],
    "G3": lambda e: [cfg_with(hidden_size=True)],
    "G4": lambda e: [cfg_with(index_topk="8")],
    "G5": lambda e: [cfg_with(index_topk=0)],
    "G6": lambda e: [cfg_with(o_groups=3)],
    "G7": lambda e: [cfg_with(rope_theta=v) for v in (1.0, 0.5, float("nan"), float("inf"))],
    "G8": lambda e: [cfg_with(norm_eps=v) for v in (0.0, -1e-6, 2.0)],
    "G9": lambda e: [cfg_with(compress_ratios=(0, 4, 8, 4, 0))],
    "G10": lambda e: [cfg_with(hca_ratio=4)],
    "G11": lambda e: [cfg_with(window=0)],
    "G12": lambda e: [cfg_with(rope_dim=63), cfg_with(rope_dim=512)],
    "G13": lambda e: [cfg_with(yarn_beta_fast=0.5)],
    "G14": lambda e: [cfg_with(max_position=2**31)],
    "G15": lambda e: [cfg_with(compress_ratios=(0, 4, 16, 4))],
    "G16": lambda e: [lambda: dsv4.ModelConfig.from_hf(hf_dict(num_attention_heads=4.5))],
    "G17": lambda e: [bad_json_config(e)],
    "G18": lambda e: [lambda: dsv4.ModelConfig.preset(["tiny"])],
    "G19": lambda e: [lambda: TINY.layer_kind(True), lambda: TINY.ratio(1.0)],
    # ---- argument types at the API boundary
    "T1": lambda e: [lambda: dsv4.AttentionWeights.random(TINY.to_hf_dict(), 0)],
    "T2": lambda e: [lambda: dsv4.AttentionWeights.random(TINY, True), lambda: dsv4.AttentionWeights.random(TINY, 1.0)],
    "T3": lambda e: [lambda: dsv4.AttentionWeights.random(TINY, 0, seed=1.5)],
    "T4": lambda e: [lambda: dsv4.AttentionWeights.random(TINY, 0, device="tpu")],
    "T5": lambda e: [lambda: dsv4.AttentionWeights.random(TINY, 0, device="cuda:99")],
    "T6": lambda e: [lambda: dsv4.AttentionWeights.random(TINY, 0, dtype=torch.int32)],
    "T7": lambda e: [lambda: dsv4.AttentionWeights.from_hf_module(None), lambda: dsv4.AttentionWeights.from_hf_module(torch.nn.Linear(2, 2))],
    "T8": lambda e: [lambda: dsv4.AttentionWeights.from_checkpoint(3, 0, cfg=TINY)],
    "T9": lambda e: [lambda: Attention(None, TINY, 0)],
    "T10": lambda e: [lambda: Attention(e.layers[0].weights, TINY.to_hf_dict(), 0)],
    "T11": lambda e: [lambda: Attention(e.layers[1].weights, TINY, 1.0)],
    "T12": lambda e: [lambda: Attention(e.layers[0].weights, TINY, 0, nan_policy="warn")],
    "T13": lambda e: [lambda: Attention(e.layers[0].weights, TINY, 0, check_inputs="yes")],
    "T14": lambda e: [lambda: Attention(dataclasses.replace(weights_with(1), compressor=dataclasses.replace(
        weights_with(1).compressor, wkv=None)), TINY, 1)],
    "T15": lambda e: [lambda: HybridCache(TINY.to_hf_dict(), num_blocks=4)],
    "T16": lambda e: [lambda: HybridCache(TINY, layers=[1.0], num_blocks=4), lambda: HybridCache(TINY, layers=[True], num_blocks=4)],
    "T17": lambda e: [lambda: HybridCache(TINY, num_blocks=4, device="tpu")],
    "T18": lambda e: [lambda: HybridCache(TINY, num_blocks=4, numerics=3)],
    "T19": lambda e: [lambda: HybridCache(TINY, num_blocks=4, block_size=True)],
    "T20": lambda e: [lambda: e.cache.prepare_forward({"c": 1}, max_blocks=2.5)],
    "T21": lambda e: [lambda li=li: e.layers[li](e.x(), e.batch, {"cache": 1}) for li in LAYERS],
    "T22": lambda e: [lambda: EngineConfig(max_running=0)],
    "T23": lambda e: [lambda: EngineConfig(block_size=64.0)],
    "T24": lambda e: [lambda: EngineConfig(decode_tokens=5)],
    "T25": lambda e: [lambda: EngineConfig(device="tpu")],
    "T26": lambda e: [lambda: EngineConfig(check_finite=1)],
    "T27": lambda e: [lambda: EngineConfig(max_batched_tokens=0)],
    "T28": lambda e: [lambda: Engine(TINY.to_hf_dict())],
    "T29": lambda e: [lambda: Engine(TINY, config={"device": "cpu"})],
    "T30": lambda e: [lambda: Engine(TINY, layers=[True, False], config=EngineConfig(device="cpu"))],
    "T31": lambda e: [lambda: dsv4.reference.attention(None, TINY, 0, e.x())],
    "T32": lambda e: [lambda: dsv4.reference.attention(e.layers[0].weights, TINY, 0, e.x().tolist())],
    "T33": lambda e: [lambda: dsv4.reference.attention(e.layers[0].weights, TINY, 0.0, e.x())],
    "T34": lambda e: [lambda: plan_formats(TINY, 4096.0, 1 << 30)],
    "T35": lambda e: [lambda: plan_capacity(TINY, -1, 4096)],
    "T36": lambda e: [lambda: plan_formats(TINY.to_hf_dict(), 4096, 1 << 30)],
    "T37": lambda e: [lambda: parse_bytes("lots")],
    # ---- a batch bound to its cache step
    "B1": lambda e: stale_after(e, lambda e: e.cache.release("c")),
    "B2": lambda e: stale_after(e, lambda e: e.cache.prepare_forward({"c": 1})),
    "B3": lambda e: stale_after(e, lambda e: (e.cache.release("c"), e.cache.add_request("d"))),
    "B4": lambda e: stale_after(e, lambda e: (e.cache.release("b"), e.cache.restore_request("a2", e.snap))),
    "B5": lambda e: stale_after(e, lambda e: e.cache.preempt_request("c")),
    "B6": lambda e: layer_calls(e, other_cache_batch(e)),
    "B7": lambda e: layer_calls(e, dataclasses.replace(e.batch, ticket=None)),
    "B8": lambda e: (partly_run(e), [lambda: e.layers[0](e.x(), e.batch, e.cache)])[1],
    "B9": lambda e: (partly_run(e), [lambda: e.cache.prepare_forward({"c": 1})])[1],
    "B10": lambda e: (partly_run(e), [lambda: e.cache.add_request("d")])[1],
    "B11": lambda e: (partly_run(e), [lambda: e.cache.save_request("a"), lambda: e.cache.preempt_request("b")])[1],
    "B12": lambda e: (partly_run(e), [lambda: e.cache.restore_request("a2", e.snap)])[1],
    "B13": missing_data_calls,
    "B14": restored_mid_step_calls,
    "B15": lambda e: (lambda old: (e.cache.release("c"), [lambda: e.cache.claim_step(old)])[1])(e.batch),
    "B16": lambda e: (partly_run(e), [lambda: e.cache.claim_step(e.batch, [0])])[1],
    "B17": lambda e: [lambda: e.cache.claim_step(e.batch, [1.0])],
    "B18": lambda e: [lambda: pad_step_batch(e.cache, ["c"], [1], 2, 1, 4, 0, 0)],
    # ---- NaN / Inf produced inside a layer step (nan_policy="raise": rolled back)
    "N1": nan_weights_after_build,
    "N2": lambda e: forward_each_layer(e, overflowing_x),
    "N3": nan_x_unchecked,
    # ---- snapshots: checksum, values, devices, dtypes, fields
    "S9": lambda e: restore_calls(e, flipped_bit_snapshot),
    "S10": lambda e: restore_calls(e, lambda e: dataclasses.replace(e.snap, num_tokens=31)),
    "S11": lambda e: restore_calls(e, lambda e: forged(e.snap, state=with_tensor(
        e.snap, "state", (1, "tail_kv"), lambda t: set_(t, (0, 0), float("nan"))))),
    "S12": lambda e: restore_calls(e, lambda e: forged(e.snap, state=with_tensor(
        e.snap, "state", (0, "ring_positions"), lambda t: set_(t, (0,), 999)))),
    "S13": lambda e: restore_calls(e, nan_page_snapshot),
    "S14": lambda e: restore_calls(e, lambda e: dataclasses.replace(e.snap, state=with_tensor(
        e.snap, "state", (2, "tail_kv"), lambda t: t.to("meta")))),
    "S15": lambda e: restore_calls(e, lambda e: forged(e.snap, state=with_tensor(
        e.snap, "state", (1, "tail_kv"), lambda t: t.double()))),
    "S16": lambda e: restore_calls(e, lambda e: dataclasses.replace(e.snap, num_tokens="30")),
    # ---- prefix caching (token ids, prefix snapshots)
    "X1": lambda e: [lambda: e.cache.add_request("d", "abc"), lambda: e.cache.add_request("d", [1, 2.5])],
    "X2": lambda e: [lambda: e.cache.add_request("d", [3, -1])],
    "X3": lambda e: [lambda: e.cache.add_request("d", [0] * (TINY.max_position + 1))],
    "X4": lambda e: (with_token_ids(e), [lambda: e.cache.prepare_forward({"t": 2}, token_ids={"t": [7, 6]})])[1],
    "X5": lambda e: (with_token_ids(e), [lambda: e.cache.prepare_forward({"t": 2}, token_ids={"t": [7, 8, 9]})])[1],
    "X6": lambda e: (with_token_ids(e), [lambda: e.cache.prepare_forward({"t": 2}, token_ids={"a": [1, 2, 3]})])[1],
    "X7": lambda e: [lambda: e.cache.prepare_forward({"b": 1}, token_ids={"b": [5]})],
    "X8": lambda e: [lambda: e.cache.import_prefix(exported_prefix(numerics="exact"))],
    "X9": lambda e: [lambda: e.cache.import_prefix(exported_prefix())],
    "X10": lambda e: [lambda: e.cache.import_prefix(e.snap), lambda: e.cache.import_prefix(None)],
    "X11": lambda e: [lambda: HybridCache(TINY, num_blocks=4, prefix_states=-1),
                      lambda: HybridCache(TINY, num_blocks=4, prefix_states=1.5)],
    "X12": lambda e: (free_one_slot(e), [lambda: e.cache.restore_request(
        "a2", dataclasses.replace(e.snap, token_ids=(1,) * 30, prefix_nodes=(("key", 1),)))])[1],
}


ROWS = doc_rows()


def test_table_and_cases_match() -> None:
    """Every row of docs/errors.md has a case and every case a row (checkpoint and CLI cases are defined further
    down)."""
    cases = set(CASES) | set(CHECKPOINT_CASES) | set(CLI_CASES)
    assert not set(CASES) & set(CHECKPOINT_CASES) and not set(CASES) & set(CLI_CASES)
    assert len(ROWS) >= 90
    assert not sorted(set(ROWS) - cases), f"rows of docs/errors.md without a test case: {sorted(set(ROWS) - cases)}"
    assert not sorted(cases - set(ROWS)), f"test cases without a row in docs/errors.md: {sorted(cases - set(ROWS))}"
    for row in ROWS.values():
        assert row.error in ERRORS, f"row {row.id}: unknown error class {row.error}"


@pytest.mark.parametrize("row_id", sorted(set(CASES) & set(ROWS)))
def test_row(env: Env, row_id: str) -> None:
    row = ROWS[row_id]
    exc_type = ERRORS[row.error]
    calls = CASES[row_id](env)
    assert calls, row_id
    before = env.cache.snapshot()
    for call in calls:
        with pytest.raises(BaseException) as info:
            call()
        assert type(info.value) is exc_type, f"row {row_id}: raised {type(info.value).__name__}: {info.value}"
        assert row.message in str(info.value), f"row {row_id}: message {str(info.value)!r} lacks {row.message!r}"
        env.cache.assert_same(before)
    env.cache.check_invariants()
    assert_usable(env)


def assert_usable(env: Env) -> None:
    """After failing calls the cache still works: with its requests released, a new request computes exactly as
    in a fresh cache (outputs bit for bit, every layer kind)."""
    cache = env.cache
    for rid in cache.active_requests:
        cache.release(rid)
    fresh = HybridCache(TINY, layers=LAYERS, max_requests=3, num_blocks=4, block_size=16, max_step_tokens=64)
    x = torch.randn(21, TINY.hidden_size, generator=torch.Generator().manual_seed(3))
    batches = []
    for c in (cache, fresh):
        c.add_request("u")
        batches.append(c.prepare_forward({"u": 21}))
    for li in LAYERS:
        got = env.layers[li](x, batches[0], cache)
        want = env.layers[li](x, batches[1], fresh)
        assert torch.isfinite(got).all() and torch.equal(got, want), f"layer {li} computes differently after the errors"
    cache.check_invariants()


# ------------------------------------------------------------------------------------------------ checkpoints
CK_LAYER = 1  # tiny layer 1 (CSA): every kind of tensor


def _ck_key(name: str) -> str:
    from dsv4.checkpoint import OFFICIAL_NAMES

    if name.endswith(".scale"):  # an FP8 projection's block scales
        return f"layers.{CK_LAYER}.attn.{OFFICIAL_NAMES[name[: -len('.scale')]][0][: -len('.weight')]}.scale"
    return f"layers.{CK_LAYER}.attn.{OFFICIAL_NAMES[name][0]}"


def _ck_tensors() -> dict[str, torch.Tensor]:
    """Tiny layer 1's weights under the official checkpoint names."""
    w = dsv4.AttentionWeights.random(TINY, CK_LAYER, seed=0)
    return {_ck_key(name): t.contiguous() for name, t in w.named_tensors()}


def _ck_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path))


def _load(path: Path, cfg: dsv4.ModelConfig | None = TINY) -> Callable[[], object]:
    return lambda: dsv4.AttentionWeights.from_checkpoint(path, CK_LAYER, cfg=cfg)


def _checkpoint_case(change: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], list[Callable[[], object]]]:
    """A one-file checkpoint of tiny layer 1 with ``change`` applied to its tensors."""

    def case(tmp_path: Path) -> list[Callable[[], object]]:
        tensors = _ck_tensors()
        change(tensors)
        _ck_save(tensors, tmp_path / "model.safetensors")
        return [_load(tmp_path)]

    return case


def _truncated(tmp_path: Path) -> list[Callable[[], object]]:
    f = tmp_path / "model.safetensors"
    _ck_save(_ck_tensors(), f)
    data = f.read_bytes()
    calls = []
    for keep in (len(data) // 2, 8):  # the data cut, and the header cut
        d = tmp_path / f"cut{keep}"
        d.mkdir()
        (d / "model.safetensors").write_bytes(data[:keep])
        calls.append(_load(d))
    return calls


def _two_shards(tmp_path: Path, index: dict | str | None, wkv_in_both: bool = False) -> list[Callable[[], object]]:
    """Shard 1: every tensor but wkv; shard 2: wkv (and ``wkv_in_both``: shard 1 too); ``index``: the index JSON."""
    tensors = _ck_tensors()
    wkv = {_ck_key("wkv"): tensors.pop(_ck_key("wkv"))}
    _ck_save({**tensors, **(wkv if wkv_in_both else {})}, tmp_path / "model-1.safetensors")
    _ck_save(wkv, tmp_path / "model-2.safetensors")
    if index is not None:
        text = index if isinstance(index, str) else json.dumps(index)
        (tmp_path / "model.safetensors.index.json").write_text(text)
    return [_load(tmp_path)]


def _weight_map(wkv_file: str) -> dict:
    names = list(_ck_tensors())
    return {"weight_map": {n: ("model-1.safetensors" if n != _ck_key("wkv") else wkv_file) for n in names}}


def _with_config(tmp_path: Path, text: str) -> list[Callable[[], object]]:
    _ck_save(_ck_tensors(), tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(text)
    return [_load(tmp_path, cfg=None)]


def _set(name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[_ck_key(name)] = fn(tensors[_ck_key(name)]).contiguous()

    return change


def _nan_at_0(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


CHECKPOINT_CASES = {
    "K1": _checkpoint_case(lambda t: t.pop(_ck_key("compressor.wgate"))),
    "K2": _checkpoint_case(_set("wkv", lambda t: t[:, :-1])),
    "K3": _truncated,
    "K4": lambda p: _two_shards(p, _weight_map("model-1.safetensors")),
    "K5": lambda p: _two_shards(p, None, wkv_in_both=True),
    "K6": _checkpoint_case(_set("attn_sink", lambda t: t.to(torch.int32))),
    "K7": _checkpoint_case(_set("q_norm", lambda t: t > 0)),
    "K8": lambda p: _two_shards(p, '{"weight_map": {"a": "model-1.safetensors",}}'),
    "K9": lambda p: _with_config(p, '{"hidden_size": 128'),
    "K10": _checkpoint_case(_set("compressor.ape", _nan_at_0)),
    "K11": lambda p: _two_shards(p, _weight_map("model-9.safetensors")),
    "K12": lambda p: _two_shards(p, '{"weight_map": {"x": "model-1.safetensors", "x": "model-2.safetensors"}}'),
    "K13": lambda p: _with_config(p, json.dumps(hf_dict(num_attention_heads=-4))),
    "K14": lambda p: [_load(p / "nowhere")],
}


@pytest.mark.parametrize("row_id", sorted(set(CHECKPOINT_CASES) & set(ROWS)))
def test_checkpoint_row(tmp_path: Path, row_id: str) -> None:
    if not hasattr(dsv4.AttentionWeights, "from_checkpoint"):
        pytest.skip("AttentionWeights.from_checkpoint not available in this checkout")
    row = ROWS[row_id]
    for call in CHECKPOINT_CASES[row_id](tmp_path):
        with pytest.raises(BaseException) as info:
            call()
        assert type(info.value) is ERRORS[row.error], f"row {row_id}: raised {type(info.value).__name__}: {info.value}"
        assert row.message in str(info.value), f"row {row_id}: message {str(info.value)!r} lacks {row.message!r}"
        if row.error == "CheckpointError" and row_id != "K14":  # the message names the file
            assert str(tmp_path) in str(info.value), f"row {row_id}: {info.value} does not name the file"


# ------------------------------------------------------------------------------------------------ command line
def _cli_files(tmp_path: Path) -> dict[str, str]:
    """A config with a negative head count, and a checkpoint folder whose .safetensors is corrupted."""
    neg = tmp_path / "neg.json"
    neg.write_text(json.dumps(hf_dict(num_attention_heads=-4)))
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    (ck / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    return {"neg": str(neg), "ck": str(ck), "missing": str(tmp_path / "no" / "such" / "out.json"),
            "png": str(tmp_path / "no" / "plot.png")}


RUN = ["run", "--device", "cpu", "--no-progress"]
CLI_CASES: dict[str, Callable[[dict[str, str]], list[list[str]]]] = {
    "L1": lambda f: [RUN + ["--cache-memory", "lots"]],
    "L2": lambda f: [RUN[:1] + ["--device", "tpu"]],
    "L3": lambda f: [RUN[:1] + ["--device", "cuda:99"]],
    "L4": lambda f: [RUN + ["--json", f["missing"]]],
    "L5": lambda f: [RUN + ["--checkpoint", f["ck"]]],
    "L6": lambda f: [RUN + ["--config", f["neg"]]],
    "L7": lambda f: [["plan", "--config", f["neg"]]],
    "L8": lambda f: [RUN + ["--block-size", "0"]],
    "L9": lambda f: [RUN + ["--max-running", "0"]],
    "L10": lambda f: [RUN + ["--max-batched-tokens", "0"]],
    "L11": lambda f: [RUN + ["--prompt-len", "100000"]],
    "L12": lambda f: [RUN + ["--block-size", "24"]],
    "L13": lambda f: [RUN + ["--requests", "2.5"]],
    "L14": lambda f: [RUN + ["--config", "missing.json"]],
    "L15": lambda f: [["plan", "--memory", "lots"]],
    "L16": lambda f: [["plan", "--preset", "tiny", "--plot", f["png"]]],
    "L17": lambda f: [["bench", "--device", "cpu", "--dir", f["missing"]]],
    "L18": lambda f: [["check", "--device", "cpu", "--layers", "9"]],
    "L19": lambda f: [RUN + ["--tp", "2"]],
    "L20": lambda f: [["plan", "--preset", "tiny", "--tp", "3"]],
}


@pytest.mark.parametrize("row_id", sorted(set(CLI_CASES) & set(ROWS)))
def test_cli_row(tmp_path: Path, capsys: pytest.CaptureFixture[str], row_id: str) -> None:
    """The command stops before any work with one line naming the value (argparse: usage, then that line; exit
    status 2) or ``error: …`` (exit status 1), and no traceback."""
    from dsv4.cli import main

    row = ROWS[row_id]
    for argv in CLI_CASES[row_id](_cli_files(tmp_path)):
        with pytest.raises(SystemExit) as info:
            main(argv)
        out = capsys.readouterr()
        code = info.value.code
        last = code if isinstance(code, str) else out.err.strip().splitlines()[-1]
        status = 1 if isinstance(code, str) else code
        assert status in (1, 2), f"row {row_id}: exit status {status}"
        assert "\n" not in last and row.message in last, f"row {row_id}: {last!r} lacks {row.message!r}"
        assert "Traceback" not in out.out + out.err and not out.out.strip(), f"row {row_id}: printed {out.out!r}"


# ------------------------------------------------------------------------------------------------ NaN policy
def test_nan_without_check_stays_inside_its_request(weights) -> None:
    """``check_inputs=False, nan_policy="off"``: a NaN in one request's hidden states reaches that
    request's outputs and cache only. The other request's outputs and cache bytes equal a run without the NaN, and
    after the poisoned request is released, a new request reusing its slot and blocks sees no trace of it."""
    T_a, T_b = 37, 21
    xa, xb = torch.randn(T_a, TINY.hidden_size), torch.randn(T_b, TINY.hidden_size)
    for li in LAYERS:
        layer = Attention(weights[li], TINY, li, check_inputs=False, nan_policy="off")
        runs = {}
        for poison in (False, True):
            cache = HybridCache(TINY, layers=[li], max_requests=2, num_blocks=8, block_size=16)
            cache.add_request("a")
            cache.add_request("b")
            xa_p = xa.clone()
            if poison:
                xa_p[T_a - 3, 7] = float("nan")
            y = layer(torch.cat((xa_p, xb)), cache.prepare_forward({"a": T_a, "b": T_b}), cache)
            y2 = layer(torch.randn(2, TINY.hidden_size, generator=torch.Generator().manual_seed(1)),
                       cache.prepare_forward({"a": 1, "b": 1}), cache)
            runs[poison] = (cache, y, y2)
        (clean, y_c, y2_c), (dirty, y_d, y2_d) = runs[False], runs[True]
        assert torch.isnan(y_d[:T_a]).any() and torch.isnan(y2_d[0]).any(), "the NaN must show in request a"
        assert torch.equal(y_d[T_a:], y_c[T_a:]) and torch.equal(y2_d[1], y2_c[1]), "request b was affected"
        b_slot, b_blocks = dirty.slot("b"), dirty.block_table("b")
        lc, ld = clean.layer(li), dirty.layer(li)
        for name in ld.state:
            assert torch.equal(ld.state[name][b_slot], lc.state[name][clean.slot("b")]), name
        if ld.kv_pages is not None:
            assert torch.equal(ld.kv_pages[b_blocks], lc.kv_pages[clean.block_table("b")])
        # release the poisoned request; a new one on its slot and blocks computes as in a fresh cache
        dirty.release("a")
        dirty.add_request("n")
        fresh = HybridCache(TINY, layers=[li], max_requests=2, num_blocks=8, block_size=16)
        fresh.add_request("n")
        xn = torch.randn(40, TINY.hidden_size)
        got = layer(xn, dirty.prepare_forward({"n": 40}), dirty)
        want = layer(xn, fresh.prepare_forward({"n": 40}), fresh)
        assert not torch.isnan(got).any() and torch.equal(got, want)


def test_rejected_input_then_retry_same_batch(weights) -> None:
    """A layer that rejects its input writes nothing, so the same batch can be run again with valid input: outputs
    and every cache byte then equal those of a twin cache that never saw the bad input."""
    seen, twin = make_env(weights), make_env(weights)
    assert not seen.cache.differences(twin.cache.snapshot())
    x = seen.x()
    bad = x.clone()
    bad[2, 9] = float("inf")
    got, want = {}, {}
    for li in LAYERS:
        with pytest.raises(ValueError, match="NaN or Inf"):
            seen.layers[li](bad, seen.batch, seen.cache)
        got[li] = seen.layers[li](x, seen.batch, seen.cache)
        want[li] = twin.layers[li](x, twin.batch, twin.cache)
        assert torch.isfinite(got[li]).all() and got[li].abs().amax() > 0
        assert torch.equal(got[li], want[li])
    assert not seen.cache.differences(twin.cache.snapshot())
