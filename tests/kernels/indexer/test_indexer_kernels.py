"""Triton indexer (scores over the paged MXFP4 / FP8 / FP32 keys, fused MXFP4 query prep) and radix top-k against
the torch backend.

GPU tests are marked ``gpu``. The CPU tests run the same kernels in the Triton interpreter (``TRITON_INTERPRET=1``,
small shapes; the MXFP4 key conversion takes its plain-integer path there) and skip when triton is absent. The
interpreter must be chosen before any kernel is decorated, so ``test_indexer_interpreter.py`` reruns this
file's CPU tests in a fresh process with ``TRITON_INTERPRET=1`` (in the main process they skip; setting the variable
here would leak into other modules). Tests that need a specific kernel or launch construct its plan
(``dsv4.kernels.indexer.plan``) or ``dataclasses.replace`` the step's.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

triton = pytest.importorskip("triton")

import dsv4  # noqa: E402
from dsv4.cache import HybridCache  # noqa: E402
from dsv4.numerics import Numerics  # noqa: E402
from dsv4.ops import torch_ops  # noqa: E402
from dsv4.reference.indexer import indexer_queries as reference_indexer_queries  # noqa: E402
from dsv4.reference.primitives import project  # noqa: E402
from dsv4.ops import triton_indexer as ti  # noqa: E402
from dsv4.kernels import device  # noqa: E402
from dsv4.kernels.indexer.scores import index_scores  # noqa: E402
from dsv4.kernels.indexer.scores_plan import ScoresPlan, plan_scores, sm90_register_cap  # noqa: E402
from dsv4.kernels.indexer.topk import radix_topk  # noqa: E402
from dsv4.kernels.indexer.topk_plan import bisect_plan, filter_plan, plan_topk, split_plan  # noqa: E402
from dsv4.reference.indexer import index_scores as ref_scores  # noqa: E402

TINY = dsv4.ModelConfig.preset("tiny")
LAYER = 1  # a CSA layer of the tiny preset
M = 4
ON_GPU = torch.cuda.is_available()


def _numerics(fmt: str) -> Numerics:
    return Numerics.exact() if fmt == "fp32" else Numerics.official().with_formats(index_format=fmt)


def _scenario(device: str, fmt: str, heads: int, k: int, steps: list[dict[str, int]], block_size: int = 32,
              seed: int = 0, block_spread: int = 0):
    """A cache whose CSA layer's indexer pool is filled with random keys (on the format's grid), after ``steps``.

    ``block_spread``: each 32-value block of a key is scaled by ``2**u``, ``u`` uniform in ``[−spread, spread]``
    (MXFP4 keys whose block exponents differ by up to ``2·spread`` binades; 0: one scale per key).
    Returns ``(cfg, cache, layer, batch)`` with ``batch`` the last step's ``StepBatch``.
    """
    cfg = dataclasses.replace(TINY, index_n_heads=heads, index_topk=k)
    total = {}
    for st in steps:
        for r, n in st.items():
            total[r] = total.get(r, 0) + n
    blocks = sum(-(-n // block_size) + 1 for n in total.values()) + 4
    cache = HybridCache(cfg, layers=[LAYER], max_requests=len(total) + 1, num_blocks=blocks, block_size=block_size,
                        device=device, numerics=_numerics(fmt))
    batch = None
    for st in steps:
        for r in st:
            if r not in cache._requests:
                cache.add_request(r)
        batch = cache.prepare_forward(st)
    layer = cache.layer(LAYER)
    g = torch.Generator().manual_seed(seed)
    epp = layer.schema.entries_per_block
    n = blocks * epp
    vals = torch.randn(n, 128, generator=g) * torch.exp2(torch.randint(-3, 4, (n, 1), generator=g).float())
    if block_spread:
        u = torch.randint(-block_spread, block_spread + 1, (n, 4, 1), generator=g).float()
        vals = (vals.view(n, 4, 32) * torch.exp2(u)).view(n, 128)
    vals = _numerics(fmt).qdq_index(vals).to(device)
    ids = torch.arange(n, device=device)
    layer.schema.index_storage.write(layer.index_pages, ids // epp, ids % epp, vals)
    return cfg, cache, layer, batch


def _queries(cfg, fmt: str, T: int, device: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, cfg.index_n_heads, 128, generator=g) * 2.0
    w = torch.randn(T, cfg.index_n_heads, generator=g) * cfg.index_weight_scale
    return _numerics(fmt).qdq_index(q).to(device), w.to(device)


def _reference_rows(layer, batch, q, w, score_dtype):
    """Per token: the torch reference scores over its request's existing entries and the magnitude
    ``Σ_h |w_h| Σ_c |q_hc k_c|`` that bounds accumulation-order error (float64 copies, CPU)."""
    rows = []
    cu = [0]
    for n in batch.num_new:
        cu.append(cu[-1] + n)
    for b, (s, n) in enumerate(zip(batch.start_positions, batch.num_new)):
        ne = (s + n) // M
        if ne == 0:
            rows += [(torch.zeros(0), torch.zeros(0))] * n
            continue
        idx = torch.arange(ne, device=q.device)
        block, slot = torch_ops._entry_addresses(batch, M, torch.full_like(idx, b), idx)
        keys = layer.schema.index_storage.read(layer.index_pages, block, slot)
        sc = ref_scores(q[cu[b]:cu[b + 1]], w[cu[b]:cu[b + 1]], keys, score_dtype).double().cpu()
        mag = ref_scores(q[cu[b]:cu[b + 1]].abs(), w[cu[b]:cu[b + 1]].abs(), keys.abs(), torch.float64).cpu()
        rows += list(zip(sc, mag))
    return rows


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at |x| (float64)."""
    mant = 7 if dtype == torch.bfloat16 else 23
    e = torch.floor(torch.log2(x.abs().clamp_min(1e-30)))
    return torch.exp2(e - mant)


