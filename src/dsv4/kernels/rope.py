"""RoPE of adjacent channel pairs in a Triton kernel, as ``reference.rope.apply_rope`` computes it (SPEC §2.2)."""

from __future__ import annotations

import triton
import triton.language as tl  # noqa: F401  (the interpreter patches the jit function's `tl`)

from .quant import cosf, sinf

__all__ = ["rope_pairs"]


@triton.jit
def rope_pairs(re, im, pos_f, inv_freq):
    """Rotate adjacent pairs ``(re, im)`` by ``pos·ω`` as ``reference.rope.apply_rope`` (fp32, no FMA contraction).

    Args: ``re``, ``im`` fp32 ``[..., 32]``; ``pos_f`` fp32 broadcastable to them (``[..., 1]``); ``inv_freq``
    fp32 ``[32]``. Returns the rotated ``(re', im')`` fp32.
    """
    angle = pos_f * inv_freq
    c = cosf(angle)
    s = sinf(angle)
    return re * c - im * s, re * s + im * c
