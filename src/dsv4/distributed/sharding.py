"""Tensor parallelism over the query heads: which part of a layer's weights a rank holds, and the layer as a rank
sees it.

A rank ``r`` of ``tp`` holds ``H/tp`` contiguous query heads — the heads of ``G/tp`` whole output groups (SPEC §3
step 7: group g is heads ``g·H/G … (g+1)·H/G − 1``), so ``tp`` must divide ``o_groups``:

==============  ======================================  ============================================
tensor          full                                    rank r's shard
==============  ======================================  ============================================
``wq_b``        ``[H·D, q_lora_rank]``                  rows ``r·(H/tp)·D … (r+1)·(H/tp)·D``
``attn_sink``   ``[H]``                                 ``r·H/tp … (r+1)·H/tp``
``wo_a``        ``[G·o_lora_rank, H·D/G]``              rows of its groups ``r·(G/tp)·o_lora_rank …``
``wo_b``        ``[d, G·o_lora_rank]``                  columns of its groups (so ``y = Σ_ranks partial``)
==============  ======================================  ============================================

Everything else (``wq_a``, ``wkv``, the norms, the compressors, the indexer) is head-independent and stays whole
on every rank (the same tensors, not copies). A block-scaled FP8 projection (``BlockFp8Weight``, 128 × 128
scales) is cut along whole blocks only: the shard keeps the checkpoint's bytes and scales exactly.

Under numerics with FP8 projections (``"official"``) the input of ``wo_b`` is quantized per 1 × 128 block along
its columns, so each rank's columns must also be whole 128-blocks for the partial products to be the ones one
process forms (``check_fp8_split``).
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import ModelConfig
from ..formats.block_fp8 import ACT_BLOCK, WEIGHT_BLOCK, BlockFp8Weight
from ..numerics import Numerics
from ..validate import require_int

__all__ = ["check_fp8_split", "check_tp_size", "head_geometry", "local_config", "shard_attention_weights"]


def check_tp_size(cfg: ModelConfig, tp_size: int) -> None:
    """``ValueError`` unless ``tp_size`` ranks can share ``cfg``'s heads in whole output groups."""
    require_int("tp_size", tp_size, 1)
    if cfg.o_groups % tp_size:
        raise ValueError(
            f"tensor parallelism over {tp_size} ranks needs o_groups ({cfg.o_groups} in {cfg.name}) divisible by "
            f"{tp_size}: a rank holds whole output groups of {cfg.num_heads // cfg.o_groups} heads"
        )


def local_config(cfg: ModelConfig, tp_size: int) -> ModelConfig:
    """The layer as one of ``tp_size`` ranks computes it: ``num_heads = H/tp``, ``o_groups = G/tp`` (everything
    else as ``cfg``). The ops of a layer step read this config (``LayerStep.cfg``)."""
    check_tp_size(cfg, tp_size)
    if tp_size == 1:
        return cfg
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp_size, o_groups=cfg.o_groups // tp_size)


def check_fp8_split(cfg: ModelConfig, tp_size: int, numerics: Numerics) -> None:
    """``ValueError`` when ``numerics`` runs ``wo_b`` as an FP8 GEMM (activations quantized per 1 × 128 block) and a
    rank's ``(G/tp)·o_lora_rank`` input columns are not whole blocks: its partial product would not be a part of
    the one-process product."""
    cols = cfg.o_groups // tp_size * cfg.o_lora_rank
    if tp_size > 1 and numerics.fp8_projections and cols % ACT_BLOCK:
        raise ValueError(
            f"numerics {numerics.name!r} runs wo_b as an FP8 GEMM whose input is quantized per {ACT_BLOCK} columns, "
            f"but tensor parallelism over {tp_size} ranks gives each rank {cols} of its "
            f"{cfg.o_groups * cfg.o_lora_rank} columns (o_groups/tp x o_lora_rank), not whole {ACT_BLOCK}-blocks; use "
            f"a tp size that leaves each rank a multiple of {ACT_BLOCK} columns, or numerics without FP8 projections "
            f"(e.g. 'exact')"
        )


def head_geometry(w) -> tuple[int, int, int, int]:  # w: AttentionWeights
    """``(H, D, G, o_lora_rank)`` read off a full layer's weights (``attn_sink`` [H], ``wq_b`` [H·D, ·], ``wo_a``
    [G·o_lora_rank, H·D/G])."""
    H = int(w.attn_sink.shape[0])
    HD = int(w.wq_b.shape[0])
    G = HD // int(w.wo_a.shape[1])
    return H, HD // H, G, int(w.wo_a.shape[0]) // G


def _cut(name: str, v, dim: int, start: int, stop: int, what: str):
    """Rows (``dim`` 0) or columns (1) ``start:stop`` of a projection, as a copy; a ``BlockFp8Weight`` only along
    whole 128-blocks (its E4M3 bytes and the scales of those blocks)."""
    if not isinstance(v, BlockFp8Weight):
        return v.narrow(dim, start, stop - start).clone(memory_format=torch.contiguous_format)
    size = v.shape[dim]
    if start % WEIGHT_BLOCK or (stop % WEIGHT_BLOCK and stop != size):
        raise ValueError(
            f"{name} is block-scaled FP8 ({WEIGHT_BLOCK}x{WEIGHT_BLOCK} blocks) and {what} gives a rank "
            f"{'rows' if dim == 0 else 'columns'} {start}..{stop - 1} of {size}, not whole blocks; FP8 projections "
            f"are sharded along whole blocks only (use a tp size that leaves each rank a multiple of {WEIGHT_BLOCK}, "
            f"or plain weights)"
        )
    b0, b1 = start // WEIGHT_BLOCK, -(-stop // WEIGHT_BLOCK)
    return BlockFp8Weight(v.data.narrow(dim, start, stop - start).clone(memory_format=torch.contiguous_format),
                          v.scale.narrow(dim, b0, b1 - b0).clone(memory_format=torch.contiguous_format))


def shard_attention_weights(w, tp_rank: int, tp_size: int):  # w: AttentionWeights -> AttentionWeights
    """Rank ``tp_rank``'s share of a full layer's weights (see the module docstring); ``tp_size`` 1: ``w``.

    Raises ``ValueError`` naming the problem: ``w`` is already a shard, ``tp_size`` does not divide the output
    groups, or an FP8 projection would be cut inside a 128 × 128 block."""
    tp_size = require_int("tp_size", tp_size, 1)
    tp_rank = require_int("tp_rank", tp_rank, 0, tp_size - 1)
    if w.tp_shard != (0, 1):
        raise ValueError(f"these weights are already shard {w.tp_shard[0]} of {w.tp_shard[1]}; shard full weights")
    if tp_size == 1:
        return w
    H, D, G, o_lora = head_geometry(w)
    if G % tp_size:
        raise ValueError(f"tensor parallelism over {tp_size} ranks needs the {G} output groups divisible by {tp_size}")
    Hl, Gl = H // tp_size, G // tp_size
    what = f"tp={tp_size}"
    heads = slice(tp_rank * Hl, (tp_rank + 1) * Hl)
    groups = (tp_rank * Gl * o_lora, (tp_rank + 1) * Gl * o_lora)
    return dataclasses.replace(
        w,
        wq_b=_cut("wq_b", w.wq_b, 0, heads.start * D, heads.stop * D, what),
        attn_sink=w.attn_sink[heads].clone(),
        wo_a=w.wo_a[groups[0]:groups[1]].clone(),
        wo_b=_cut("wo_b", w.wo_b, 1, *groups, what),
        tp_shard=(tp_rank, tp_size),
    )

