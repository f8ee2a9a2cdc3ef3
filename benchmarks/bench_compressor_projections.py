"""The compressors' projections of one CSA and one HCA layer (``--preset``) at decode and prefill row counts, each
GEMM way, against the roofline.

Ways: ``separate`` — one ``torch.mm(x, Wᵀ, out_dtype=float32)`` per matrix (CSA 5 with the indexer's
``weights_proj``, HCA 2: the path before the matrices were stacked, and still the path of weights without a stack);
``per-comp`` — one GEMM per compressor over its ``[W_kv; W_gate]`` and one for ``weights_proj`` (CSA only: 3);
``stacked`` — one GEMM over every compressor's matrices and, CSA, ``weights_proj``
(``ops.projections.stacked_compressor_projections`` over ``dsv4.compressor_stack``: what a layer runs on CUDA with
BF16 activations). The column ``vs sep`` is the largest difference from ``separate``'s outputs relative to their
largest magnitude (the FP32 sums in another order: ~1e-7).

Times: the median of CUDA-graph replays (the GPU time, as the engine's decode steps run), L2 flushed before each
(``--flush``: the weights come from HBM, as in a model whose other layers evict them); ``eager`` adds the Python
launch overhead. Roofline (``dsv4.bench.roofline``): the bytes a GEMM must move — the BF16 weights read once, x read,
the FP32 outputs written — at the copy bandwidth measured in the same run, or its FLOPs at the BF16 matmul rate
measured in the same run, whichever is longer; ``w floor`` is the weights' bytes alone at the copy bandwidth.
``--kernels`` lists the CUDA kernels each way launches (torch.profiler), e.g. to see cuBLAS's split-K reductions.

    python benchmarks/bench_compressor_projections.py [--preset v4-flash] [--rows 1 4 64 256 8192] [--kernels]
        [--flush read|zero|none] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
from typing import Any, Callable

import torch

import dsv4
from dsv4.bench.roofline import environment, measure_copy_bandwidth, measure_matmul_rate, roofline_row, time_cuda
from dsv4.compressor_stack import compressor_stack, compressors, head_rows, stack_compressor_weights
from dsv4.ops.projections import stacked_compressor_projections

REQUIRES_CUDA = True
ROWS = (1, 4, 64, 256, 8192)
KINDS = ("CSA", "HCA")


def stacked_layer_weights(cfg: dsv4.ModelConfig, kind: str) -> tuple[int, dsv4.AttentionWeights]:
    """The first layer of ``kind`` and its random weights as a layer computes with them under the official numerics
    (compressor matrices BF16, stacked)."""
    li = next(i for i in range(cfg.num_layers) if cfg.layer_kind(i).name == kind)
    w = dsv4.AttentionWeights.random(cfg, li, seed=0, device="cuda").for_numerics(dsv4.Numerics.official())
    return li, stack_compressor_weights(w)


def ways(w: dsv4.AttentionWeights) -> dict[str, tuple[int, Callable[[torch.Tensor], list[torch.Tensor]]]]:
    """Each way's GEMM count and its call ``x -> [outputs]`` over the stacked weights ``w`` (CSA: the indexer's
    ``weights_proj`` is the stack's last block, a GEMM of its own in the other ways)."""
    stack = compressor_stack(w)
    widths = [c.wkv.shape[0] for c in compressors(w)]
    rows = head_rows(w)
    heads = [w.indexer.weights_proj] if rows else []
    mats = [m for c in compressors(w) for m in (c.wkv, c.wgate)] + heads

    def flat(result: tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]) -> list[torch.Tensor]:
        pairs, head = result
        return [t for pair in pairs for t in pair] + ([head] if head is not None else [])

    def separate(x: torch.Tensor, ms: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.mm(x, m.T, out_dtype=torch.float32) for m in ms]

    out: dict[str, tuple[int, Callable[[torch.Tensor], list[torch.Tensor]]]] = {
        "separate": (len(mats), lambda x: separate(x, mats))}
    if len(widths) > 1:
        starts = [2 * sum(widths[:i]) for i in range(len(widths))]
        per = [(stack[s : s + 2 * n], n) for s, n in zip(starts, widths)]  # each compressor's [W_kv; W_gate]
        out["per-comp"] = (len(per) + len(heads),
                           lambda x: [t for s, n in per for t in flat(stacked_compressor_projections(x, s, [n]))]
                           + separate(x, heads))
    out["stacked"] = (1, lambda x: flat(stacked_compressor_projections(x, stack, widths, rows)))
    return out


