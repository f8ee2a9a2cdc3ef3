"""Triton glue of the write path: ``window_entries``, ``compress`` and ``append_swa`` (see ``dsv4.ops.torch_ops``
for the interface; same signatures and results, bit for bit on CUDA); and what the layer computes before them, one
launch each: ``rms_norm`` (``kernels.rms_norm``: the window KV's bit for bit, ``c^Q``'s within one BF16 step) and
``queries``, the per-head RMSNorm + RoPE of the query projection (``kernels.queries``: within one BF16 step of the
torch backend's, the squares being summed in another order).

Per layer and decode step the writes take two launches (plus the compressors' projection GEMMs, which stay torch
matmuls computed exactly as ``reference.compressor.project`` does):

1. before attention — ``compress`` (CSA/HCA layers: the window entries *and* the main and indexer compressors,
   ``kernels.compressor.write_before_attention``; a CSA step where a request emits more than two entries — a
   prefill chunk — takes two: ``kernels.csa_entries`` for the entries and window entries, then the state
   updates) or ``window_entries`` (SWA layers, ``kernels.swa_write``);
2. after attention — ``append_swa``: the kept tokens' 584-B entries and positions into their rings.

Graph-safe: the kernels read only fixed-shape ``StepBatch`` tensors (``emit_pad_*``, ``num_emit_device``; see
``dsv4.cache.batch`` for the capture / ``copy_`` / replay recipe), never branch on the host on device data, and
allocate only outputs whose shapes the host knows.

Formats: the Triton path implements the official numerics (BF16 activations, ``fp8_ds_mla`` KV entries, ``mxfp4``
indexer keys, 512-dim entries with 64 rope dims, 128-dim indexer keys). Any other ``Numerics`` or geometry runs
the torch backend's function instead (same results, not graph-safe). CPU tensors run the torch backend too,
except under the Triton interpreter (``TRITON_INTERPRET=1``), where the kernels run on the CPU for tests.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
from torch import Tensor

from ..cache.batch import StepBatch
from ..cache.manager import LayerCache
from ..kernels import queries as query_kernels, rms_norm as rms_norm_kernels, swa_write
from ..kernels.compressor import CompressorArgs, scratch_rows, write_before_attention
from ..numerics import Numerics
from ..weights import CompressorWeights
from . import torch_ops

__all__ = ["rms_norm", "queries", "window_entries", "compress", "append_swa", "supported"]


def _runs_here(t: Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def supported(numerics: Numerics, nope_dim: int, kv_dim: int = 512) -> bool:
    """Whether the Triton kernels implement these numerics and entry geometry (else the torch backend runs)."""
    return (
        numerics.kv_format == "fp8_ds_mla"
        and numerics.index_format == "mxfp4"
        and numerics.act_dtype == torch.bfloat16
        and nope_dim == 448
        and kv_dim == 512
    )


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """See ``torch_ops.rms_norm``. One launch for BF16 rows of up to 8,192 channels; else the torch backend."""
    if not (_runs_here(x) and x.dtype == torch.bfloat16 and x.dim() == 2 and 0 < x.shape[1] <= 8192):
        return torch_ops.rms_norm(x, weight, eps)
    return rms_norm_kernels.rms_norm(x, weight, eps)


def queries(q: Tensor, positions: Tensor, inv_freq: Tensor, eps: float) -> Tensor:
    """See ``torch_ops.queries``. One launch for BF16 heads of 512 dims; anything else runs the torch backend."""
    if not (_runs_here(q) and q.dtype == torch.bfloat16 and q.dim() == 3 and q.shape[-1] == query_kernels.HEAD_DIM
            and inv_freq.numel() == query_kernels.ROPE_DIM // 2):
        return torch_ops.queries(q, positions, inv_freq, eps)
    return query_kernels.queries(q.contiguous(), positions, inv_freq.float().contiguous(), eps)


def window_entries(kv: Tensor, positions: Tensor, inv_freq: Tensor, numerics: Numerics, nope_dim: int) -> Tensor:
    """See ``torch_ops.window_entries``. One launch (SWA layers; compressed layers get theirs from ``compress``)."""
    if not (supported(numerics, nope_dim, kv.shape[-1]) and _runs_here(kv) and kv.dtype == torch.bfloat16):
        return torch_ops.window_entries(kv, positions, inv_freq, numerics, nope_dim)
    return swa_write.window_entries(kv, positions, inv_freq.float().contiguous())


def _fp32(t: Tensor, device: torch.device) -> Tensor:
    return t.to(device=device, dtype=torch.float32).contiguous()


def compress(
    layer: LayerCache,
    batch: StepBatch,
    x: Tensor,
    compressors: Sequence[tuple[CompressorWeights, str]],
    m: int,
    overlap: bool,
    inv_freq: Tensor,
    eps: float,
    numerics: Numerics,
    nope_dim: int,
    window_kv: Tensor,
) -> Tensor:
    """See ``torch_ops.compress``: the window entries (returned) and every compressor's accumulate + flush, in one
    launch after the projection GEMMs (two for a CSA prefill chunk: ``kernels.csa_entries``, then the state)."""
    c_main = compressors[0][0].norm.shape[0] if compressors else 0
    roles = [role for _, role in compressors]
    ok = (
        supported(numerics, nope_dim, window_kv.shape[-1])
        and _runs_here(window_kv)
        and window_kv.dtype == torch.bfloat16
        and roles in (["kv"], ["kv", "index"])
        and c_main == 512
        and (roles == ["kv"] or (overlap and compressors[1][0].norm.shape[0] == 128))
        and batch.block_size % m == 0
    )
    if not ok:
        return torch_ops.compress(layer, batch, x, compressors, m, overlap, inv_freq, eps, numerics, nope_dim, window_kv)
    xf = x.float()
    args: dict[str, CompressorArgs] = {}
    for cw, role in compressors:
        prefix = "" if role == "kv" else "index_"
        st = layer.state
        args[role] = CompressorArgs(
            # the same GEMMs as reference.compressor.project (the bias is added inside the kernel)
            a=xf @ cw.wkv.to(xf.device, torch.float32).T,
            z_raw=xf @ cw.wgate.to(xf.device, torch.float32).T,
            ape=_fp32(cw.ape, xf.device),
            norm=_fp32(cw.norm, xf.device),
            tail_kv=st[f"{prefix}tail_kv"],
            tail_gate=st[f"{prefix}tail_gate"],
            prev_kv=st.get(f"{prefix}prev_kv"),
            prev_gate=st.get(f"{prefix}prev_gate"),
            pages=layer.kv_pages if role == "kv" else layer.index_pages,
        )
    rows = scratch_rows(batch, m, overlap, "index" in args)
    scratch = layer.workspace.get("compressor.rms_scratch", (rows, 512), torch.float32)
    arrivals = layer.workspace.get("compressor.arrivals", (rows,), torch.int32, zero=True)  # zero-kept counters
    return write_before_attention(
        window_kv, batch.positions, inv_freq.float().contiguous(), batch, m, overlap, float(eps),
        args["kv"], args.get("index"), scratch=scratch, arrivals=arrivals,
    )


def append_swa(layer: LayerCache, batch: StepBatch, kv_new: Tensor) -> None:
    """See ``torch_ops.append_swa``. One launch."""
    schema = layer.schema
    if not (
        schema.kv_storage.name == "fp8_ds_mla" and kv_new.dtype == torch.bfloat16 and _runs_here(kv_new)
        and kv_new.shape[-1] == 512
    ):
        return torch_ops.append_swa(layer, batch, kv_new)
    swa_write.append_swa(
        kv_new.contiguous(), layer.ring, layer.ring_positions, batch.token_slots, batch.ring_slots, batch.ring_rows,
        batch.positions, batch.window,
    )