def _check(layer, batch, q, w, k, score_dtype, got_idx, scores_buf):
    """Scores within one rounding step of the reference; top-k exact on our scores and equal to the reference's
    up to ties / one-ulp flips at the threshold; −1 padding and causality."""
    vis = batch.visible_entries[M].cpu()
    ref = _reference_rows(layer, batch, q, w, score_dtype)
    got_idx = got_idx.cpu()
    assert got_idx.shape == (batch.num_tokens, k) and got_idx.dtype == torch.int64
    buf = scores_buf.double().cpu()
    worst = 0.0
    for t in range(batch.num_tokens):
        n = int(vis[t])
        r, mag = ref[t][0][:n], ref[t][1][:n]
        s = buf[t, :n]
        assert torch.isfinite(s).all()
        # one rounding step of the score dtype, plus the FP32 (FP8 MMA: ~2**-14) accumulation-order error
        acc_err = 2.0**-20 if score_dtype == torch.float32 else 2.0**-14
        tol = _ulp(r, score_dtype) + acc_err * mag + 1e-30
        err = ((s - r).abs() / tol).max().item() if n else 0.0
        worst = max(worst, err)
        assert err <= 1.0 + 1e-9, (t, err)
        ke = min(k, n)
        sel = got_idx[t]
        assert (sel[ke:] == -1).all(), t
        chosen = sel[:ke]
        assert (chosen >= 0).all() and (chosen < n).all(), (t, chosen)  # causal: only visible entries
        assert chosen.unique().numel() == ke
        if ke == 0:
            continue
        # exact top-k of our own scores (values as a multiset)
        assert torch.equal(s[chosen].sort().values, s.topk(ke).values.sort().values), t
        # against the reference scores: everything chosen is ≥ the k-th best up to one ulp, nothing better left out
        kth = r.topk(ke).values[-1]
        slack = 2 * (_ulp(kth.reshape(1), score_dtype)[0] + acc_err * mag.max())
        assert (r[chosen] >= kth - slack).all(), t
        mask = torch.ones(n, dtype=torch.bool)
        mask[chosen] = False
        if mask.any():
            assert (r[mask] <= kth + slack).all(), t
    return worst


def _device_facts() -> dict:
    """The facts of the device the kernels run on, as ``plan_*`` take them."""
    dev = torch.device("cuda" if ON_GPU else "cpu")
    return dict(sm_count=device.sm_count(dev), sm90=device.is_sm90(dev), interpreted=device.interpreting())


def _step_plan(layer, batch, k: int, score_dtype: torch.dtype, heads: int, *, topk: str | None = None,
               triton_scores: bool = False):
    """The step's indexer plan (``indexer_plan``), its top-k forced to algorithm ``topk`` (``"bisect_triton"``: the
    Triton "bisect" where the Gluon one would run) and its scores to the Triton kernel if ``triton_scores``."""
    plan = ti.indexer_plan(layer, batch, M, k, heads, score_dtype)
    facts = _device_facts()
    if topk is not None:
        t = plan.topk
        gluon = facts.pop("sm90") and topk != "bisect_triton"
        plan = dataclasses.replace(plan, topk=plan_topk(t.rows, t.columns, k, score_dtype, sm90=gluon,
                                                        algorithm=topk.removesuffix("_triton"), **facts))
    if triton_scores:
        s = plan.scores
        plan = dataclasses.replace(plan, scores=plan_scores(
            key_format=s.key_format, heads=heads, requests=s.requests, max_new=s.max_new, entries=s.entries,
            ratio=s.ratio, block_size=s.block_size, entries_per_page=s.entries_per_page,
            sm_count=_device_facts()["sm_count"], sm90=False, interpreted=device.interpreting()))
    return plan


STEPS_SMALL = [{"a": 90, "b": 13, "c": 3}, {"a": 3, "b": 1, "c": 40, "d": 7}]


@pytest.mark.parametrize("fmt,algorithm", [("fp8", None), *((f, a) for a in ("split", "filter", "bisect")
                                                               for f in ("mxfp4", "fp32"))])
def test_interpreter_scores_and_topk(fmt: str, algorithm: str | None) -> None:
    if ON_GPU or not INTERPRETED:
        pytest.skip("interpreter test (CPU only, TRITON_INTERPRET=1)")
    cfg, cache, layer, batch = _scenario("cpu", fmt, heads=4, k=8, steps=STEPS_SMALL)
    q, w = _queries(cfg, fmt, batch.num_tokens, "cpu")
    nm = _numerics(fmt)
    plan = _step_plan(layer, batch, 8, nm.score_dtype, 4, topk=algorithm)
    assert plan.topk.algorithm == (algorithm or plan.topk.algorithm)
    got = ti.topk_layer(layer, batch, M, q, w, 8, nm.score_dtype, plan=plan)
    buf = ti.score_buffer(layer, batch, M, nm.score_dtype)  # the matrix indexer_topk wrote
    _check(layer, batch, q, w, 8, nm.score_dtype, got, buf)


