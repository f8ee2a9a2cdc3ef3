"""Benchmark: where a prefill step's attention time goes — per key chunk and per (token, head block) item.

Times ``sparse_attention_fwd`` on 4K-query prefill chunks (one request, 8K or 16K tokens before it) with top-k
64 … 2048 (2 window chunks + top-k / 64 chunks of 64 keys per token) and fits ``time per program wave = a + b ·
chunks``: ``b`` is the cost of a chunk, ``a`` what every item costs besides its chunks (its queries, its output,
the hand-over between items). The BF16 key rows (``bf16_keys``, part of every step) are timed on their own and
taken out. CUDA-graph replays, L2 flushed before each.

    python benchmarks/bench_prefill_chunks.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_attention import build  # noqa: E402

from dsv4.bench.roofline import environment, time_cuda  # noqa: E402
from dsv4.kernels.attention.bf16_keys import bf16_keys  # noqa: E402
from dsv4.kernels.attention.launch import sparse_attention_fwd  # noqa: E402
from dsv4.kernels.device import sm_count  # noqa: E402

REQUIRES_CUDA = True  # dsv4 bench skips this script on other devices (dsv4.bench.suite)

#: (heads, top-k, tokens before the chunk)
SHAPES = [(64, 64, 8192), (64, 256, 8192), (64, 512, 8192), (64, 1024, 8192), (64, 2048, 16384),
          (128, 64, 8192), (128, 1024, 8192)]
QUERIES = 4096


def run(json_path: str | None = None) -> list[dict]:
    rows = []
    for heads, topk, context in SHAPES:
        a = build(heads, 4, topk, context, 1, QUERIES, "cuda")
        call = {k: v for k, v in a.items() if not k.startswith("_")}
        out = torch.empty_like(call["q"])
        lse = torch.empty(call["q"].shape[:2], dtype=torch.float32, device="cuda")
        step = time_cuda(lambda: sparse_attention_fwd(**call, out=out, lse=lse), warmup=5, iters=30, flush_l2=True,
                         graph=True)
        keys = time_cuda(lambda: bf16_keys(call["ring"], call["pool"], call["block_tables"], call["cu_seqlens"],
                                           call["start_pos"], call["token_slots"], window=call["window"],
                                           ratio=call["ratio"], block_size=call["block_size"],
                                           entries=call["max_visible"]),
                         warmup=5, iters=30, flush_l2=True, graph=True)
        items = QUERIES * -(-heads // 64)
        waves = -(-items // sm_count(torch.device("cuda")))
        chunks = 2 + topk // 64
        rows.append(dict(heads=heads, topk=topk, chunks=chunks, step_us=step * 1e6, bf16_keys_us=keys * 1e6,
                         wave_us=(step - keys) * 1e6 / waves))
        print(f"H={heads:3d} top-k {topk:4d} ({chunks:2d} chunks): step {step * 1e6:8.1f} µs, BF16 rows "
              f"{keys * 1e6:5.1f} µs, attention per program wave {rows[-1]['wave_us']:6.2f} µs", flush=True)
    flash = [r for r in rows if r["heads"] == 64]
    n = len(flash)
    mx = sum(r["chunks"] for r in flash) / n
    my = sum(r["wave_us"] for r in flash) / n
    b = sum((r["chunks"] - mx) * (r["wave_us"] - my) for r in flash) / sum((r["chunks"] - mx) ** 2 for r in flash)
    a = my - b * mx
    print(f"# {environment('cuda')['device']}: per chunk {b:.3f} µs, per item {a:.2f} µs (64 heads, least squares)")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"environment": environment("cuda"), "per_chunk_us": b, "per_item_us": a, "rows": rows}, f,
                      indent=1)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write rows + fit here")
    run(ap.parse_args().json)


if __name__ == "__main__":
    main()
