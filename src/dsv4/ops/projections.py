"""The layer's projection GEMMs (SPEC §1.3, §3), shared by both backends, on the weights ``LayerStep.weights``
holds (``AttentionWeights.for_numerics``).

The five projections DeepSeek runs as FP8 GEMMs go through a ``Project`` — ``reference.primitives.project`` on the
torch backend (the official numerics' FP8 quantization points, products summed in FP32), the Triton backend's
FP8 GEMM on the GPU — and each function takes the RMSNorm to apply where SPEC §3 has one, so that a backend
passes its own (the Triton backend's is one launch per norm). ``wo_a`` (grouped) and the indexer's ``weights_proj``
are BF16 GEMMs in the official model and here.

The compressors' projections (``a = x W_kvᵀ``, ``z_raw = x W_gateᵀ`` of the main compressor and, CSA, the indexer's;
SPEC §4: FP32 products and sums) are BF16 matrices: with BF16 activations on CUDA they run on BF16 tensor cores with
FP32 accumulation and output — all of a layer's in ONE GEMM over the stacked matrix ``[main.wkv; main.wgate;
indexer.wkv; indexer.wgate; indexer.weights_proj]`` (``dsv4.compressor_stack``; ``Attention`` stacks its device
weights once), each projection a column block of the one FP32 output; elsewhere (the CPU, the exact numerics) one
FP32 GEMM per matrix. Both backends call ``layer_compressor_projections``, so they compute the same bits on a device.
The stack's last block, the FP32 sums of the indexer's ``W_w x``, is kept with ``x`` (``attach_head_sums``) for
``indexer_weights``, which rounds it to BF16 as the official BF16 GEMM rounds its output: the same products, summed
in another order, and one GEMM fewer per CSA layer.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from torch import Tensor

from ..compressor_stack import compressor_stack, compressors, head_rows
from ..reference.indexer import indexer_head_weights
from ..numerics import Numerics
from ..reference.layer import grouped_output
from ..reference.primitives import project as reference_project
from ..weights import CompressorWeights, Projection
from .step import LayerStep

__all__ = ["Norm", "Project", "attach_head_sums", "compressor_projections", "grouped_latent",
           "indexer_query_projection", "indexer_weights", "layer_compressor_projections", "output", "query_latent",
           "query_projection", "stacked_compressor_projections", "take_head_sums", "window_kv"]

#: a weighted RMSNorm ``(x [rows, C], weight [C], eps) -> [rows, C]`` in x's dtype
Norm = Callable[[Tensor, Tensor, float], Tensor]
#: one of the FP8-GEMM projections ``(x [..., in], weight [out, in], numerics) -> [..., out]`` in the act dtype
Project = Callable[[Tensor, Projection, Numerics], Tensor]


def query_latent(step: LayerStep, x: Tensor, norm: Norm, project: Project = reference_project) -> Tensor:
    """``c^Q = RMSNorm_{q_norm}(W_qa x)``: x ``[T, d]`` → ``[T, q_lora_rank]`` act dtype."""
    w = step.weights
    return norm(project(x, w.wq_a, step.numerics), w.q_norm, step.cfg.norm_eps)


def query_projection(step: LayerStep, q_latent: Tensor, project: Project = reference_project) -> Tensor:
    """``W_qb c^Q`` split into heads: ``[T, q_lora_rank]`` → ``[T, H, D]`` act dtype."""
    cfg = step.cfg
    return project(q_latent, step.weights.wq_b, step.numerics).unflatten(-1, (cfg.num_heads, cfg.head_dim))


def window_kv(step: LayerStep, x: Tensor, norm: Norm, project: Project = reference_project) -> Tensor:
    """``RMSNorm_{kv_norm}(W_kv x)``: x ``[T, d]`` → ``[T, D]`` act dtype."""
    w = step.weights
    return norm(project(x, w.wkv, step.numerics), w.kv_norm, step.cfg.norm_eps)


def indexer_query_projection(step: LayerStep, q_latent: Tensor, project: Project = reference_project) -> Tensor:
    """``W_Iq c^Q``: ``[T, q_lora_rank]`` → ``[T, H_I · c_I]`` act dtype (heads not yet split)."""
    return project(q_latent, step.weights.indexer.wq_b, step.numerics)


def indexer_weights(step: LayerStep, x: Tensor) -> Tensor:
    """The indexer's per-head weights, float32 ``[T, H_I]`` (``reference.indexer.indexer_head_weights``): from the
    stacked compressor GEMM's sums where ``layer_compressor_projections`` kept them with ``x``, else one GEMM."""
    sums = take_head_sums(x, step.weights.indexer.weights_proj)
    if sums is not None:
        return sums.to(step.numerics.act_dtype).float() * step.cfg.index_weight_scale
    return indexer_head_weights(x, step.weights.indexer, step.cfg, step.numerics)


