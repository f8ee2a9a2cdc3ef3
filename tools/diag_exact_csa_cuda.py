"""Diagnostic (GPU, < 30 s): the tiny CSA layer of ``tests/layer/test_torch_backend_cuda.py`` on the CPU and on
CUDA, stage by stage.

Prints which backend and plan each stage of the CUDA step took, then per step the CPU-vs-CUDA relative error of
the compressed entries (main and indexer pools), of the index scores (the CUDA kernel's score buffer against the
torch backend's scores), the top-k rows whose selections differ — and how many of those are ties (the two
selections' CPU scores equal to 1e-5: SPEC §5 leaves the order of ties open) —, and of the layer's output.
Usage: PYTHONPATH=src python3 tools/diag_exact_csa_cuda.py [--numerics exact] [--seed 2]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

import dsv4
from dsv4.cache import HybridCache
from dsv4.layer import Attention
from dsv4.ops import torch_ops
from dsv4.ops.triton_indexer import score_buffer
from dsv4.reference.indexer import index_scores, topk_differences

CHUNKS = [37, 5, 60, 1, 1, 3, 4]  # the test's steps
LAYER = 1  # the tiny preset's CSA layer


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a − b‖ / ‖b‖`` in FP64 on the CPU (0 when both are empty or zero)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    den = b.norm().item()
    return (a - b).norm().item() / den if den else (a - b).norm().item()


def stage_table(lp: Any) -> list[tuple[str, str]]:
    """What each stage of a CSA step runs under the layer plan ``lp`` (``ops.plan.LayerPlan``)."""
    idx = lp.indexer
    return [
        ("norms, queries", "Triton kernels" if lp.kernels else "torch"),
        ("FP8-GEMM projections", lp.projection.describe() if lp.projection else "torch (reference.primitives.project)"),
        ("new_entries (write)", lp.write.describe() if lp.write else "torch (torch_ops.new_entries)"),
        ("indexer scores", idx.scores.describe() if idx and idx.scores else "torch (reference.indexer.index_scores)"),
        ("indexer top-k", idx.topk.describe() if idx else "torch (reference.indexer.select_topk)"),
        ("attention", lp.attention.describe() if lp.attention else "torch (torch_ops.attend)"),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numerics", default="exact", choices=["exact", "official"])
    ap.add_argument("--seed", type=int, default=2, help="the weights' seed (the test's: 2)")
    ap.add_argument("--device", default="cuda", help="the device compared with the CPU (cpu: a smoke run)")
    a = ap.parse_args()
    cfg = dsv4.ModelConfig.preset("tiny")
    m, k = cfg.ratio(LAYER), cfg.index_topk
    x = torch.randn(sum(CHUNKS), cfg.hidden_size, generator=torch.Generator().manual_seed(LAYER))
    w = dsv4.AttentionWeights.random(cfg, LAYER, seed=a.seed)
    runs = {}
    for dev in ("cpu", a.device):
        cache = HybridCache(cfg, layers=[LAYER], max_requests=2, num_blocks=64, block_size=32, device=dev,
                            numerics=a.numerics)
        cache.add_request("r")
        runs["cpu" if dev == "cpu" and "cpu" not in runs else "cuda"] = (cache, Attention(w, cfg, LAYER))
    layer_gpu = runs["cuda"][1]
    print(f"tiny CSA layer {LAYER}, numerics {a.numerics}; default backend on {a.device}: "
          f"{layer_gpu.backend_for(torch.device(a.device))!r}, on the CPU: "
          f"{runs['cpu'][1].backend_for(torch.device('cpu'))!r}")

    # the torch backend's index scores of each step, from its own queries and head weights (CPU run)
    cpu_scores: list[torch.Tensor] = []
    plain_topk = torch_ops.indexer_topk

    def recording_topk(step, q_idx, head_weights):
        s = torch.full((step.batch.num_tokens, max(1, step.batch.addressable_entries(m))), float("nan"))
        for rows, keys in torch_ops.request_index_keys(step.cache, step.batch, m):
            s[rows, : keys.shape[0]] = index_scores(q_idx[rows], head_weights[rows], keys, step.numerics.score_dtype)
        cpu_scores.append(s)
        return plain_topk(step, q_idx, head_weights)

    torch_ops.indexer_topk = recording_topk
    at, ys, plan_lines = 0, {"cpu": [], "cuda": []}, []
    print(f"\n{'step':>4} {'T':>3} {'kv pool':>9} {'idx pool':>9} {'scores':>9} {'top-k rows differ':>18} "
          f"{'of them ties':>12} {'output':>9} {'lse':>9}")
    try:
        for s, n in enumerate(CHUNKS):
            outs, batches, plans = {}, {}, {}
            for dev, (cache, layer) in runs.items():
                batch = cache.prepare_forward({"r": n})
                plan = layer.plan_step(batch, cache)
                if dev == "cuda" and s in (0, 1, 3):  # a 37-token chunk, a 5-token one, a 1-token decode
                    plan_lines.append(f"step {s} on {a.device} ({plan.backend} backend{', ' if plan.summary else ''}"
                                      f"{plan.summary}):")
                    plan_lines += [f"    {stage:<22} {how}" for stage, how in stage_table(plan.layer(layer.kind))]
                outs[dev] = layer.forward_with_aux(x[at: at + n].to(cache.device), batch, cache, plan)
                batches[dev], plans[dev] = batch, plan.layer(layer.kind)
            at += n
            cpu_cache, gpu_cache = runs["cpu"][0].layer(LAYER), runs["cuda"][0].layer(LAYER)
            kv = rel(gpu_cache.kv_pages.view(torch.float32), cpu_cache.kv_pages.view(torch.float32))
            ix = rel(gpu_cache.index_pages.view(torch.float32), cpu_cache.index_pages.view(torch.float32))
            visible = batches["cpu"].visible_entries[m].cpu()
            ref = cpu_scores[-1]
            vis_mask = torch.arange(ref.shape[1])[None, :] < visible[:, None]
            lp_gpu = plans["cuda"]
            if lp_gpu.indexer is not None and lp_gpu.indexer.scores is not None:
                got = score_buffer(gpu_cache, batches["cuda"], m, runs["cuda"][0].numerics.score_dtype).float().cpu()
                got = got[:, : ref.shape[1]]
                sc = rel(torch.where(vis_mask, got, 0.0), torch.where(vis_mask, ref.float(), 0.0))
                sc_txt = f"{sc:9.2e}"
            else:
                sc_txt = f"{'(torch)':>9}"
            want, have = outs["cpu"].entry_idx.cpu(), outs["cuda"].entry_idx.cpu()
            if have.shape[1] > want.shape[1]:  # the Triton backend's fixed width k; the torch one's min(k, N)
                assert (have[:, want.shape[1]:] == -1).all()
                have = have[:, : want.shape[1]]
            differs, ties = topk_differences(ref.nan_to_num(float("-inf")), want, have)
            for t in differs.nonzero().flatten().tolist():
                print(f"      row {t}: CPU {sorted(v for v in want[t].tolist() if v >= 0)} "
                      f"CUDA {sorted(v for v in have[t].tolist() if v >= 0)}")
            y = rel(outs["cuda"].y.float(), outs["cpu"].y.float())
            lse = rel(outs["cuda"].lse, outs["cpu"].lse)
            print(f"{s:>4} {n:>3} {kv:9.2e} {ix:9.2e} {sc_txt} {int(differs.sum()):>18} {int(ties.sum()):>12} "
                  f"{y:9.2e} {lse:9.2e}")
            for dev in ys:
                ys[dev].append(outs[dev].y.float().cpu())
    finally:
        torch_ops.indexer_topk = plain_topk
    print("\nwhat each stage ran:\n" + "\n".join(plan_lines))
    total = rel(torch.cat(ys["cuda"]), torch.cat(ys["cpu"]))
    print(f"\nwhole output, CUDA vs CPU: relative error {total:.3e} (the test's bound: "
          f"{1e-4 if a.numerics == 'exact' else 5e-2:g})")


if __name__ == "__main__":
    main()