STEPS_PAGED = [{"a": 600, "b": 300}, {"a": 1, "b": 1, "c": 5}]


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_interpreter_scores_page_tiles(fmt: str) -> None:
    """Pages of 64 entries (block size 256): the decode step's key tiles each lie in one page (the split's pages
    held in registers, the scales taken a tile ahead) and cross pages from tile to tile within one program (one
    program per request and query chunk); MXFP4 keys whose four block exponents differ by up to 10 binades (every
    block shift of the conversion tables)."""
    if ON_GPU or not INTERPRETED:
        pytest.skip("interpreter test (CPU only, TRITON_INTERPRET=1)")
    cfg, cache, layer, batch = _scenario("cpu", fmt, heads=4, k=8, steps=STEPS_PAGED, block_size=256, block_spread=5)
    q, w = _queries(cfg, fmt, batch.num_tokens, "cpu")
    nm = _numerics(fmt)
    plan = _step_plan(layer, batch, 8, nm.score_dtype, 4)
    plan = dataclasses.replace(plan, scores=dataclasses.replace(plan.scores, tiles_per_split=plan.scores.tiles))
    assert plan.scores.page_vector and plan.scores.splits == 1 and plan.scores.tiles == 3
    got = ti.topk_layer(layer, batch, M, q, w, 8, nm.score_dtype, plan=plan)
    buf = ti.score_buffer(layer, batch, M, nm.score_dtype)
    assert int(batch.visible_entries[M].max()) > 128  # three tiles of 64, over three pages
    _check(layer, batch, q, w, 8, nm.score_dtype, got, buf)


def _check_topk(s: torch.Tensor, counts: torch.Tensor, k: int, out: torch.Tensor) -> None:
    """Exactly ``min(k, n_t)`` distinct valid indices whose values are the row's top-k (up to ties), then −1."""
    assert out.shape == (s.shape[0], k) and out.dtype == torch.int64
    s, counts, out = s.float().cpu(), counts.cpu(), out.cpu()
    for t in range(s.shape[0]):
        n = int(counts[t])
        ke = min(k, n)
        assert (out[t, ke:] == -1).all(), t
        c = out[t, :ke]
        assert c.unique().numel() == ke and (c >= 0).all() and (c < n).all(), t
        assert torch.equal(s[t, c].sort().values, s[t, :n].topk(ke).values.sort().values), t


