"""Benchmark of the Triton write path (issue 4): window entries + compressors (one launch) and the ring commit.

Shapes: V4-Flash and V4-Pro layers (SWA, CSA, HCA); decode steps at batch 1 / 64 / 256 where every request
closes a window (the heaviest decode step), and one 8K-token prefill chunk. For each: the µs of the Triton
kernels alone (projection GEMMs done beforehand), the minimum bytes they must move, and the fraction of the
copy bandwidth measured in the same run; plus the whole op time (GEMMs included) and the torch backend's, and
the number of Triton launches of a step (counted with the profiler). Prefill rows also time one device copy of
the same bytes the same way (``copy same bytes``): the floor at that size, launch and ramp included. And the
queries' per-head RMSNorm + RoPE (``ops.queries``, one launch) against the torch backend's kernels for it.

    python benchmarks/bench_write.py [--quick] [--json out.json]

``run(quick=False) -> list[dict]`` is what ``dsv4 bench`` calls.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

import dsv4
from dsv4.bench.roofline import environment, measure_copy_bandwidth, roofline_row, time_cuda
from dsv4.cache import HybridCache
from dsv4.layer import Attention
from dsv4.ops import projections, torch_ops, triton_ops

REQUIRES_CUDA = True  # dsv4 bench skips this script on other devices (dsv4.bench.suite)

LAYERS = {"v4-flash": {"swa": 0, "csa": 2, "hca": 3}, "v4-pro": {"csa": 2, "hca": 3}}


def _setup(cfg, li, plan_start: dict[str, int], plan: dict[str, int]):
    B = len(plan)
    max_tok = max(plan_start.get(r, 0) + n for r, n in plan.items())
    nb = B * (max_tok // 256 + 2) + 8
    cache = HybridCache(cfg, layers=[li], max_requests=B, num_blocks=nb, block_size=256, device="cuda")
    for r in plan:
        cache.add_request(r)
        if plan_start.get(r):
            cache.prepare_forward({r: plan_start[r]})  # advance positions only (contents don't matter for timing)
    return cache, cache.prepare_forward(plan)


def _bytes(cfg, kind, batch, m) -> float:
    T, B = batch.num_tokens, batch.num_requests
    total = T * 512 * 2 * 2  # window: read kv, write kv_new
    kept = batch.ring_rows.shape[0]
    total += kept * (1024 + 584 + 4)  # append: read kv_new, write entry + position
    if kind == "swa":
        return total
    comps = [(1024 if kind == "csa" else 512, 584)] + ([(256, 68)] if kind == "csa" else [])
    E = batch.num_emit[m]
    for width, entry in comps:
        total += T * width * 8  # read a and z_raw
        total += E * entry  # pool writes
        # tail rows read by the closing windows (positions before the step) and open-window rows written
        old = sum(min(s % m, n) if (s + n) // m > s // m else 0 for s, n in zip(batch.start_positions, batch.num_new))
        new = sum((s + n) - max(s, ((s + n) // m) * m) for s, n in zip(batch.start_positions, batch.num_new))
        total += (old + new) * width * 8
        if kind == "csa":
            total += B * m * width // 2 * 8 * 2  # previous-window state read + rewritten
    return total


def _count_launches(fn) -> tuple[int, int]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    triton_k = [n for n in names if n.startswith(("write_before", "csa_entries", "_append_swa", "_window_entries"))]
    return len(triton_k), len(names)


def _query_rows(preset: str, cfg, bw: float, quick: bool, only: str | None, flush: str) -> list[dict]:
    """The queries' per-head RMSNorm + RoPE (``ops.queries``): the Triton launch vs the torch backend's kernels,
    decode B = 1 / 64 / 256 and an 8K prefill chunk (CUDA-graph replays, L2 flushed)."""
    from dsv4.kernels.project.queries import queries
    from dsv4.reference.primitives import rms_norm
    from dsv4.reference.rope import apply_rope
    from dsv4.reference.rope import rope_inv_freq

    rows = []
    inv = rope_inv_freq(cfg, dsv4.LayerKind.SWA, device="cuda")
    for T in (1, 64, 256, 8192):
        name = f"{preset} queries {'prefill 8K' if T == 8192 else f'decode B={T}'}"
        if only and only not in name:
            continue
        q = torch.randn(T, cfg.num_heads, cfg.head_dim, device="cuda").bfloat16()
        pos = torch.randint(0, 1 << 17, (T,), device="cuda")
        out = torch.empty_like(q)
        iters = 20 if quick else 50
        t_k = time_cuda(lambda: queries(q, pos, inv, cfg.norm_eps, out=out), warmup=3, iters=iters, flush_l2=flush,
                        graph=True)
        t_torch = time_cuda(lambda: apply_rope(rms_norm(q, None, cfg.norm_eps), pos, inv), warmup=3, iters=iters,
                            flush_l2=flush, graph=True)
        nbytes = 2 * q.numel() * 2 + T * 8
        row = roofline_row(name, t_k, bytes=nbytes, flops=0.0, copy_bw=bw, mm_rate=math.nan, preset=preset,
                           kind="queries", scenario=name.split("queries ")[1], torch_graph_us=t_torch * 1e6,
                           triton_launches=1, copy_gbps=bw / 1e9, l2_flush=flush)
        rows.append(row)
        print(f"{name:<34} {row['us']:9.1f} us {nbytes / 1e6:9.2f} MB {row['gbps']:8.0f} GB/s "
              f"{100 * row['roofline_frac']:6.1f}% | torch backend (graph) {t_torch * 1e6:8.1f} us", flush=True)
    return rows


def run(quick: bool = False, only: str | None = None, profile_calls: int = 0, flush: str = "zero") -> list[dict]:
    """Time every case (``quick``: fewer repetitions). ``only``: just the cases whose name contains it;
    ``profile_calls``: no timing, call the kernels that many times (a target for ``ncu``); ``flush``: how L2 is
    flushed before each timed call (``time_cuda``'s ``flush_l2``: ``"zero"``, the default, or ``"read"``)."""
    bw = measure_copy_bandwidth("cuda")
    rows = []
    presets = ["v4-flash", "v4-pro"]
    for preset in presets:
        cfg = dsv4.ModelConfig.preset(preset)
        if not profile_calls:
            rows += _query_rows(preset, cfg, bw, quick, only, flush)
        for kind, li in LAYERS[preset].items():
            w = dsv4.AttentionWeights.random(cfg, li, seed=0, device="cuda")
            lay = Attention(w, cfg, li, backend="triton")
            m = cfg.ratio(li) or 1
            mm = max(m, 4)
            scen = [(f"decode B={b}", {f"r{i}": mm * 4 - 1 + mm * (i % 3) for i in range(b)}, {f"r{i}": 1 for i in range(b)})
                    for b in (1, 64, 256)]
            scen.append(("prefill 8K", {}, {"r0": 8192}))
            for name, start, plan in scen:
                if only and only not in f"{preset} {kind} {name}":
                    continue
                cache, batch = _setup(cfg, li, start, plan)
                step = lay.layer_step(batch, cache, triton_ops.plan_step(batch, cache))
                torch_step = lay.layer_step(batch, cache, torch_ops.plan_step(batch, cache))
                layer, inv, wp = step.cache, step.inv_freq, step.plan.write
                x = torch.randn(batch.num_tokens, cfg.hidden_size, device="cuda").bfloat16()
                kv_in = torch_ops.window_kv(step, x)

                def op(ops=triton_ops):
                    s = step if ops is triton_ops else torch_step
                    kv = ops.new_entries(s, x, kv_in)
                    ops.append_swa(s, kv)

                from dsv4.kernels.write import window
                from dsv4.kernels.write.launch import CompressorArgs, write_before_attention

                if kind == "swa":
                    kernels = lambda: window.append_swa(  # noqa: E731
                        window.window_entries(kv_in, batch.positions, inv), layer.ring, layer.ring_positions,
                        batch.token_slots, batch.ring_slots, batch.ring_rows, batch.positions, batch.window)
                else:
                    wd = step.weights
                    comps = [(wd.compressor, "")] + ([(wd.indexer.compressor, "index_")] if kind == "csa" else [])
                    # the layer's projections (one stacked GEMM: column views), computed once, outside the timing
                    projected = projections.layer_compressor_projections(step, x)
                    args = [CompressorArgs(
                        *az, cw.ape.contiguous(), cw.norm.contiguous(),
                        layer.state[f"{pre}tail_kv"], layer.state[f"{pre}tail_gate"], layer.state.get(f"{pre}prev_kv"),
                        layer.state.get(f"{pre}prev_gate"), layer.index_pages if pre else layer.kv_pages)
                        for (cw, pre), az in zip(comps, projected)]
                    scratch = torch.empty((wp.scratch_rows, 512), dtype=torch.float32, device="cuda")
                    arrivals = torch.zeros(wp.scratch_rows, dtype=torch.int32, device="cuda")

                    def kernels():
                        kv = write_before_attention(wp, kv_in, batch.positions, inv, batch, cfg.norm_eps, args[0],
                                                    args[1] if len(args) > 1 else None, scratch, arrivals)
                        window.append_swa(kv, layer.ring, layer.ring_positions, batch.token_slots,
                                          batch.ring_slots, batch.ring_rows, batch.positions, batch.window)

                if profile_calls:
                    for _ in range(profile_calls):
                        kernels()
                    torch.cuda.synchronize()
                    print(f"{preset} {kind} {name}: {profile_calls} calls", flush=True)
                    continue
                # kernels' GPU time: CUDA-graph replays, L2 flushed before each (eager: Python launches included)
                t_k = time_cuda(kernels, warmup=3, iters=20 if quick else 50, flush_l2=flush, graph=True)
                extra = {}
                nbytes = _bytes(cfg, kind, batch, m)
                if "prefill" in name:
                    # the floor at this size: one device copy moving the same bytes, timed the same way
                    src = torch.empty(int(nbytes) // 2, dtype=torch.uint8, device="cuda")
                    dst = torch.empty_like(src)
                    extra["us_copy_same_bytes"] = 1e6 * time_cuda(lambda: dst.copy_(src), warmup=3,
                                                                  iters=20 if quick else 50, flush_l2=flush, graph=True)
                    del src, dst
                t_k_eager = time_cuda(kernels, warmup=1, iters=10 if quick else 30, flush_l2=flush)
                t_op = time_cuda(op, warmup=2, iters=10 if quick else 30)
                t_torch = time_cuda(lambda: op(torch_ops), warmup=0 if quick else 1, iters=1 if quick else 10)
                n_tri, n_all = _count_launches(op)
                row = roofline_row(f"{preset} {kind} {name}", t_k, bytes=nbytes, flops=0.0, copy_bw=bw,
                                   mm_rate=math.nan, preset=preset, kind=kind, scenario=name,
                                   op_us=t_op * 1e6, kernels_eager_us=t_k_eager * 1e6, torch_us=t_torch * 1e6, triton_launches=n_tri,
                                   all_launches=n_all, emitted=batch.num_emit.get(m, 0), copy_gbps=bw / 1e9, l2_flush=flush, **extra)
                rows.append(row)
                print(f"{row['name']:<34} {row['us']:9.1f} us {nbytes / 1e6:9.2f} MB {row['gbps']:8.0f} GB/s "
                      f"{100 * row['roofline_frac']:6.1f}% (eager {t_k_eager * 1e6:7.1f} us) | op {t_op * 1e6:8.1f} us torch {t_torch * 1e6:9.1f} us "
                      f"| launches triton {n_tri} all {n_all}"
                      + "".join(f" | {k[3:].replace('_', ' ')} {v:.1f} us" for k, v in extra.items()),
                      flush=True)
                del cache
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the acceptance shapes only, fewer repetitions")
    ap.add_argument("--json", help="write the rows (and the environment) here")
    ap.add_argument("--only", help="run only the cases whose name contains this, e.g. 'v4-flash hca decode B=1'")
    ap.add_argument("--profile-calls", type=int, default=0, help="no timing: call the kernels N times (for ncu)")
    ap.add_argument("--flush", choices=["zero", "read"], default="zero",
                    help="L2 flush before each timed call: overwrite a 256 MiB buffer (default; leaves dirty lines the "
                         "kernels write back) or read it (clean lines)")
    a = ap.parse_args()
    if a.profile_calls:
        run(only=a.only, profile_calls=a.profile_calls)
        return
    env = environment("cuda")
    print(f"device: {env.get('device')}  copy bandwidth measured: {measure_copy_bandwidth('cuda') / 1e9:.0f} GB/s")
    print(f"{'shape':<34} {'kernels':>12} {'bytes':>12} {'achieved':>13} {'%copy':>7} | whole op (GEMMs incl.), torch backend | launches per step")
    rows = run(a.quick, only=a.only, flush=a.flush)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
