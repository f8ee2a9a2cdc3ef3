"""The RoPE fields of a ``ModelConfig`` read from a ``transformers`` or official DeepSeek-V4 config dict.

DeepSeek-V4 has two RoPE tables (SPEC §2.2): ``main`` for the sliding-only layers (θ = ``rope_theta``, never YaRN)
and ``compress`` for every RoPE of a CSA/HCA layer (θ = ``compress_rope_theta``, YaRN in the official models).
Three spellings reach ``ModelConfig.from_hf``; each is read the way its own library reads it:

* **transformers, nested** (``DeepseekV4Config.to_dict()``): ``rope_parameters = {"main": {...}, "compress":
  {...}}``, each with ``rope_type`` (``"default"`` or ``"yarn"``), ``rope_theta``, ``partial_rotary_factor`` and
  the YaRN keys. A YaRN table without ``attention_factor`` gets transformers' computed magnitude scale.
* **transformers, flat** (a checkpoint's ``config.json``: ``rope_scaling`` or a flat ``rope_parameters``): the dict
  describes the compressed layers only, as ``DeepseekV4Config`` reads it — its θ is ``compress_rope_theta``, the
  main table is plain RoPE with ``rope_theta``, ``rope_type`` (or ``type``) defaults to ``"default"``, a YaRN dict
  gets ``attention_factor = 1.0`` and ``original_max_position_embeddings`` defaults to ``max_position_embeddings``.
  No RoPE dict at all means plain RoPE on the compressed layers (what ``DeepseekV4Config`` builds).
* **official inference names** (``rope_factor``, ``original_seq_len``, ``beta_fast``, ``beta_slow``, or a dict
  spelled with ``dim`` / ``n_heads``): YaRN on the compressed layers iff ``original_seq_len > 0``, as the official
  ``precompute_freqs_cis`` does; defaults 16 / 65,536 / 32 / 1.

What dsv4 cannot represent is refused with a ``ValueError`` naming the field: YaRN (or any non-default type) on the
main table, RoPE types other than default / YaRN, a YaRN magnitude scale (``attention_factor`` ≠ 1: dsv4, like the
official reference, scales neither cos/sin nor logits), an untruncated YaRN correction range, and different
rotary widths for the two tables.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

__all__ = ["COMPRESS_ROPE_TYPES", "rope_fields"]

COMPRESS_ROPE_TYPES = ("yarn", "default")

_OFFICIAL_ROPE_KEYS = ("rope_factor", "original_seq_len")
_OFFICIAL_NAMING_KEYS = ("dim", "n_heads", "n_layers")


def _yarn_magnitude(factor: float, mscale: float = 1.0) -> float:
    """transformers' ``get_mscale``: the YaRN cos/sin scale for a context extension ``factor``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_type(table: Mapping[str, Any]) -> str:
    return str(table.get("rope_type", table.get("type", "default")))


def _rotary_dim(head_dim: int, table: Mapping[str, Any], fallback: float | None) -> int | None:
    prf = table.get("partial_rotary_factor", fallback)
    return None if prf is None else int(head_dim * float(prf))


def _yarn_fields(
    table: Mapping[str, Any], max_position: int, where: str, default_attention_factor: float | None
) -> dict[str, Any]:
    """``ModelConfig`` YaRN fields of one transformers YaRN table (``_compute_yarn_parameters``'s reading)."""
    if "factor" not in table:
        raise ValueError(f"{where}: a YaRN table needs 'factor'")
    original = int(table.get("original_max_position_embeddings") or max_position)
    factor = table["factor"]
    factor = float(max_position / original if factor is None else factor)
    attention = table.get("attention_factor", default_attention_factor)
    if attention is None:
        mscale, mscale_all = table.get("mscale"), table.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_magnitude(factor, mscale) / _yarn_magnitude(factor, mscale_all)
        else:
            attention = _yarn_magnitude(factor)
    if float(attention) != 1.0:
        raise ValueError(
            f"{where}: YaRN with a magnitude scale (attention_factor {float(attention):.6g}; transformers computes it "
            "from factor / mscale when attention_factor is absent) cannot be represented: dsv4, like the official "
            "reference, scales neither cos/sin nor the logits; set attention_factor to 1.0"
        )
    if table.get("truncate", True) is False:
        raise ValueError(f"{where}: truncate=False (an unrounded YaRN correction range) cannot be represented")
    return {
        "compress_rope_type": "yarn",
        "yarn_factor": factor,
        "yarn_original_seq_len": original,
        # transformers reads these with `or`: 0 / None mean the defaults
        "yarn_beta_fast": float(table.get("beta_fast") or 32),
        "yarn_beta_slow": float(table.get("beta_slow") or 1),
    }


