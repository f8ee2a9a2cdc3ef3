"""Weights of one DeepSeek-V4 attention layer (SPEC §1.3), under the official inference names.

The projections DeepSeek runs as FP8 GEMMs (``FP8_PROJECTIONS``: ``wq_a``, ``wq_b``, ``wkv``, ``wo_b``, the
indexer's ``wq_b``) may be held as the checkpoints store them, a ``formats.block_fp8.BlockFp8Weight`` (E4M3 values +
one power-of-two scale per 128 × 128 block: ``random`` makes them so by default, ``from_checkpoint`` keeps them so),
or as plain tensors; every other tensor is a plain tensor (FP32 on the host by default; ``.to(device, dtype)``
moves them). ``for_numerics`` makes the copy a layer computes with; the numerics decide what each op rounds to. Shapes (d = hidden, H = heads, D = head dim, G = o_groups, c = compressor width):

==========================  =====================================  ==========================================
field                       shape                                  meaning
==========================  =====================================  ==========================================
``wq_a``                    ``[q_lora_rank, d]``                   query down-projection
``q_norm``                  ``[q_lora_rank]``                      weighted RMSNorm of the query latent
``wq_b``                    ``[H·D, q_lora_rank]``                 query up-projection
``wkv``                     ``[D, d]``                             shared key/value projection
``kv_norm``                 ``[D]``                                weighted RMSNorm of kv
``attn_sink``               ``[H]``                                per-head sink logit (denominator only)
``wo_a``                    ``[G·o_lora_rank, H·D/G]``             grouped output projection (group g = rows
                                                                   ``g·o_lora_rank … (g+1)·o_lora_rank``)
``wo_b``                    ``[d, G·o_lora_rank]``                 output projection
``compressor.wkv/.wgate``   ``[2D, d]`` (CSA) / ``[D, d]`` (HCA)   compressor projections (FP32 products and sums)
``compressor.ape``          ``[m, 2D]`` / ``[m', D]``              learned in-window position bias of the gate
``compressor.norm``         ``[D]``                                weighted RMSNorm of each entry
``indexer.wq_b``            ``[H_I·c_I, q_lora_rank]``             indexer query projection (from the latent)
``indexer.weights_proj``    ``[H_I, d]``                           indexer head weights
``indexer.compressor.*``    as above with c = c_I (CSA only)       the indexer's own compressor
==========================  =====================================  ==========================================

The copy an ``Attention`` computes with under BF16 activations also has its compressor matrices stacked
(``dsv4.compressor_stack.stack_compressor_weights``): ``compressor.wkv``, ``compressor.wgate``,
``indexer.compressor.wkv``, ``indexer.compressor.wgate`` and ``indexer.weights_proj`` (which reads the same input)
are then row views of one ``[N, d]`` tensor, held with those weights (not a field: a copy made by ``to``,
``for_numerics``, ``shard`` or ``dataclasses.replace`` has no stack until stacked again), so that one GEMM computes
every compressor projection of the layer and the indexer's head-weight projection.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch

from .checkpoint import (FP8_PROJECTIONS, CheckpointError, CheckpointIndex, config_from_checkpoint,
                         dequantize_fp8_blocks, read_attention_tensors)
from .config import LayerKind, ModelConfig, require_config
from .formats.block_fp8 import BlockFp8Weight
from .numerics import Numerics
from .validate import describe, require_device, require_float_dtype, require_int

__all__ = ["AttentionWeights", "CompressorWeights", "FP8_PROJECTIONS", "IndexerWeights", "Projection"]

#: a projection matrix ``[out, in]``: a plain tensor, or block-scaled FP8 as the checkpoints store it
Projection = torch.Tensor | BlockFp8Weight


@dataclass
class CompressorWeights:
    """One compressor (main KV of CSA/HCA, or the CSA indexer's). ``width`` = 2c (CSA, overlapping) or c (HCA).
    In the weights a layer computes with under BF16 activations, ``wkv`` / ``wgate`` are row views of the layer's
    stacked compressor matrix (``dsv4.compressor_stack``)."""

    wkv: torch.Tensor  # [width, d]
    wgate: torch.Tensor  # [width, d]
    ape: torch.Tensor  # [m, width]
    norm: torch.Tensor  # [c]


@dataclass
class IndexerWeights:
    """The lightning indexer of a CSA layer."""

    wq_b: Projection  # [H_I * c_I, q_lora_rank]
    weights_proj: torch.Tensor  # [H_I, d]
    compressor: CompressorWeights


@dataclass
class AttentionWeights:
    """All parameters of one attention layer. ``compressor``/``indexer`` are ``None`` where the kind has none.
    ``tp_shard`` ``(rank, size)``: these are tensor-parallel rank ``rank``'s heads of ``size`` (``shard``;
    ``(0, 1)``: the whole layer)."""

    wq_a: Projection
    q_norm: torch.Tensor
    wq_b: Projection
    wkv: Projection
    kv_norm: torch.Tensor
    attn_sink: torch.Tensor
    wo_a: torch.Tensor
    wo_b: Projection
    compressor: CompressorWeights | None = None
    indexer: IndexerWeights | None = None
    tp_shard: tuple[int, int] = (0, 1)

    # ------------------------------------------------------------------ construction
    @classmethod
    def random(
        cls,
        cfg: ModelConfig,
        layer_idx: int,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        fp8: bool = True,
    ) -> "AttentionWeights":
        """Random weights with realistic scales: projections ~ N(0, 1/fan_in) (unit-scale activations), norm
        weights near 1, sinks and position biases O(1). Deterministic in ``seed``, ``layer_idx`` and the device
        type (``device="cuda"`` draws on the GPU: fast for full-size presets, a different stream than the CPU's).
        ``fp8``: the ``FP8_PROJECTIONS`` are block-scaled FP8 and the compressors' matrices BF16 values, as in the
        official checkpoints (drawn, then rounded: a layer moves the real model's bytes); else plain ``dtype``
        tensors.

        Raises ``TypeError`` / ``ValueError`` naming the argument (``cfg`` not a ``ModelConfig``, ``layer_idx`` /
        ``seed`` not an int, ``dtype`` not a floating dtype, a device that does not exist), ``IndexError`` for a
        layer the config does not have."""
        require_config(cfg)
        layer_idx = require_int("layer_idx", layer_idx)
        seed = require_int("seed", seed, 0, 2**62)
        require_float_dtype("dtype", dtype)
        if not isinstance(fp8, bool):
            raise TypeError(f"fp8 must be True or False, got {describe(fp8)}")
        dev = require_device("device", device)
        if dev.type == "meta":
            raise ValueError("device 'meta' holds no values; random weights need 'cpu' or 'cuda'")
        cfg.layer_kind(layer_idx)
        g = torch.Generator(device=dev).manual_seed(seed * 1000003 + layer_idx)

        def lin(out_f: int, in_f: int) -> torch.Tensor:
            return (torch.randn(out_f, in_f, generator=g, device=dev) * in_f**-0.5).to(dtype)

        def norm(n: int) -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(n, generator=g, device=dev)).to(dtype)

        def proj(out_f: int, in_f: int) -> Projection:
            w = lin(out_f, in_f)
            return BlockFp8Weight.quantize(w) if fp8 else w

        d, H, D = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        kind = cfg.layer_kind(layer_idx)
        w = cls(
            wq_a=proj(cfg.q_lora_rank, d),
            q_norm=norm(cfg.q_lora_rank),
            wq_b=proj(H * D, cfg.q_lora_rank),
            wkv=proj(D, d),
            kv_norm=norm(D),
            attn_sink=(torch.randn(H, generator=g, device=dev) + 1.0).to(dtype),
            wo_a=lin(cfg.o_groups * cfg.o_lora_rank, H * D // cfg.o_groups),
            wo_b=proj(d, cfg.o_groups * cfg.o_lora_rank),
        )

        def comp_lin(out_f: int, in_f: int) -> torch.Tensor:  # BF16 in the official checkpoints
            w = lin(out_f, in_f)
            return w.to(torch.bfloat16).to(dtype) if fp8 else w

        def compressor(c: int, m: int, overlap: bool) -> CompressorWeights:
            width = 2 * c if overlap else c
            return CompressorWeights(
                wkv=comp_lin(width, d), wgate=comp_lin(width, d), ape=(0.5 * torch.randn(m, width, generator=g, device=dev)).to(dtype),
                norm=norm(c),
            )

        if kind is LayerKind.CSA:
            w.compressor = compressor(D, cfg.csa_ratio, overlap=True)
            w.indexer = IndexerWeights(
                wq_b=proj(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
                weights_proj=lin(cfg.index_n_heads, d),
                compressor=compressor(cfg.index_head_dim, cfg.csa_ratio, overlap=True),
            )
        elif kind is LayerKind.HCA:
            w.compressor = compressor(D, cfg.hca_ratio, overlap=False)
        return w

    @classmethod
    def from_hf_module(
        cls, module: Any, copy: bool = True, fp8_dtype: torch.dtype = torch.float32
    ) -> "AttentionWeights":
        """From a ``transformers`` ``DeepseekV4Attention``: copied to FP32 on the host (``copy=True``), or the
        module's own parameter tensors, detached, on their device and in their dtype (``copy=False``: no memory
        of its own; in-place changes to the module's parameters show through).

        FP8 projections (transformers' ``FP8Linear``: an 8-bit ``weight`` and its block scales
        ``weight_scale_inv``, ``block_size`` rows × cols per scale, or one scale) are dequantized, ``weight ·
        scale`` exactly in FP32 (``dsv4.checkpoint.dequantize_fp8_blocks``): to FP32 on the host with ``copy=True``,
        to ``fp8_dtype`` on their device with ``copy=False`` (new tensors: the only copies that makes).

        Raises ``TypeError`` naming the attribute when ``module`` is not such a module (``None``, another module)."""
        need = ("q_a_proj", "q_a_norm", "q_b_proj", "kv_proj", "kv_norm", "sinks", "o_a_proj", "o_b_proj", "compressor")
        lacking = [a for a in need if not hasattr(module, a)]
        if lacking:
            raise TypeError(
                f"module must be a transformers DeepseekV4Attention, got {type(module).__name__} without {lacking}"
            )

        def t(p: torch.Tensor) -> torch.Tensor:
            if isinstance(p, torch.nn.Module) and hasattr(p, "weight"):
                p = p.weight
            if not isinstance(p, torch.Tensor) or not p.dtype.is_floating_point:
                raise TypeError(f"module parameter must be a floating-point tensor, got {describe(p)}")
            return p.detach().to("cpu", torch.float32).clone() if copy else p.detach()

        def lin(m: Any) -> torch.Tensor:
            scale = getattr(m, "weight_scale_inv", None)
            if m.weight.element_size() != 1 or scale is None:
                return t(m.weight)
            block = tuple(getattr(m, "block_size", None) or (128, 128))  # no block size: one scale for all
            w = dequantize_fp8_blocks(m.weight.detach(), scale.detach(), block)
            return w.to("cpu") if copy else w.to(fp8_dtype)

        def comp(c: Any) -> CompressorWeights:
            return CompressorWeights(wkv=lin(c.kv_proj), wgate=lin(c.gate_proj), ape=t(c.position_bias), norm=t(c.kv_norm.weight))

        w = cls(
            wq_a=lin(module.q_a_proj),
            q_norm=t(module.q_a_norm.weight),
            wq_b=lin(module.q_b_proj),
            wkv=lin(module.kv_proj),
            kv_norm=t(module.kv_norm.weight),
            attn_sink=t(module.sinks),
            wo_a=lin(module.o_a_proj),
            wo_b=lin(module.o_b_proj),
        )
        if module.compressor is not None:
            w.compressor = comp(module.compressor)
            indexer = getattr(module.compressor, "indexer", None)
            if indexer is not None:
                w.indexer = IndexerWeights(wq_b=lin(indexer.q_b_proj), weights_proj=lin(indexer.scorer.weights_proj), compressor=comp(indexer))
        return w

    @classmethod
    def from_named(cls, tensors: "Mapping[str, torch.Tensor]", kind: LayerKind) -> "AttentionWeights":
        """From ``{official dotted name: tensor}`` (the names ``named_tensors`` yields: an FP8 projection as ``name``
        + ``name.scale``, or a ``BlockFp8Weight`` under ``name``) for a layer of ``kind``. Tensors are used as given
        (no copy, no cast)."""
        t = dict(tensors)
        for name in FP8_PROJECTIONS:
            if f"{name}.scale" in t:
                t[name] = BlockFp8Weight(t[name], t.pop(f"{name}.scale"))

        def comp(prefix: str) -> CompressorWeights:
            return CompressorWeights(
                wkv=t[f"{prefix}wkv"], wgate=t[f"{prefix}wgate"], ape=t[f"{prefix}ape"], norm=t[f"{prefix}norm"]
            )

        w = cls(**{k: t[k] for k in ("wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "attn_sink", "wo_a", "wo_b")})
        if kind is not LayerKind.SWA:
            w.compressor = comp("compressor.")
        if kind is LayerKind.CSA:
            w.indexer = IndexerWeights(
                wq_b=t["indexer.wq_b"], weights_proj=t["indexer.weights_proj"], compressor=comp("indexer.compressor.")
            )
        return w

    @classmethod
    def from_checkpoint(
        cls,
        path: "str | os.PathLike[str] | CheckpointIndex",
        layer_idx: int,
        cfg: ModelConfig | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> "AttentionWeights":
        """Layer ``layer_idx``'s attention weights from an HF-format safetensors checkpoint directory (``tp_size`` >
        1: only tensor-parallel rank ``tp_rank``'s share, ``shard``).

        Reads the official DeepSeek-V4 names (``layers.{i}.attn.wq_a.weight`` …, FP8 E4M3 weights with per-128×128
        block ``.scale`` / ``.weight_scale_inv``: the ``FP8_PROJECTIONS`` kept as ``BlockFp8Weight``, other FP8
        tensors dequantized exactly) or ``transformers``' own names
        (``layers.{i}.self_attn.q_a_proj.weight`` …); see ``dsv4.checkpoint``. Only this layer's tensors are read.

        Args:
            path: checkpoint directory (``config.json`` + ``*.safetensors`` / ``model.safetensors.index.json``),
                one ``.safetensors`` file, or an open ``dsv4.checkpoint.CheckpointIndex`` (to read many layers).
            layer_idx: 0-based layer; ``≥ cfg.num_layers`` reads the MTP block (``mtp.{j}.attn``).
            cfg: the model configuration (default: ``ModelConfig.from_hf`` of the checkpoint's ``config.json``);
                every tensor's shape is checked against it.
            dtype, device: where the weights go (default FP32 on the host, like ``random``).
            tp_rank, tp_size: keep rank ``tp_rank``'s heads of ``tp_size`` (the layer is read, checked whole, then
                cut; the rest is freed before the move to ``device``).
        Raises:
            dsv4.checkpoint.CheckpointError: missing, truncated or malformed files, missing tensors or scales,
                tensors of the wrong dtype, shape or with non-finite values (the message names the file and tensor).
            ValueError: ``tp_size`` cannot split the layer's heads (see ``shard``).
        """
        if not isinstance(path, (str, os.PathLike, CheckpointIndex)):
            raise TypeError(f"path must be a checkpoint directory, a .safetensors file or a CheckpointIndex, got {describe(path)}")
        layer_idx = require_int("layer_idx", layer_idx)
        if cfg is not None:
            require_config(cfg)
        require_float_dtype("dtype", dtype)
        require_device("device", device)
        index = path if isinstance(path, CheckpointIndex) else CheckpointIndex.open(path)
        cfg = cfg if cfg is not None else config_from_checkpoint(index)
        tensors = read_attention_tensors(index, layer_idx, cfg)
        w = cls.from_named(tensors, cfg.layer_kind(layer_idx))
        try:
            w.check(cfg, layer_idx)
        except ValueError as e:
            raise CheckpointError(f"checkpoint {index.path}: {e}") from None
        w = w.shard(tp_rank, tp_size)
        return w.to(device, dtype) if (dtype != torch.float32 or torch.device(device).type != "cpu") else w

    def shard(self, tp_rank: int, tp_size: int) -> "AttentionWeights":
        """Tensor-parallel rank ``tp_rank``'s share of these (full) weights over ``tp_size`` ranks: its ``H/tp``
        query heads — ``wq_b`` rows, ``attn_sink``, its whole ``wo_a`` groups and the matching ``wo_b`` columns —
        and every head-independent tensor as it is (``dsv4.distributed.sharding``). ``tp_size`` 1: ``self``.

        Raises ``ValueError``: already a shard, ``tp_size`` does not divide ``o_groups``, or an FP8 projection
        (128 × 128 block scales) would be cut inside a block."""
        from .distributed.sharding import shard_attention_weights

        return shard_attention_weights(self, tp_rank, tp_size)

    # ------------------------------------------------------------------ utilities
    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(dotted official name, tensor)`` for every parameter; a ``BlockFp8Weight`` as its ``name`` (the E4M3
        values, float8_e4m3fn) and ``name.scale`` (float32 block scales), as a checkpoint stores it."""
        for name, v in self.named_parameters():
            if isinstance(v, BlockFp8Weight):
                yield name, v.data
                yield f"{name}.scale", v.scale
            else:
                yield name, v

    def named_parameters(self) -> Iterator[tuple[str, Projection]]:
        """``(dotted official name, parameter)``: tensors, and ``BlockFp8Weight`` for FP8 projections."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (torch.Tensor, BlockFp8Weight)):
                yield f.name, v
        if self.compressor is not None:
            for f in dataclasses.fields(self.compressor):
                yield f"compressor.{f.name}", getattr(self.compressor, f.name)
        if self.indexer is not None:
            yield "indexer.wq_b", self.indexer.wq_b
            yield "indexer.weights_proj", self.indexer.weights_proj
            for f in dataclasses.fields(self.indexer.compressor):
                yield f"indexer.compressor.{f.name}", getattr(self.indexer.compressor, f.name)

    def nonfinite(self) -> list[str]:
        """Names of the parameters holding NaN / Inf (FP8 values: their E4M3 NaN codes; scales: non-finite)."""
        bad = []
        for name, v in self.named_parameters():
            if v.device.type == "meta":
                continue
            t = v.dequantize() if isinstance(v, BlockFp8Weight) else v
            if not bool(torch.isfinite(t).all()):
                bad.append(name)
        return bad

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "AttentionWeights":
        """A copy with every tensor moved/cast (``BlockFp8Weight`` projections are only moved)."""

        def mv(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return x.to(device=device, dtype=dtype)
            if isinstance(x, BlockFp8Weight):  # stays FP8: its bytes are the checkpoint's
                return x.to(device)
            if dataclasses.is_dataclass(x):
                return dataclasses.replace(x, **{f.name: mv(getattr(x, f.name)) for f in dataclasses.fields(x)})
            return x

        return mv(self)

    def for_numerics(self, numerics: Numerics) -> "AttentionWeights":
        """The copy a layer computes with under ``numerics`` (cast once, so no step casts a weight): the
        ``FP8_PROJECTIONS`` as ``BlockFp8Weight`` where ``numerics.fp8_projections`` (plain ones quantized the way
        the checkpoints are), else dequantized to ``act_dtype``; ``wo_a`` and the indexer's ``weights_proj`` in
        ``act_dtype`` (the official model holds them in BF16), as are the compressors' projection matrices (their
        GEMMs form FP32 products of the operands either way: ``ops.projections.layer_compressor_projections``;
        ``Attention`` then stacks them, ``dsv4.compressor_stack``); norms, sinks, position biases in FP32."""
        act = numerics.act_dtype

        def proj(v: Projection) -> Projection:
            if numerics.fp8_projections:
                return v if isinstance(v, BlockFp8Weight) else BlockFp8Weight.quantize(v)
            return v.dequantize(act) if isinstance(v, BlockFp8Weight) else v.to(act)

        def comp(c: CompressorWeights | None) -> CompressorWeights | None:
            if c is None:
                return None
            return dataclasses.replace(c, wkv=c.wkv.to(act), wgate=c.wgate.to(act), ape=c.ape.float(),
                                       norm=c.norm.float())

        gemm = {name: proj(getattr(self, name)) for name in ("wq_a", "wq_b", "wkv", "wo_b")}
        indexer = None if self.indexer is None else dataclasses.replace(
            self.indexer, wq_b=proj(self.indexer.wq_b), weights_proj=self.indexer.weights_proj.to(act),
            compressor=comp(self.indexer.compressor))
        return dataclasses.replace(self, indexer=indexer, wo_a=self.wo_a.to(act), compressor=comp(self.compressor),
                                   **gemm)

    def check(self, cfg: ModelConfig, layer_idx: int) -> None:
        """Raise ``ValueError`` naming every tensor whose shape does not fit ``cfg``'s layer ``layer_idx``."""
        require_config(cfg)
        if self.compressor is not None and not isinstance(self.compressor, CompressorWeights):
            raise TypeError(f"compressor must be a CompressorWeights or None, got {describe(self.compressor)}")
        if self.indexer is not None and not isinstance(self.indexer, IndexerWeights):
            raise TypeError(f"indexer must be an IndexerWeights or None, got {describe(self.indexer)}")
        d, H, D = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        kind = cfg.layer_kind(layer_idx)
        want: dict[str, tuple[int, ...]] = {
            "wq_a": (cfg.q_lora_rank, d), "q_norm": (cfg.q_lora_rank,), "wq_b": (H * D, cfg.q_lora_rank),
            "wkv": (D, d), "kv_norm": (D,), "attn_sink": (H,),
            "wo_a": (cfg.o_groups * cfg.o_lora_rank, H * D // cfg.o_groups), "wo_b": (d, cfg.o_groups * cfg.o_lora_rank),
        }
        if kind is not LayerKind.SWA:
            m = cfg.ratio(layer_idx)
            width = 2 * D if kind is LayerKind.CSA else D
            want.update({"compressor.wkv": (width, d), "compressor.wgate": (width, d), "compressor.ape": (m, width), "compressor.norm": (D,)})
        if kind is LayerKind.CSA:
            ci = cfg.index_head_dim
            want.update({
                "indexer.wq_b": (cfg.index_n_heads * ci, cfg.q_lora_rank), "indexer.weights_proj": (cfg.index_n_heads, d),
                "indexer.compressor.wkv": (2 * ci, d), "indexer.compressor.wgate": (2 * ci, d),
                "indexer.compressor.ape": (cfg.csa_ratio, 2 * ci), "indexer.compressor.norm": (ci,),
            })
        have = dict(self.named_parameters())
        problems = []
        for name, shape in want.items():
            v = have.get(name)
            if name not in have:
                problems.append(f"{name} missing (a {kind.name} layer needs it)")
            elif isinstance(v, BlockFp8Weight):
                if name not in FP8_PROJECTIONS:
                    problems.append(f"{name} is block-scaled FP8, which only {list(FP8_PROJECTIONS)} may be")
                elif tuple(v.shape) != shape:
                    problems.append(f"{name} has shape {tuple(v.shape)}, expected {shape}")
            elif not isinstance(v, torch.Tensor):
                problems.append(f"{name} is {describe(v)}, expected a tensor of shape {shape}")
            elif not v.dtype.is_floating_point or v.element_size() == 1:
                problems.append(f"{name} has dtype {v.dtype}, expected a floating-point tensor of 16 or 32 bits "
                                "(FP8 projections: a BlockFp8Weight)")
            elif tuple(v.shape) != shape:
                problems.append(f"{name} has shape {tuple(v.shape)}, expected {shape}")
        extra = sorted(set(have) - set(want))
        if extra:
            problems.append(f"unexpected tensors for a {kind.name} layer: {extra}")
        bad = [n for n in self.nonfinite() if have[n].device.type != "meta"] if not problems else []
        if bad:
            problems.append(f"non-finite values (NaN/Inf) in {bad}")
        if problems:
            if self.tp_shard != (0, 1):
                problems.append(f"(these weights are tensor-parallel shard {self.tp_shard[0]} of {self.tp_shard[1]}: "
                                "check them against the rank's config, dsv4.distributed.local_config)")
            raise ValueError(f"weights do not fit {cfg.name} layer {layer_idx}: " + "; ".join(problems))
