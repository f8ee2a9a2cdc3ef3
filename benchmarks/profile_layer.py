"""One whole layer step of each kind against its roofline: time (CUDA-graph replays and eager), launches, and the
kernels that take the time.

One ``--preset`` layer of each kind (random weights as the checkpoints hold them: FP8 projections, BF16
compressors), a cache with ``--batch`` requests advanced to ``--context`` tokens (positions only: the pages hold
garbage, which does not change the kernels' work), then one decode step (``--prefill N``: one chunk of N tokens
per request). The step is timed as the user runs it — ``Attention.forward`` with the step's plan — replayed from a
CUDA graph and called eagerly (the host's work included), and profiled once for its kernels.

Roofline of a layer step: the longer of two times, each with its device rate measured in the same run —

* the bytes it must move (its weights once, as stored: FP8 projections, BF16 matrices; plus the cache bytes the
  step reads: each token's window, its CSA top-k entries and every indexer key it scores, HCA's visible entries)
  at the copy bandwidth: what bounds a decode step;
* its FLOPs (``dsv4.bench.e2e.layer_step_flops``) at the rates the official inference runs them: the FP8
  projections and CSA's index scores at the FP8 GEMM rate, the BF16 matrices and attention at the BF16 GEMM rate
  (``measure_matmul_rate``): what bounds a prefill chunk.

    python benchmarks/profile_layer.py [--preset v4-flash] [--batch 64 4] [--context 8192] [--side-stream on|off]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch
import triton

import dsv4
from dsv4.bench.kernel_profile import device_events, kernel_totals, torch_sync_sites
from dsv4.bench.e2e import layer_step_flops
from dsv4.bench.roofline import environment, measure_copy_bandwidth, measure_matmul_rate, time_cuda
from dsv4.cache import HybridCache
from dsv4.config import LayerKind
from dsv4.formats.block_fp8 import BlockFp8Weight
from dsv4.formats.layouts import KV_ENTRY_BYTES, MXFP4_KEY_BYTES
from dsv4.kernels.project import plan as projection_plan

REQUIRES_CUDA = True


def weight_bytes(w: dsv4.AttentionWeights) -> int:
    """Bytes of a layer's device weights as a step reads them (``BlockFp8Weight``: values + scales)."""
    return sum(v.nbytes if isinstance(v, BlockFp8Weight) else v.numel() * v.element_size()
               for _, v in w.named_parameters())


def cache_bytes(cfg: dsv4.ModelConfig, kind: LayerKind, batch: int, context: int, new: int) -> int:
    """The cache bytes one step reads: per token its window (ring entries), CSA its top-k entries and every indexer
    key it scores, HCA its visible entries."""
    tokens = batch * new
    per_token = min(context + new, cfg.window) * KV_ENTRY_BYTES
    m = cfg.csa_ratio if kind is LayerKind.CSA else cfg.hca_ratio
    visible = (context + new) // m
    if kind is LayerKind.CSA:
        per_token += min(cfg.index_topk, visible) * KV_ENTRY_BYTES
        keys = batch * visible * MXFP4_KEY_BYTES  # scored once per request's step (decode: one query each)
        return tokens * per_token + keys * (new if new == 1 else 1)
    if kind is LayerKind.HCA:
        per_token += visible * KV_ENTRY_BYTES
    return tokens * per_token


def host_profile(run, calls: int = 20, top: int = 15) -> dict:
    """Where an eager call spends its host time: cProfile of ``calls`` calls (the ``top`` functions by own time) and
    every host-device synchronisation it makes (``dsv4.bench.kernel_profile.torch_sync_sites``: the lines that made
    it)."""
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        run()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(top)
    return {"cprofile": buf.getvalue(), "syncs_per_call": dict(torch_sync_sites(run))}


@triton.jit
def _empty_kernel(x_ptr, n):
    pass


