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

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cache_oracle import one_thread  # noqa: F401

import dsv4
from dsv4.cache import (
    CacheFullError,
    DuplicateRequestError,
    HybridCache,
    IncompatibleSnapshotError,
    InvalidPlanError,
    RequestSnapshot,
    UnknownRequestError,
)
from dsv4.layer import Attention

TINY = dsv4.ModelConfig.preset("tiny")
pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS = (0, 1, 2)  # SWA, CSA (ratio 4), HCA (ratio 16)
DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
ERRORS: dict[str, type[BaseException]] = {
    e.__name__: e
    for e in (
        CacheFullError, DuplicateRequestError, IncompatibleSnapshotError, InvalidPlanError, UnknownRequestError,
        ValueError, TypeError, KeyError, IndexError,
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

    def x(self, **kw) -> torch.Tensor:
        return torch.randn(self.batch.num_tokens, TINY.hidden_size, **kw)


@pytest.fixture(scope="module")
def weights() -> dict[int, dsv4.AttentionWeights]:
    return {li: dsv4.AttentionWeights.random(TINY, li, seed=20 + li) for li in LAYERS}


@pytest.fixture
def env(weights) -> Env:
    return make_env(weights)


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


def weights_with(li: int, **changes) -> dsv4.AttentionWeights:
    w = dsv4.AttentionWeights.random(TINY, li, seed=0)
    return dataclasses.replace(w, **changes)


def nan_weights() -> dsv4.AttentionWeights:
    w = dsv4.AttentionWeights.random(TINY, 2, seed=0)
    w.compressor.ape[0, 3] = float("nan")
    return w


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
    # ---- Attention construction (weights)
    "W1": lambda e: [lambda: Attention(dsv4.AttentionWeights.random(TINY, 1, seed=0), TINY, 0)],
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
    """Every row of docs/errors.md has a case and every case a row (checkpoint cases are defined further down)."""
    cases = set(CASES) | set(CHECKPOINT_CASES)
    assert len(ROWS) >= 20
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


# ------------------------------------------------------------------------------------------------ checkpoints
def _checkpoint_case(kind: str) -> Callable[[Path], list[Callable[[], object]]]:
    """A one-file checkpoint of tiny layer 1 (CSA) under the official names with one tensor removed or cut."""

    def case(tmp_path: Path) -> list[Callable[[], object]]:
        from safetensors.torch import save_file

        from dsv4.checkpoint import OFFICIAL_NAMES

        li = 1
        w = dsv4.AttentionWeights.random(TINY, li, seed=0)
        tensors = {f"layers.{li}.attn.{OFFICIAL_NAMES[name][0]}": t.contiguous() for name, t in w.named_tensors()}
        if kind == "missing":
            del tensors[f"layers.{li}.attn.compressor.wgate.weight"]
        else:
            key = f"layers.{li}.attn.wkv.weight"
            tensors[key] = tensors[key][:, :-1].contiguous()
        save_file(tensors, str(tmp_path / "model.safetensors"))
        return [lambda: dsv4.AttentionWeights.from_checkpoint(tmp_path, li, cfg=TINY)]

    return case


CHECKPOINT_CASES = {"K1": _checkpoint_case("missing"), "K2": _checkpoint_case("misshapen")}


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


# ------------------------------------------------------------------------------------------------ NaN policy
def test_nan_without_check_stays_inside_its_request(weights) -> None:
    """``check_inputs=False`` (e.g. inside CUDA graphs): a NaN in one request's hidden states reaches that
    request's outputs and cache only. The other request's outputs and cache bytes equal a run without the NaN, and
    after the poisoned request is released, a new request reusing its slot and blocks sees no trace of it."""
    T_a, T_b = 37, 21
    xa, xb = torch.randn(T_a, TINY.hidden_size), torch.randn(T_b, TINY.hidden_size)
    for li in LAYERS:
        layer = Attention(weights[li], TINY, li, check_inputs=False)
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
