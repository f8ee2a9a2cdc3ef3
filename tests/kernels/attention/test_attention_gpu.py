"""Triton sparse attention (``dsv4.ops.triton_attention``) against the torch backend (marked gpu).

Each case builds a real ``HybridCache`` layer, fills its pool pages and rings with random valid 584-B entries
(some ring slots stale or empty), schedules a step of several requests (decode tokens and prefill chunks), draws
random queries, window entries, sinks and CSA entry lists (some −1), and compares ``attend`` of both backends.
The kernel tests run once per entry of ``VARIANTS`` (requests to the attention plan: each kept kernel), and
``test_dequant_exact`` checks each kernel's key dequantization bit for bit over every E4M3 code;
``test_forced_plans_match_torch`` runs every kernel, key source and merge through the launcher with plans forced
by ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import dsv4
from dsv4.cache import HybridCache
from dsv4.config import LayerKind
from dsv4.ops import torch_ops

from support.attention import FLASH, PRO, compare, dequant_probe, make_case, step_fwd, step_plan

# Requests to the attention plan (``plan_attention``'s keywords; ``{}`` the rules' plan), one per kept kernel and
# merge. Each GPU case below runs once per variant; the benchmark's ``--variants`` takes the same dicts.
VARIANTS = {
    "default": {},  # the Gluon kernels on Hopper, else the Triton one
    "ws": {"impl": "gluon_ws"},  # the warp-specialized Gluon kernel (Hopper only)
    "pipelined": {"impl": "gluon_pipelined", "keys": "fp8"},  # score / value / copy warpgroups over the FP8 pages
    "kernel_combine": {"combine": "kernel"},  # split partials merged by the combine kernel, never in clusters
    "triton": {"impl": "triton"},
}


# DSV4_ATTN_VARIANTS=name,name,... runs only those (e.g. one pytest process per variant, side by side).
_SELECTED = [v for v in os.environ.get("DSV4_ATTN_VARIANTS", "").split(",") if v] or list(VARIANTS)


@pytest.fixture(params=_SELECTED)
def variant(request) -> dict:
    """The requests of one entry of ``VARIANTS``."""
    return VARIANTS[request.param]


CASES = {
    # name: (cfg, kind, prefix lengths, step lengths, topk)
    "swa_decode": (FLASH, LayerKind.SWA, [0, 5, 300, 127, 128], [1, 2, 1, 4, 3], None),
    "swa_prefill": (FLASH, LayerKind.SWA, [0, 200], [300, 77], None),
    "csa_decode_flash": (FLASH, LayerKind.CSA, [3, 40, 2500, 9000], [1, 1, 2, 4], None),
    "csa_decode_pro": (PRO, LayerKind.CSA, [9000, 4100, 11], [1, 3, 1], None),
    "csa_prefill": (FLASH, LayerKind.CSA, [0, 3000], [513, 260], None),
    "csa_small_k": (FLASH, LayerKind.CSA, [7, 1], [1, 5], 3),
    "hca_decode": (FLASH, LayerKind.HCA, [127, 1000, 40000, 5], [1, 2, 1, 1], None),
    "hca_prefill": (PRO, LayerKind.HCA, [0, 1000], [700, 300], None),
    "hca_1m": (FLASH, LayerKind.HCA, [128 * 8192 - 1, 128 * 8192 - 2], [1, 2], None),  # 128 + 8192 keys
}


@pytest.mark.gpu
@pytest.mark.parametrize("wide", [False, True], ids=["e100-134", "e10-246"])
def test_dequant_exact(variant: dict, wide: bool) -> None:
    """The key tiles the kernel feeds the tensor cores are exactly the decoded entries (every E4M3 code)."""
    got, expected = dequant_probe("cuda", variant, wide)
    bad = (got != expected).nonzero()
    first = tuple(bad[0].tolist()) if bad.numel() else None
    assert first is None, f"{bad.shape[0]} wrong, first at {first}: {got[first]} vs {expected[first]}"


_BUILT: dict = {}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_attend_matches_torch(name: str, variant: dict) -> None:
    cfg, kind, prefix, step, topk = CASES[name]
    if name not in _BUILT:  # built once, shared by the variants (attend only reads the cache)
        _BUILT[name] = make_case(cfg, kind, prefix, step, "cuda", seed=len(name), topk=topk)
    layer, batch, args, ti, xi = _BUILT[name]
    err_o, err_l, o, _ = compare(layer, batch, args, ti, xi, variant)
    assert err_o <= 1e-2, err_o
    assert err_l <= 1e-3, err_l
    if name == "hca_1m":
        assert int(batch.visible_entries[cfg.hca_ratio].max()) == 8192


# Plans forced onto a step with dataclasses.replace: (kernel, key source, splits asked, merge of the splits).
FORCED = {
    "triton": ("triton", "fp8", 1, None),
    "triton_splits": ("triton", "fp8", 3, "combine_kernel"),
    "gluon": ("gluon", "fp8", 1, None),
    "gluon_splits": ("gluon", "fp8", 3, "combine_kernel"),
    "gluon_cluster": ("gluon", "fp8", 3, "cluster"),
    "gluon_bf16": ("gluon", "bf16", 1, None),
    "gluon_bf16_cluster": ("gluon", "bf16", 3, "cluster"),
    "ws": ("gluon_ws", "fp8", 1, None),
    "ws_splits": ("gluon_ws", "fp8", 3, "combine_kernel"),
    "pipelined_fp8": ("gluon_pipelined", "fp8", 1, None),
    "pipelined_bf16": ("gluon_pipelined", "bf16", 1, None),
}


def force(plan, batch, m: int, kernel: str, keys: str, splits: int, merge: str | None):
    """``plan`` with another kernel, key source and split (``dataclasses.replace``; the fields that follow from
    them — chunks per split, BF16 rows' entries, persistent programs, 64 heads per program — set to match)."""
    assert plan.block_n == 64
    per = -(-plan.max_chunks // splits)
    splits = -(-plan.max_chunks // per)
    entries = {"list": batch.addressable_entries(m) if m else 0, "all": plan.num_compressed, "window": 0}[plan.mode]
    return dataclasses.replace(
        plan, kernel=kernel, keys=keys, key_entries=entries if keys == "bf16" else 0, splits=splits,
        chunks_per_split=per, merge="none" if splits == 1 else merge, block_h=64,
        persistent_programs=min(plan.items, 132) if kernel == "gluon_pipelined" else 0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["csa_decode_flash", "hca_decode", "swa_decode", "csa_prefill"])
@pytest.mark.parametrize("forced", list(FORCED))
def test_forced_plans_match_torch(name: str, forced: str) -> None:
    """Every kept kernel, key source (FP8 pages, BF16 rows) and merge (none, combine kernel, clusters) runs through
    ``attend(plan=...)`` with a plan forced by ``dataclasses.replace`` and matches the torch backend."""
    from dsv4.kernels.device import is_sm90
    from dsv4.ops import triton_attention

    if FORCED[forced][0] != "triton" and not is_sm90(torch.device("cuda")):
        pytest.skip("the Gluon kernels need a Hopper GPU")
    cfg, kind, prefix, step, topk = CASES[name]
    if name not in _BUILT:
        _BUILT[name] = make_case(cfg, kind, prefix, step, "cuda", seed=len(name), topk=topk)
    layer, batch, args, ti, xi = _BUILT[name]

    base = triton_attention.attention_plan(batch, args["q"], args["kv_new"], args["m"], xi)
    plan = force(base, batch, args["m"], *FORCED[forced])
    err_o, err_l, _, _ = compare(layer, batch, args, ti, xi, plan=plan)
    assert err_o <= 1e-2, (plan.describe(), err_o)
    assert err_l <= 1e-3, (plan.describe(), err_l)


@pytest.mark.gpu
def test_attend_forced_splits_and_poisoned_output(variant: dict) -> None:
    """Split-KV partials + combine give the same result, and every output element is written."""
    layer, batch, args, ti, _ = make_case(FLASH, LayerKind.CSA, [5000, 12], [1, 3], "cuda", seed=7)
    o_ref, lse_ref = torch_ops.attend_layer(layer, batch, entry_idx=ti, **args)
    for splits in (1, 3, 20):
        out, lse = step_fwd(layer, batch, args, entry_idx=ti, num_splits=splits, **variant)
        assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
        err = ((out.double() - o_ref.double()).norm() / o_ref.double().norm()).item()
        assert err <= 1e-2, (splits, err)
        assert torch.allclose(lse, lse_ref, rtol=1e-3, atol=1e-3), splits


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["csa_prefill", "hca_prefill", "swa_prefill", "csa_decode_pro", "hca_decode"])
def test_bf16_keys_same_bits_as_fp8_keys(name: str) -> None:
    """The serial Gluon kernel reading the step's keys dequantized once into BF16 rows (``keys="bf16"``) gives
    the bits it gives reading and dequantizing the FP8 pages per chunk (``keys="fp8"``): the same key tiles, the
    same math; so does the pipelined kernel over BF16 rows (``impl="gluon_pipelined"``, prefill chunks). Prefill
    chunks (where ``"auto"`` picks BF16 rows) and decode steps (forced; split, in clusters)."""
    cfg, kind, prefix, step, topk = CASES[name]
    layer, batch, args, _, xi = make_case(cfg, kind, prefix, step, "cuda", seed=len(name) + 1, topk=topk)
    m = args["m"]
    listed = xi if kind is LayerKind.CSA else None
    counts = xi if kind is LayerKind.HCA else None
    runs = [("gluon", "bf16"), ("gluon", "fp8")] + ([("gluon_pipelined", "bf16")] if "prefill" in name else [])
    got = {}
    for impl, keys in runs:
        got[impl, keys] = step_fwd(
            layer, batch, args, ratio=m, entry_idx=listed, visible=counts,
            max_entries=batch.addressable_entries(m) if counts is not None else 0,
            max_visible=batch.addressable_entries(m) if m else None, impl=impl, keys=keys)
    want_o, want_lse = got["gluon", "fp8"]
    for run, (o, lse) in got.items():
        assert torch.isfinite(o.float()).all(), run
        assert torch.equal(o.view(torch.int16), want_o.view(torch.int16)), run
        assert torch.equal(lse.view(torch.int32), want_lse.view(torch.int32)), run


def _entry_options(kind: LayerKind, batch, args, triton_idx) -> dict:
    """``step_fwd``'s keywords for a ``make_case`` step's compressed entries: CSA's lists or HCA's counts."""
    m = args["m"]
    return dict(ratio=m, entry_idx=triton_idx if kind is LayerKind.CSA else None,
                visible=triton_idx if kind is LayerKind.HCA else None,
                max_entries=batch.addressable_entries(m) if kind is LayerKind.HCA else 0,
                max_visible=batch.addressable_entries(m) if m else None)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["csa_prefill", "hca_prefill", "swa_prefill"])
@pytest.mark.parametrize("programs", [1, 3, 7])
def test_prefill_kernel_any_number_of_programs(name: str, programs: int) -> None:
    """The pipelined kernel's persistent programs (over BF16 rows) each take items (token, head block) one after the
    other, the next item's queries and first keys copied in during the current item's last chunk: with 1, 3 or 7
    programs (a plan with ``persistent_programs`` replaced; each then runs hundreds of items, of different chunk
    counts for HCA) the outputs are the serial FP8 path's bits."""
    cfg, kind, prefix, step, topk = CASES[name]
    layer, batch, args, _, xi = make_case(cfg, kind, prefix, step, "cuda", seed=programs, topk=topk)
    opts = _entry_options(kind, batch, args, xi)
    want_o, want_lse = step_fwd(layer, batch, args, impl="gluon", keys="fp8", **opts)
    plan = step_plan(layer, batch, args, impl="gluon_pipelined", keys="bf16", **opts)
    o, lse = step_fwd(layer, batch, args, plan=dataclasses.replace(plan, persistent_programs=programs), **opts)
    assert torch.equal(o.view(torch.int16), want_o.view(torch.int16))
    assert torch.equal(lse.view(torch.int32), want_lse.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["csa_decode_pro", "hca_decode", "csa_prefill", "hca_1m"])
@pytest.mark.parametrize("programs", [1, 3, 7, 132])
def test_pipelined_fp8_any_number_of_programs(name: str, programs: int) -> None:
    """The pipelined kernel over the FP8 pages (``impl="gluon_pipelined"``, ``keys="fp8"``: the copy warpgroup
    dequantizes): with 1, 3, 7 or 132 persistent programs, each taking many (token, head block) items of different
    chunk counts (HCA), the outputs match the torch backend; a ``num_splits`` asked for does not apply to it."""
    cfg, kind, prefix, step, topk = CASES[name]
    layer, batch, args, ti, xi = make_case(cfg, kind, prefix, step, "cuda", seed=programs, topk=topk)
    o_ref, lse_ref = torch_ops.attend_layer(layer, batch, entry_idx=ti, **args)
    opts = _entry_options(kind, batch, args, xi)
    plan = step_plan(layer, batch, args, num_splits=9, impl="gluon_pipelined", keys="fp8", **opts)
    assert plan.splits == 1
    out, lse = step_fwd(layer, batch, args, plan=dataclasses.replace(plan, persistent_programs=programs), **opts)
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
    err = ((out.double() - o_ref.double()).norm() / o_ref.double().norm()).item()
    assert err <= 1e-2, err
    assert torch.allclose(lse, lse_ref, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_bf16_keys_short_bound_reads_no_further() -> None:
    """An entry index beyond the BF16 rows (the caller's ``max_visible`` too small) is no key — not a read past the
    buffer: the output is the FP8 path's with those indices set to −1, bit for bit."""
    layer, batch, args, _, idx = make_case(FLASH, LayerKind.CSA, [3000, 2000], [300, 77], "cuda", seed=21)
    bound = 300  # entries 0…299 get rows; the lists reach past 700
    assert int(idx.max()) >= bound
    got = {}
    for keys, listed in (("bf16", idx), ("fp8", torch.where(idx < bound, idx, -1))):
        got[keys] = step_fwd(layer, batch, args, entry_idx=listed, max_visible=bound, impl="gluon", keys=keys)
    assert torch.equal(got["bf16"][0].view(torch.int16), got["fp8"][0].view(torch.int16))
    assert torch.equal(got["bf16"][1].view(torch.int32), got["fp8"][1].view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [2, 5, 10, 16])
def test_cluster_combine_matches_combine_kernel(splits: int) -> None:
    """Each token's splits launched as one cluster that merges its partials (``combine="cluster"``) give the
    combine kernel's output within one BF16 step and its lse within FP32 rounding, and both the torch backend's;
    every output element is written (poisoned before). Flash (64 heads) and Pro (two head blocks per token)."""
    for cfg, prefix, step in ((FLASH, [9000, 12, 3000], [1, 3, 1]), (PRO, [9000, 700], [2, 1])):
        layer, batch, args, ti, _ = make_case(cfg, LayerKind.CSA, prefix, step, "cuda", seed=splits)
        o_ref, lse_ref = torch_ops.attend_layer(layer, batch, entry_idx=ti, **args)
        got = {}
        for combine in ("cluster", "kernel"):
            out, lse = step_fwd(layer, batch, args, entry_idx=ti, num_splits=splits, impl="gluon", combine=combine)
            assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all(), combine
            err = ((out.double() - o_ref.double()).norm() / o_ref.double().norm()).item()
            assert err <= 1e-2, (combine, err)
            assert torch.allclose(lse, lse_ref, rtol=1e-3, atol=1e-3), combine
            got[combine] = out.float(), lse
        (o_c, l_c), (o_k, l_k) = got["cluster"], got["kernel"]
        # Nope dims: one BF16 step of the kernel's value. Rope dims are rounded, rotated and rounded again: a
        # one-step difference before the rotation moves both of a pair's outputs by up to a step of the pair's
        # larger value.
        nope_c, nope_k = o_c[..., :448], o_k[..., :448]
        assert ((nope_c - nope_k).abs() <= nope_k.abs() * 2.0 ** -7).all(), (nope_c - nope_k).abs().max()
        pair_max = o_k[..., 448:].unflatten(-1, (32, 2)).abs().amax(-1, keepdim=True).expand(-1, -1, -1, 2)
        rope_diff = (o_c[..., 448:] - o_k[..., 448:]).unflatten(-1, (32, 2)).abs()
        assert (rope_diff <= pair_max * 2.0 ** -6).all(), rope_diff.max()
        assert torch.allclose(l_c, l_k, rtol=1e-6, atol=1e-6), (l_c - l_k).abs().max()


@pytest.mark.gpu
def test_cluster_combine_without_splits() -> None:
    """``combine="cluster"`` on a step that does not split (one split per token) is no error: the kernel's own
    output, the bits of ``combine="kernel"``."""
    layer, batch, args, ti, _ = make_case(FLASH, LayerKind.CSA, [9000, 12], [1, 3], "cuda", seed=4)
    got = [step_fwd(layer, batch, args, entry_idx=ti, num_splits=1, impl="gluon", combine=c)
           for c in ("cluster", "kernel")]
    assert torch.equal(got[0][0].view(torch.int16), got[1][0].view(torch.int16))
    assert torch.equal(got[0][1].view(torch.int32), got[1][1].view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("combine", ["auto", "kernel"])
def test_split_combine_graph_replay_bits(combine: str) -> None:
    """Split partials + combine (in clusters, or by the combine kernel) replayed as a CUDA graph give the bits of
    eager launches, over repeated replays with fresh queries written into the captured input; the partials'
    buffers are poisoned (NaN) before each replay, so a merge that read them before every split wrote them would
    differ."""
    layer, batch, args, ti, _ = make_case(FLASH, LayerKind.CSA, [5000, 12, 3000], [1, 3, 1], "cuda", seed=11)
    q = args["q"].clone()
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")

    def run() -> None:
        step_fwd(layer, batch, args, q=q, out=out, lse=lse, entry_idx=ti, num_splits=5, combine=combine)

    run()  # compile and allocate the workspace outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    gen = torch.Generator(device="cuda").manual_seed(5)
    for _ in range(4):
        q.copy_(torch.randn(q.shape, generator=gen, device="cuda", dtype=torch.float32).to(q.dtype))
        run()
        want_o, want_lse = out.clone(), lse.clone()
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        for name in ("sparse_attention.partial_o", "sparse_attention.partial_lse"):  # the buffers the graph holds
            layer.workspace._buffers[name].fill_(0xFF)  # NaN as fp32
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), want_o.view(torch.int16))
        assert torch.equal(lse.view(torch.int32), want_lse.view(torch.int32))


@pytest.mark.gpu
def test_attend_all_invalid_gives_sink_only(variant: dict) -> None:
    """A token whose compressed slots are all −1 and whose ring is empty sees only its own window entry."""
    layer, batch, args, ti, _ = make_case(FLASH, LayerKind.CSA, [400], [1], "cuda", seed=3, invalid_frac=1.0)
    ti = torch.full_like(ti, -1)
    err_o, err_l, _, _ = compare(layer, batch, args, ti, ti, variant)
    assert err_o <= 1e-2 and err_l <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("li", [0, 1, 2], ids=["swa", "csa", "hca"])
def test_layer_triton_backend_matches_torch(li: int) -> None:
    """``dsv4.Attention(backend="triton")`` end to end over several steps (tiny config) vs the torch backend."""
    tiny = dsv4.ModelConfig.preset("tiny")
    w = dsv4.AttentionWeights.random(tiny, li, seed=4)
    outs = {}
    for backend in ("torch", "triton"):
        cache = HybridCache(tiny, layers=[li], max_requests=2, num_blocks=64, block_size=32, device="cuda")
        layer = dsv4.Attention(w, tiny, li, backend=backend)
        cache.add_request("a")
        cache.add_request("b")
        x = torch.randn(200, tiny.hidden_size, generator=torch.Generator().manual_seed(li)).cuda()
        ys, idx, at = [], [], 0
        for plan in ({"a": 37, "b": 5}, {"a": 1, "b": 60}, {"a": 3, "b": 1}, {"a": 1, "b": 1}):
            n = sum(plan.values())
            res = layer.forward_with_aux(x[at : at + n], cache.prepare_forward(plan), cache)
            ys.append(res.y.float())
            idx.append(res.attended_entries())
            at += n
        outs[backend] = (torch.cat(ys), idx)
    y_t, y_x = outs["torch"][0], outs["triton"][0]
    assert torch.isfinite(y_x).all()
    err = ((y_x.double() - y_t.double()).norm() / y_t.double().norm()).item()
    assert err <= 5e-2, err  # other ops may also run Triton kernels (BF16 GEMMs, top-k ties)
    for a, b in zip(*(outs[k][1] for k in ("torch", "triton"))):
        assert a.shape == b.shape