def host_launch_costs(calls: int = 2000) -> dict[str, float]:
    """Host µs per call of the building blocks of an eager step, on this machine: a Triton launch of a 2-argument
    kernel (``kernel[grid](...)``), the same compiled kernel launched through its own launcher (what Triton's
    ``JITFunction.run`` calls after binding and specializing the arguments: the floor of a launch from Python), a
    cuBLAS BF16 GEMM of one row, a ``torch.empty``, an elementwise torch op."""
    x = torch.zeros(64, device="cuda", dtype=torch.bfloat16)
    a, b = torch.zeros(1, 256, device="cuda", dtype=torch.bfloat16), torch.zeros(256, 256, device="cuda",
                                                                                 dtype=torch.bfloat16)
    compiled = _empty_kernel[(1,)](x, 64)
    stream = torch.cuda.current_stream().cuda_stream

    def direct() -> None:  # Triton 3.x's CompiledKernel.run signature (the launcher JITFunction.run calls)
        compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, x, 64)

    ops = {"triton_launch": lambda: _empty_kernel[(1,)](x, 64), "triton_compiled_run": direct,
           "torch_mm": lambda: torch.mm(a, b), "torch_empty": lambda: torch.empty(64, device="cuda"),
           "torch_add": lambda: x.add(1)}
    out = {}
    for name, fn in ops.items():
        try:
            for _ in range(50):
                fn()
        except Exception:  # noqa: BLE001 - another Triton's launcher signature: that row is not measured
            out[name] = float("nan")
            continue
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out[name] = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
    return out


