"""Numerics: where values are rounded, and in which storage formats cached tensors live.

Two presets:

* ``"official"`` — the DeepSeek reference (SPEC §1.3, §7.1): BF16 activations; the projections ``wq_a``, ``wq_b``,
  ``wkv``, ``wo_b`` and the indexer's ``wq_b`` as FP8 GEMMs (FP8 E4M3 weights with one power-of-two scale per
  128 × 128 block, activations quantized per 1 × 128 block with UE8M0 scales, FP32 accumulation:
  ``formats.block_fp8``); the 448 nope dims of every KV entry
  (window and compressed) through FP8 E4M3 with one power-of-two scale per 64 values, the 64 rope dims BF16;
  indexer queries and keys through the 128-point Hadamard rotation and MXFP4 (E2M1, power-of-two scale per 32);
  compressor projections and pooling in FP32; index scores rounded to BF16; attention probabilities cast to
  BF16 before P·V.
* ``"exact"`` — no quantization anywhere, FP32 activations and FP32 storage: the mode in which dsv4 agrees with
  ``transformers`` (FP32, eager) to rounding.

Other storage formats (the prototype's per-token FP8 entries and NVFP4 indexer keys, the Hopper engines' FP8
132-B indexer keys) are selected by building a ``Numerics`` with other ``kv_format`` / ``index_format`` values,
e.g. ``Numerics.official().with_formats(index_format="fp8")``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Union

import torch

__all__ = ["Numerics", "KV_FORMATS", "INDEX_FORMATS", "resolve_numerics"]

#: Main KV entry formats (window ring and compressed pool).
#: ``fp8_ds_mla``: FlashMLA / vLLM 584-B entry (E4M3 block-64 UE8M0 + BF16 rope) — the official numerics;
#: ``fp8_per_token``: the prototype's E4M3 with one fp32 scale amax/448 per entry (+ BF16 rope);
#: ``fp32``: unquantized.
KV_FORMATS = ("fp8_ds_mla", "fp8_per_token", "fp32")
#: Indexer key formats. ``mxfp4``: 68-B official (Hadamard + E2M1 block-32 UE8M0); ``nvfp4``: the prototype's
#: E2M1 block-16 with E4M3 scales (sign kept); ``fp8``: Hopper engines' E4M3 + fp32 scale per key (132 B);
#: ``fp32``: unquantized.
INDEX_FORMATS = ("mxfp4", "nvfp4", "fp8", "fp32")


@dataclass(frozen=True)
class Numerics:
    """Rounding points and storage formats of one attention layer.

    Attributes:
        name: label used in reports.
        act_dtype: dtype of activations between ops (q, kv, attention output, projections' outputs).
        kv_format: storage format of window and compressed KV entries (one of ``KV_FORMATS``).
        index_format: storage format of indexer keys; indexer queries are rounded the same way.
        score_dtype: dtype index scores are rounded to before top-k.
        prob_dtype: dtype attention probabilities are cast to before the P·V product.
        fp8_projections: the projections of SPEC §1.3 that DeepSeek runs as FP8 GEMMs do so here too
            (``formats.block_fp8.fp8_linear``); else they run in ``act_dtype`` on dequantized weights.
    """

    name: str
    act_dtype: torch.dtype
    kv_format: str
    index_format: str
    score_dtype: torch.dtype
    prob_dtype: torch.dtype
    fp8_projections: bool = False

    def __post_init__(self) -> None:
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"unknown kv_format {self.kv_format!r}; choose one of {KV_FORMATS}")
        if self.index_format not in INDEX_FORMATS:
            raise ValueError(f"unknown index_format {self.index_format!r}; choose one of {INDEX_FORMATS}")

    @staticmethod
    def official() -> "Numerics":
        return Numerics("official", torch.bfloat16, "fp8_ds_mla", "mxfp4", torch.bfloat16, torch.bfloat16,
                        fp8_projections=True)

    @staticmethod
    def exact() -> "Numerics":
        return Numerics("exact", torch.float32, "fp32", "fp32", torch.float32, torch.float32)

    def with_formats(self, kv_format: str | None = None, index_format: str | None = None) -> "Numerics":
        """A copy with other storage formats (name gets a suffix so reports stay honest)."""
        kv = kv_format or self.kv_format
        ix = index_format or self.index_format
        name = self.name if (kv, ix) == (self.kv_format, self.index_format) else f"{self.name}[{kv},{ix}]"
        return dataclasses.replace(self, name=name, kv_format=kv, index_format=ix)

    @property
    def uses_hadamard(self) -> bool:
        """Indexer q/k are Hadamard-rotated before quantization (a no-op for q·k when unquantized)."""
        return self.index_format != "fp32"

    # ---------------------------------------------------------------- quantize→dequantize points
    def qdq_kv(self, kv: torch.Tensor, nope_dim: int) -> torch.Tensor:
        """Round a KV entry as its storage format does.

        Args:
            kv: ``[..., D]`` entries (rope already applied), any float dtype.
            nope_dim: N; dims ``[:N]`` are quantized, ``[N:]`` (rope) are rounded to BF16 when quantizing.
        Returns:
            ``[..., D]`` in ``act_dtype``; values exactly representable in the storage format.
        """
        if self.kv_format == "fp32":
            return kv.to(self.act_dtype)
        from . import formats

        nope = kv[..., :nope_dim]
        qdq = formats.qdq_fp8_block if self.kv_format == "fp8_ds_mla" else formats.qdq_fp8_per_token
        nope_q = qdq(nope, check=False)
        rope_q = kv[..., nope_dim:].to(torch.bfloat16).float()
        return torch.cat([nope_q, rope_q], dim=-1).to(self.act_dtype)

    def qdq_index(self, v: torch.Tensor) -> torch.Tensor:
        """Indexer query/key rounding: Hadamard then the index format's quantizer (fp32: identity).

        Args:
            v: ``[..., c_I]`` (rope applied). Returns ``[..., c_I]`` float32.
        """
        if self.index_format == "fp32":
            return v.float()
        from . import formats

        rotated = formats.hadamard_transform(v.float())
        if self.index_format == "mxfp4":
            return formats.qdq_mxfp4(rotated, check=False)
        if self.index_format == "nvfp4":
            return formats.qdq_nvfp4(rotated, check=False)
        return formats.qdq_fp8_key(rotated, check=False)


NumericsLike = Union[str, Numerics]


def resolve_numerics(numerics: NumericsLike) -> Numerics:
    """``"official"`` / ``"exact"`` / a ``Numerics`` → ``Numerics``."""
    if isinstance(numerics, Numerics):
        return numerics
    if numerics == "official":
        return Numerics.official()
    if numerics == "exact":
        return Numerics.exact()
    if not isinstance(numerics, str):
        raise TypeError(f"numerics must be 'official', 'exact' or a dsv4.Numerics, got {type(numerics).__name__} {numerics!r}")
    raise ValueError(f"unknown numerics {numerics!r}; use 'official', 'exact' or a dsv4.Numerics")