def output(step: LayerStep, o: Tensor, project: Project = reference_project) -> Tensor:
    """Grouped ``W_oa``, then ``W_ob``: o ``[T, H, D]`` (after the inverse RoPE) → ``[T, d]`` act dtype.

    On CUDA the grouped GEMM writes ``[T, G·o_lora]`` in place (``grouped_latent``: the layout ``W_ob`` reads, no
    copy); elsewhere ``reference.layer.grouped_output``'s einsum. The same products either way."""
    if not o.is_cuda:
        return grouped_output(step.weights, step.cfg, o, step.numerics, project)
    return project(grouped_latent(step, o), step.weights.wo_b, step.numerics)


def grouped_latent(step: LayerStep, o: Tensor) -> Tensor:
    """The grouped ``W_oa`` of SPEC §3 step 7 as one batched GEMM writing its ``[T, G, o_lora]`` output in place:
    o ``[T, H, D]`` → ``[T, G·o_lora]`` act dtype, contiguous (group g's latent in columns ``g·o_lora …``).
    ``reference.layer.grouped_output``'s einsum computes the same products into a ``[G, T, o_lora]`` buffer and
    copies it into this layout."""
    cfg, act = step.cfg, step.numerics.act_dtype
    T, G = o.shape[0], cfg.o_groups
    groups = o.reshape(T, G, -1).to(act)  # [T, G, H/G·D], heads contiguous per group
    wo_a = step.weights.wo_a.to(o.device, act).unflatten(0, (G, cfg.o_lora_rank))  # [G, o_lora, H/G·D]
    out = torch.empty((T, G, cfg.o_lora_rank), dtype=act, device=o.device)
    torch.bmm(groups.transpose(0, 1), wo_a.transpose(1, 2), out=out.transpose(0, 1))
    return out.flatten(1)


