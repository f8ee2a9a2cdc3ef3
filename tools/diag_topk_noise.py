"""The reference's own top-k noise floor: how far a CSA row's selection moves when the compressor projections are
summed in another order (issue 38's stacked compressor GEMM; the spot check's ``TOPK_SLACK``).

The official numerics quantize the indexer's compressed keys to FP4 (E2M1, block-scaled) after a BF16 cast. Two
correct implementations whose compressor GEMMs sum in different orders (an FP32 GEMM, cuBLAS's BF16 tensor-core
GEMM, one stacked GEMM) give projections a few 1e-6 apart; where a value sits that close to a BF16 or E2M1 rounding
boundary, the key's code flips by a whole step, and the row's index scores move by that step times the query.
This tool measures the resulting selection differences with the reference alone, on the CPU:

1. the reference's index scores and top-k of one CSA layer (random V4-Flash weights, RMS-normed random inputs);
2. the same with the compressor projections ``a``, ``z`` multiplied by ``1 + ε·N(0, 1)`` (``--rel``, default
   4e-6: the relative difference measured on an H200 between stacked and separate cuBLAS GEMMs of these shapes,
   ``bench_compressor_projections.py``);
3. every row whose perturbed selection differs: its ``topk_within`` gap against the unperturbed scores.

Prints, per perturbation seed, how many rows differ and the distribution of their gaps (fraction of the row's
largest |score|), with the counts above 2⁻⁴ and 2⁻³.

    PYTHONPATH=src python tools/diag_topk_noise.py [--tokens 4096] [--seeds 3] [--rel 4e-6]
"""

from __future__ import annotations

import argparse
import time

import torch

import dsv4
from dsv4.config import LayerKind
from dsv4.numerics import resolve_numerics
from dsv4.reference import compressor as ref_compressor
from dsv4.reference import indexer as ref_indexer
from dsv4.reference.layer import query_path
from dsv4.reference.indexer import select_topk, topk_within
from dsv4.reference.rope import rope_inv_freq


def index_scores(w, cfg, x: torch.Tensor, li: int, nm, rel: float, seed: int | None) -> torch.Tensor:
    """The reference's index scores ``[T, n]`` of layer ``li``; ``seed``: perturb the indexer compressor's
    projections by ``rel`` (None: as the reference computes them)."""
    positions = torch.arange(x.shape[0])
    inv_freq = rope_inv_freq(cfg, cfg.layer_kind(li), x.device)
    _, q_latent = query_path(w, cfg, x, positions, inv_freq, nm)
    index_q = ref_indexer.indexer_queries(q_latent, w.indexer, positions, inv_freq, cfg, nm)
    head_w = ref_indexer.indexer_head_weights(x, w.indexer, cfg, nm)
    project = ref_compressor.project
    if seed is not None:
        g = torch.Generator().manual_seed(seed)

        def perturbed(*args, **kwargs):
            a, z = project(*args, **kwargs)
            return (a * (1 + rel * torch.randn(a.shape, generator=g)),
                    z * (1 + rel * torch.randn(z.shape, generator=g)))

        ref_compressor.project = perturbed
    try:
        keys = nm.qdq_index(ref_compressor.compress(x, w.indexer.compressor, True, inv_freq, cfg.norm_eps,
                                                    nm.act_dtype))
    finally:
        ref_compressor.project = project
    return ref_indexer.index_scores(index_q, head_w, keys, nm.score_dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="v4-flash")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--seeds", type=int, default=3, help="perturbations drawn")
    p.add_argument("--rel", type=float, default=4e-6, help="relative size of the projections' perturbation")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = dsv4.ModelConfig.preset(a.preset)
    li = next(i for i in range(cfg.num_layers) if cfg.layer_kind(i) is LayerKind.CSA)
    nm = resolve_numerics("official")
    w = dsv4.AttentionWeights.random(cfg, li, seed=0)
    h = torch.randn(a.tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    x = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)).to(nm.act_dtype)
    m = cfg.ratio(li)
    visible = (torch.arange(a.tokens) + 1) // m
    t0 = time.perf_counter()
    with torch.no_grad():
        s0 = index_scores(w, cfg, x, li, nm, a.rel, None)
        want = select_topk(s0, visible, cfg.index_topk)
        print(f"{a.preset} layer {li} (CSA), {a.tokens} tokens, top-{cfg.index_topk}; perturbation rel {a.rel:g}; "
              f"reference {time.perf_counter() - t0:.0f} s")
        print(f"{'seed':>5}{'rows differ':>13}{'max gap':>10}{'p99 gap':>10}{'> 2^-4':>8}{'> 2^-3':>8}  worst rows")
        for seed in range(a.seeds):
            s1 = index_scores(w, cfg, x, li, nm, a.rel, seed)
            got = select_topk(s1, visible, cfg.index_topk)
            differs = (torch.sort(got, dim=1).values != torch.sort(want, dim=1).values).any(dim=1)
            _, gap = topk_within(s0, visible, got, cfg.index_topk, 2.0**-4)
            g = gap[differs].clamp_min(0)
            top = torch.topk(gap.masked_fill(~differs, float("-inf")), min(3, int(differs.sum()))).indices.tolist() \
                if bool(differs.any()) else []
            q99 = float(torch.quantile(g, 0.99)) if g.numel() else 0.0
            print(f"{seed:>5}{int(differs.sum()):>13}{float(g.max()) if g.numel() else 0.0:>10.4f}{q99:>10.4f}"
                  f"{int((g > 2.0**-4).sum()):>8}{int((g > 2.0**-3).sum()):>8}  {top}", flush=True)


if __name__ == "__main__":
    main()