def _topk_rows(g: torch.Generator, dt: torch.dtype, n: int = 700) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with many ties at the threshold, all −0, few candidates, none, all equal, all equal but one, +inf/−inf."""
    s = (torch.randn(8, n, generator=g) * 3).to(dt)
    s[0, : n * 3 // 7] = 0.5  # many exact ties at the threshold
    s[1] = -0.0
    s[5] = 2.0  # all equal
    s[6] = -1.0
    s[6, n // 2] = 3.0
    s[7, :10] = float("inf")
    s[7, 10:20] = float("-inf")
    counts = torch.tensor([n, n - 1, 5, 0, 64, n, n, n])
    return s, counts


def _topk_plans(algorithm: str, rows: int, columns: int, k: int, bits: int, small: bool = True) -> list:
    """Launches of ``algorithm`` in the interpreter: with small register blocks (looped paths, several programs per
    row, the filter's candidates selected in blocks) and with the default ones."""
    facts = dict(sm_count=device.INTERPRETER_SMS, interpreted=True)
    if algorithm == "bisect":
        return [bisect_plan(rows, columns, k, bits, gluon=False, interpreted=True)]
    if algorithm == "filter":
        return ([filter_plan(rows, columns, k, bits, max_block=64, candidate_block=16, **facts)] if small else []) + [
            filter_plan(rows, columns, k, bits, max_block=1024, **facts)]
    return ([split_plan(rows, columns, k, bits, block=64, **facts)] if small else []) + [
        split_plan(rows, columns, k, bits, block=1024, **facts)]


@pytest.mark.parametrize("algorithm", ["split", "filter", "bisect"])
def test_interpreter_radix_topk(algorithm: str) -> None:
    if ON_GPU or not INTERPRETED:
        pytest.skip("interpreter test (CPU only, TRITON_INTERPRET=1)")
    g = torch.Generator().manual_seed(3)
    for dt, bits in ((torch.bfloat16, 16), (torch.float32, 32)):
        s, counts = _topk_rows(g, dt)
        rows, columns = s.shape
        plans = _topk_plans(algorithm, rows, columns, 64, bits)
        if algorithm == "split":
            assert plans[0].programs_per_row > 1 and plans[1].programs_per_row == 1
        if algorithm == "filter":
            assert plans[0].chunk > plans[0].block  # the looped path
        for plan in plans:
            _check_topk(s, counts, 64, radix_topk(s, counts, plan))
        # k larger than every row; a reused workspace with garbage in it
        ws = torch.full((16384,), 12345, dtype=torch.int32)
        for plan in _topk_plans(algorithm, rows, columns, 1000, bits):
            _check_topk(s, counts, 1000, radix_topk(s, counts, plan, workspace=ws))
        if algorithm in ("filter", "bisect"):  # the bound over groups of 64 columns (k=2: enough groups)
            for plan in _topk_plans(algorithm, rows, columns, 2, bits, small=False):
                assert plan.group == 64
                _check_topk(s, counts, 2, radix_topk(s, counts, plan))
        if algorithm == "filter":  # the header is zero again after each call; candidates are scratch
            plan = _topk_plans(algorithm, rows, columns, 64, bits)[0]
            header = torch.zeros(plan.scratch()["header"][0], dtype=torch.int32)
            cand = torch.full((s.numel(),), 777, dtype=torch.int32)
            for _ in range(2):
                _check_topk(s, counts, 64, radix_topk(s, counts, plan, header=header, candidates=cand))
                assert not header.any()


def test_plans_must_match_their_inputs() -> None:
    """A plan for other scores, another device or another score dtype raises instead of launching."""
    s = torch.zeros(8, 700, dtype=torch.bfloat16)
    counts = torch.full((8,), 700)
    gpu_plan = plan_topk(8, 700, 64, torch.bfloat16, sm_count=132, sm90=False)
    cpu_plan = plan_topk(8, 700, 64, torch.bfloat16, sm_count=4, sm90=False, interpreted=True)
    if not INTERPRETED:
        with pytest.raises(ValueError, match="plan for the interpreter"):
            radix_topk(s.cuda() if ON_GPU else s, counts, cpu_plan)
    with pytest.raises(ValueError, match="plan is for"):
        radix_topk(s[:, :600], counts, gpu_plan if not INTERPRETED else cpu_plan)
    with pytest.raises(ValueError, match="16-bit keys"):
        radix_topk(s.float(), counts, gpu_plan if not INTERPRETED else cpu_plan)


# ------------------------------------------------------------------------------------------------ GPU
FLASH_STEPS = [
    {"a": 3000, "b": 700, "c": 5},  # prefill chunks (one in several programs' query groups)
    {"a": 1, "b": 4, "c": 2000, "d": 33, "e": 1},  # decode 1–4 tokens, a prefill chunk, a fresh request
]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8", "fp32"])
@pytest.mark.parametrize("heads,k", [(64, 512), (4, 8)])
def test_gpu_scores_and_topk(fmt: str, heads: int, k: int) -> None:
    cfg, cache, layer, batch = _scenario("cuda", fmt, heads=heads, k=k, steps=FLASH_STEPS, block_size=256, seed=heads)
    q, w = _queries(cfg, fmt, batch.num_tokens, "cuda", seed=k)
    nm = _numerics(fmt)
    # poison the score buffer: every visible element must be written
    ti.score_buffer(layer, batch, M, nm.score_dtype).fill_(float("nan"))
    got = ti.topk_layer(layer, batch, M, q, w, k, nm.score_dtype)
    buf = ti.score_buffer(layer, batch, M, nm.score_dtype)
    worst = _check(layer, batch, q, w, k, nm.score_dtype, got, buf)
    print(f"{fmt} H={heads} k={k}: worst score error {worst:.3f} ulp")


def _mxfp4_plan(batch, heads: int, *, sm90: bool | None = None, **fields) -> ScoresPlan:
    """The scores plan of MXFP4 keys in pages of 64 entries (block size 256) for ``batch`` on the GPU (``sm90``:
    the Gluon kernel where it applies; default: where the device runs it), with ``fields`` replaced."""
    dev = torch.device("cuda")
    n_max = max((s + n) // M for s, n in zip(batch.start_positions, batch.num_new))
    plan = plan_scores(key_format="mxfp4", heads=heads, requests=batch.num_requests, max_new=batch.max_new,
                       entries=n_max, ratio=M, block_size=256, entries_per_page=64, sm_count=device.sm_count(dev),
                       sm90=device.is_sm90(dev) if sm90 is None else sm90)
    return dataclasses.replace(plan, **fields)


def _mxfp4_score_bits(layer, batch, q, w, plan: ScoresPlan, dtype=torch.bfloat16) -> torch.Tensor:
    """The scores kernel's BF16 scores (as int16 bits; unwritten elements stay NaN) of MXFP4 queries ``q`` with head
    weights ``w`` over ``layer``'s pool (block size 256), launched by ``plan`` (``_mxfp4_plan``); with ``dtype``
    float32 the FP32 scores themselves."""
    qq = ti.queries_from_float(q, "mxfp4")
    wq = torch.zeros_like(qq.scale)
    wq[:, : w.shape[1]] = w
    wq *= qq.scale
    out = torch.full((batch.num_tokens, plan.entries), float("nan"), dtype=dtype, device="cuda")
    index_scores(layer.index_pages, batch.block_tables, batch.cu_seqlens, batch.visible_entries[M], qq.q, wq, out,
                 plan)
    return out.view(torch.int16) if dtype == torch.bfloat16 else out


DECODE_STEPS = [
    {"a": 3000, "b": 700, "c": 5},
    {"a": 1, "b": 2, "c": 1},  # decode steps of 1–2 tokens: 64-key tiles, one page each (the page vector)
]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8", "fp32"])
def test_gpu_scores_page_vector(fmt: str) -> None:
    """Decode steps whose key tiles lie in one page each (``PAGE_VECTOR``: block-table entries held in registers,
    MXFP4 scales a tile ahead, tiles copied two ahead); MXFP4 keys with block exponents up to 10 binades apart.
    Scores and top-k vs the reference; then, one program per request (tiles cross pages within a program), the PTX
    conversion and its integer twin, and the per-row block-table gather, all bitwise equal (the Triton kernel: the
    step's own plan runs the Gluon one on Hopper)."""
    cfg, cache, layer, batch = _scenario("cuda", fmt, heads=64, k=512, steps=DECODE_STEPS, block_size=256,
                                         block_spread=5 if fmt == "mxfp4" else 0)
    q, w = _queries(cfg, fmt, batch.num_tokens, "cuda")
    nm = _numerics(fmt)
    plan = _step_plan(layer, batch, 512, nm.score_dtype, 64, triton_scores=True)
    assert plan.scores.kernel == "triton" and plan.scores.block_n == 64 and plan.scores.page_vector
    ti.score_buffer(layer, batch, M, nm.score_dtype).fill_(float("nan"))
    got = ti.topk_layer(layer, batch, M, q, w, 512, nm.score_dtype, plan=plan)
    buf = ti.score_buffer(layer, batch, M, nm.score_dtype)
    _check(layer, batch, q, w, 512, nm.score_dtype, got, buf)
    if fmt != "mxfp4":
        return
    # one program per request: its tiles cross pages; the integer twin; the per-row block-table gather — bitwise
    triton = _mxfp4_plan(batch, 64, sm90=False)
    one = dataclasses.replace(triton, tiles_per_split=triton.tiles)
    assert one.splits == 1 and triton.splits > 1
    outs = [_mxfp4_score_bits(layer, batch, q, w, p)
            for p in (one, dataclasses.replace(one, inline_ptx=False), dataclasses.replace(triton, page_vector=False))]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def _recorded_gluon_launches(monkeypatch) -> list[ScoresPlan]:
    """Skip without an sm_90 device; else record the plan of every ``scores_sm90.launch`` (the list returned, filled
    as the test runs)."""
    from dsv4.kernels.indexer import scores_sm90

    if not device.is_sm90(torch.device("cuda")):
        pytest.skip("the Gluon kernel needs an sm_90 device")
    calls = []
    launch = scores_sm90.launch
    monkeypatch.setattr(scores_sm90, "launch", lambda *a: (calls.append(a[-1]), launch(*a)))
    return calls


GLUON_STEPS = [
    {"a": 3000, "b": 700, "c": 5, "d": 64, "e": 256, "f": 4},  # prefill chunks
    {"a": 1, "b": 1, "c": 1, "d": 1, "e": 1, "f": 1},  # single-token decode: the Gluon kernel on sm_90
]


@pytest.mark.gpu
@pytest.mark.parametrize("heads,k,spread", [(64, 512, 5), (64, 512, 0), (4, 8, 5)])
def test_gpu_scores_gluon_decode(heads: int, k: int, spread: int, monkeypatch) -> None:
    """The Gluon scores kernel (``scores_sm90``: single-token decode over MXFP4 keys) against the reference:
    requests of 1 to 750 keys (partial tiles, tiles over several pages, odd and even tile counts per program),
    keys whose block exponents differ by up to 10 binades, 64 and 4 heads; the poisoned buffer must be written
    wherever a key is visible. Then with one program per request, and the Triton kernel on the same step."""
    calls = _recorded_gluon_launches(monkeypatch)
    cfg, cache, layer, batch = _scenario("cuda", "mxfp4", heads=heads, k=k, steps=GLUON_STEPS, block_size=256,
                                         block_spread=spread, seed=spread)
    assert batch.max_new == 1
    q, w = _queries(cfg, "mxfp4", batch.num_tokens, "cuda", seed=heads)
    nm = _numerics("mxfp4")
    buf = ti.score_buffer(layer, batch, M, nm.score_dtype)
    buf.fill_(float("nan"))
    got = ti.topk_layer(layer, batch, M, q, w, k, nm.score_dtype)
    assert len(calls) == 1
    _check(layer, batch, q, w, k, nm.score_dtype, got, buf)
    # tiles per program 12, 6, 4, 3 (odd and even counts through the two-tile loop): the same bits
    ref_bits = buf.view(torch.int16).clone()
    gluon = _mxfp4_plan(batch, heads)
    assert gluon.kernel == "sm90" and gluon.tiles == 12
    for per_split in (12, 6, 4, 3):
        bits = _mxfp4_score_bits(layer, batch, q, w, dataclasses.replace(gluon, tiles_per_split=per_split))
        live = ~torch.isnan(bits.view(torch.bfloat16))
        visible = torch.arange(bits.shape[1], device="cuda")[None, :] < batch.visible_entries[M][:, None]
        assert torch.equal(live, visible), per_split  # every visible score written, nothing else
        assert torch.equal(bits[live], ref_bits[:, : bits.shape[1]][live]), per_split
    # without the register cap (ptxas's own allocation): the same bits
    bits = _mxfp4_score_bits(layer, batch, q, w, dataclasses.replace(gluon, tiles_per_split=6, max_registers=0))
    live = ~torch.isnan(bits.view(torch.bfloat16))
    assert torch.equal(bits[live], ref_bits[:, : bits.shape[1]][live])
    # FP32 scores: written at the same places, each the sum that rounds to the BF16 score
    f32 = _mxfp4_score_bits(layer, batch, q, w, dataclasses.replace(gluon, tiles_per_split=6), dtype=torch.float32)
    live = ~torch.isnan(f32)
    assert torch.equal(live, visible)
    assert torch.equal(f32[live].to(torch.bfloat16).view(torch.int16), ref_bits[:, : f32.shape[1]][live])
    # the Triton kernel on the same step
    buf.fill_(float("nan"))
    plan = _step_plan(layer, batch, k, nm.score_dtype, heads, triton_scores=True)
    got = ti.topk_layer(layer, batch, M, q, w, k, nm.score_dtype, plan=plan)
    _check(layer, batch, q, w, k, nm.score_dtype, got, buf)
    assert len(calls) == 7  # the default launch, four splits, one uncapped, FP32; the Triton plan took no Gluon


CHUNK_STEPS = [
    {"a": 3000, "b": 700, "c": 5, "d": 64},
    # 1–4-token decodes, prefill chunks (odd lengths: partial query groups), a fresh request
    {"a": 1, "b": 4, "c": 2001, "d": 33, "e": 3, "f": 1},
]


@pytest.mark.gpu
@pytest.mark.parametrize("heads,k,spread", [(64, 512, 5), (4, 8, 0)])
def test_gpu_scores_gluon_chunks(heads: int, k: int, spread: int, monkeypatch) -> None:
    """The Gluon scores kernel on multi-token steps (``QT`` queries per program, each key tile converted once for
    all of them) against the reference, causal per query, the poisoned buffer written exactly where a key is
    visible; ``QT`` = 1 / 2 and one program per request give the same scores (bit for bit where the head sums'
    order agrees, else within one BF16 step: a warning says which); then the Triton kernel on the same step."""
    import warnings

    calls = _recorded_gluon_launches(monkeypatch)
    cfg, cache, layer, batch = _scenario("cuda", "mxfp4", heads=heads, k=k, steps=CHUNK_STEPS, block_size=256,
                                         block_spread=spread, seed=spread + 1)
    assert batch.max_new > 1
    q, w = _queries(cfg, "mxfp4", batch.num_tokens, "cuda", seed=heads + 1)
    nm = _numerics("mxfp4")
    buf = ti.score_buffer(layer, batch, M, nm.score_dtype)
    buf.fill_(float("nan"))
    got = ti.topk_layer(layer, batch, M, q, w, k, nm.score_dtype)
    assert [c.queries_per_program for c in calls] == [4]
    _check(layer, batch, q, w, k, nm.score_dtype, got, buf)
    ref = buf.clone()
    visible = torch.arange(buf.shape[1], device="cuda")[None, :] < batch.visible_entries[M][:, None]
    gluon = _mxfp4_plan(batch, heads)
    for over in (dict(queries_per_program=1, max_registers=sm90_register_cap(1)),
                 dict(queries_per_program=2, max_registers=sm90_register_cap(2)),
                 dict(tiles_per_split=gluon.tiles)):  # one program per request and query group
        got_bf16 = _mxfp4_score_bits(layer, batch, q, w, dataclasses.replace(gluon, **over)).view(torch.bfloat16)
        live = ~torch.isnan(got_bf16)
        assert torch.equal(live, visible[:, : live.shape[1]]), over  # every visible score written, nothing else
        a, b = got_bf16[live].double(), ref[:, : live.shape[1]][live].double()
        if not torch.equal(a, b):
            warnings.warn(f"Gluon scores {over} differ from QT=4 by reduction order: max "
                          f"{((a - b).abs() / _ulp(b, torch.bfloat16)).max().item():.2f} BF16 steps")
            assert ((a - b).abs() <= _ulp(b, torch.bfloat16) * 1.0001).all(), over
    assert [c.queries_per_program for c in calls] == [4, 1, 2, 4]
    # the Triton kernel on the same step
    buf.fill_(float("nan"))
    plan = _step_plan(layer, batch, k, nm.score_dtype, heads, triton_scores=True)
    got = ti.topk_layer(layer, batch, M, q, w, k, nm.score_dtype, plan=plan)
    _check(layer, batch, q, w, k, nm.score_dtype, got, buf)
    assert len(calls) == 4


@pytest.mark.gpu
def test_gpu_scores_exact_per_block_vs_asm() -> None:
    """The Triton kernel's inline-PTX E2M1→E4M3 conversion and its plain-integer twin give identical scores
    (bitwise), on keys whose block exponents differ by up to 10 binades (every table shift)."""
    cfg, cache, layer, batch = _scenario("cuda", "mxfp4", heads=64, k=512, steps=FLASH_STEPS, block_size=256,
                                         block_spread=5)
    q, w = _queries(cfg, "mxfp4", batch.num_tokens, "cuda")
    plan = _mxfp4_plan(batch, 64, sm90=False)
    outs = [_mxfp4_score_bits(layer, batch, q, w, dataclasses.replace(plan, inline_ptx=ptx)) for ptx in (True, False)]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
def test_gpu_mxfp4_queries_match_reference() -> None:
    """Fused RoPE → Hadamard → MXFP4 of the reference's projection equals the torch reference's queries, encoded
    (bitwise). The projection is the official FP8 GEMM (``reference.primitives.project``), as in the reference."""
    cfg = dsv4.ModelConfig.preset("v4-flash")
    nm = Numerics.official()
    g = torch.Generator().manual_seed(5)
    T = 300
    q_lat = torch.randn(T, cfg.q_lora_rank, generator=g).to("cuda", torch.bfloat16)
    wq_b = (torch.randn(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, generator=g) * 0.03).to("cuda")
    iw = dsv4.weights.IndexerWeights(wq_b=wq_b, weights_proj=None, compressor=None)
    pos = torch.randint(0, 1 << 20, (T,), generator=g).to("cuda")
    from dsv4.reference.rope import rope_inv_freq

    inv_freq = rope_inv_freq(cfg, dsv4.config.LayerKind.CSA, "cuda")
    got = ti.queries_from_projection(project(q_lat, wq_b, nm), pos, inv_freq, cfg, nm)
    assert isinstance(got, ti.IndexerQueries) and got.q.dtype == torch.uint8
    ref = reference_indexer_queries(q_lat, iw, pos, inv_freq, cfg, nm)
    assert torch.equal(_decode_mxfp4_queries(got).cpu(), ref.cpu())


def _decode_mxfp4_queries(iq) -> torch.Tensor:
    """float32 ``[T, H, 128]`` values of an MXFP4 ``IndexerQueries`` (E4M3 bytes times the per-head scale)."""
    v = iq.q.view(torch.float8_e4m3fn).float() * iq.scale[:, None, :, None]
    out = torch.empty(v.shape[0], v.shape[2], 128, device=v.device)
    channels = ti.mxfp4_operand_channels(v.device)
    out[..., channels[0]], out[..., channels[1]] = v[:, 0], v[:, 1]
    return out[:, : iq.num_heads]


def test_interpreter_mxfp4_queries() -> None:
    """The fused query kernel (interpreter) equals RoPE → Hadamard → MXFP4 QDQ of the reference (bitwise values);
    the indexer's column block of a wider GEMM output (the stacked ``[W_qb; W_Iq]`` projection) is read in place,
    the same bytes as its contiguous copy."""
    if ON_GPU or not INTERPRETED:
        pytest.skip("interpreter test (CPU only, TRITON_INTERPRET=1)")
    from dsv4.kernels.indexer.queries import mxfp4_queries
    from dsv4.reference.rope import apply_rope, rope_inv_freq

    g = torch.Generator().manual_seed(4)
    T, H = 6, 4
    q = (torch.randn(T, H * 128, generator=g) * 3).bfloat16()
    pos = torch.randint(0, 1 << 20, (T,), generator=g)
    inv = rope_inv_freq(TINY, dsv4.config.LayerKind.CSA)
    q8, qs = mxfp4_queries(q, pos, inv, H, 16)
    want = Numerics.official().qdq_index(apply_rope(q.unflatten(-1, (H, 128)), pos, inv))
    assert torch.equal(_decode_mxfp4_queries(ti.IndexerQueries("mxfp4", q8, qs, H)), want)
    assert (q8[:, :, H:] == 0).all() and (qs[:, H:] == 0).all()
    wide = (torch.randn(T, 3 * 512 + H * 128, generator=g) * 3).bfloat16()
    block = wide[:, 3 * 512 :]  # after three 512-wide heads, rows 2,048 elements apart
    q8s, qss = mxfp4_queries(block, pos, inv, H, 16)
    assert block.stride(0) == 2048 and torch.equal(q8s, mxfp4_queries(block.contiguous(), pos, inv, H, 16)[0])
    assert torch.equal(qss, mxfp4_queries(block.contiguous(), pos, inv, H, 16)[1])
    want = Numerics.official().qdq_index(apply_rope(block.unflatten(-1, (H, 128)), pos, inv))
    assert torch.equal(_decode_mxfp4_queries(ti.IndexerQueries("mxfp4", q8s, qss, H)), want)


@pytest.mark.gpu
def test_gpu_topk_default_decode_16k() -> None:
    """Decode rows of 16,384 BF16 columns (64K context): on Hopper the plan is the Gluon "bisect" (no scratch),
    elsewhere "filter" (its scratch); either way torch.topk's selection up to ties."""
    g = torch.Generator(device="cuda").manual_seed(16)
    T, n = 64, 16384
    s = torch.randn(T, n, generator=g, device="cuda").bfloat16()
    s[2, : n // 2] = 0.5  # ties across the row
    counts = torch.randint(1, n + 1, (T,), generator=g, device="cuda")
    counts[0], counts[1] = n, 300
    facts = _device_facts()
    if facts["sm_count"] < T:
        pytest.skip(f"{T} decode rows need at least {T} SMs")
    plan = plan_topk(T, n, 512, s.dtype, **facts)
    assert plan.gluon == device.is_sm90(s.device)
    assert plan.algorithm == ("bisect" if plan.gluon else "filter") and (plan.scratch() == {}) == plan.gluon
    scratch = {name: torch.zeros(shape, dtype=torch.int32, device="cuda")
               for name, (shape, _) in plan.scratch().items()}
    _check_topk(s, counts, 512, radix_topk(s, counts, plan, **scratch))


#: the top-k launches the GPU tests run: (label, algorithm asked, Gluon "bisect" allowed)
TOPK_LAUNCHES = [("split", "split", False), ("filter", "filter", False), ("bisect", "bisect", True),
                 ("bisect_triton", "bisect", False)]


@pytest.mark.gpu
@pytest.mark.parametrize("label,algorithm,gluon", TOPK_LAUNCHES)
@pytest.mark.parametrize("n", [2048, 32768, 262144])
def test_gpu_radix_topk_large(n: int, label: str, algorithm: str, gluon: bool) -> None:
    g = torch.Generator(device="cuda").manual_seed(n)
    T = 10
    facts = _device_facts()
    sm90 = facts.pop("sm90") and gluon
    for dt in (torch.bfloat16, torch.float32):
        s = torch.randn(T, n, generator=g, device="cuda").to(dt)
        s[0, : n // 2] = 1.0
        s[8] = 0.25  # all equal
        s[9, :] = s[9, :1024].repeat(n // 1024)  # every value repeated: ties spread over all programs
        counts = torch.tensor([n, n - 1, n // 3, 7, 0, 512, 513, n, n, n], device="cuda")
        plan = plan_topk(T, n, 512, dt, sm90=sm90, algorithm=algorithm, **facts)
        # reused: the header must be left zero by every call
        scratch = {name: torch.full(shape, 0 if zero else 99, dtype=torch.int32, device="cuda")
                   for name, (shape, zero) in plan.scratch().items()}
        for _ in range(3):  # the atomics' order varies between runs; each run must be right
            out = torch.full((T, 512), -7, dtype=torch.int64, device="cuda")
            _check_topk(s, counts, 512, radix_topk(s, counts, plan, out=out, **scratch))
            assert "header" not in scratch or not scratch["header"].any()


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1024, 2048, 8192, 16384])
def test_gpu_bisect_gluon_same_bits_as_triton(n: int) -> None:
    """The Gluon "bisect" kernel (``topk_bisect_sm90``, Hopper) against the Triton one on the same rows: the same
    slots — both scan in column order — on rows with ties at the threshold, all equal, ≤ k / k + 1 candidates, counts
    not a multiple of 8 (a partly read vector), a huge spread of values, −inf / +inf, and scores with the NaN bits
    0xFFFF (key 0, like the columns past a row's count) needed to fill the selection."""
    if not device.is_sm90(torch.device("cuda")):
        pytest.skip("needs sm_90 and Gluon")
    g = torch.Generator(device="cuda").manual_seed(n)
    T = 12
    s = (torch.randn(T, n, generator=g, device="cuda") * 4).to(torch.bfloat16)
    s[0, : n // 3] = 0.5
    s[1] = 0.25
    s[2] = s[2].abs() * 1e-30
    s[3, 5] = float("inf")
    s[3, 9] = float("-inf")
    s[4, :] = s[4, :64].repeat(n // 64)
    s[11].view(torch.int16)[5:] = -1  # 0xFFFF: all but five of the row's 1000 counted scores
    counts = torch.tensor([n, n - 1, n - 5, n // 3 + 3, n, 512, 513, 7, 0, n - 8, n // 2 + 1, 1000],
                          device="cuda").clamp(max=n)
    outs = []
    for gluon in (True, False):
        out = torch.full((T, 512), -7, dtype=torch.int64, device="cuda")
        outs.append(radix_topk(s, counts, bisect_plan(T, n, 512, 16, gluon=gluon, interpreted=False), out=out))
    finite = torch.arange(T, device="cuda") != 11  # torch.topk orders NaN first: row 11 checked by hand
    _check_topk(s[finite], counts[finite], 512, outs[0][finite])
    nan_row = outs[0][11].cpu()
    assert nan_row.unique().numel() == 512 and bool(((nan_row >= 0) & (nan_row < 1000)).all())
    assert set(range(5)) <= set(nan_row.tolist())  # the five numbers, then ties among the NaNs
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("label", [t[0] for t in TOPK_LAUNCHES])
def test_gpu_indexer_topk_variants(label: str) -> None:
    """The indexer's top-k through each algorithm (Flash shapes, MXFP4 and exact FP32 scores; "filter" falls back to
    "split" on the prefill step's rows)."""
    for fmt in ("mxfp4", "fp32"):
        cfg, cache, layer, batch = _scenario("cuda", fmt, heads=64, k=512, steps=FLASH_STEPS, block_size=256, seed=7)
        q, w = _queries(cfg, fmt, batch.num_tokens, "cuda", seed=8)
        nm = _numerics(fmt)
        plan = _step_plan(layer, batch, 512, nm.score_dtype, 64, topk=label)
        n_max = max((s + n) // M for s, n in zip(batch.start_positions, batch.num_new))
        layer.workspace.get("indexer_topk.workspace", (4096,), torch.int32).fill_(999)  # garbage from an earlier step
        for _ in range(2):  # the second call reuses the workspace the first one left (filter: a zero header)
            got = ti.topk_layer(layer, batch, M, q, w, 512, nm.score_dtype, plan=plan)
            buf = ti.score_buffer(layer, batch, M, nm.score_dtype)  # the matrix indexer_topk wrote
            assert buf.shape[1] >= n_max
            _check(layer, batch, q, w, 512, nm.score_dtype, got, buf)
