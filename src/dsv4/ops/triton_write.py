"""The Triton backend's projections and write path (``ops.backend``): the norms and queries one launch each
(``kernels.project``), the window entries and every compressor one launch per layer step (``kernels.write``), and
the ring commit after attention.

Per layer and decode step the writes take two launches (plus the compressors' projections, the torch backend's:
one GEMM for all of a layer's, ``projections.layer_compressor_projections``): ``compress`` (one launch; CSA/HCA: with
every compressor, two launches for a CSA prefill chunk) before attention, ``append_swa`` after it — as ``LayerStep.plan.write`` says. Bit for
bit the torch backend's results on CUDA (the norms of ``c^Q``: within one BF16 step; the queries: within one BF16
step, their sum of squares in Triton's order). A layer whose plan has no ``write`` (formats or geometry the
kernels do not handle) runs the torch backend's ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..input_stack import input_stack
from ..kernels.device import runs_here
from ..kernels.project import queries as query_kernels, rms_norm as rms_norm_kernels
from ..kernels.write import window as window_kernels
from ..kernels.write.launch import CompressorArgs, write_before_attention
from ..numerics import Numerics
from ..query_stack import query_stack
from ..reference.primitives import rms_norm as torch_rms_norm
from ..weights import CompressorWeights, Projection
from . import projections, torch_ops
from .triton_project import projector, takes_codes
from .step import LayerStep

__all__ = ["append_swa", "input_projections", "kernels_handle", "new_entries", "queries", "query_latent",
           "query_projections", "rms_norm", "window_kv"]

#: widest row the RMSNorm kernel takes in one program
RMS_NORM_MAX_CHANNELS = 8192


def kernels_handle(numerics: Numerics, nope_dim: int, kv_dim: int, index_dim: int) -> bool:
    """Whether the write kernels implement these numerics and entry geometry: the official formats (BF16
    activations, ``fp8_ds_mla`` KV entries of 448 + 64 dims, 128-dim ``mxfp4`` indexer keys)."""
    return (numerics.kv_format == "fp8_ds_mla" and numerics.index_format == "mxfp4"
            and numerics.act_dtype == torch.bfloat16 and (nope_dim, kv_dim, index_dim) == (448, 512, 128))


def rms_norm(x: Tensor, weight: Tensor, eps: float, quantize: bool = False) -> Tensor:
    """A weighted RMSNorm (``reference.primitives.rms_norm``) in one launch for BF16 rows of up to
    ``RMS_NORM_MAX_CHANNELS``; else the reference's torch ops. ``quantize``: the launch also makes the result's FP8
    codes for the GEMM that reads it (``kernels.project.rms_norm``; not for 512 channels)."""
    if not (runs_here(x) and x.dtype == torch.bfloat16 and x.dim() == 2 and 0 < x.shape[1] <= RMS_NORM_MAX_CHANNELS):
        return torch_rms_norm(x, weight, eps)
    return rms_norm_kernels.rms_norm(x, weight, eps, quantize=quantize and x.shape[1] != 512)


def input_projections(step: LayerStep, x: Tensor) -> tuple[Tensor, Tensor]:
    """See ``backend.AttentionBackend.input_projections``: with the layer's ``[W_qa; W_kv]`` stacked
    (``dsv4.input_stack``) one FP8 GEMM as the step's plan says, then each norm reading its column block in place;
    else one GEMM per projection."""
    stack = input_stack(step.weights)
    if stack is None or step.plan.projection is None or not runs_here(x):
        return query_latent(step, x), window_kv(step, x)
    y = projector(step)(x, stack, step.numerics)
    n, w, eps = step.cfg.q_lora_rank, step.weights, step.cfg.norm_eps
    q_latent = rms_norm(y[:, :n], w.q_norm, eps, quantize=takes_codes(step, _query_weight(step)))
    return q_latent, rms_norm(y[:, n:], w.kv_norm, eps)


def query_latent(step: LayerStep, x: Tensor) -> Tensor:
    """``c^Q = RMSNorm_{q_norm}(W_qa x)`` (its own GEMM): x ``[T, d]`` → ``[T, q_lora_rank]`` act dtype."""
    return projections.query_latent(step, x, rms_norm, projector(step))


def queries(step: LayerStep, q_latent: Tensor) -> tuple[Tensor, Tensor | None]:
    """See ``backend.AttentionBackend.queries``: the projection (``query_projections``: CSA, one GEMM for the
    heads' and the indexer's), then the per-head RMSNorm + RoPE in one launch reading the heads' projection in
    place. Returns the queries and the indexer's projection where that GEMM made it (else ``None``)."""
    if not step.plan.kernels:
        return torch_ops.queries(step, q_latent)
    q, index = query_projections(step, q_latent)
    return query_kernels.queries(q, step.positions, step.inv_freq.float().contiguous(), step.cfg.norm_eps), index


