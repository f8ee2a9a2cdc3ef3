"""GPU diagnostic (not a test): which summation order does torch's CUDA reduce kernel use for ``x.pow(2).mean(-1)``
of a contiguous ``[E, C]`` fp32 tensor (the RMSNorm of the compressor's entries)? Every candidate order is emulated
with elementwise fp32 adds (each rounded, no FMA) and compared bit for bit with torch over all rows, for several E.
"""
import itertools
import sys

import torch

dev = "cuda" if torch.cuda.is_available() else "cpu"
print(torch.__version__, torch.cuda.get_device_name() if dev == "cuda" else "cpu", flush=True)


def thread_values(sq: torch.Tensor, V: int, BW: int, combine: str) -> torch.Tensor:
    """Per-thread partial sums ``[E, BW]``: thread l reads the V-vectors l, l+BW, … into V accumulators."""
    E, C = sq.shape
    K = C // (V * BW)
    v = sq.view(E, K, BW, V)  # [k, lane, vector element]
    acc = v[:, 0]
    for k in range(1, K):
        acc = acc + v[:, k]
    if combine == "seq":
        out = acc[..., 0]
        for i in range(1, V):
            out = out + acc[..., i]
    else:  # pairwise tree over the vector elements
        out = acc
        while out.shape[-1] > 1:
            h = out.shape[-1] // 2
            out = out[..., :h] + out[..., h:]
        out = out[..., 0]
    return out


def block_reduce(p: torch.Tensor, warp: str) -> torch.Tensor:
    """``[E, BW]`` thread values → ``[E]``: shared-memory halving down to 32 lanes, then the warp's shuffle tree."""
    while p.shape[1] > 32:
        h = p.shape[1] // 2
        p = p[:, :h] + p[:, h:]
    n = p.shape[1]
    if warp == "asc":  # shfl_down offsets 1, 2, 4, …: adjacent pairs first
        while p.shape[1] > 1:
            p = p[:, 0::2] + p[:, 1::2]
    else:  # offsets n/2, …, 1: halves first
        while p.shape[1] > 1:
            h = p.shape[1] // 2
            p = p[:, :h] + p[:, h:]
    return p[:, 0] if n else p


def candidates(C: int):
    for V, BW, combine, warp in itertools.product((1, 2, 4, 8), (16, 32, 64, 128, 256), ("seq", "tree"), ("asc", "desc")):
        if C % (V * BW) == 0 and not (V == 1 and combine == "tree"):
            yield (V, BW, combine, warp)


g = torch.Generator(device=dev).manual_seed(0)
for C in (512, 128):
    for E in (1, 4, 7, 8, 12, 15, 16, 31, 32, 59, 64, 300, 1024, 5000, 9438, 20000):
        x = torch.randn(E, C, generator=g, device=dev) * torch.exp(torch.randn(E, 1, generator=g, device=dev))
        x = x.bfloat16().float()
        ref = x.pow(2).mean(-1)
        sq = x.pow(2)
        match = []
        for V, BW, combine, warp in candidates(C):
            s = block_reduce(thread_values(sq, V, BW, combine), warp)
            if torch.equal(s * (1.0 / C), ref):
                match.append(f"V{V}/BW{BW}/{combine}/{warp}")
        print(f"C={C} E={E}: {match or 'NONE'}", flush=True)
sys.stdout.flush()