def _hf_fields(d: Mapping[str, Any], head_dim: int, max_position: int) -> dict[str, Any]:
    rp = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(rp, Mapping):
        raise ValueError(f"rope_parameters / rope_scaling must be a dict, got {type(rp).__name__}")
    top_prf = d.get("partial_rotary_factor")
    nested = [k for k in ("main", "compress") if isinstance(rp.get(k), Mapping)]
    if len(nested) == 1:
        raise ValueError(
            f"rope_parameters has a {nested[0]!r} table but no {({'main', 'compress'} - set(nested)).pop()!r} table "
            "(transformers ignores such a half-nested dict); give both or a flat dict"
        )
    if nested:
        main, comp = dict(rp["main"]), dict(rp["compress"])
        main.setdefault("rope_theta", d.get("rope_theta") or 10000.0)
        comp.setdefault("rope_theta", d.get("compress_rope_theta") or 160000.0)
        default_attention = None
    else:
        # DeepseekV4Config: main is plain RoPE with rope_theta; the flat dict describes the compressed layers, whose
        # θ is compress_rope_theta (a rope_theta inside the flat dict is overwritten, as transformers does).
        main = {"rope_type": "default", "rope_theta": d.get("rope_theta") or 10000.0}
        comp = {**rp, "rope_theta": d.get("compress_rope_theta") or 160000.0}
        default_attention = 1.0
    main_type, comp_type = _rope_type(main), _rope_type(comp)
    if main_type != "default":
        raise ValueError(
            f"rope_parameters['main'] has rope_type {main_type!r}: dsv4 applies only plain RoPE to the sliding-only "
            "layers (the official models never scale them)"
        )
    if comp_type not in COMPRESS_ROPE_TYPES:
        raise ValueError(
            f"the compressed layers' rope_type {comp_type!r} is not supported; dsv4 implements {list(COMPRESS_ROPE_TYPES)}"
        )
    fields: dict[str, Any] = {"rope_theta": float(main["rope_theta"]), "compress_rope_theta": float(comp["rope_theta"])}
    if comp_type == "yarn":
        fields.update(_yarn_fields(comp, max_position, "the compressed layers' RoPE", default_attention))
    else:
        fields["compress_rope_type"] = "default"
    dims = {name: _rotary_dim(head_dim, t, top_prf) for name, t in (("main", main), ("compress", comp))}
    if dims["main"] is not None and dims["compress"] is not None and dims["main"] != dims["compress"]:
        raise ValueError(
            f"the main and compressed RoPE tables rotate different widths ({dims['main']} vs {dims['compress']} dims "
            "from partial_rotary_factor); dsv4 has one rope_dim"
        )
    fields["rope_dim"] = dims["main"] if dims["main"] is not None else dims["compress"]
    return fields


def _official_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    original = int(d.get("original_seq_len", 65536))
    fields: dict[str, Any] = {
        "rope_theta": float(d.get("rope_theta") or 10000.0),
        "compress_rope_theta": float(d.get("compress_rope_theta") or 160000.0),
        "compress_rope_type": "yarn" if original > 0 else "default",
        "rope_dim": None,
    }
    if original > 0:
        fields.update(
            yarn_factor=float(d.get("rope_factor", 16.0)),
            yarn_original_seq_len=original,
            yarn_beta_fast=float(d.get("beta_fast", 32.0)),
            yarn_beta_slow=float(d.get("beta_slow", 1.0)),
        )
    return fields


def rope_fields(d: Mapping[str, Any], head_dim: int, max_position: int) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments for both RoPE tables of config dict ``d`` (see the module docstring).

    Returns ``rope_theta``, ``compress_rope_theta``, ``compress_rope_type`` and, for YaRN, ``yarn_factor``,
    ``yarn_original_seq_len``, ``yarn_beta_fast``, ``yarn_beta_slow``; plus ``rope_dim`` from
    ``partial_rotary_factor`` (``None`` when the dict gives none: the caller reads ``qk_rope_head_dim``).

    Raises:
        ValueError: a RoPE setting dsv4 cannot represent, naming the field.
    """
    has_hf_rope = d.get("rope_scaling") is not None or d.get("rope_parameters") is not None
    if not has_hf_rope and (
        any(d.get(k) is not None for k in _OFFICIAL_ROPE_KEYS) or any(k in d for k in _OFFICIAL_NAMING_KEYS)
    ):
        return _official_fields(d)
    return _hf_fields(d, head_dim, max_position)
