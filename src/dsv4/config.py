"""Model configuration: the attention hyper-parameters of DeepSeek-V4 (SPEC §1).

``ModelConfig`` holds only what the attention block needs. Presets:

* ``"v4-flash"`` — DeepSeek-V4-Flash (43 layers + MTP, 64 heads, CSA/HCA interleaved after two SWA layers);
* ``"v4-pro"``   — DeepSeek-V4-Pro (61 layers + MTP, 128 heads, two HCA layers then CSA/HCA interleaved);
* ``"tiny"``     — the same structure at CPU-test size (small hidden size and head counts, a 16-token window,
  HCA ratio 16, top-k 8); head dim 512 / rope 64 / indexer dim 128 are kept so every storage format applies.

``ModelConfig.from_hf`` reads a ``transformers`` ``DeepseekV4Config``, its dict, or a ``config.json`` path
(official inference-style names are accepted too).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Mapping

from .config_rope import COMPRESS_ROPE_TYPES, rope_fields
from .validate import describe

__all__ = ["InvalidConfigError", "LayerKind", "ModelConfig", "require_config"]


class InvalidConfigError(ValueError):
    """A ``ModelConfig`` field (or a config file's value) outside its allowed range."""


class LayerKind(str, enum.Enum):
    """The three attention layer kinds. Every kind has the sliding window; CSA/HCA add compressed entries."""

    SWA = "swa"  # sliding window only (compress ratio 0)
    CSA = "csa"  # compressed sparse attention (ratio 4, overlapping windows, lightning indexer + top-k)
    HCA = "hca"  # heavily compressed attention (ratio 128, non-overlapping, attended densely)


_HF_LAYER_TYPE = {
    LayerKind.SWA: "sliding_attention",
    LayerKind.CSA: "compressed_sparse_attention",
    LayerKind.HCA: "heavily_compressed_attention",
}
_KIND_OF_HF_LAYER_TYPE = {v: k for k, v in _HF_LAYER_TYPE.items()}


#: int fields: (smallest allowed value, largest allowed value or None)
_INT_FIELDS: dict[str, tuple[int, int | None]] = {
    "hidden_size": (1, None), "num_layers": (1, None), "num_heads": (1, None), "head_dim": (1, None),
    "rope_dim": (2, None), "q_lora_rank": (1, None), "o_groups": (1, None), "o_lora_rank": (1, None),
    "window": (1, None), "csa_ratio": (1, None), "hca_ratio": (1, None), "index_n_heads": (1, None),
    "index_head_dim": (1, None), "index_topk": (1, None), "yarn_original_seq_len": (1, None),
    "max_position": (1, 2**31 - 1),  # positions are stored as int32 (ring positions)
    "num_mtp_layers": (0, None),
}
#: float fields: (lower bound, lower bound excluded, upper bound or None)
_FLOAT_FIELDS: dict[str, tuple[float, bool, float | None]] = {
    "norm_eps": (0.0, True, 1.0), "rope_theta": (1.0, True, None), "compress_rope_theta": (1.0, True, None),
    "yarn_factor": (1.0, False, None), "yarn_beta_fast": (0.0, True, None), "yarn_beta_slow": (0.0, True, None),
}


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _field_problems(c: "ModelConfig") -> tuple[list[str], list[str]]:
    """``(type problems, value problems)`` of a config's fields, each a message naming the field."""
    types: list[str] = []
    values: list[str] = []
    if not isinstance(c.name, str) or not c.name:
        types.append(f"name must be a non-empty str, got {describe(c.name)}")
    for f, (lo, hi) in _INT_FIELDS.items():
        v = getattr(c, f)
        allowed = f"an int >= {lo}" + (f" and <= {hi}" if hi is not None else "")
        if not _is_int(v):
            types.append(f"{f} must be {allowed}, got {describe(v)}")
        elif v < lo or (hi is not None and v > hi):
            values.append(f"{f} must be {allowed}, got {v}")
    for f, (lo, open_lo, hi) in _FLOAT_FIELDS.items():
        v = getattr(c, f)
        allowed = f"a finite number {'>' if open_lo else '>='} {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            types.append(f"{f} must be {allowed}, got {describe(v)}")
        elif not math.isfinite(v) or (v <= lo if open_lo else v < lo) or (hi is not None and v > hi):
            values.append(f"{f} must be {allowed}, got {v!r}")
    ratios = c.compress_ratios
    if not isinstance(ratios, tuple) or not all(_is_int(r) for r in ratios):
        types.append(f"compress_ratios must be a sequence of ints, got {describe(ratios)}")
    if types:
        return types, values
    # relations between fields (every field has the right type and its own range here)
    if c.rope_dim % 2 or c.rope_dim >= c.head_dim:
        values.append(f"rope_dim ({c.rope_dim}) must be even and smaller than head_dim ({c.head_dim})")
    if c.num_heads % c.o_groups:
        values.append(f"num_heads ({c.num_heads}) must be divisible by o_groups ({c.o_groups})")
    if c.index_head_dim < c.rope_dim:
        values.append(f"index_head_dim ({c.index_head_dim}) must be >= rope_dim ({c.rope_dim})")
    if c.yarn_beta_fast < c.yarn_beta_slow:
        values.append(f"yarn_beta_fast ({c.yarn_beta_fast}) must be >= yarn_beta_slow ({c.yarn_beta_slow})")
    if c.csa_ratio == c.hca_ratio:
        values.append(f"csa_ratio and hca_ratio must differ, both are {c.csa_ratio}")
    if len(ratios) != c.num_layers + c.num_mtp_layers:
        values.append(
            f"compress_ratios has {len(ratios)} entries; expected num_layers + num_mtp_layers"
            f" = {c.num_layers + c.num_mtp_layers}"
        )
    bad = sorted({r for r in ratios if r not in (0, c.csa_ratio, c.hca_ratio)})
    if bad:
        values.append(f"compress_ratios contains {bad}; allowed: 0, {c.csa_ratio} (CSA), {c.hca_ratio} (HCA)")
    if c.compress_rope_type not in COMPRESS_ROPE_TYPES:
        values.append(f"compress_rope_type must be one of {list(COMPRESS_ROPE_TYPES)}, got {c.compress_rope_type!r}")
    return types, values


def _config_int(key: str, v: object) -> int:
    """A config file's integer value: an int, or a float holding an integer (JSON writers differ); nothing else."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if not _is_int(v):
        raise TypeError(f"config {key} must be an int, got {describe(v)}")
    return int(v)


def _config_float(key: str, v: object) -> float:
    """A config file's real value (an int or a float; not a bool or a str)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"config {key} must be a number, got {describe(v)}")
    return float(v)


@dataclass(frozen=True)
class ModelConfig:
    """Attention hyper-parameters of one DeepSeek-V4 model (official names in comments).

    ``compress_ratios`` has one entry per layer plus one for each MTP block (0 = SWA, ``csa_ratio`` = CSA,
    ``hca_ratio`` = HCA), exactly as the official ``config.json`` ships it.
    """

    name: str
    hidden_size: int  # dim (d)
    num_layers: int  # n_layers
    num_heads: int  # n_heads (H)
    head_dim: int  # D = 512
    rope_dim: int  # rope_head_dim (R = 64): the last R dims of every head get RoPE
    q_lora_rank: int
    o_groups: int  # G
    o_lora_rank: int  # per-group width of the grouped output projection
    window: int  # window_size / sliding_window (n_win)
    csa_ratio: int  # m
    hca_ratio: int  # m'
    index_n_heads: int  # H_I
    index_head_dim: int  # c_I
    index_topk: int  # k
    compress_ratios: tuple[int, ...]
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # sliding-only layers (never YaRN)
    compress_rope_theta: float = 160000.0  # CSA/HCA layers
    yarn_factor: float = 16.0  # rope_factor
    yarn_original_seq_len: int = 65536  # original_seq_len
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    max_position: int = 1 << 20  # max_position_embeddings
    num_mtp_layers: int = 1
    # The CSA/HCA layers' RoPE table: "yarn" (the official models; the yarn_* fields apply) or "default" (plain
    # RoPE with compress_rope_theta, the yarn_* fields unused) — e.g. a transformers config without rope_parameters.
    compress_rope_type: str = "yarn"

    def __post_init__(self) -> None:
        """Validate every field (``TypeError`` for a value of the wrong kind, ``InvalidConfigError`` for one out of
        range; the message names the field, the allowed range and the value). ``compress_ratios`` may be given as
        any sequence of ints; it is stored as a tuple."""
        if isinstance(self.compress_ratios, (list, tuple)):
            object.__setattr__(self, "compress_ratios", tuple(self.compress_ratios))
        label = self.name if isinstance(self.name, str) else "?"
        types, values = _field_problems(self)
        if types:
            raise TypeError(f"invalid ModelConfig {label!r}: " + "; ".join(types))
        if values:
            raise InvalidConfigError(f"invalid ModelConfig {label!r}: " + "; ".join(values))

    # ------------------------------------------------------------------ derived geometry
    @property
    def nope_dim(self) -> int:
        """N = D − R: the dims that carry no position (FP8 in the official cache)."""
        return self.head_dim - self.rope_dim

    @property
    def num_attention_layers(self) -> int:
        """Layers including the MTP block(s): the length of ``compress_ratios``."""
        return len(self.compress_ratios)

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    @property
    def index_weight_scale(self) -> float:
        """``c_I^{-1/2} · H_I^{-1/2}``: folded into the indexer head weights (SPEC §5 step 2)."""
        return self.index_head_dim**-0.5 * self.index_n_heads**-0.5

    def layer_kind(self, layer_idx: int) -> LayerKind:
        """Kind of layer ``layer_idx`` (0-based; ``num_layers`` … are the MTP blocks)."""
        if not _is_int(layer_idx):
            raise TypeError(f"layer_idx must be an int, got {describe(layer_idx)}")
        if not 0 <= layer_idx < len(self.compress_ratios):
            raise IndexError(f"layer_idx {layer_idx} out of range for {self.name!r} ({len(self.compress_ratios)} layers)")
        r = self.compress_ratios[layer_idx]
        return LayerKind.SWA if r == 0 else LayerKind.CSA if r == self.csa_ratio else LayerKind.HCA

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return tuple(self.layer_kind(i) for i in range(len(self.compress_ratios)))

    def ratio(self, layer_idx: int) -> int:
        """Compression ratio of the layer (0 for SWA)."""
        self.layer_kind(layer_idx)
        return self.compress_ratios[layer_idx]

    def layers_of_kind(self, kind: LayerKind) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k is kind]

    # ------------------------------------------------------------------ presets
    @staticmethod
    def preset(name: str) -> "ModelConfig":
        """``"v4-flash"``, ``"v4-pro"`` or ``"tiny"``."""
        if not isinstance(name, str):
            raise TypeError(f"preset name must be a str (one of {sorted(_PRESETS)}), got {describe(name)}")
        try:
            return _PRESETS[name]()
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(_PRESETS)}") from None

    @staticmethod
    def presets() -> list[str]:
        return sorted(_PRESETS)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ transformers interop
    @classmethod
    def from_hf(cls, config: Any, name: str | None = None) -> "ModelConfig":
        """Build from a ``transformers`` ``DeepseekV4Config``, its ``to_dict()``, a ``config.json`` path or a
        directory holding one. Official inference names (``dim``, ``n_heads``, ``window_size`` …) work too.

        The per-layer pattern comes from ``compress_ratios`` (the list real checkpoints ship, MTP entries
        included) or else from ``layer_types`` + ``compress_rates``.
        """
        if isinstance(config, (str, os.PathLike)):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            try:
                with open(path) as f:
                    d = json.load(f)
            except json.JSONDecodeError as e:
                raise InvalidConfigError(f"config file {path!r} is not valid JSON: {e}") from None
            except UnicodeDecodeError:
                raise InvalidConfigError(f"config file {path!r} is not a text (JSON) file") from None
            if not isinstance(d, Mapping):
                raise InvalidConfigError(f"config file {path!r} must hold a JSON object, got {type(d).__name__}")
            name = name or os.path.basename(os.path.dirname(os.path.abspath(path))) or "hf"
            try:
                return cls._from_dict(d, name)
            except (TypeError, InvalidConfigError) as e:
                raise type(e)(f"config file {path}: {e}") from None
        elif isinstance(config, Mapping):
            d = dict(config)
        elif hasattr(config, "to_dict"):
            d = config.to_dict()
            # transformers turns `compress_ratios` into `layer_types` and drops it; fine, handled below.
        else:
            raise TypeError(f"from_hf expects a DeepseekV4Config, a dict or a path, got {type(config).__name__}")
        return cls._from_dict(d, name or "hf")

    @classmethod
    def _from_dict(cls, d: Mapping[str, Any], name: str) -> "ModelConfig":
        """Values are taken as given: ints must be integral (``4.0`` is accepted from JSON, ``4.5`` / ``"4"`` /
        ``true`` are not), floats real numbers; ``ModelConfig`` then checks every range."""

        def get(*keys: str, default: Any = None, required: bool = True) -> Any:
            for k in keys:
                if k in d and d[k] is not None:
                    return d[k]
            if required and default is None:
                raise InvalidConfigError(f"config is missing {' / '.join(keys)}")
            return default

        def gi(*keys: str, **kw: Any) -> int:
            return _config_int(keys[0], get(*keys, **kw))

        def gf(*keys: str, first: Any = None, **kw: Any) -> float:
            return _config_float(keys[0], first if first is not None else get(*keys, **kw))

        rates = d.get("compress_rates") or {}
        if not isinstance(rates, Mapping):
            raise TypeError(f"config compress_rates must be a mapping, got {describe(rates)}")
        csa = gi("compress_rate_csa", default=rates.get("compressed_sparse_attention", 4))
        hca = gi("compress_rate_hca", default=rates.get("heavily_compressed_attention", 128))
        num_layers = gi("num_hidden_layers", "n_layers")
        n_mtp = gi("num_nextn_predict_layers", "n_mtp_layers", default=1, required=False)
        if d.get("compress_ratios") is not None:
            if not isinstance(d["compress_ratios"], (list, tuple)):
                raise TypeError(f"config compress_ratios must be a list of ints, got {describe(d['compress_ratios'])}")
            ratios = [_config_int("compress_ratios", r) for r in d["compress_ratios"]]
            if len(ratios) < num_layers:
                raise InvalidConfigError(f"compress_ratios has {len(ratios)} entries, fewer than num_layers={num_layers}")
            # Later revisions pad the list with trailing zeros for extra MTP stages; keep what the MTP count covers.
            n_mtp = len(ratios) - num_layers
        elif d.get("layer_types") is not None:
            lt = list(d["layer_types"])[:num_layers]
            by_type = {"sliding_attention": 0, "compressed_sparse_attention": csa, "heavily_compressed_attention": hca}
            try:
                ratios = [by_type[t] for t in lt]
            except (KeyError, TypeError):
                bad = next(t for t in lt if not isinstance(t, str) or t not in by_type)
                raise InvalidConfigError(f"unknown layer type {bad!r} in layer_types; allowed: {sorted(by_type)}") from None
            ratios += [0] * max(n_mtp, 0)  # the MTP block is sliding-only (SPEC §1.2)
        else:
            raise InvalidConfigError("config has neither compress_ratios nor layer_types; cannot tell the layer pattern")

        head_dim = gi("head_dim")
        max_position = gi("max_position_embeddings", "max_seq_len", default=1 << 20)
        rope = rope_fields(d, head_dim, max_position)
        rope_dim = get("qk_rope_head_dim", "rope_head_dim", required=False)
        prf_dim = rope.pop("rope_dim")
        if rope_dim is not None and prf_dim is not None and _config_int("qk_rope_head_dim", rope_dim) != prf_dim:
            raise InvalidConfigError(
                f"qk_rope_head_dim {rope_dim} disagrees with partial_rotary_factor (head_dim {head_dim} x factor ="
                f" {prf_dim} rotated dims)"
            )
        if rope_dim is None:
            rope_dim = prf_dim if prf_dim is not None else head_dim // 8  # transformers' default factor 64 / 512
        return cls(
            name=name,
            hidden_size=gi("hidden_size", "dim"),
            num_layers=num_layers,
            num_heads=gi("num_attention_heads", "n_heads"),
            head_dim=head_dim,
            rope_dim=_config_int("qk_rope_head_dim", rope_dim),
            q_lora_rank=gi("q_lora_rank"),
            o_groups=gi("o_groups"),
            o_lora_rank=gi("o_lora_rank"),
            window=gi("sliding_window", "window_size"),
            csa_ratio=csa,
            hca_ratio=hca,
            index_n_heads=gi("index_n_heads"),
            index_head_dim=gi("index_head_dim"),
            index_topk=gi("index_topk"),
            compress_ratios=tuple(ratios),
            norm_eps=gf("rms_norm_eps", "norm_eps", default=1e-6),
            max_position=max_position,
            num_mtp_layers=n_mtp,
            **rope,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The fields a ``transformers`` ``DeepseekV4Config`` needs for this attention geometry
        (layer pattern as ``layer_types`` of the ``num_layers`` main layers; MTP blocks are not modelled there)."""
        return {
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "partial_rotary_factor": self.rope_dim / self.head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.window,
            "compress_rates": {"compressed_sparse_attention": self.csa_ratio, "heavily_compressed_attention": self.hca_ratio},
            "layer_types": [_HF_LAYER_TYPE[self.layer_kind(i)] for i in range(self.num_layers)],
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "rope_parameters": self._hf_compress_rope(),
            "max_position_embeddings": self.max_position,
            "num_nextn_predict_layers": self.num_mtp_layers,
        }

    def _hf_compress_rope(self) -> dict[str, Any]:
        """The compressed layers' RoPE as a flat transformers ``rope_parameters`` dict."""
        if self.compress_rope_type == "default":
            return {"rope_type": "default"}
        return {
            "rope_type": "yarn",
            "factor": self.yarn_factor,
            "original_max_position_embeddings": self.yarn_original_seq_len,
            "beta_fast": self.yarn_beta_fast,
            "beta_slow": self.yarn_beta_slow,
        }

    def describe(self) -> str:
        kinds = self.layer_kinds
        counts = {k.name: sum(1 for x in kinds if x is k) for k in LayerKind}
        return (
            f"{self.name}: {self.num_layers} layers + {self.num_mtp_layers} MTP "
            f"({counts['SWA']} SWA, {counts['CSA']} CSA, {counts['HCA']} HCA), d={self.hidden_size}, "
            f"H={self.num_heads}x{self.head_dim} (rope {self.rope_dim}), window {self.window}, "
            f"ratios {self.csa_ratio}/{self.hca_ratio}, indexer {self.index_n_heads}x{self.index_head_dim} top-{self.index_topk}"
        )


def _flash() -> ModelConfig:
    # [0, 0, 4, 128, 4, 128, …, 4, 128, 4, 0]: SWA, SWA, then CSA on even / HCA on odd layers; MTP sliding.
    ratios = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, 43)] + [0]
    return ModelConfig(
        name="v4-flash", hidden_size=4096, num_layers=43, num_heads=64, head_dim=512, rope_dim=64,
        q_lora_rank=1024, o_groups=8, o_lora_rank=1024, window=128, csa_ratio=4, hca_ratio=128,
        index_n_heads=64, index_head_dim=128, index_topk=512, compress_ratios=tuple(ratios),
    )