def query_projections(step: LayerStep, q_latent: Tensor) -> tuple[Tensor, Tensor | None]:
    """``W_qb c^Q`` per head ``[T, H, D]`` and, where the layer's ``[W_qb; W_Iq]`` are stacked
    (``dsv4.query_stack``: CSA), the indexer's ``W_Iq c^Q`` ``[T, H_I·c_I]``: column views of one FP8 GEMM's
    ``[T, H·D + H_I·c_I]`` output (rows that far apart), as the step's plan says; else (no stack, or the plan runs
    it as its parts: ``ProjectionPlan.stacked``) ``W_qb c^Q`` alone (its own GEMM, contiguous) and ``None``.
    Act dtype."""
    stack = _query_weight(step)
    if stack is step.weights.wq_b or not runs_here(q_latent):
        return projections.query_projection(step, q_latent, projector(step)), None
    y = projector(step)(q_latent, stack, step.numerics)
    cfg = step.cfg
    n = cfg.num_heads * cfg.head_dim
    return y[:, :n].unflatten(-1, (cfg.num_heads, cfg.head_dim)), y[:, n:]


def _query_weight(step: LayerStep) -> Projection:
    """The weight the query latent's GEMM multiplies: the stack ``[W_qb; W_Iq]`` (``dsv4.query_stack``: CSA) where
    the step's plan runs it whole, else ``W_qb``."""
    stack = query_stack(step.weights)
    plan = step.plan.projection
    if stack is None or plan is None or not plan.stacked(*stack.shape):
        return step.weights.wq_b
    return stack


def window_kv(step: LayerStep, x: Tensor) -> Tensor:
    """The window KV ``RMSNorm_{kv_norm}(W_kv x)`` (its own GEMM; the norm: the torch backend's bits): x ``[T, d]``
    → ``[T, D]`` act dtype."""
    return projections.window_kv(step, x, rms_norm, projector(step))


def _window_entries(step: LayerStep, kv: Tensor) -> Tensor:
    """An SWA layer's window entries: one launch."""
    return window_kernels.window_entries(kv, step.positions, step.inv_freq.float().contiguous())


def _compressor_args(step: LayerStep, projected: tuple[Tensor, Tensor], cw: CompressorWeights, prefix: str,
                     pages: Tensor) -> CompressorArgs:
    """One compressor's kernel arguments: its projections ``(a, z_raw)`` (column views of the layer's one GEMM
    output; the position bias is added in the kernel), weights and state."""
    st = step.cache.state
    a, z_raw = projected
    return CompressorArgs(
        a=a, z_raw=z_raw, ape=cw.ape.float().contiguous(), norm=cw.norm.float().contiguous(),
        tail_kv=st[f"{prefix}tail_kv"], tail_gate=st[f"{prefix}tail_gate"],
        prev_kv=st.get(f"{prefix}prev_kv"), prev_gate=st.get(f"{prefix}prev_gate"), pages=pages,
    )


def new_entries(step: LayerStep, x: Tensor, kv: Tensor) -> Tensor:
    """See ``backend.AttentionBackend.new_entries``: SWA layers one launch; CSA/HCA one launch after the
    compressors' projection GEMMs (two for a CSA prefill chunk), as ``step.plan.write`` says."""
    plan = step.plan.write
    if plan is None:
        return torch_ops.new_entries(step, x, kv)
    if plan.ratio == 0:
        return _window_entries(step, kv)
    layer, w = step.cache, step.weights
    projected = projections.layer_compressor_projections(step, x)  # the torch backend's: same bits
    main = _compressor_args(step, projected[0], w.compressor, "", layer.kv_pages)
    index = (_compressor_args(step, projected[1], w.indexer.compressor, "index_", layer.index_pages)
             if plan.has_index else None)
    scratch = layer.workspace.get("compressor.rms_scratch", (plan.scratch_rows, 512), torch.float32)
    arrivals = layer.workspace.get("compressor.arrivals", (plan.scratch_rows,), torch.int32, zero=True)
    return write_before_attention(plan, kv, step.positions, step.inv_freq.float().contiguous(), step.batch,
                                  float(step.cfg.norm_eps), main, index, scratch, arrivals)


def append_swa(step: LayerStep, kv: Tensor) -> None:
    """See ``backend.AttentionBackend.append_swa``: one launch over the kept tokens."""
    if step.plan.write is None:
        return torch_ops.append_swa(step, kv)
    layer, batch = step.cache, step.batch
    window_kernels.append_swa(kv.contiguous(), layer.ring, layer.ring_positions, batch.token_slots, batch.ring_slots,
                              batch.ring_rows, batch.positions, batch.window)