def kernel_names(fn: Callable[[], Any]) -> str:
    """The CUDA kernels one ``fn()`` launches, as ``name ×count`` (names cut at 60 characters)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = collections.Counter(e.name[:60] for e in prof.events() if e.device_type.name == "CUDA")
    return "; ".join(f"{n} x{c}" for n, c in names.items())


def run(quick: bool = False, roofline: Any = None, preset: str = "v4-flash", rows: tuple[int, ...] = ROWS,
        flush: str = "read", kernels: bool = False) -> list[dict]:
    """Time every (layer kind, rows, way); returns ``roofline_row`` rows (``quick``: fewer repetitions)."""
    cfg = dsv4.ModelConfig.preset(preset)
    bw = roofline.copy_bw if roofline is not None else measure_copy_bandwidth("cuda")
    rate = roofline.bf16_rate if roofline is not None else measure_matmul_rate("cuda", torch.bfloat16)
    flush_l2 = False if flush == "none" else flush
    iters = 20 if quick else 100
    print(f"{torch.cuda.get_device_name()}  {preset}; copy {bw / 1e12:.2f} TB/s, BF16 matmul {rate / 1e12:.0f} "
          f"TFLOP/s; L2 flush: {flush}")
    print(f"{'layer':<10}{'N x K':>12}{'M':>6}{'way':>10}{'GEMMs':>6}{'us':>9}{'eager':>9}{'roof us':>9}"
          f"{'roof %':>8}{'w floor':>9}{'vs sep':>9}")
    out = []
    g = torch.Generator(device="cuda").manual_seed(1)
    for kind in KINDS:
        li, w = stacked_layer_weights(cfg, kind)
        stack = compressor_stack(w)
        N, K = stack.shape
        w_bytes = stack.numel() * stack.element_size()
        for M in rows:
            x = torch.randn(M, K, generator=g, device="cuda").bfloat16()
            base = None
            for way, (n_gemm, fn) in ways(w).items():
                got = fn(x)
                if base is None:
                    base = got
                diff = max(float((a - b).abs().max()) for a, b in zip(got, base))
                scale = max(float(b.abs().max()) for b in base)
                t = time_cuda(lambda: fn(x), warmup=5, iters=iters, flush_l2=flush_l2, graph=True)
                t_eager = time_cuda(lambda: fn(x), warmup=3, iters=max(10, iters // 4), flush_l2=flush_l2)
                row = roofline_row(f"{preset} {kind} compressor projections M={M} {way}", t,
                                   bytes=w_bytes + M * K * 2 + M * N * 4, flops=2.0 * M * N * K, copy_bw=bw,
                                   mm_rate=rate, preset=preset, kind=kind, layer=li, M=M, N=N, K=K, way=way,
                                   gemms=n_gemm, eager_us=t_eager * 1e6, weight_floor_us=w_bytes / bw * 1e6,
                                   rel_diff_vs_separate=diff / scale, l2_flush=flush)
                if kernels:
                    row["kernels"] = kernel_names(lambda: fn(x))
                out.append(row)
                print(f"{f'{kind} L{li}':<10}{f'{N}x{K}':>12}{M:>6}{way:>10}{n_gemm:>6}{row['us']:>9.1f}"
                      f"{row['eager_us']:>9.1f}{row['roofline_us']:>9.1f}{100 * row['roofline_frac']:>7.1f}%"
                      f"{row['weight_floor_us']:>9.1f}{row['rel_diff_vs_separate']:>9.1e}", flush=True)
                if kernels:
                    print(f"{'':<16}kernels: {row['kernels']}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="v4-flash")
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--flush", choices=["read", "zero", "none"], default="read",
                    help="L2 before each timed call: evicted by reading a 256 MiB buffer (default), by overwriting "
                         "it, or left warm (the weights may then come from L2)")
    ap.add_argument("--kernels", action="store_true", help="list the CUDA kernels of each way")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--json", help="write the rows (and the environment) here")
    a = ap.parse_args()
    rows = run(quick=a.quick, preset=a.preset, rows=tuple(a.rows), flush=a.flush, kernels=a.kernels)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"environment": environment("cuda"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
