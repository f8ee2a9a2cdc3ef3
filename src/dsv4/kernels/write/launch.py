"""Launching a layer's writes before attention from its ``WritePlan``: the compressors' fused launch (and, for a
CSA prefill chunk, ``csa_entries``' launch first), or an SWA layer's window entries (``window.window_entries``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from .compressor import write_before_attention_kernel
from .csa_entries import csa_entries_kernel
from .plan import TOKENS_PER_PROGRAM, WritePlan
from ..torch_order import TORCH_REDUCE_MAX_THREADS

__all__ = ["CompressorArgs", "write_before_attention"]


@dataclass
class CompressorArgs:
    """One compressor's tensors for ``write_before_attention`` (all on the cache's device; contiguous but for
    ``a`` / ``z_raw``).

    Attributes:
        a, z_raw: fp32 ``[T, width]``: ``x W_kv^T`` and ``x W_gate^T`` (no bias); unit column stride and one row
            stride ≥ width for both — e.g. column blocks of one GEMM's output
            (``ops.projections.stacked_compressor_projections``), or each contiguous.
        ape: fp32 ``[m, width]`` position bias; norm: fp32 ``[c]`` RMSNorm weight.
        tail_kv, tail_gate: fp32 ``[R, m, width]``; prev_kv, prev_gate: fp32 ``[R, m, c]`` (CSA; else ``None``).
        pages: uint8 ``[num_blocks, page_bytes]`` (KV pages for the main compressor, indexer pages for the index).
    """

    a: Tensor
    z_raw: Tensor
    ape: Tensor
    norm: Tensor
    tail_kv: Tensor
    tail_gate: Tensor
    prev_kv: Tensor | None
    prev_gate: Tensor | None
    pages: Tensor


def _row_stride(args: CompressorArgs, name: str) -> int:
    """The row stride (elements) ``a`` and ``z_raw`` share — a constexpr of the kernels, which index both with it;
    ``ValueError`` naming the compressor when they have none, their columns are not unit-strided, or rows would
    overlap."""
    a, z = args.a, args.z_raw
    two_d = a.dim() == 2 and z.shape == a.shape
    stride = a.stride(0) if two_d else 0
    if two_d and a.shape[0] <= 1 and (z.stride(0) != stride or stride < a.shape[1]):
        stride = a.shape[1]  # only row 0 is read: the stride is never applied
    ok = (two_d and a.dtype == z.dtype == torch.float32 and a.stride(1) == 1 and z.stride(1) == 1
          and (a.shape[0] <= 1 or (z.stride(0) == stride and stride >= a.shape[1])))
    if not ok:
        raise ValueError(
            f"the {name} compressor's a / z_raw must be float32 [T, width] tensors with unit column stride and one "
            f"row stride >= width, got {a.dtype} {list(a.shape)} strides {list(a.stride())} and {z.dtype} "
            f"{list(z.shape)} strides {list(z.stride())}")
    return stride


def _check_scratch(plan: WritePlan, scratch: Tensor, arrivals: Tensor) -> None:
    rows = plan.scratch_rows
    if arrivals.dtype != torch.int32 or arrivals.dim() != 1 or arrivals.shape[0] < rows:
        raise ValueError(f"arrivals must be an int32 [>= {rows}] tensor, got {arrivals.dtype} {list(arrivals.shape)}")
    if (scratch.dtype != torch.float32 or scratch.dim() != 2 or scratch.shape[0] < rows or scratch.shape[1] != 512
            or not scratch.is_contiguous()):
        raise ValueError(f"scratch must be a contiguous float32 [>= {rows}, 512] tensor, got "
                         f"{scratch.dtype} {list(scratch.shape)}")


def write_before_attention(
    plan: WritePlan, kv: Tensor, positions: Tensor, inv_freq: Tensor, batch, eps: float,
    main: CompressorArgs, index: CompressorArgs | None, scratch: Tensor, arrivals: Tensor,
) -> Tensor:
    """The step's window entries and every compressor's accumulate + flush, launched as ``plan`` says.

    Args:
        plan: ``plan_write`` of this step and layer kind (``plan.has_index`` iff ``index`` is given).
        kv: bf16 ``[T, 512]`` ``RMSNorm(W_kv x)``; positions: int64 ``[T]``; inv_freq: fp32 ``[32]``.
        batch: the ``StepBatch`` (its fixed-shape device tensors only: graph-safe). eps: RMSNorm epsilon.
        main / index: the main and (CSA) indexer compressor's tensors.
        scratch: fp32 ``[≥ plan.scratch_rows, 512]`` RMSNorm scratch (contents undefined).
        arrivals: int32 ``[≥ plan.scratch_rows]``, zero, left zero: the counters of entries split over programs.
    Returns:
        bf16 ``[T, 512]`` the window entries as stored.
    """
    _check_scratch(plan, scratch, arrivals)
    m_stride = _row_stride(main, "main")
    x_stride = _row_stride(index, "indexer") if index is not None else m_stride
    kv = kv.contiguous()
    out = torch.empty_like(kv)
    T, B, m = kv.shape[0], plan.requests, plan.ratio
    x = index if index is not None else main
    n_entry = plan.entry_programs
    if plan.separate_entries:
        # every entry and the window entries first: they read the tails and previous-window state that the
        # fused launch's leads then update
        csa_entries_kernel[(plan.csa_entries_grid,)](
            main.a, main.z_raw, m_stride, main.ape, main.tail_kv, main.tail_gate, main.prev_kv, main.prev_gate,
            main.norm, main.pages, main.pages.shape[1],
            x.a, x.z_raw, x_stride, x.ape, x.tail_kv, x.tail_gate, x.prev_kv, x.prev_gate, x.norm, x.pages,
            x.pages.shape[1],
            inv_freq, batch.block_tables, batch.block_tables.stride(0), batch.block_size, batch.start_pos,
            batch.cu_seqlens, batch.slots, batch.emit_pad_request[m], batch.emit_pad_entry[m],
            batch.num_emit_device[m], n_entry, n_entry if index is not None else 0, eps,
            scratch[B * (1 + plan.has_index):], kv, positions, out, T, BT=TOKENS_PER_PROGRAM,
            num_warps=1, enable_fp_fusion=False,
        )
        n_entry = 0
    dummy = main.tail_kv
    write_before_attention_kernel[(plan.grid,)](
        kv, positions, inv_freq, out, T,
        batch.start_pos, batch.end_pos, batch.cu_seqlens, batch.slots, batch.block_tables,
        batch.block_tables.stride(0), batch.block_size, B,
        batch.emit_pad_request[m], batch.emit_pad_entry[m], batch.num_emit_device[m], n_entry, eps, scratch, arrivals,
        main.a, main.z_raw, m_stride, main.ape, main.tail_kv, main.tail_gate,
        main.prev_kv if plan.overlap else dummy, main.prev_gate if plan.overlap else dummy, main.norm, main.pages,
        main.pages.shape[1],
        x.a, x.z_raw, x_stride, x.ape, x.tail_kv, x.tail_gate, x.prev_kv if plan.has_index else dummy,
        x.prev_gate if plan.has_index else dummy, x.norm, x.pages, x.pages.shape[1],
        C=main.norm.shape[0], M=m, OVERLAP=plan.overlap, HAS_INDEX=plan.has_index, BT=TOKENS_PER_PROGRAM,
        NW=plan.pool_warps, NW_INDEX=plan.pool_warps_index, MAXT=TORCH_REDUCE_MAX_THREADS, PARTS=plan.parts,
        STATE_ONLY=plan.separate_entries, ENTRY_PROGRAMS=n_entry > 0,
        num_warps=plan.warps, enable_fp_fusion=False,
    )
    return out
