"""Benchmark of the Triton lightning indexer: scores over paged MXFP4 keys, and the radix top-k, timed separately.

Shapes: Flash indexer (64 heads × 128 dims, k = 512), batch 1/8/64/128 × context 8K/32K/128K/1M, decode (one query
per request) and 4096-token prefill chunks (the chunk that ends at the context length, so queries see ~context/4
entries). Pools are built directly (random MXFP4 bytes, random block tables), not through the cache.

Roofline per row: ``max(bytes / copy bandwidth, FLOPs / FP8 matmul rate)``, both measured in this run
(``dsv4.bench.roofline``). Scores: bytes = keys read once per request (68 B each) + scores written (BF16) +
queries; FLOPs = the FP8 MMA work ``2 · Σ_t visible_t · 64 · 128``. Top-k: bytes = scores read once + indices
written; no FLOPs.

Each launch runs the plan the engine would build for the step (``dsv4.kernels.indexer.plan``). ``--quick`` also times
every top-k algorithm (``TOPK_LAUNCHES``: the plan with its algorithm replaced) at B=8 / 64 / 128 × 128K decode and
B=8 × 32K 4K-prefill, eagerly and as CUDA-graph replays, each checked against torch.topk (``check`` in the JSON
rows); ``--topk-only`` / ``--topk-prefill`` time only those, on decode steps (8K–128K) / on 4K-token prefill chunks
(one request at 8K / 32K / 64K / 128K, eight at 32K), each on the index scores the scores kernel computed for that
step. At the acceptance shape ``--quick`` also times the scores' plan variants ``SCORES_VARIANTS`` (``--no-sweep``:
not; ``ab_scores.py`` times plan variants at more shapes).

Usage: ``python benchmarks/bench_indexer.py [--quick] [--no-sweep] [--topk-only | --topk-prefill] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

import dataclasses

import torch

from dsv4.bench.roofline import environment, measure_copy_bandwidth, measure_matmul_rate, roofline_row, time_cuda
from dsv4.kernels import device
from dsv4.kernels.indexer.scores import index_scores
from dsv4.kernels.indexer.scores_plan import MAX_TILES_PER_SPLIT, ScoresPlan, head_pad, plan_scores
from dsv4.kernels.indexer.topk import radix_topk
from dsv4.kernels.indexer.topk_plan import TopkPlan, plan_topk

REQUIRES_CUDA = True  # dsv4 bench skips this script on other devices (dsv4.bench.suite)

H, C, K_TOP, M, BLOCK = 64, 128, 512, 4, 256
CEILINGS: dict[str, float] = {}  # measured copy bandwidth and FP8 matmul rate of this run
EPP = BLOCK // M  # entries per page


def _setup(batch: int, context: int, tokens: int, fmt: str, seed: int = 0):
    """Random pool + step metadata for ``batch`` requests each at ``context`` tokens after a step of ``tokens``."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    entries = context // M
    blocks_per = -(-context // BLOCK)
    nblocks = batch * blocks_per
    entry_bytes = 68 if fmt == "mxfp4" else 132
    pages = torch.randint(0, 256, (nblocks, EPP * entry_bytes), dtype=torch.uint8, device=dev, generator=g)
    if fmt == "mxfp4":  # UE8M0 scales near 2**0 (realistic after the Hadamard rotation)
        pages[:, EPP * 64:] = torch.randint(124, 129, (nblocks, EPP * 4), dtype=torch.uint8, device=dev, generator=g)
    else:  # E4M3 codes without NaN, fp32 scales ~1/448
        codes = pages[:, : EPP * 128]
        codes[(codes & 0x7F) == 0x7F] = 0
        pages[:, EPP * 128:] = torch.full((nblocks, EPP), 1 / 448, device=dev).view(torch.uint8)
    perm = torch.randperm(nblocks, device=dev, generator=g).to(torch.int32)
    block_tables = perm.view(batch, blocks_per)
    cu = torch.arange(0, batch + 1, device=dev, dtype=torch.int32) * tokens
    pos = (context - tokens + torch.arange(tokens, device=dev)).repeat(batch)
    visible = (pos + 1) // M
    T = batch * tokens
    hp = head_pad(H)
    q = torch.randint(0, 256, (T, 2, hp, 64), dtype=torch.uint8, device=dev, generator=g)
    q[(q & 0x7F) == 0x7F] = 0
    w = torch.randn(T, hp, device=dev, generator=g) * 1e-3
    scores = torch.empty((T, entries), dtype=torch.bfloat16, device=dev)
    return dict(pages=pages, block_tables=block_tables, cu=cu, visible=visible, q=q, w=w, scores=scores,
                entries=entries, T=T, fmt=fmt, entry_bytes=entry_bytes)


def _device_facts(sm90: bool | None = None) -> dict:
    dev = torch.device("cuda")
    return dict(sm_count=device.sm_count(dev), sm90=device.is_sm90(dev) if sm90 is None else sm90)


def scores_plan(s, batch: int, tokens: int, sm90: bool | None = None) -> ScoresPlan:
    """The scores' plan of the step ``s`` (``_setup``) on this GPU (``sm90=False``: the Triton kernel's)."""
    return plan_scores(key_format=s["fmt"], heads=H, requests=batch, max_new=tokens, entries=s["entries"], ratio=M,
                       block_size=BLOCK, entries_per_page=EPP, **_device_facts(sm90))


def scaled_tiles(plan: ScoresPlan, factor: float) -> ScoresPlan:
    """``plan`` with its key tiles per program scaled by ``factor`` (at least 1; at most ``MAX_TILES_PER_SPLIT``
    where the Triton kernel holds a split's pages in registers)."""
    per_split = max(1, round(plan.tiles_per_split * factor))
    if plan.kernel == "triton" and plan.page_vector:
        per_split = min(per_split, MAX_TILES_PER_SPLIT)
    return dataclasses.replace(plan, tiles_per_split=per_split)


def _scores_fn(s, batch: int, tokens: int, plan: ScoresPlan | None = None):
    plan = plan or scores_plan(s, batch, tokens)

    def fn():
        index_scores(s["pages"], s["block_tables"], s["cu"], s["visible"], s["q"], s["w"], s["scores"], plan)
    return fn


def _measure(name, fn, bytes_, flops, bw, rate, iters, graph: bool = False, **extra):
    """Time ``fn`` (median of ``iters``); ``graph``: capture it once in a CUDA graph and time the replays (as the
    engine's decode steps run: no Python launch overhead between a variant's launches)."""
    sec = time_cuda(fn, warmup=max(3, iters // 5), iters=iters, graph=graph)
    row = roofline_row(name, sec, bytes_, flops, bw, rate, graph=graph, **extra)
    print(_table([row], header=False), flush=True)  # progress (long sweeps)
    return row


#: the scores' plan variants timed at the acceptance shape by --quick (without --no-sweep): (label, the plan from
#: the default one)
SCORES_VARIANTS = [
    ("triton", lambda plan, s, batch, tokens: scores_plan(s, batch, tokens, sm90=False)),
    ("tiles/program x2", lambda plan, *_: scaled_tiles(plan, 2)),
    ("tiles/program /2", lambda plan, *_: scaled_tiles(plan, 0.5)),
]

#: top-k launches timed in --quick at every shape: (label, algorithm, the Gluon "bisect" allowed); the labels are
#: those of earlier trees' rows ("split8": 8-bit radix passes, "filter4": 4-bit passes in its rare blocked path)
TOPK_LAUNCHES = [("split8", "split", False), ("filter4", "filter", False), ("bisect", "bisect", True),
                 ("bisect_triton", "bisect", False)]


def topk_plan(scores: torch.Tensor, algorithm: str | None = None, gluon: bool = True) -> TopkPlan:
    """The top-k plan of ``scores`` on this GPU (``algorithm``: instead of the rule's; ``gluon=False``: no Gluon)."""
    facts = _device_facts()
    return plan_topk(scores.shape[0], scores.shape[1], K_TOP, scores.dtype, sm_count=facts["sm_count"],
                     sm90=facts["sm90"] and gluon, algorithm=algorithm)


def _topk_variants(s, tag, tk_bytes, bw, rate, iters, common) -> list[dict]:
    """Every ``TOPK_LAUNCHES`` entry on the scores of ``s``: checked against torch.topk (values, once), then timed
    eagerly and as a CUDA-graph replay."""
    sc, vis = s["scores"], s["visible"]
    out = torch.empty((sc.shape[0], K_TOP), dtype=torch.int64, device=sc.device)
    ke = vis.clamp(max=K_TOP)
    ref = None
    rows = []
    for label, algorithm, gluon in TOPK_LAUNCHES:
        plan = topk_plan(sc, algorithm, gluon)
        scratch = {name: torch.zeros(shape, dtype=torch.int32, device=sc.device)
                   for name, (shape, _) in plan.scratch().items()}

        def fn(plan=plan, scratch=scratch):
            radix_topk(sc, vis, plan, out=out, **scratch)
        kw = plan.describe()
        try:
            fn()
            # check: same multiset of values as torch.topk over each row's visible prefix (rows of equal length)
            if ref is None:
                masked = torch.where(torch.arange(sc.shape[1], device=sc.device)[None, :] < vis[:, None],
                                     sc.float(), float("-inf"))
                ref = masked.topk(K_TOP, dim=-1).values
            slot = torch.arange(K_TOP, device=sc.device)[None, :] < ke[:, None]
            got = torch.where(slot, sc.float().gather(1, out.clamp(min=0)), float("-inf"))
            ok = bool(torch.equal(got.sort(dim=-1, descending=True).values, ref)
                      and ((out >= 0) == slot).all() and (out < vis[:, None]).all())
            for graph in (False, True):
                rows.append(_measure(f"topk k=512 {tag} [{label}{' graph' if graph else ''}]", fn, tk_bytes, 0, bw,
                                     rate, iters, graph=graph, op="topk-variant", variant=label, options=kw, check=ok,
                                     **common))
            if not ok:
                print(f"topk variant {label}: WRONG RESULT at {tag}", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
            print(f"topk variant {label} at {tag}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
            rows.append(dict(name=f"topk k=512 {tag} [{label}]", op="topk-variant", variant=label, options=kw,
                             error=f"{type(e).__name__}: {str(e)[:300]}", **common))
    return rows


def run(quick: bool = False, sweep: bool | None = None, rows: list[dict] | None = None,
        topk_only: bool = False, topk_prefill: bool = False, contexts: list[int] | None = None) -> list[dict]:
    """Measure; returns the rows (see ``roofline_row``). ``quick``: the acceptance shape (batch 64 × 128K decode,
    with a small config sweep of the scores kernel), batch 8 and 128 decode at 128K, and 4K prefill chunks (8 × 32K,
    1 × 128K). ``topk_only``: every ``TOPK_LAUNCHES`` entry on decode steps of 8 / 64 / 128 requests at 8K / 32K /
    64K / 128K context (``contexts``: these instead), nothing else; ``topk_prefill``: the same on 4K-token prefill
    chunks (one request at 8K / 32K / 64K / 128K, eight at 32K), each on the index scores the scores kernel computed
    for that chunk."""
    bw = measure_copy_bandwidth()
    rate = measure_matmul_rate(dtype=torch.float8_e4m3fn)
    rows = [] if rows is None else rows  # a caller's list keeps the rows measured so far if the run is cut short
    CEILINGS.update(copy_bw_GBps=bw / 1e9, fp8_mm_TFLOPs=rate / 1e12)
    if topk_prefill:
        shapes = [(1, 8192, 4096), (1, 32768, 4096), (1, 65536, 4096), (1, 131072, 4096), (8, 32768, 4096)]
    elif topk_only:
        shapes = [(b, c, 1) for c in (contexts or (131072, 65536, 32768, 8192)) for b in (64, 8, 128)]
    elif quick:
        shapes = [(64, 131072, 1), (8, 131072, 1), (128, 131072, 1), (8, 32768, 4096), (1, 131072, 4096)]
    else:
        shapes = [(b, c, t) for t in (1, 4096) for c in (8192, 32768, 131072, 1 << 20) for b in (1, 8, 64, 128)]
    free = torch.cuda.mem_get_info()[0]
    for batch, context, tokens in shapes:
        T = batch * tokens
        entries = context // M
        mem = T * entries * 2 + batch * (context // BLOCK) * EPP * 132
        vis_sum = batch * sum((p + 1) // M for p in range(context - tokens, context))
        flops = 2.0 * vis_sum * H * C
        mode = "decode" if tokens == 1 else f"prefill{tokens}"
        tag = f"B={batch} ctx={context // 1024}K {mode}"
        if mem > 0.6 * free:
            print(f"skip {tag}: needs {mem / 2**30:.1f} GiB", file=sys.stderr)
            continue
        if flops > 3e14:
            print(f"skip {tag}: {flops / 1e12:.0f} TFLOP per call (too long for this run)", file=sys.stderr)
            continue
        iters = 30 if flops < 1e12 else (10 if flops < 2e13 else 4)
        s = _setup(batch, context, tokens, "mxfp4")
        key_bytes = batch * entries * 68
        sc_bytes = key_bytes + vis_sum * 2 + T * (2 * 64 * 64 + 64 * 4)
        common = dict(batch=batch, context=context, tokens=tokens, entries=entries)
        # decode steps run as CUDA-graph replays in the engine: time them so (prefill chunks: eager, launch-bound never)
        graph = tokens == 1
        if topk_only or topk_prefill:
            _scores_fn(s, batch, tokens)()  # the top-k reads real index scores
            rows += _topk_variants(s, tag, vis_sum * 2 + T * K_TOP * 8, bw, rate, 30, common)
            del s
            continue
        rows.append(_measure(f"scores mxfp4 {tag}{' graph' if graph else ''}", _scores_fn(s, batch, tokens), sc_bytes,
                             flops, bw, rate, iters, graph=graph, op="scores", fmt="mxfp4", **common))
        tk_bytes = vis_sum * 2 + T * K_TOP * 8
        plan = topk_plan(s["scores"])  # the step's plan; its scratch allocated per call, as in earlier trees' rows
        rows.append(_measure(f"topk k=512 {tag}{' graph' if graph else ''}",
                             lambda plan=plan: radix_topk(s["scores"], s["visible"], plan), tk_bytes, 0, bw, rate,
                             iters, graph=graph, op="topk", plan=plan.describe(), **common))
        if quick and batch > 1:
            rows += _topk_variants(s, tag, tk_bytes, bw, rate, max(iters, 20), common)
        if quick and tokens == 1 and batch == 64:
            # at the acceptance shape: the default config as CUDA-graph replays, then the config sweep
            rows.append(_measure(f"scores mxfp4 {tag} [default graph]", _scores_fn(s, batch, tokens), sc_bytes, flops,
                                 bw, rate, iters, graph=True, op="scores", fmt="mxfp4", **common))
            do_sweep = True if sweep is None else sweep
            if do_sweep:
                default = scores_plan(s, batch, tokens)
                for label, make in SCORES_VARIANTS:
                    plan = make(default, s, batch, tokens)
                    try:
                        rows.append(_measure(f"scores mxfp4 {tag} [{label}]", _scores_fn(s, batch, tokens, plan),
                                             sc_bytes, flops, bw, rate, iters, op="scores-variant", fmt="mxfp4",
                                             plan=plan.describe(), **common))
                    except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
                        print(f"variant {label}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
            sc = s["scores"]
            sc.normal_()
            rows.append(_measure(f"torch.topk k=512 {tag}", lambda: sc.topk(K_TOP, dim=-1), tk_bytes, 0, bw, rate,
                                 iters, op="torch-topk", **common))
            del s
            s8 = _setup(batch, context, tokens, "fp8")
            fb = batch * entries * 132 + vis_sum * 2 + T * (2 * 64 * 64 + 64 * 4)
            rows.append(_measure(f"scores fp8-132B {tag}", _scores_fn(s8, batch, tokens), fb, flops, bw, rate, iters,
                                 op="scores", fmt="fp8", **common))
            del s8
        else:
            del s
        torch.cuda.empty_cache()
    for r in rows:
        r["copy_bw_GBps"] = bw / 1e9
        r["fp8_mm_TFLOPs"] = rate / 1e12
    return rows


def _table(rows: list[dict], header: bool = True) -> str:
    out = [f"{'name':58s} {'us':>10s} {'MB':>9s} {'TFLOP':>8s} {'roof_us':>9s} {'%roof':>6s}"] if header else []
    for r in rows:
        if "us" not in r:
            out.append(f"{r['name']:58s} {r.get('error', '?')[:80]}")
            continue
        out.append(f"{r['name']:58s} {r['us']:10.1f} {r['bytes'] / 1e6:9.1f} {r['flops'] / 1e12:8.3f} "
                   f"{r['roofline_us']:9.1f} {100 * r['roofline_frac']:6.1f}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="acceptance shapes only")
    ap.add_argument("--no-sweep", action="store_true", help="skip the config variants in --quick")
    ap.add_argument("--topk-only", action="store_true", help="only the top-k launches, decode steps (8K–128K)")
    ap.add_argument("--contexts", type=lambda v: [int(c) for c in v.split(",")],
                    help="--topk-only: these contexts (tokens, comma-separated) instead of 8K-128K")
    ap.add_argument("--topk-prefill", action="store_true",
                    help="only the top-k launches, 4K-token prefill chunks (8K–128K)")
    ap.add_argument("--json", help="write rows + environment here")
    args = ap.parse_args()
    rows: list[dict] = []
    complete = False
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # `timeout`: still write what was measured
    try:
        run(quick=args.quick, sweep=not args.no_sweep, rows=rows, topk_only=args.topk_only,
            topk_prefill=args.topk_prefill, contexts=args.contexts)
        complete = True
    finally:
        env = environment()
        if CEILINGS:
            print(f"device: {env['device']}  torch {env['torch']}  triton {env['triton']}  "
                  f"copy {CEILINGS['copy_bw_GBps']:.0f} GB/s  fp8 mm {CEILINGS['fp8_mm_TFLOPs']:.0f} TFLOP/s")
        print(_table(rows) + ("" if complete else "\n(run cut short)"))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"environment": env, "ceilings": CEILINGS, "complete": complete, "rows": rows}, f, indent=1,
                          default=str)


if __name__ == "__main__":
    main()