def _pro() -> ModelConfig:
    # [128, 128, 4, 128, 4, …, 4, 128, 4, 0]: HCA, HCA, then CSA on even / HCA on odd layers; MTP sliding.
    ratios = [128, 128] + [4 if i % 2 == 0 else 128 for i in range(2, 61)] + [0]
    return ModelConfig(
        name="v4-pro", hidden_size=7168, num_layers=61, num_heads=128, head_dim=512, rope_dim=64,
        q_lora_rank=1536, o_groups=16, o_lora_rank=1024, window=128, csa_ratio=4, hca_ratio=128,
        index_n_heads=64, index_head_dim=128, index_topk=1024, compress_ratios=tuple(ratios),
    )


def _tiny() -> ModelConfig:
    # Same structure as Flash (SWA first, then CSA/HCA interleaved, MTP sliding) at CPU-test size.
    return ModelConfig(
        name="tiny", hidden_size=128, num_layers=4, num_heads=4, head_dim=512, rope_dim=64,
        q_lora_rank=64, o_groups=2, o_lora_rank=32, window=16, csa_ratio=4, hca_ratio=16,
        index_n_heads=4, index_head_dim=128, index_topk=8, compress_ratios=(0, 4, 16, 4, 0),
        max_position=1 << 16,
    )


_PRESETS = {"v4-flash": _flash, "v4-pro": _pro, "tiny": _tiny}


def require_config(cfg: object, name: str = "cfg") -> ModelConfig:
    """``cfg`` if it is a ``ModelConfig``; ``TypeError`` naming the argument otherwise (e.g. a dict)."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"{name} must be a ModelConfig, got {describe(cfg)}; use ModelConfig.preset(name) or "
                        f"ModelConfig.from_hf(dict)")
    return cfg