def layer_compressor_projections(step: LayerStep, x: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Every compressor's projections ``(a, z_raw)`` of the layer — the main compressor's, then (CSA) the
    indexer's; none for SWA —, float32 ``[T, width]`` each (no position bias). Both backends call this.

    With BF16 activations on CUDA and stacked weights (``compressor_stack(step.weights)``: the weights ``Attention``
    computes with) one GEMM computes them all (``stacked_compressor_projections``): column views of one
    ``[T, N]`` output, row stride N; where the stack holds the indexer's ``weights_proj``, its columns are kept with
    ``x`` for ``indexer_weights`` (``attach_head_sums``). Otherwise ``compressor_projections`` of each compressor."""
    comps = compressors(step.weights)
    if comps and x.is_cuda and step.numerics.act_dtype == torch.bfloat16:
        stack = compressor_stack(step.weights)
        if stack is not None:
            rows = head_rows(step.weights)
            pairs, head = stacked_compressor_projections(x.to(torch.bfloat16), stack,
                                                         [c.wkv.shape[0] for c in comps], rows)
            if head is not None:
                attach_head_sums(x, head, step.weights.indexer.weights_proj)
            return pairs
    return [compressor_projections(step, x, cw) for cw in comps]


def stacked_compressor_projections(x: Tensor, stack: Tensor, widths: Sequence[int], head_rows: int = 0
                                   ) -> tuple[list[tuple[Tensor, Tensor]], Tensor | None]:
    """Several compressors' projections in one GEMM: ``x`` BF16 ``[T, d]`` times ``stackᵀ``, ``stack`` BF16
    ``[N, d]`` = ``[W_kv,0; W_gate,0; W_kv,1; W_gate,1; …; W_w]`` with compressor i's matrices ``[widths[i], d]``
    and, when ``head_rows`` > 0, the indexer's ``weights_proj`` ``[head_rows, d]`` last (N = 2·Σ widths +
    head_rows), on BF16 tensor cores with FP32 accumulation and output (``torch.mm(out_dtype=)``; where torch lacks
    it, the CPU, an FP32 GEMM of the same operands). The products are exact in FP32, the sums in the GEMM's order.

    Returns:
        per compressor ``(a, z_raw)``, float32 ``[T, widths[i]]``, and the head sums float32 ``[T, head_rows]``
        (``None`` without head rows): column views of the one ``[T, N]`` output (row stride N).
    Raises:
        ValueError: ``stack`` does not have 2·Σ widths + head_rows rows."""
    if stack.dim() != 2 or stack.shape[0] != 2 * sum(widths) + head_rows:
        raise ValueError(f"stack must be [2 * sum(widths) + head_rows = {2 * sum(widths) + head_rows}, d] for widths "
                         f"{list(widths)} and {head_rows} head rows, got {list(stack.shape)}")
    out = _bf16_mm_fp32_out(x, stack)
    views, col = [], 0
    for width in widths:
        views.append((out[:, col : col + width], out[:, col + width : col + 2 * width]))
        col += 2 * width
    return views, (out[:, col:] if head_rows else None)


_HEAD_SUMS_ATTR = "_dsv4_head_sums"


def attach_head_sums(x: Tensor, sums: Tensor, weights_proj: Tensor) -> None:
    """Keep with the tensor object ``x`` (the layer's attention input) the FP32 sums ``x W_wᵀ`` ``[T, H_I]`` that the
    stacked GEMM made with this ``weights_proj`` (the exact tensor object), for ``take_head_sums``."""
    setattr(x, _HEAD_SUMS_ATTR, (sums, weights_proj))


def take_head_sums(x: Tensor, weights_proj: Tensor) -> Tensor | None:
    """The sums ``attach_head_sums`` kept with ``x``, removed from it — or ``None`` when there are none or they were
    made with another matrix than this ``weights_proj`` object (another layer's): taken once, never stale."""
    kept = x.__dict__.pop(_HEAD_SUMS_ATTR, None)
    if kept is None or kept[1] is not weights_proj:
        return None
    return kept[0]


def compressor_projections(step: LayerStep, x: Tensor, cw: CompressorWeights) -> tuple[Tensor, Tensor]:
    """One compressor's projections ``a = x W_kvᵀ`` and ``z_raw = x W_gateᵀ`` (no position bias), float32
    ``[T, width]`` each (SPEC §4: FP32 products and sums), one GEMM per matrix.

    With BF16 activations on CUDA (the official numerics; the checkpoint's compressor weights are BF16) they run on
    BF16 tensor cores with FP32 accumulation and FP32 output: the same products as an FP32 GEMM of the same operands,
    summed in another order. Elsewhere (the CPU, the exact numerics) an FP32 GEMM. ``layer_compressor_projections``
    runs this where the layer's weights are not stacked."""
    if x.is_cuda and step.numerics.act_dtype == torch.bfloat16:
        xb = x.to(torch.bfloat16)
        return _bf16_mm_fp32_out(xb, cw.wkv), _bf16_mm_fp32_out(xb, cw.wgate)
    xf = x.float()
    return xf @ cw.wkv.float().T, xf @ cw.wgate.float().T


def _bf16_mm_fp32_out(x: Tensor, w: Tensor) -> Tensor:
    """``x @ wᵀ`` of BF16 operands with FP32 output (``torch.mm(..., out_dtype=)`` where torch has it)."""
    w = w.to(torch.bfloat16)
    try:
        return torch.mm(x, w.T, out_dtype=torch.float32)
    except (TypeError, RuntimeError):
        return x.float() @ w.float().T