def profile_kind(cfg: dsv4.ModelConfig, li: int, batch: int, context: int, prefill: int, rates: dict[str, float],
                 host: int = 0, streams: bool = True) -> dict:
    """Time, launches and roofline of one step of layer ``li`` (``streams``: the plan may put two stages on a second
    stream, ``Attention.plan_step``)."""
    kind = cfg.layer_kind(li)
    w = dsv4.AttentionWeights.random(cfg, li, seed=0, device="cuda")
    layer = dsv4.Attention(w, cfg, li, backend="triton", check_inputs=False, nan_policy="off")
    new = max(prefill, 1)
    blocks = batch * ((context + 2 * new) // 256 + 2) + 8
    cache = HybridCache(cfg, layers=[li], max_requests=batch, num_blocks=blocks, block_size=256, device="cuda")
    for r in range(batch):
        cache.add_request(f"r{r}")
    if context:
        cache.claim_step(cache.prepare_forward({f"r{r}": context for r in range(batch)}))  # positions only
    step = cache.repeatable(cache.prepare_forward({f"r{r}": new for r in range(batch)}))
    x = torch.randn(batch * new, cfg.hidden_size, device="cuda").bfloat16()
    plan = layer.plan_step(step, cache, streams=streams)

    def run() -> None:
        layer(x, step, cache, plan)

    t_graph = time_cuda(run, warmup=3, iters=30, graph=True)
    t_eager = time_cuda(run, warmup=3, iters=30)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = kernel_totals(device_events(prof))
    launches = sum(n for _, n, _ in kernels)
    nbytes = weight_bytes(layer._weights_on(cache.device, cache.numerics)[0]) + cache_bytes(cfg, kind, batch,
                                                                                          context, new)
    fp8, bf16 = layer_step_flops(cfg, li, batch, context, new)
    t_bytes = nbytes / rates["copy"]
    t_flops = fp8 / rates["fp8"] + bf16 / rates["bf16"]
    floor = max(t_bytes, t_flops)
    extra = host_profile(run, top=host) if host else {}
    return {**extra, "layer": li, "kind": kind.name, "batch": batch, "context": context, "new_tokens": new,
            "graph_us": t_graph * 1e6, "eager_us": t_eager * 1e6, "eager_over_graph": t_eager / t_graph,
            "launches": launches, "bytes": nbytes, "fp8_flops": fp8, "bf16_flops": bf16, "bytes_us": t_bytes * 1e6,
            "flops_us": t_flops * 1e6, "roofline_us": floor * 1e6, "roofline_frac": floor / t_graph,
            "plan": plan.describe(), "kernels": [{"name": k, "calls": n, "us": us} for k, n, us in kernels]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="v4-flash", help="model preset")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 4], help="requests per step (one row each)")
    ap.add_argument("--context", type=int, default=8192, help="tokens each request holds before the step")
    ap.add_argument("--prefill", type=int, default=0, help="a prefill chunk of this many tokens per request")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per layer kind (0: none)")
    ap.add_argument("--side-stream", default="on", choices=("on", "off"),
                    help="each layer's writes and ring commit on a second CUDA stream (the engine's default) or not")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="also print the N functions that take an eager call's host time, and its host syncs")
    ap.add_argument("--triton-gemm-min-values", type=int, metavar="N",
                    help="explore the projection rule: decode steps run the Triton block GEMM over FP8 weights of "
                         f"at least N values (default {projection_plan.TRITON_MIN_VALUES}: wq_b, wo_b only)")
    ap.add_argument("--json", help="write the rows (and the environment) here")
    a = ap.parse_args()
    if a.triton_gemm_min_values is not None:
        projection_plan.TRITON_MIN_VALUES = a.triton_gemm_min_values
        print(f"projection rule explored: Triton block GEMM for weights of >= {a.triton_gemm_min_values} values")
    cfg = dsv4.ModelConfig.preset(a.preset)
    kinds: dict[LayerKind, int] = {}
    for li in range(cfg.num_layers):
        kinds.setdefault(cfg.layer_kind(li), li)
    rates = {"copy": measure_copy_bandwidth("cuda"), "bf16": measure_matmul_rate("cuda", torch.bfloat16),
             "fp8": measure_matmul_rate("cuda", torch.float8_e4m3fn)}
    if not rates["fp8"] > 0:  # no FP8 GEMM here: count those FLOPs at the BF16 rate
        rates["fp8"] = rates["bf16"]
    what = f"prefill chunk of {a.prefill} tokens" if a.prefill else "decode step"
    print(f"{torch.cuda.get_device_name()}  {a.preset} {what}, context {a.context}; copy bandwidth "
          f"{rates['copy'] / 1e12:.2f} TB/s, GEMM BF16 {rates['bf16'] / 1e12:.0f} / FP8 "
          f"{rates['fp8'] / 1e12:.0f} TFLOP/s")
    costs = host_launch_costs()
    print("host us per call: " + ", ".join(f"{k} {v:.1f}" for k, v in costs.items()))
    print(f"{'layer':<10}{'B':>5}{'graph us':>10}{'eager us':>10}{'eager/gr':>9}{'launches':>9}{'MB':>8}"
          f"{'GFLOP':>8}{'bytes us':>9}{'flops us':>9}{'roof %':>8}")
    rows = []
    for b in a.batch:
        for kind, li in kinds.items():
            r = profile_kind(cfg, li, b, a.context, a.prefill, rates, a.host_profile, a.side_stream == "on")
            rows.append(r)
            print(f"{kind.name + ' ' + str(li):<10}{b:>5}{r['graph_us']:>10.1f}{r['eager_us']:>10.1f}"
                  f"{r['eager_over_graph']:>9.2f}{r['launches']:>9}{r['bytes'] / 1e6:>8.1f}"
                  f"{(r['fp8_flops'] + r['bf16_flops']) / 1e9:>8.1f}{r['bytes_us']:>9.1f}{r['flops_us']:>9.1f}"
                  f"{100 * r['roofline_frac']:>7.1f}%", flush=True)
            for k in r["kernels"][: a.top]:
                print(f"      {k['us']:8.1f} us {k['calls']:3d}x  {k['name']}")
            if a.host_profile:
                print(f"      host syncs per eager call: {r['syncs_per_call'] or 'none'}")
                print(r["cprofile"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"environment": environment("cuda"), "copy_bw": rates["copy"], "gemm_rates": rates,
                       "host_us_per_call": costs, "rows": rows},
                      f, indent=1, default=str)


if __name__ == "__main__":
    main()
