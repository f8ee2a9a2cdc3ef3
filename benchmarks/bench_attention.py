"""Benchmark: sparse attention over the paged 584-B KV entries (``dsv4.kernels.attention``).

Shapes (issue 6): decode, one query token per request, batch 1/8/64/128 —

* Flash CSA: 64 heads, 128 window + 512 top-k keys;
* Pro CSA: 128 heads, 128 + 1024 keys;
* Flash HCA 128K: 64 heads, 128 + 1024 keys (every visible entry);
* Flash HCA 1M: 64 heads, 128 + 8192 keys;

and prefill chunks of 4096 queries (one request, window mostly from this step's tokens): Flash CSA 640 keys,
Pro CSA 1152 keys. Pages, rings and entry lists are built directly (random valid FP8 bytes, block tables with
scattered blocks), not through the cache. Timing: median of CUDA-event-timed CUDA-graph replays (the kernels' GPU time, as the engine's decode steps run),
L2 flushed before each; the eager time (Python launches and the plan included) is reported next to it.

Bytes: the keys each token reads (584 B per window/compressed entry, 1 KiB for its own BF16 entry), entry
indices, q, o, lse (prefill: each compressed entry once, it is shared by the chunk's queries). FLOPs:
``4 · H · keys · 512`` per token (Q·Kᵀ and P·V). The roofline is the larger of bytes / copy bandwidth and
FLOPs / BF16 matmul rate, both measured in the same run.

    python benchmarks/bench_attention.py [--quick] [--json out.json] [--variants JSON] [--parallel-compile]
        [--only flash_csa:8,pro_csa] [--set sm90_ws.NAME=VALUE ...] [--flush zero|read]

``--variants`` compares request sets of ``sparse_attention_fwd`` in one process (``impl``, ``keys``, ``combine``,
``num_splits`` and the Triton tiling: ``plan_attention``'s keywords); each row names the plan it ran
(``AttentionPlan.describe``). ``--set`` changes a module constant of ``dsv4.kernels.attention`` for the whole run
(one process per setting for an A/B of kernel constants; not passed on to ``--parallel-compile``'s subprocesses).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import subprocess
import sys
import time
from typing import Any

import torch

from dsv4.bench.roofline import environment, measure_copy_bandwidth, measure_matmul_rate, roofline_row, time_cuda

REQUIRES_CUDA = True  # dsv4 bench skips this script on other devices (dsv4.bench.suite)

ENTRY = 584
WINDOW = 128
# FlashMLA SM90 sparse kernels on an H200, same shapes and pages (the reference points), in µs.
FLASHMLA_US = {
    ("flash_csa", 1): 17.0,
    ("flash_csa", 8): 19.1, ("pro_csa", 8): 23.5, ("flash_hca_128k", 8): 22.0, ("flash_hca_1m", 8): 54.4,
    ("flash_csa", 64): 48.7, ("pro_csa", 64): 59.1, ("flash_hca_128k", 64): 64.2, ("flash_hca_1m", 64): 249.0,
    ("flash_csa", 128): 51.9, ("pro_csa", 128): 108.4, ("flash_hca_128k", 128): 79.2, ("flash_hca_1m", 128): 464.0,
    ("prefill_flash_csa", 4096): 710.0, ("prefill_pro_csa", 4096): 2277.0,
}
# name: (heads, ratio, top-k (0 = every visible entry), context before the step)
DECODE = {
    "flash_csa": (64, 4, 512, 65536),
    "pro_csa": (128, 4, 1024, 65536),
    "flash_hca_128k": (64, 128, 0, 131072 - 1),
    "flash_hca_1m": (64, 128, 0, 1048576 - 1),
}
PREFILL = {
    "prefill_flash_csa": (64, 4, 512, 8192),
    "prefill_pro_csa": (128, 4, 1024, 8192),
    "prefill_flash_hca_128k": (64, 128, 0, 131072),  # no FlashMLA reference: the kernel choice's check
}


def _random_pages(n_pages: int, entries: int, page_bytes: int, gen: torch.Generator, device: str) -> torch.Tensor:
    """``n_pages`` pages of ``entries`` random valid 584-B entries (E4M3 codes without NaN, exponents 114–122,
    finite BF16 rope values), generated on ``device``."""
    codes = torch.randint(0, 0x7E, (n_pages, entries, 448), generator=gen, dtype=torch.uint8, device=device)
    codes |= torch.randint(0, 2, codes.shape, generator=gen, dtype=torch.uint8, device=device) << 7
    rope = torch.randn(n_pages, entries, 64, generator=gen, device=device).to(torch.bfloat16).view(torch.uint8)
    exps = torch.randint(114, 123, (n_pages, entries, 8), generator=gen, dtype=torch.uint8, device=device)
    exps[..., 7] = 0
    pages = torch.zeros(n_pages, page_bytes, dtype=torch.uint8, device=device)
    pages[:, : entries * 576] = torch.cat((codes, rope), dim=-1).reshape(n_pages, -1)
    pages[:, entries * 576 : entries * 584] = exps.reshape(n_pages, -1)
    return pages


def build(heads: int, ratio: int, topk: int, context: int, batch: int, new: int, device: str = "cuda",
          block_size: int = 256, seed: int = 0) -> dict[str, Any]:
    """Inputs of ``sparse_attention_fwd`` for ``batch`` requests with ``context`` cached tokens and ``new`` query
    tokens each (all requests alike; different data)."""
    gen = torch.Generator().manual_seed(seed)
    dgen = torch.Generator(device=device).manual_seed(seed)
    epp = block_size // ratio
    page_bytes = -(-epp * ENTRY // 576) * 576
    end = context + new
    n_entries = end // ratio
    blocks_per_req = -(-end // block_size)
    n_blocks = batch * blocks_per_req
    pool = _random_pages(n_blocks, epp, page_bytes, dgen, device)
    tables = torch.randperm(n_blocks, generator=gen).view(batch, blocks_per_req).to(torch.int32).to(device)
    ring_bytes = -(-WINDOW * ENTRY // 576) * 576
    ring = _random_pages(batch, WINDOW, ring_bytes, dgen, device)
    pos_ring = torch.full((batch, WINDOW), -1, dtype=torch.int32)
    for p in range(max(0, context - WINDOW), context):
        pos_ring[:, p % WINDOW] = p
    T = batch * new
    req = torch.arange(batch).repeat_interleave(new)
    positions = context + torch.arange(new).repeat(batch)
    q = torch.randn(T, heads, 512, generator=gen).to(torch.bfloat16)
    kv_new = torch.randn(T, 512, generator=gen).to(torch.bfloat16)
    visible = (positions + 1) // ratio
    args = dict(
        q=q.to(device), kv_new=kv_new.to(device), ring=ring, ring_positions=pos_ring.to(device), pool=pool,
        block_tables=tables, token_request=req.to(torch.int32).to(device), positions=positions.to(device),
        cu_seqlens=(torch.arange(batch + 1) * new).to(torch.int32).to(device),
        start_pos=torch.full((batch,), context, dtype=torch.int64).to(device),
        token_slots=req.to(device), sink=torch.randn(heads, generator=gen).to(device),
        inv_freq=(1.0 / (160000 ** (torch.arange(0, 64, 2) / 64))).float().to(device), scale=512 ** -0.5,
        window=WINDOW, ratio=ratio, block_size=block_size,
    )
    if topk:
        width = min(topk, n_entries)
        idx = torch.empty(T, width, dtype=torch.int32)
        for t in range(T):  # distinct visible entries per token (host, once)
            idx[t] = torch.randperm(int(visible[t]), generator=gen)[:width].to(torch.int32)
        args["entry_idx"] = idx.to(device)
        args["max_visible"] = n_entries  # host bound: lets keys="auto" dequantize a prefill chunk's keys once
        keys = WINDOW + width
    else:
        args["visible"] = visible.to(device)
        args["max_entries"] = n_entries
        keys = WINDOW + n_entries
    args["_keys"] = keys
    args["_unique_entries"] = batch * n_entries
    return args


def figures(args: dict[str, Any], heads: int, T: int, prefill: bool) -> tuple[float, float]:
    """(bytes, flops) of one call."""
    keys = args["_keys"]
    idx_bytes = args["entry_idx"].numel() * args["entry_idx"].element_size() if "entry_idx" in args else 0
    qo = T * heads * 512 * 2 * 2 + T * heads * 4
    if prefill:
        kv = args["_unique_entries"] * ENTRY + T * 1024 + WINDOW * ENTRY
    else:
        kv = T * ((WINDOW - 1) * ENTRY + 1024 + (keys - WINDOW) * ENTRY)
    return kv + idx_bytes + qo, 4.0 * T * heads * keys * 512


def compile_in_parallel(quick: bool, variants: list[dict[str, Any]]) -> None:
    """Run every shape once per variant, one subprocess per variant side by side: the Triton compiles (seconds
    each, CPU-bound) land in the on-disk cache before the serial timing run."""
    procs = [subprocess.Popen([sys.executable, __file__, "--compile-only", "--variants", json.dumps([v])]
                              + (["--quick"] if quick else [])) for v in {json.dumps(v): v for v in variants}.values()]
    for p in procs:
        p.wait()


def run(quick: bool = False, device: str = "cuda", variants: list[dict[str, Any]] | None = None,
        json_path: str | None = None, compile_only: bool = False, only: list[str] | None = None,
        flush: str = "zero", warmup_ms: float = 0.0) -> list[dict]:
    """Time every shape (``quick``: the acceptance shapes only; ``only``: shapes named ``name:batch``) and return
    roofline rows (``compile_only``: call each variant once per shape, no timing). ``flush``: how L2 is flushed
    before each timed call (``time_cuda``'s ``flush_l2``): ``"zero"`` (the default, as ``triton.testing.do_bench``
    does: L2 left full of dirty lines, which the kernel writes back as it reads — up to an L2 of extra DRAM writes)
    or ``"read"`` (clean lines). ``warmup_ms``: ``time_cuda``'s time-based warm-up before each timing (0: five
    calls)."""
    from dsv4.kernels.attention.launch import plan_for, sparse_attention_fwd

    variants = variants or [{}]
    if compile_only:
        bw = rate = 1.0
    else:
        bw = measure_copy_bandwidth(device)
        rate = measure_matmul_rate(device, torch.bfloat16)
    rows: list[dict] = []
    batches = (1, 8, 64, 128)
    shapes = [(name, b, 1, False) for name in DECODE for b in batches if not (quick and name != "flash_csa" and b == 1)]
    shapes += [(name, 1, 4096, True) for name in PREFILL]
    if only:
        shapes = [sh for sh in shapes if f"{sh[0]}:{sh[1]}" in only or sh[0] in only]
    for name, batch, new, prefill in shapes:
        heads, ratio, topk, context = (PREFILL if prefill else DECODE)[name]
        args = build(heads, ratio, topk, context, batch, new, device)
        T = batch * new
        nbytes, flops = figures(args, heads, T, prefill)
        call = {k: v for k, v in args.items() if not k.startswith("_")}
        ws_out = torch.empty_like(call["q"])
        lse = torch.empty(call["q"].shape[:2], dtype=torch.float32, device=device)
        first = None
        for vi, var in enumerate(variants):
            try:
                plan = plan_for(call["q"], call["kv_new"], call["block_tables"], **{
                    k: call[k] for k in ("window", "ratio", "block_size", "entry_idx", "visible", "max_entries",
                                         "max_visible") if k in call}, **var)
                # (planned inside each call, as a step without a plan: the eager time includes it)
                fn = lambda: sparse_attention_fwd(**call, out=ws_out, lse=lse, **var)  # noqa: E731
                fn()
                torch.cuda.synchronize()
                # Every variant must compute what the first one does (the tests check the default vs torch).
                if first is None:
                    first, diff = ws_out.double().clone(), 0.0
                else:
                    diff = ((ws_out.double() - first).norm() / first.norm()).item()
                    if not diff <= 2e-2:
                        print(f"{name} B={batch} {var}: WRONG, rel diff {diff:.3g} vs the first variant",
                              file=sys.stderr)
                if compile_only:
                    continue
                # GPU time as CUDA-graph replays (how the engine's decode steps run); eager for reference
                s = time_cuda(fn, warmup=5, iters=30, flush_l2=flush, graph=True, warmup_ms=warmup_ms)
                s_eager = time_cuda(fn, warmup=2, iters=20, flush_l2=flush, warmup_ms=warmup_ms)
            except Exception as e:  # noqa: BLE001 - a failing variant is reported, the others still run
                print(f"{name} B={batch} {var}: FAILED {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
                continue
            ref = FLASHMLA_US.get((name, T if prefill else batch))
            label = f"{name} B={batch}" + (f" T={T}" if prefill else "")
            label += f" #{vi} {var}" if len(variants) > 1 else ""
            rows.append(roofline_row(
                label, s, nbytes, flops, bw, rate, shape=name, batch=batch, tokens=T, heads=heads,
                keys=args["_keys"], variant=var, variant_index=vi, plan=plan.describe(), flashmla_us=ref,
                diff_vs_first=diff,
                vs_flashmla=(ref / (s * 1e6)) if ref else None, eager_us=s_eager * 1e6, l2_flush=flush,
                warmup_ms=warmup_ms,
            ))
        del args, call
        torch.cuda.empty_cache()
        if json_path and not compile_only:  # after every shape, so a run cut short still leaves its rows
            with open(json_path, "w") as f:
                json.dump({"partial": True, "rows": rows}, f, indent=1, default=str)
    if compile_only:
        return rows
    env = environment(device)
    print(f"# {env['device']}  torch {env['torch']}  triton {env['triton']}  copy {bw / 1e12:.2f} TB/s  "
          f"bf16 mm {rate / 1e12:.0f} TFLOP/s  L2 flush {flush!r}  warm-up {warmup_ms:g} ms")
    print(f"{'shape':80s} {'µs':>8s} {'eager':>8s} {'MB':>8s} {'GFLOP':>8s} {'roof%':>6s} {'FlashMLA µs':>11s} {'speedup':>7s}")
    for r in rows:
        ref = f"{r['flashmla_us']:.1f}" if r["flashmla_us"] else "-"
        sp = f"{r['vs_flashmla']:.2f}x" if r["vs_flashmla"] else "-"
        print(f"{r['name']:80s} {r['us']:8.1f} {r['eager_us']:8.1f} {r['bytes'] / 1e6:8.1f} {r['flops'] / 1e9:8.2f} "
              f"{100 * r['roofline_frac']:5.1f}% {ref:>11s} {sp:>7s}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"environment": env, "copy_bw": bw, "mm_rate": rate, "rows": rows}, f, indent=1, default=str)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="acceptance shapes only")
    ap.add_argument("--json", default=None, help="write rows + environment here")
    ap.add_argument("--variants", default=None,
                    help="JSON list of request sets for sparse_attention_fwd, e.g. '[{\"impl\": \"triton\"}, {}]'")
    ap.add_argument("--only", default=None, help="comma-separated shapes, 'name' or 'name:batch' (e.g. flash_csa:64)")
    ap.add_argument("--compile-only", action="store_true", help="call each variant once per shape, no timing")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="set a constant of a dsv4.kernels.attention module first (Python literal), e.g. "
                         "sm90_ws.PRODUCER_REGS=144; repeatable")
    ap.add_argument("--flush", choices=("zero", "read"), default="zero",
                    help="L2 flush before each timed call: overwrite a 256 MiB buffer (dirty lines, the default) or "
                         "read it (clean lines)")
    ap.add_argument("--warmup-ms", type=float, default=0.0,
                    help="untimed calls for this long before each timing, so that it runs under sustained load "
                         "(default 0: five calls, a short burst, as every figure in RESULTS.md unless it says so)")
    ap.add_argument("--parallel-compile", action="store_true",
                    help="first compile every variant in its own subprocess, side by side (warms the Triton cache); "
                         "with --compile-only nothing else")
    a = ap.parse_args()
    variants = json.loads(a.variants) if a.variants else None
    for item in a.set:
        target, value = item.split("=", 1)
        module, name = target.rsplit(".", 1)
        mod = importlib.import_module(f"dsv4.kernels.attention.{module}")
        if not hasattr(mod, name):
            raise SystemExit(f"--set: dsv4.kernels.attention.{module} has no {name}")
        setattr(mod, name, ast.literal_eval(value))
        print(f"# dsv4.kernels.attention.{module}.{name} = {getattr(mod, name)!r}", flush=True)
    if a.parallel_compile:
        t0 = time.time()
        compile_in_parallel(a.quick, variants or [{}])
        print(f"# parallel compile: {time.time() - t0:.0f} s", flush=True)
        if a.compile_only:
            return
    run(quick=a.quick, variants=variants, json_path=a.json, compile_only=a.compile_only,
        only=a.only.split(",") if a.only else None, flush=a.flush, warmup_ms=a.warmup_ms)


if __name__ == "__main__":
    main()
