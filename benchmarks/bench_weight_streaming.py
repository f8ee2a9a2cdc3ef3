"""How close a decode step's GEMMs are to reading their weights: each GEMM of a layer at decode rows against a kernel
that only streams the same bytes, and what the whole step would gain if every GEMM ran at that speed.

For every weight a V4 decode step multiplies (the FP8 block GEMMs ``wq_a+wkv``, ``wq_b`` or the CSA stack
``wq_b+indexer.wq_b``, ``wo_b``; the BF16 grouped ``wo_a``; the BF16 compressor stacks) at ``--rows`` rows:

* ``gemm``: the launch the step runs — ``kernels.project.block_gemm`` as ``gemm_config`` picks it, on activations
  already quantized (as the norm that makes them, or the quantization launch before it, leaves them in a step);
  ``torch.bmm`` for the grouped ``wo_a`` (``ops.projections.grouped_latent``'s call); ``torch.mm`` with FP32 output
  for a compressor stack (``ops.projections.stacked_compressor_projections``'s);
* ``stream``: a Triton kernel that reads the same bytes once and does nothing else (a persistent grid, 16-byte
  loads folded into one word per program), the best of a few grid sizes: what any kernel reading this weight can
  reach at this size, launch and ramp included.

Each timing is a CUDA graph of calls that each read another copy of the weight (none in L2 when its call starts,
as in a layer: ``bench_fp8_projections.weight_copies``), per call. The last table weights each row by how many of
that GEMM a decode step runs (per layer kind) and gives the step's GEMM time against the same GEMMs at the
streaming figure.

    python benchmarks/bench_weight_streaming.py [--preset v4-flash] [--rows 64] [--json out.json]

``dsv4 bench`` runs it through ``run``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable

import torch
import triton
import triton.language as tl

import dsv4
from dsv4.bench.roofline import environment, measure_copy_bandwidth, roofline_row, time_cuda
from dsv4.compressor_stack import compressor_stack, stack_compressor_weights
from dsv4.config import LayerKind
from dsv4.formats.block_fp8 import BlockFp8Weight
from dsv4.input_stack import input_stack, stack_input_projections
from dsv4.kernels.device import sm_count
from dsv4.kernels.project import block_gemm, fp8_gemm
from dsv4.query_stack import query_stack, stack_query_projections

from bench_fp8_projections import weight_copies

REQUIRES_CUDA = True
#: int32 words each program of the streaming kernel loads per iteration (16 KiB)
STREAM_BLOCK = 4096
#: programs per SM the streaming kernel tries (the best is kept)
STREAM_PROGRAMS_PER_SM = (1, 2, 4, 8)


@triton.jit
def _stream_kernel(src_ptr, out_ptr, n_words, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    """Program p reads words ``(p + i·P)·BLOCK …`` (i < ITERS, P programs) of ``src`` and stores their XOR: every
    byte is read once, and the store keeps the loads from being optimised away."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(ITERS):
        offs = (pid + i * programs).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(src_ptr + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + pid, tl.xor_sum(acc, 0))


def stream_read(words: torch.Tensor, out: torch.Tensor, programs: int) -> None:
    """One pass over ``words`` (int32, contiguous) by ``programs`` programs; ``out``: int32 ``[≥ programs]``."""
    n = words.numel()
    iters = triton.cdiv(triton.cdiv(n, STREAM_BLOCK), programs)
    _stream_kernel[(programs,)](words, out, n, ITERS=iters, BLOCK=STREAM_BLOCK, num_warps=8)


def decode_weights(cfg: dsv4.ModelConfig) -> dict[str, tuple[object, dict[LayerKind, int]]]:
    """Every weight a decode step multiplies, by name, with how many of it each layer kind runs."""
    kinds = {cfg.layer_kind(li): li for li in range(cfg.num_layers)}
    out: dict[str, tuple[object, dict[LayerKind, int]]] = {}
    csa, hca = kinds.get(LayerKind.CSA), kinds.get(LayerKind.HCA)
    ref = csa if csa is not None else next(iter(kinds.values()))
    official = dsv4.Numerics.official()
    w = stack_query_projections(stack_input_projections(stack_compressor_weights(
        dsv4.AttentionWeights.random(cfg, ref, seed=0, device="cuda").for_numerics(official))))
    every = {k: 1 for k in kinds}
    out["wq_a+wkv"] = (input_stack(w), every)
    if csa is not None:
        out["wq_b+indexer.wq_b"] = (query_stack(w), {LayerKind.CSA: 1})
    out["wq_b"] = (w.wq_b, {k: 1 for k in kinds if k is not LayerKind.CSA})
    out["wo_b"] = (w.wo_b, every)
    out["wo_a (bf16, grouped)"] = (w.wo_a.unflatten(0, (cfg.o_groups, cfg.o_lora_rank)), every)
    if csa is not None:
        out["compressors CSA (bf16)"] = (compressor_stack(w), {LayerKind.CSA: 1})
    if hca is not None:
        wh = stack_compressor_weights(
            dsv4.AttentionWeights.random(cfg, hca, seed=0, device="cuda").for_numerics(official))
        out["compressors HCA (bf16)"] = (compressor_stack(wh), {LayerKind.HCA: 1})
    return out


def _nbytes(w: object) -> int:
    """The bytes a GEMM over ``w`` must read (FP8: values and block scales)."""
    return w.nbytes if isinstance(w, BlockFp8Weight) else w.numel() * w.element_size()


