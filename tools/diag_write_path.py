"""GPU diagnostics for the write path (not a test): which reduction orders torch's CUDA kernels use, whether the
libdevice functions match torch's, and the write path vs torch on a few scenarios under both reduce models.

Usage: PYTHONPATH=src python3 tools/diag_write_path.py (it imports the tests' write-path driver from tests/support)."""
import random, sys, time
from pathlib import Path

import torch, triton, triton.language as tl
import dsv4
from dsv4.kernels.quant import expf, cosf, sinf, rsqrtf
from dsv4.kernels.write import launch as write_launch, plan as write_plan
from dsv4.layer import Attention
from dsv4.ops import torch_ops, triton_ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.write_path import make_cache, write_step, differences  # noqa: E402

dev = "cuda"
torch.manual_seed(0)

def seq4(a, b, c, d): return ((a + b) + c) + d

def pool_tree(x, nw):  # x [E, S, C] -> [E, C]
    S = x.shape[1]
    if nw == 0:
        acc = [None] * 4
        for d in range(S):
            acc[d % 4] = x[:, d] if acc[d % 4] is None else acc[d % 4] + x[:, d]
        return seq4(*acc)
    parts = []
    for y in range(nw):
        vl = []
        for i in range(4):
            s = None
            for k in range(S // (4 * nw)):
                v = x[:, y + nw * i + 4 * nw * k]
                s = v if s is None else s + v
            vl.append(s)
        parts.append(seq4(*vl))
    n = nw
    while n > 1:
        parts = [parts[j] + parts[j + n // 2] for j in range(n // 2)]
        n //= 2
    return parts[0]

def halve(p):
    n = p.shape[1] // 2
    return p[:, :n] + p[:, n:]

def sumsq_tree(sq, W):  # sq [E, C]
    E, C = sq.shape
    if C == 512:
        K = 128 // W
        v = sq.view(E, K, W, 4)
        acc = v[:, 0]
        for k in range(1, K):
            acc = acc + v[:, k]
        p = seq4(acc[..., 0], acc[..., 1], acc[..., 2], acc[..., 3])
    else:
        if W == 32:
            v = sq.view(E, 4, 32); p = seq4(v[:, 0], v[:, 1], v[:, 2], v[:, 3])
        elif W == 64:
            p = sq[:, :64] + sq[:, 64:]
        else:
            p = sq
    while p.shape[1] > 32:
        p = halve(p)
    while p.shape[1] > 1:
        p = p[:, 0::2] + p[:, 1::2]
    return p[:, 0]

print("== pooled sum over dim 1 (x.sum(1) of [E, S, C]): matching trees")
for E, S, C in [(1, 8, 512), (300, 8, 512), (3, 8, 128), (1, 128, 512), (50, 128, 512), (2, 16, 512)]:
    x = torch.randn(E, S, C, device=dev) * torch.exp(2 * torch.randn(E, S, 1, device=dev))
    ref = x.sum(1)
    print(E, S, C, [nw for nw in (0, 4, 8, 2, 16) if S % (4 * max(nw, 1)) == 0 and torch.equal(pool_tree(x, nw), ref)])

print("== mean of squares over the last dim: matching thread counts per row count")
for C in (512, 128):
    res = {}
    for E in (1, 2, 4, 7, 8, 12, 15, 16, 20, 31, 32, 40, 300, 5000):
        x = torch.randn(E, C, device=dev).bfloat16().float()
        ref = x.pow(2).mean(-1)
        res[E] = [W for W in (32, 64, 128) if torch.equal(sumsq_tree(x.pow(2), W) * (1.0 / C), ref)]
    print(C, res)

@triton.jit
def _fns(x_ptr, o_ptr, N):
    i = tl.arange(0, 1024)
    for b in range(0, N, 1024):
        m = b + i < N
        x = tl.load(x_ptr + b + i, mask=m)
        tl.store(o_ptr + b + i, expf(x), mask=m)
        tl.store(o_ptr + N + b + i, cosf(x * 100.0), mask=m)
        tl.store(o_ptr + 2 * N + b + i, sinf(x * 100.0), mask=m)
        tl.store(o_ptr + 3 * N + b + i, rsqrtf(tl.abs(x) + 1e-6), mask=m)

N = 1 << 20
x = torch.randn(N, device=dev) * 8
o = torch.empty(4 * N, device=dev)
_fns[(1,)](x, o, N, enable_fp_fusion=False)
refs = [x.exp(), (x * 100.0).cos(), (x * 100.0).sin(), torch.rsqrt(x.abs() + 1e-6)]
print("== libdevice vs torch mismatches (of 1M):", [int((o[k * N:(k + 1) * N] != r).sum()) for k, r in enumerate(refs)])

CFG = dsv4.ModelConfig.preset("v4-flash")
lay = Attention(dsv4.AttentionWeights.random(CFG, 2, seed=7, device=dev), CFG, 2, backend="torch")

def set_reduce_max_threads(n):
    """The thread count the write path assumes torch's reduce kernels stop at (``torch_order.TORCH_REDUCE_MAX_THREADS``,
    read by the write plan and the launch)."""
    write_plan.TORCH_REDUCE_MAX_THREADS = write_launch.TORCH_REDUCE_MAX_THREADS = n


def scenario(name, plans, B):
    for maxt in (512, 1024):
        set_reduce_max_threads(maxt)
        ca = make_cache(CFG, [2], dev, B, num_blocks=3 * B + 64, block_size=256)
        cb = make_cache(CFG, [2], dev, B, num_blocks=3 * B + 64, block_size=256)
        g = torch.Generator(device=dev).manual_seed(3)
        out = []
        for step, plan in enumerate(plans):
            for r in plan:
                if r not in ca: ca.add_request(r); cb.add_request(r)
            ba, bb = ca.prepare_forward(plan), cb.prepare_forward(plan)
            x = torch.randn(ba.num_tokens, CFG.hidden_size, generator=g, device=dev)
            k1 = write_step(torch_ops, lay, ca, ba, x); k2 = write_step(triton_ops, lay, cb, bb, x)
            d = differences(ca, cb, 2)
            nk = int((k1.view(torch.int16) != k2.view(torch.int16)).sum())
            detail = ""
            if d:
                for pname, storage in (("kv_pages", ca.schemas[2].kv_storage), ("index_pages", ca.schemas[2].index_storage)):
                    if ba.num_emit[4]:
                        ea = storage.read_bytes(ca.pool.tensors[2][pname], ba.emit_block[4], ba.emit_slot[4])
                        eb = storage.read_bytes(cb.pool.tensors[2][pname], ba.emit_block[4], ba.emit_slot[4])
                        bad = (ea != eb).any(1)
                        detail += f" {pname}: {int(bad.sum())}/{len(bad)} entries differ (first {bad.nonzero().flatten()[:6].tolist()})"
            out.append(f"step{step} E={ba.num_emit[4]} kv_new {nk} {d}{detail}")
            # resync so later steps test their own numerics
            for k, t in ca.state.tensors[2].items(): cb.state.tensors[2][k].copy_(t)
            for k, t in ca.pool.tensors[2].items(): cb.pool.tensors[2][k].copy_(t)
        print(f"== {name} MAXT={maxt}:", "; ".join(out), flush=True)
    set_reduce_max_threads(512)

rng = random.Random(101)
scenario("csa prefill b1", [{"r0": n} for n in (7, 40, 333, 12, 1, 1, 1, 61)], 1)
ids = [f"r{i}" for i in range(256)]
scenario("csa decode b256", [{r: rng.randint(1, 300) for r in ids}] + [{r: 1 for r in ids} for _ in range(4)], 256)
