"""The official FP8 projections of one ``--preset`` layer at decode and prefill row counts, every GEMM way the
plan can pick, against the weight-read roofline.

Ways: ``bf16`` (the activations' quantized values times the weight's BF16 copy on cuBLAS), ``scaled_mm``
(``torch._scaled_mm`` with blockwise scales, where this torch takes it and gets it right; the probe's figures are
printed either way), ``triton`` (``kernels.project.block_gemm``: the block-scaled FP8 GEMM on FP8 tensor cores) —
``gemm_config``'s launch and, with ``--sweep``, other kernel / tile / split / stage / grid choices. Each timing
includes the activation quantization (the user's call). Errors are relative L2 against the reference's FP32 sums of
the same products (``formats.block_fp8.fp8_linear``).

Each timing is a CUDA graph of calls that each read another copy of the weight (none in L2 when its GEMM starts, as
in a layer), per call. Roofline: the FP8 weight (values + scales) read once at the copy bandwidth measured in the
same run.

    python benchmarks/bench_fp8_projections.py [--preset v4-flash] [--rows 1 4 16 64 128 8192] [--sweep]
        [--weights wq_b wo_b] [--ways triton] [--json out]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import traceback

import torch

import dsv4
from dsv4.bench.roofline import environment, measure_copy_bandwidth, time_cuda
from dsv4.formats.block_fp8 import BlockFp8Weight, fp8_linear as reference_fp8_linear
from dsv4.input_stack import input_stack, stack_input_projections
from dsv4.query_stack import query_stack, stack_query_projections
from dsv4.kernels.device import sm_count
from dsv4.kernels.project import block_gemm, fp8_gemm

REQUIRES_CUDA = True
#: row counts ``--sweep`` explores (each launch shape compiles once: a wider sweep costs minutes)
SWEEP_ROWS = (1, 8, 16, 17, 32, 64)
#: bytes of weight copies each timing cycles through (3x the H200's 50 MB L2)
L2_SPAN = 150 << 20
#: weights ``--sweep`` explores: the large square-ish one, the long-K one and the narrow one
SWEEP_WEIGHTS = ("wq_b", "wo_b", "wq_a+wkv", "wq_b+indexer.wq_b")


def fp8_projections(cfg: dsv4.ModelConfig) -> dict[str, BlockFp8Weight]:
    """The layer's FP8 projection weights (random, as checkpoints store them) by name, and the stacks of the two
    that read the layer's input (``wq_a+wkv``, ``dsv4.input_stack``) and of the two that read the query latent
    (``wq_b+indexer.wq_b``, ``dsv4.query_stack``), one GEMM each."""
    kind = {li: cfg.layer_kind(li) for li in range(cfg.num_layers)}
    li = next((i for i, k in kind.items() if k.name == "CSA"), 0)
    w = dsv4.AttentionWeights.random(cfg, li, seed=0, device="cuda")
    out = {n: v for n, v in w.named_parameters() if isinstance(v, BlockFp8Weight)}
    for name, stack in (("wq_a+wkv", input_stack(stack_input_projections(w))),
                        ("wq_b+indexer.wq_b", query_stack(stack_query_projections(w)))):
        if stack is not None:
            out[name] = stack
    return out


def weight_copies(w: BlockFp8Weight | torch.Tensor) -> list[BlockFp8Weight | torch.Tensor]:
    """``w`` and copies of it, together at least ``L2_SPAN`` bytes: a timed graph whose every call reads the next
    copy finds none of its weight in L2 when the call starts, as in a layer."""
    if isinstance(w, BlockFp8Weight):
        nbytes, clone = w.nbytes, lambda: BlockFp8Weight(w.data.clone(), w.scale.clone())
    else:
        nbytes, clone = w.numel() * w.element_size(), w.clone
    return [w] + [clone() for _ in range(max(1, -(-L2_SPAN // nbytes)) - 1)]


def scaled_mm_probe() -> str:
    """Why ``torch._scaled_mm`` does or does not take the blockwise recipe here: 'ok' or the first error per M."""
    out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    w = BlockFp8Weight.quantize(torch.randn(256, 256, generator=g, device="cuda") * 0.05)
    for m in (1, 16, 32, 64, 128):
        x = torch.randn(m, 256, generator=g, device="cuda").bfloat16()
        try:
            got = fp8_gemm.fp8_linear(x, w, torch.bfloat16, "scaled_mm").float()
            want = reference_fp8_linear(x, w, torch.float32)
            out.append(f"M={m}: rel {((got - want).norm() / want.norm()).item():.1e}")
        except Exception as e:  # noqa: BLE001 - the probe reports whatever torch raises
            out.append(f"M={m}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
    return "; ".join(out)


def run_way(x: torch.Tensor, w: BlockFp8Weight, way: str, config: block_gemm.GemmConfig | None):
    if way == "triton":
        return lambda: block_gemm.block_fp8_linear(x, w, torch.bfloat16, config)
    return lambda: fp8_gemm.fp8_linear(x, w, torch.bfloat16, way)


def sweep_configs(plan: block_gemm.GemmConfig, sms: int) -> list[block_gemm.GemmConfig]:
    """The plan's launch and neighbours of it (4 warps, the plan's kernel): 64- or 128-column tiles, K split as
    planned, half or twice as much; the TMA kernel with 6 stages, unsplit on a persistent grid or one program per
    tile, also with 64-row tiles where the plan's are smaller; the pointer kernel with 3 or 5 stages, and there the
    TMA kernel in 64-row tiles as well."""
    out = [plan]
    splits = sorted({plan.split, max(1, plan.split // 2), plan.split * 2})
    for bn in (64, 128):
        for split in splits:
            if not plan.tma:
                out += [block_gemm.GemmConfig(bm=plan.bm, bn=bn, split=split, num_stages=st) for st in (3, 5)]
                # the TMA kernel at these rows too (64-row tiles; its quantization launch included)
                out += [block_gemm.GemmConfig(bm=64, bn=bn, split=split, num_stages=6, tma=True)]
                if split == 1 and bn == 128:
                    out += [block_gemm.GemmConfig(bm=64, bn=128, num_stages=6, tma=True, programs=sms)]
                continue
            for programs in ((0, sms) if split == 1 else (0,)):
                out += [block_gemm.GemmConfig(bm=bm, bn=bn, split=split, num_stages=6, tma=True, programs=programs)
                        for bm in dict.fromkeys((plan.bm, 64))]
    return list(dict.fromkeys(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="v4-flash")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 128, 8192])
    ap.add_argument("--sweep", action="store_true", help="also time neighbouring Triton launches")
    ap.add_argument("--triton-rows", type=int, default=8192, help="time the Triton GEMM up to this many rows")
    ap.add_argument("--weights", nargs="+", help="only these weights (names as printed; default: all)")
    ap.add_argument("--ways", nargs="+", choices=["bf16", "triton", "scaled_mm"], help="only these ways")
    ap.add_argument("--json")
    a = ap.parse_args()
    cfg = dsv4.ModelConfig.preset(a.preset)
    bw = measure_copy_bandwidth("cuda")
    sms = sm_count("cuda")
    probe = scaled_mm_probe()
    print(f"{torch.cuda.get_device_name()}  {a.preset}; copy bandwidth {bw / 1e12:.2f} TB/s; {sms} SMs")
    print(f"torch {torch.__version__} _scaled_mm blockwise probe: {probe}")
    ways = ["bf16", "triton"] + (["scaled_mm"] if fp8_gemm.scaled_mm_works(torch.device("cuda")) else [])
    ways = [w for w in ways if not a.ways or w in a.ways]
    weights = {n: w for n, w in fp8_projections(cfg).items() if not a.weights or n in a.weights}
    print(f"{'weight':<18}{'N x K':>14}{'M':>6}{'way':>10}{'us':>9}{'roof us':>9}{'roof %':>8}{'rel err':>10}  launch")
    rows = []
    g = torch.Generator(device="cuda").manual_seed(1)
    for name, w in weights.items():
        N, K = w.shape
        floor = w.nbytes / bw
        copies = weight_copies(w)
        for M in a.rows:
            x = (torch.randn(M, K, generator=g, device="cuda") * torch.exp(torch.randn(M, 1, generator=g,
                                                                                        device="cuda"))).bfloat16()
            want = reference_fp8_linear(x, w, torch.float32)
            plan = block_gemm.gemm_config(M, N, K, sms)
            cases = [(way, plan if way == "triton" else None) for way in ways
                     if way != "triton" or M <= a.triton_rows]
            if a.sweep and M in SWEEP_ROWS and name in SWEEP_WEIGHTS:
                cases += [("triton", c) for c in sweep_configs(plan, sms)[1:]]
            for way, config in cases:
                try:
                    got = run_way(x, w, way, config)().float()
                    rel = ((got - want).norm() / want.norm()).item()
                    calls = [run_way(x, c, way, config) for c in copies]
                    t = time_cuda(lambda: [f() for f in calls], warmup=5, iters=30, graph=True) / len(calls)
                except Exception:  # noqa: BLE001 - one failing launch must not hide the others
                    print(f"{name:<18}{M:>6} {way} {config}: FAILED\n{traceback.format_exc(limit=2)}")
                    continue
                launch = "" if config is None else (f"bm{config.bm} bn{config.bn} split{config.split} "
                                                    f"w{config.num_warps} s{config.num_stages}"
                                                    + (f" tma p{config.programs}" if config.tma else "")
                                                    + (" (plan)" if config == plan else ""))
                rows.append({"weight": name, "N": N, "K": K, "M": M, "way": way, "launch": launch,
                             "us": t * 1e6, "roofline_us": floor * 1e6, "rel_err": rel})
                print(f"{name:<18}{f'{N}x{K}':>14}{M:>6}{way:>10}{t * 1e6:>9.1f}{floor * 1e6:>9.1f}"
                      f"{100 * floor / t:>7.1f}%{rel:>10.1e}  {launch}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"environment": environment("cuda"), "copy_bw": bw, "scaled_mm_probe": probe, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
