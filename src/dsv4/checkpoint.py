"""Read one attention layer's weights from an HF-format safetensors checkpoint directory.

Two naming schemes are accepted, with any prefix before ``layers.`` (``model.``, ``language_model.model.`` …):

* **official DeepSeek-V4** (the ``deepseek-ai/DeepSeek-V4-*`` repos, and what ``transformers`` ≥ 5 writes back with
  ``save_pretrained``): ``layers.{i}.attn.wq_a.weight``, ``.q_norm.weight``, ``.wq_b.weight``, ``.wkv.weight``,
  ``.kv_norm.weight`` (``transformers`` writes it back as ``.norm.weight``), ``.attn_sink``, ``.wo_a.weight``,
  ``.wo_b.weight``, ``.compressor.{wkv,wgate}.weight``, ``.compressor.ape``, ``.compressor.norm.weight``,
  ``.indexer.{wq_b,weights_proj}.weight``, ``.indexer.compressor.*``; the MTP block ``j`` is ``mtp.{j}.attn.*``
  (our layer index ``num_layers + j``);
* **transformers module names**: ``layers.{i}.self_attn.q_a_proj.weight``, ``.q_a_norm``, ``.q_b_proj``,
  ``.kv_proj``, ``.kv_norm``, ``.sinks``, ``.o_a_proj``, ``.o_b_proj``, ``.compressor.{kv_proj,gate_proj,
  position_bias,kv_norm}``, ``.compressor.indexer.{q_b_proj,scorer.weights_proj,kv_proj,gate_proj,position_bias,
  kv_norm}``.

FP8 weights (``float8_e4m3fn`` / ``float8_e5m2``) come with per-block scales under ``<name>.scale`` (official) or
``<name>.weight_scale_inv`` (transformers), ``[ceil(out/128), ceil(in/128)]``, as float32 / bfloat16 or UE8M0
(``float8_e8m0fnu``, or its raw bytes as uint8). The block shape is read from ``config.json``'s
``quantization_config.weight_block_size`` (default 128×128). Dequantization is ``w_fp32 = float(w_fp8) ·
float(scale)`` per block: exact for power-of-two (UE8M0) scales, one correctly rounded FP32 product otherwise
(what ``transformers`` computes).

Sharded checkpoints (``model.safetensors.index.json``) are read lazily: only the files holding the layer's
tensors are opened, and only those tensors are read.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .config import LayerKind, ModelConfig
from .formats.block_fp8 import WEIGHT_BLOCK, BlockFp8Weight

__all__ = [
    "HF_NAMES",
    "OFFICIAL_NAMES",
    "CheckpointError",
    "CheckpointIndex",
    "FP8_PROJECTIONS",
    "dequantize_fp8_blocks",
    "quantize_fp8_blocks",
    "read_attention_tensors",
]

#: the projections the official model runs as FP8 GEMMs (SPEC §1.3), by their dotted names
FP8_PROJECTIONS = ("wq_a", "wq_b", "wkv", "wo_b", "indexer.wq_b")


class CheckpointError(ValueError):
    """The checkpoint is missing, malformed, or lacks a tensor the layer needs. The message names the file and,
    where one is involved, the tensor."""


def _load_json(path: str) -> Any:
    """``json.load`` of ``path``; ``CheckpointError`` naming the file for malformed JSON or a repeated key."""

    def no_repeats(pairs: list[tuple[str, Any]]) -> dict:
        keys = [k for k, _ in pairs]
        repeated = sorted({k for k in keys if keys.count(k) > 1})
        if repeated:
            raise CheckpointError(f"{path}: key {repeated[0]!r} appears more than once")
        return dict(pairs)

    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f, object_pairs_hook=no_repeats)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: malformed JSON ({e})") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: not a UTF-8 JSON file") from None


def _safe_open(path: str) -> Any:
    """``safetensors.safe_open`` of ``path``; ``CheckpointError`` naming the file when it is truncated or not a
    safetensors file."""
    from safetensors import safe_open

    try:
        return safe_open(path, "pt")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file is missing") from None
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError) for unreadable files
        raise CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupted?): {e}") from None


# Our (official) field name → checkpoint suffixes after ``…layers.{i}.attn.`` (official) in order of preference.
OFFICIAL_NAMES: dict[str, tuple[str, ...]] = {
    "wq_a": ("wq_a.weight",),
    "q_norm": ("q_norm.weight",),
    "wq_b": ("wq_b.weight",),
    "wkv": ("wkv.weight",),
    "kv_norm": ("kv_norm.weight", "norm.weight"),  # transformers' save_pretrained writes ``attn.norm.weight``
    "attn_sink": ("attn_sink",),
    "wo_a": ("wo_a.weight",),
    "wo_b": ("wo_b.weight",),
    "compressor.wkv": ("compressor.wkv.weight",),
    "compressor.wgate": ("compressor.wgate.weight",),
    "compressor.ape": ("compressor.ape",),
    "compressor.norm": ("compressor.norm.weight",),
    "indexer.wq_b": ("indexer.wq_b.weight",),
    "indexer.weights_proj": ("indexer.weights_proj.weight",),
    "indexer.compressor.wkv": ("indexer.compressor.wkv.weight",),
    "indexer.compressor.wgate": ("indexer.compressor.wgate.weight",),
    "indexer.compressor.ape": ("indexer.compressor.ape",),
    "indexer.compressor.norm": ("indexer.compressor.norm.weight",),
}

# Our field name → suffix after ``…layers.{i}.self_attn.`` (transformers' DeepseekV4Attention parameter names).
HF_NAMES: dict[str, tuple[str, ...]] = {
    "wq_a": ("q_a_proj.weight",),
    "q_norm": ("q_a_norm.weight",),
    "wq_b": ("q_b_proj.weight",),
    "wkv": ("kv_proj.weight",),
    "kv_norm": ("kv_norm.weight",),
    "attn_sink": ("sinks",),
    "wo_a": ("o_a_proj.weight",),
    "wo_b": ("o_b_proj.weight",),
    "compressor.wkv": ("compressor.kv_proj.weight",),
    "compressor.wgate": ("compressor.gate_proj.weight",),
    "compressor.ape": ("compressor.position_bias",),
    "compressor.norm": ("compressor.kv_norm.weight",),
    "indexer.wq_b": ("compressor.indexer.q_b_proj.weight",),
    "indexer.weights_proj": ("compressor.indexer.scorer.weights_proj.weight",),
    "indexer.compressor.wkv": ("compressor.indexer.kv_proj.weight",),
    "indexer.compressor.wgate": ("compressor.indexer.gate_proj.weight",),
    "indexer.compressor.ape": ("compressor.indexer.position_bias",),
    "indexer.compressor.norm": ("compressor.indexer.kv_norm.weight",),
}

_MAIN = ("wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "attn_sink", "wo_a", "wo_b")
_COMPRESSOR = ("compressor.wkv", "compressor.wgate", "compressor.ape", "compressor.norm")
_INDEXER = (
    "indexer.wq_b", "indexer.weights_proj", "indexer.compressor.wkv", "indexer.compressor.wgate",
    "indexer.compressor.ape", "indexer.compressor.norm",
)
_KEY_RE = re.compile(r"^(?:.*\.)?(layers|mtp)\.(\d+)\.(attn|self_attn)\.(.+)$")
_SCALE_SUFFIXES = ("scale", "weight_scale_inv")


def fields_for(kind: LayerKind) -> tuple[str, ...]:
    """The weight fields (official dotted names) a layer of ``kind`` has."""
    if kind is LayerKind.SWA:
        return _MAIN
    if kind is LayerKind.HCA:
        return _MAIN + _COMPRESSOR
    return _MAIN + _COMPRESSOR + _INDEXER


# ------------------------------------------------------------------------------------------------ FP8 blocks
def _fp8_dtypes() -> tuple[torch.dtype, ...]:
    return tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def _scale_to_float(scale: Tensor) -> Tensor:
    """Block scales as float32: float32/bfloat16/float16 as is, UE8M0 (``float8_e8m0fnu`` or its uint8 bytes)
    as ``2^(byte − 127)`` (byte 255 = NaN)."""
    if scale.dtype == torch.uint8:
        e = scale.to(torch.int32) - 127
        out = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)
        return out.masked_fill(scale == 255, float("nan"))
    return scale.float()


def dequantize_fp8_blocks(weight: Tensor, scale: Tensor, block: tuple[int, int] = (128, 128)) -> Tensor:
    """``float32(weight) · scale`` with one scale per ``block`` (rows × cols; partial edge blocks allowed).

    Args:
        weight: ``[out, in]`` ``float8_e4m3fn`` / ``float8_e5m2``.
        scale: ``[ceil(out/b0), ceil(in/b1)]`` float32 / bfloat16 / float16 / ``float8_e8m0fnu`` / uint8 (UE8M0
            bytes); a 0-d or 1-element scale applies to the whole tensor.
        block: ``(b0, b1)``.
    Returns:
        float32 ``[out, in]``.
    """
    if weight.dim() != 2:
        raise CheckpointError(f"FP8 weight must be 2-D, got shape {list(weight.shape)}")
    rows, cols = weight.shape
    s = _scale_to_float(scale)
    w = weight.float()
    if s.numel() == 1:
        return w * s.reshape(())
    b0, b1 = block
    want = (-(-rows // b0), -(-cols // b1))
    if tuple(s.shape) != want:
        raise CheckpointError(
            f"FP8 block scales have shape {list(s.shape)}, expected {list(want)} for a {rows}x{cols} weight in "
            f"{b0}x{b1} blocks"
        )
    full = s.repeat_interleave(b0, dim=0)[:rows].repeat_interleave(b1, dim=1)[:, :cols]
    return w * full


def quantize_fp8_blocks(
    weight: Tensor, block: tuple[int, int] = (128, 128), ue8m0: bool = True, dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """Block-quantize a weight to FP8 E4M3 the way DeepSeek checkpoints are stored (for tests and tools).

    Each ``block`` gets scale ``amax / 448`` (rounded **up** to a power of two when ``ue8m0``); the weight is
    ``weight / scale`` cast to E4M3 (round to nearest even).

    Returns:
        ``(w_fp8 [out, in] float8_e4m3fn, scale [ceil(out/b0), ceil(in/b1)] float32)``.
    """
    dtype = dtype or torch.float8_e4m3fn
    rows, cols = weight.shape
    b0, b1 = block
    R, C = -(-rows // b0), -(-cols // b1)
    w = torch.nn.functional.pad(weight.float(), (0, C * b1 - cols, 0, R * b0 - rows))
    blocks = w.view(R, b0, C, b1)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale = amax / torch.finfo(dtype).max
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (blocks / scale[:, None, :, None]).view(R * b0, C * b1)[:rows, :cols].to(dtype)
    return q, scale.float()


# ------------------------------------------------------------------------------------------------ checkpoint index
@dataclass
class CheckpointIndex:
    """Which safetensors file holds each tensor of a checkpoint directory (or a single ``.safetensors`` file).

    Attributes:
        path: the directory (or file).
        files: tensor name → safetensors file path.
        config: ``config.json`` as a dict (empty if absent).
    """

    path: str
    files: dict[str, str]
    config: dict
    _layers: dict[tuple[str, int], dict[tuple[str, str], str]] | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> CheckpointIndex:
        """Index ``path``: a directory with ``model.safetensors.index.json``, or ``*.safetensors`` files, or one
        ``.safetensors`` file.

        Raises ``CheckpointError`` naming the file (and tensor): a missing path, malformed JSON (``config.json``,
        the index), a truncated or corrupted ``.safetensors`` file, a tensor found in two files, an index entry
        that is not ``name: file``."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"checkpoint path must be a str or os.PathLike, got {type(path).__name__} {path!r}")
        p = os.fspath(path)
        if not os.path.exists(p):
            raise CheckpointError(f"checkpoint {p!r} does not exist")
        config: dict = {}
        files: dict[str, str] = {}
        if os.path.isfile(p):
            if not p.endswith(".safetensors"):
                raise CheckpointError(f"{p!r} is not a .safetensors file or a checkpoint directory")
            shard_paths = [p]
            cfg_path = os.path.join(os.path.dirname(p), "config.json")
        else:
            cfg_path = os.path.join(p, "config.json")
            index_path = os.path.join(p, "model.safetensors.index.json")
            if os.path.exists(index_path):
                index = _load_json(index_path)
                weight_map = index.get("weight_map", {}) if isinstance(index, dict) else None
                if not isinstance(weight_map, dict):
                    raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to file names")
                for name, fname in weight_map.items():
                    if not isinstance(fname, str) or not fname:
                        raise CheckpointError(f"{index_path}: tensor {name!r} maps to {fname!r}, not a file name")
                    files[name] = os.path.join(p, fname)
                shard_paths = []
            else:
                shard_paths = sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith(".safetensors"))
                if not shard_paths:
                    raise CheckpointError(f"no .safetensors files (and no model.safetensors.index.json) in {p!r}")
        for sp in shard_paths:
            with _safe_open(sp) as f:
                for name in f.keys():
                    if name in files:
                        raise CheckpointError(f"tensor {name!r} is in two files: {files[name]} and {sp}")
                    files[name] = sp
        if os.path.exists(cfg_path):
            config = _load_json(cfg_path)
            if not isinstance(config, dict):
                raise CheckpointError(f"{cfg_path}: must hold a JSON object, got {type(config).__name__}")
        return cls(path=p, files=files, config=config)

    @property
    def block_size(self) -> tuple[int, int]:
        """FP8 weight block (``quantization_config.weight_block_size``, default 128×128)."""
        q = self.config.get("quantization_config") or {}
        b = q.get("weight_block_size") if isinstance(q, dict) else None
        b = b or [128, 128]
        if (not isinstance(b, (list, tuple)) or len(b) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in b)):
            raise CheckpointError(f"{self.path}: config.json quantization_config.weight_block_size must be two "
                                  f"positive ints, got {b!r}")
        return int(b[0]), int(b[1])

    def read(self, names: Iterable[str]) -> dict[str, Tensor]:
        """Read the named tensors (grouped per file, each file opened once). ``CheckpointError`` naming the file
        and tensor for a missing or unreadable file, or a file that lacks a tensor the index puts there."""
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.files[n], []).append(n)
        out: dict[str, Tensor] = {}
        for fp, ns in by_file.items():
            if not os.path.exists(fp):
                raise CheckpointError(f"{fp}: file listed in the index is missing (it should hold {ns[0]!r})")
            with _safe_open(fp) as f:
                present = set(f.keys())
                for n in ns:
                    if n not in present:
                        raise CheckpointError(f"{fp}: the index puts tensor {n!r} in this file, but it lacks it")
                    try:
                        out[n] = f.get_tensor(n)
                    except Exception as e:  # noqa: BLE001 - a truncated data section
                        raise CheckpointError(f"{fp}: cannot read tensor {n!r} (truncated or corrupted?): {e}") from None
        return out

    def layer_keys(self, group: str, number: int) -> dict[tuple[str, str], str]:
        """Keys of one layer: ``(scheme, suffix) → full key`` where scheme is ``"attn"`` (official) or
        ``"self_attn"`` (transformers), ``group`` ``"layers"`` or ``"mtp"``."""
        if self._layers is None:  # one pass over all names, then cached
            self._layers = {}
            for key in self.files:
                m = _KEY_RE.match(key)
                if m:
                    self._layers.setdefault((m.group(1), int(m.group(2))), {})[(m.group(3), m.group(4))] = key
        return dict(self._layers.get((group, number), {}))


