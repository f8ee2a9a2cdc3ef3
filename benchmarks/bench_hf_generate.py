"""Benchmark: ``model.generate()`` of a transformers DeepseekV4ForCausalLM, its own attention and cache against
dsv4's (``dsv4.hf.attach``), same random model, same prompts.

The model (``dsv4.hf.random_causal_lm``, BF16): V4-Flash attention (64 heads × 512, window 128, CSA m = 4 with
top-512, HCA m' = 128) in ``--layers`` layers (SWA, CSA, HCA, CSA, …), small MoE and vocabulary, so that
attention and its cache dominate. Prompts: ``--batch`` rows of uniform random lengths in ``--prompt LO:HI``,
left-padded; greedy, ``--new`` tokens per row. Every variant is warmed up first (Triton compiles), then timed as
``generate(max_new_tokens=1)`` (prefill) and ``generate(max_new_tokens=N)``; decode throughput is
``B·(N−1) / (t_N − t_1)``. Cache memory after the N-token run: transformers' ``DynamicCache`` (every tensor its
layers hold, dense BF16 window + compressed entries + compressor buffers) against the dsv4 ``HybridCache``
(pool blocks and state slots the rows hold; allocated in brackets). ``agree``: the fraction of generated tokens
equal to ``dsv4-torch``'s (else the first variant's), row by row up to the first difference (BF16 rounding and
top-k near-ties make long greedy runs of different kernels part ways; transformers' own padded rows also differ
by its issue #45938 and its BF16 compressors, see tests/hf/test_hf_generate.py).

    python benchmarks/bench_hf_generate.py [--quick] [--out results.json]
    python benchmarks/bench_hf_generate.py --device cpu --preset tiny --quick --variants transformers dsv4-torch

Variants: ``transformers`` (eager attention, ``DynamicCache``), ``dsv4-triton`` (official numerics, Triton
backend), ``dsv4-torch`` (official numerics, torch backend); ``--variants`` picks.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

import dsv4
import dsv4.hf
from dsv4.bench.roofline import environment

VARIANTS = {"transformers": None, "dsv4-triton": "triton", "dsv4-torch": "torch"}


def tensor_bytes(obj, seen: set[int] | None = None, depth: int = 0) -> int:
    """Bytes of the distinct tensor storages reachable from ``obj`` (lists, tuples, dicts, object attributes)."""
    seen = set() if seen is None else seen
    if depth > 6 or obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen or obj.numel() == 0:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen, depth + 1) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
        return sum(tensor_bytes(v, seen, depth + 1) for v in vars(obj).values())
    return 0


def prompts(batch: int, lo: int, hi: int, vocab: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    rng = random.Random(seed)
    lengths = [rng.randint(lo, hi) for _ in range(batch)]
    return dsv4.hf.left_padded_prompts(lengths, vocab, torch.Generator().manual_seed(seed), device)


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed_generate(model, ids, mask, new: int):
    sync(ids.device)
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, return_dict_in_generate=True)
    sync(ids.device)
    return out, time.perf_counter() - t


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of tokens equal row by row up to each row's first difference."""
    same = 0
    for x, y in zip(a.tolist(), b.tolist()):
        for u, v in zip(x, y):
            if u != v:
                break
            same += 1
    return same / a.numel()


def run(args) -> dict:
    device = args.device
    cfg = dsv4.ModelConfig.preset(args.preset)
    ratios = ([0] + [cfg.csa_ratio if i % 2 else cfg.hca_ratio for i in range(1, args.layers)])[: args.layers]
    cfg = cfg.replace(name=f"{args.preset}-{args.layers}l", num_layers=args.layers, compress_ratios=(*ratios, 0))
    model = dsv4.hf.random_causal_lm(cfg, seed=0, vocab_size=args.vocab, experts=8, expert_dim=256, hc_mult=4,
                                     dtype=torch.bfloat16, device=device)
    lo, hi = (int(v) for v in args.prompt.split(":"))
    ids, mask = prompts(args.batch, lo, hi, args.vocab, seed=1, device=device)
    real = int(mask.sum())
    print(f"# {environment(device)['device']}, transformers {__import__('transformers').__version__}: {cfg.describe()}")
    print(f"# batch {args.batch}, prompts {lo}-{hi} tokens ({real} real, {ids.shape[1]} columns), {args.new} new tokens")
    rows, generated = [], {}
    for name in args.variants:
        backend = VARIANTS[name]
        if backend is not None:
            dsv4.hf.attach(model, backend=backend, numerics="official", check_inputs=False)
        try:
            timed_generate(model, ids, mask, 2)  # warm-up: Triton JIT, allocator
            _, t1 = timed_generate(model, ids, mask, 1)
            out, tn = timed_generate(model, ids, mask, args.new)
        finally:
            if backend is not None:
                dsv4.hf.detach(model)
        cache = out["cache"] if "cache" in out else out["past_key_values"]
        if backend is None:
            used = allocated = tensor_bytes(cache)
        else:
            used, allocated = cache.memory_in_use(), cache.memory_bytes()
        generated[name] = out.sequences[:, ids.shape[1]:]
        rows.append(dict(
            variant=name, prefill_s=t1, total_s=tn, decode_tok_s=args.batch * (args.new - 1) / max(tn - t1, 1e-9),
            total_tok_s=args.batch * args.new / tn, cache_bytes=used, cache_allocated_bytes=allocated,
            cache_bytes_per_token=used / (real + args.batch * (args.new - 1)),
        ))
        del out, cache
        if device == "cuda":
            torch.cuda.empty_cache()
    reference = "dsv4-torch" if "dsv4-torch" in generated else args.variants[0]
    for r in rows:
        r["agree"] = agreement(generated[r["variant"]], generated[reference])
    print(f"{'variant':14s} {'prefill s':>10s} {'decode tok/s':>13s} {'total tok/s':>12s} {'cache MiB':>22s} "
          f"{'B/token':>9s} {'agree':>6s}")
    for r in rows:
        mem = f"{r['cache_bytes'] / 2**20:9.1f} ({r['cache_allocated_bytes'] / 2**20:9.1f})"
        print(f"{r['variant']:14s} {r['prefill_s']:10.3f} {r['decode_tok_s']:13.1f} {r['total_tok_s']:12.1f} "
              f"{mem:>22s} {r['cache_bytes_per_token']:9.0f} {r['agree']:6.2f}")
    return dict(environment=environment(device), config=cfg.describe(), batch=args.batch, prompt=args.prompt,
                new_tokens=args.new, real_prompt_tokens=real, rows=rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="v4-flash", help="attention geometry (v4-flash; tiny for a CPU smoke run)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (no Triton variant)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", default="256:1024", help="LO:HI prompt lengths")
    p.add_argument("--new", type=int, default=64, help="tokens generated per row")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--quick", action="store_true", help="batch 4, prompts 128-512, 16 new tokens")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    if args.quick:
        args.batch, args.prompt, args.new = 4, "128:512", 16
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here (--device cpu --preset tiny runs a smoke test)")
    import transformers

    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        raise SystemExit(f"transformers {transformers.__version__} has no DeepseekV4ForCausalLM (tested with 5.24.0)")
    result = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"# wrote {args.out}")


if __name__ == "__main__":
    main()
