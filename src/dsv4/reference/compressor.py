"""The KV compressor (SPEC §4): gated softmax pooling of ``m`` tokens into one entry, then norm and RoPE.

HCA (``m' = 128``) pools each window's ``m`` tokens. CSA (``m = 4``) and the CSA indexer's compressor pool
``2m`` slots: the previous window's tokens with the *first-half* features ``[:c]`` and the current window's
tokens with the *second-half* features ``[c:]``; window 0 has no previous window (value 0, gate −∞).
Projections and pooling run in FP32.
"""

from __future__ import annotations

import torch

from ..weights import CompressorWeights
from .primitives import rms_norm
from .rope import apply_rope

__all__ = ["project", "overlap_slots", "pool_windows", "finish_entries", "compress"]


def project(
    x: torch.Tensor, cw: CompressorWeights, positions: torch.Tensor, weight_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 projections of each token and its biased gate.

    Args:
        x: ``[S, d]`` attention input (any float dtype; promoted to FP32).
        cw: compressor weights; ``ape`` is ``[m, width]``.
        positions: ``[S]`` absolute positions; the bias row is ``ape[t mod m]`` (offset in the token's own window).
        weight_dtype: the dtype the projection matrices hold (the numerics' activation dtype: BF16 in the official
            model, whose checkpoints store them so); the products and sums are FP32 either way.
    Returns:
        ``a``: ``[S, width]`` float32 projected features; ``z``: ``[S, width]`` float32 gate logits + position bias.
    """
    xf = x.float()
    m = cw.ape.shape[0]
    a = xf @ cw.wkv.to(xf.device, weight_dtype).float().T
    z = xf @ cw.wgate.to(xf.device, weight_dtype).float().T + cw.ape.to(xf.device, torch.float32)[positions % m]
    return a, z


def overlap_slots(
    a: torch.Tensor, z: torch.Tensor, m: int, prev_kv: torch.Tensor | None = None, prev_gate: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay out the ``2m`` pooling slots of each CSA window.

    Args:
        a, z: ``[n·m, 2c]`` float32 features/gates of ``n`` complete, consecutive windows.
        m: the compression ratio.
        prev_kv, prev_gate: ``[m, c]`` first-half features/gates of the window before the first one, or ``None``
            when the first window is window 0 (its previous slots get value 0 and gate −∞: weight 0).
    Returns:
        ``kv, gate``: ``[n, 2m, c]``: slots ``0..m−1`` = previous window's ``[:c]``, ``m..2m−1`` = own ``[c:]``.
    """
    c = a.shape[-1] // 2
    a, z = a.unflatten(0, (-1, m)), z.unflatten(0, (-1, m))
    first_kv = torch.zeros_like(a[:1, :, :c]) if prev_kv is None else prev_kv[None].to(a)
    first_gate = torch.full_like(z[:1, :, :c], float("-inf")) if prev_gate is None else prev_gate[None].to(z)
    prev_half_kv = torch.cat((first_kv, a[:-1, :, :c]), dim=0)
    prev_half_gate = torch.cat((first_gate, z[:-1, :, :c]), dim=0)
    return torch.cat((prev_half_kv, a[..., c:]), dim=1), torch.cat((prev_half_gate, z[..., c:]), dim=1)


def pool_windows(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``C̃[c'] = Σ_slot softmax_slot(gate)[slot, c'] · kv[slot, c']`` — a per-channel softmax over the slots.

    Args:
        kv, gate: ``[n, slots, c]`` float32. Returns ``[n, c]`` float32.
    """
    return (gate.softmax(dim=1) * kv).sum(dim=1)


def finish_entries(
    pooled: torch.Tensor, norm: torch.Tensor, first_positions: torch.Tensor, inv_freq: torch.Tensor, eps: float, act_dtype: torch.dtype
) -> torch.Tensor:
    """Post-process pooled entries (SPEC §4.3 steps 1–2): cast to the activation dtype, weighted RMSNorm, RoPE at
    the position of the window's *first* token ``i·m``. Quantization is the caller's (it depends on the role).

    Args:
        pooled: ``[n, c]`` float32; norm: ``[c]``; first_positions: ``[n]`` (``i·m``). Returns ``[n, c]`` act dtype.
    """
    entries = rms_norm(pooled.to(act_dtype), norm, eps)
    return apply_rope(entries, first_positions, inv_freq)


def compress(
    x: torch.Tensor, cw: CompressorWeights, overlap: bool, inv_freq: torch.Tensor, eps: float, act_dtype: torch.dtype
) -> torch.Tensor:
    """All complete windows of a sequence starting at position 0 (stateless, full-sequence).

    Args:
        x: ``[S, d]``. overlap: CSA-style ``2m`` slots (True) or HCA-style ``m`` slots (False).
    Returns:
        ``[⌊S/m⌋, c]`` entries in ``act_dtype`` (normed, RoPE'd, not yet quantized); entry ``i`` covers
        tokens ``[i·m, (i+1)·m)``.
    """
    m = cw.ape.shape[0]
    n = x.shape[0] // m
    c = cw.norm.shape[0]
    if n == 0:
        return x.new_zeros((0, c), dtype=act_dtype)
    positions = torch.arange(n * m, device=x.device)
    a, z = project(x[: n * m], cw, positions, act_dtype)
    if overlap:
        kv, gate = overlap_slots(a, z, m)
    else:
        kv, gate = a.unflatten(0, (n, m)), z.unflatten(0, (n, m))
    return finish_entries(pool_windows(kv, gate), cw.norm, positions[::m], inv_freq, eps, act_dtype)