def _words(w: object) -> torch.Tensor:
    """The weight's bytes as int32 words (FP8: the values; the scales are < 0.02% of the bytes)."""
    t = w.data if isinstance(w, BlockFp8Weight) else w
    return t.contiguous().view(torch.uint8).flatten()[: t.numel() * t.element_size() // 4 * 4].view(torch.int32)


def gemm_call(w: object, rows: int, sms: int) -> Callable[[object], torch.Tensor]:
    """The step's launch for ``w`` at ``rows`` rows (see the module doc)."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    if isinstance(w, BlockFp8Weight):
        N, K = w.shape
        x = torch.randn(rows, K, generator=g, device="cuda").bfloat16()
        config = block_gemm.gemm_config(rows, N, K, sms)
        codes = fp8_gemm.quantize_activations(x) if config.tma else None
        return lambda wc: block_gemm.block_fp8_linear(x, wc, torch.bfloat16, config, codes=codes)
    if w.dim() == 3:  # grouped wo_a: [G, o_lora, H/G·D]
        G, n, k = w.shape
        x = torch.randn(rows, G, k, generator=g, device="cuda").bfloat16()
        out = torch.empty(rows, G, n, dtype=torch.bfloat16, device="cuda")
        return lambda wc: torch.bmm(x.transpose(0, 1), wc.transpose(1, 2), out=out.transpose(0, 1))
    x = torch.randn(rows, w.shape[1], generator=g, device="cuda").bfloat16()
    return lambda wc: torch.mm(x, wc.T, out_dtype=torch.float32)


def run(quick: bool = False, roofline: Any = None, preset: str = "v4-flash", rows: int = 64) -> list[dict]:
    """Time every decode weight's GEMM and its streaming read (see the module doc); one ``roofline_row`` per weight
    (``us``: the GEMM; ``stream_us``: the best streaming read; ``per_step``: GEMMs of it a decode step runs), then
    one for the whole step (the GEMMs' sum weighted by ``per_step``). ``quick``: fewer timed calls."""
    cfg = dsv4.ModelConfig.preset(preset)
    bw = roofline.copy_bw if roofline is not None else measure_copy_bandwidth("cuda")
    sms = sm_count("cuda")
    iters = 10 if quick else 20
    layers = {k: sum(cfg.layer_kind(li) is k for li in range(cfg.num_layers)) for k in LayerKind}
    print(f"{torch.cuda.get_device_name()}  {preset}, {rows} rows; copy bandwidth {bw / 1e12:.2f} TB/s; "
          f"{sms} SMs; layers {', '.join(f'{k.name} {n}' for k, n in layers.items() if n)}")
    print(f"{'weight':<24}{'MB':>7}{'copy-bw us':>11}{'stream us':>10}{'gemm us':>9}{'gemm/stream':>12}"
          f"{'per step':>9}")
    out, step_gemm, step_stream, step_bytes = [], 0.0, 0.0, 0
    for name, (w, per_kind) in decode_weights(cfg).items():
        nbytes = _nbytes(w)
        copies = weight_copies(w)
        words = [_words(c) for c in copies]
        sink = torch.empty(max(STREAM_PROGRAMS_PER_SM) * sms, dtype=torch.int32, device="cuda")
        stream = {}
        for per_sm in STREAM_PROGRAMS_PER_SM:
            p = per_sm * sms
            stream[per_sm] = time_cuda(lambda: [stream_read(t, sink, p) for t in words], warmup=3, iters=iters,
                                       graph=True) / len(words)
        best = min(stream, key=stream.get)
        call = gemm_call(w, rows, sms)
        t_gemm = time_cuda(lambda: [call(c) for c in copies], warmup=3, iters=iters, graph=True) / len(copies)
        count = sum(layers[k] * n for k, n in per_kind.items())
        step_gemm += count * t_gemm
        step_stream += count * stream[best]
        step_bytes += count * nbytes
        out.append(roofline_row(f"{preset} decode GEMM {name} M={rows}", t_gemm, bytes=nbytes, flops=0,
                                copy_bw=bw, mm_rate=0, weight=name, M=rows, per_step=count,
                                stream_us=stream[best] * 1e6, stream_programs_per_sm=best,
                                stream_us_by_programs_per_sm={str(k): v * 1e6 for k, v in stream.items()}))
        print(f"{name:<24}{nbytes / 1e6:>7.1f}{nbytes / bw * 1e6:>11.1f}{stream[best] * 1e6:>10.1f}"
              f"{t_gemm * 1e6:>9.1f}{t_gemm / stream[best]:>12.2f}{count:>9}", flush=True)
    out.append(roofline_row(f"{preset} decode step's GEMMs M={rows}", step_gemm, bytes=step_bytes, flops=0,
                            copy_bw=bw, mm_rate=0, M=rows, stream_us=step_stream * 1e6))
    print(f"a decode step's GEMMs: {step_gemm * 1e3:.3f} ms; the same weights streamed: {step_stream * 1e3:.3f} ms "
          f"(every GEMM at the streaming figure saves {(step_gemm - step_stream) * 1e3:.3f} ms a step)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="v4-flash")
    ap.add_argument("--rows", type=int, default=64, help="decode rows (the step's tokens)")
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = run(preset=a.preset, rows=a.rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"environment": environment("cuda"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
