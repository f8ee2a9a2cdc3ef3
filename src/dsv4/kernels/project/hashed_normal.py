"""The engine's counter-based hidden states (``engine.hidden.TokenHidden`` / ``HashHidden``) in one launch.

``engine.hidden._standard_normal`` builds a step's ``[T, d]`` standard normals in about twenty torch kernels, most
of them full passes over an int64 ``[T, 2d]`` tensor (a prefill chunk of 8K tokens: ≈ 0.5 GB per pass). Here one
program writes a ``[BLOCK_T, BLOCK_D]`` tile once, computing per value

    bits_k = hash32(key_t ^ chan_k)                 k = j and d + j, the same int64 arithmetic as ``hash32``
    u_k    = ((bits_k >> 8) + 0.5) · 2⁻²⁴            fp32
    z      = sqrt(−2 · log(u_1)) · cos(fp32(2π) · u_2)

with the CUDA math library's ``logf`` / ``cosf`` (libdevice, which torch's CUDA kernels call), an IEEE square
root and no FMA contraction: the values equal the torch ops on the same GPU bit for bit
(``tests/kernels/project/test_hashed_normal.py``). The row count is not specialised on, so one compile serves
every step.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..quant import cosf, logf

__all__ = ["hashed_normal"]

_M32: tl.constexpr = tl.constexpr(0xFFFFFFFF)
_MIX: tl.constexpr = tl.constexpr(0x45D9F3B)
_TWO_PI: tl.constexpr = tl.constexpr(2.0 * math.pi)


@triton.jit
def _hash32(x):
    """``engine.hidden.hash32`` on int64 values in ``[0, 2³²)`` (every product stays below 2⁶³)."""
    x = x & _M32
    x = ((x >> 16) ^ x) * _MIX & _M32
    x = ((x >> 16) ^ x) * _MIX & _M32
    return (x >> 16) ^ x


@triton.jit
def _uniform(bits):
    """fp32 in (0, 1) from the top 24 of 32 hashed bits, as ``engine.hidden._standard_normal``."""
    return ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)


@triton.jit(do_not_specialize=["T"])
def _hashed_normal_kernel(keys_ptr, chan_ptr, out_ptr, T, D: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    """Tile ``(pid_t, pid_d)`` of ``out`` fp32 ``[T, D]``: Box–Muller of the hashes of ``keys`` int64 ``[T]`` with
    ``chan`` int64 ``[2D]``."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = rows < T
    cols_live = cols < D
    key = tl.load(keys_ptr + rows, mask=live, other=0)[:, None]
    u1 = _uniform(_hash32(key ^ tl.load(chan_ptr + cols, mask=cols_live, other=0)[None, :]))
    u2 = _uniform(_hash32(key ^ tl.load(chan_ptr + D + cols, mask=cols_live, other=0)[None, :]))
    z = tl.sqrt_rn(-2.0 * logf(u1)) * cosf(_TWO_PI * u2)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], z, mask=live[:, None] & cols_live[None, :])


def hashed_normal(keys: Tensor, chan: Tensor, hidden_size: int) -> Tensor:
    """Standard normals of ``keys`` int64 ``[T]`` × ``chan`` int64 ``[2·hidden_size]`` (both values in
    ``[0, 2³²)``, on one CUDA device, or the Triton interpreter's CPU): float32 ``[T, hidden_size]``, equal bit
    for bit to ``engine.hidden._standard_normal`` on that GPU."""
    if keys.dtype != torch.int64 or chan.dtype != torch.int64 or chan.shape != (2 * hidden_size,):
        raise ValueError(f"keys int64 [T] and chan int64 [{2 * hidden_size}] expected, got {keys.dtype} "
                         f"{tuple(keys.shape)} and {chan.dtype} {tuple(chan.shape)}")
    T = keys.shape[0]
    out = torch.empty((T, hidden_size), dtype=torch.float32, device=keys.device)
    if T == 0:
        return out
    block_d = min(1024, triton.next_power_of_2(hidden_size))
    grid = (triton.cdiv(T, 4), triton.cdiv(hidden_size, block_d))
    _hashed_normal_kernel[grid](keys.contiguous(), chan.contiguous(), out, T, D=hidden_size, BLOCK_T=4,
                                BLOCK_D=block_d, num_warps=4, enable_fp_fusion=False)
    return out