def read_attention_tensors(
    path: str | os.PathLike[str] | CheckpointIndex, layer_idx: int, cfg: ModelConfig
) -> dict[str, Tensor | BlockFp8Weight]:
    """The tensors of layer ``layer_idx``'s attention, under our (official) dotted names: FP32, except the
    projections DeepSeek runs as FP8 GEMMs (``FP8_PROJECTIONS``), which stay as the checkpoint stores them
    when they are FP8 E4M3 in 128 × 128 blocks (a ``BlockFp8Weight``: no dequantization at load). Other FP8
    weights are dequantized with their block scales.

    Main layers are ``layers.{i}``; ``layer_idx ≥ cfg.num_layers`` reads MTP block ``mtp.{layer_idx − num_layers}``.

    Raises:
        CheckpointError: missing layer / tensor / scale, or an FP8 tensor without scales.
    """
    index = path if isinstance(path, CheckpointIndex) else CheckpointIndex.open(path)
    kind = cfg.layer_kind(layer_idx)
    if layer_idx < cfg.num_layers:
        group, number = "layers", layer_idx
    else:
        group, number = "mtp", layer_idx - cfg.num_layers
    keys = index.layer_keys(group, number)
    if not keys:
        hint = " (transformers does not save MTP blocks)" if group == "mtp" else ""
        raise CheckpointError(
            f"checkpoint {index.path!r} has no tensors for {group}.{number}.attn / .self_attn (layer {layer_idx}){hint}"
        )
    schemes = {s for s, _ in keys}
    # Prefer the official scheme when both are present.
    scheme, table = ("attn", OFFICIAL_NAMES) if "attn" in schemes else ("self_attn", HF_NAMES)
    chosen: dict[str, str] = {}
    missing = []
    for field in fields_for(kind):
        key = next((keys[(scheme, s)] for s in table[field] if (scheme, s) in keys), None)
        if key is None:
            missing.append(f"{group}.{number}.{scheme}.{table[field][0]}")
        else:
            chosen[field] = key
    if missing:
        raise CheckpointError(f"checkpoint {index.path!r}, layer {layer_idx} ({kind.name}): missing {missing}")
    scale_keys: dict[str, str] = {}
    for field, key in chosen.items():
        if key.endswith(".weight"):
            stem = key[: -len(".weight")]
            for suf in _SCALE_SUFFIXES:
                if f"{stem}.{suf}" in index.files:
                    scale_keys[field] = f"{stem}.{suf}"
                    break
    raw = index.read(list(chosen.values()) + list(scale_keys.values()))
    out: dict[str, Tensor] = {}
    fp8 = _fp8_dtypes()
    for field, key in chosen.items():
        t = raw[key]
        if not t.dtype.is_floating_point:
            raise CheckpointError(
                f"{index.files[key]}: tensor {key!r} has dtype {t.dtype}; expected floating point (FP32 / BF16 / FP16, "
                f"or FP8 with block scales)"
            )
        if t.dtype in fp8:
            if field not in scale_keys:
                raise CheckpointError(f"{key} is {t.dtype} but the checkpoint has no .scale / .weight_scale_inv for it")
            scale = raw[scale_keys[field]]
            keep = (field in FP8_PROJECTIONS and t.dtype == torch.float8_e4m3fn and t.dim() == 2
                    and tuple(index.block_size) == (WEIGHT_BLOCK, WEIGHT_BLOCK)
                    and tuple(scale.shape) == (-(-t.shape[0] // WEIGHT_BLOCK), -(-t.shape[1] // WEIGHT_BLOCK)))
            if keep:
                out[field] = BlockFp8Weight(t.contiguous(), _scale_to_float(scale).contiguous())
            else:
                out[field] = dequantize_fp8_blocks(t, scale, index.block_size)
        else:
            if field in scale_keys and t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise CheckpointError(f"{key}: unsupported quantized dtype {t.dtype}")
            out[field] = t.float()
    return out


def config_from_checkpoint(path: str | os.PathLike[str] | CheckpointIndex) -> ModelConfig:
    """``ModelConfig.from_hf`` of the checkpoint's ``config.json``."""
    index = path if isinstance(path, CheckpointIndex) else CheckpointIndex.open(path)
    if not index.config:
        raise CheckpointError(f"checkpoint {index.path!r} has no config.json; pass cfg explicitly")
    name = os.path.basename(os.path.normpath(index.path if os.path.isdir(index.path) else os.path.dirname(index.path)))
    folder = index.path if os.path.isdir(index.path) else os.path.dirname(index.path)
    try:
        return ModelConfig.from_hf(_as_mapping(index.config), name=name or "checkpoint")
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{os.path.join(folder, 'config.json')}: {e}") from None


def _as_mapping(d: Mapping) -> dict:
    return dict(d)
