"""GPU diagnostic (not a test): run test_gpu_write_path's decode[256-csa] scenario and, for every pool byte where the
Triton write path and the torch backend differ, name the entry (request, entry index, column) and print the torch
pipeline's values around it: the BF16 entry before quantization, the block scale, the scaled value and both codes.
Also checks whether torch's own RMSNorm / pooling of that entry depends on how many entries are computed together.

Usage: PYTHONPATH=src python3 tools/diag_write_locate.py [requests, default 256] (it imports the tests' write-path
driver from tests/support).
"""
import random
import sys
from pathlib import Path

import torch

import dsv4
from dsv4.layer import Attention
from dsv4.ops import torch_ops, triton_ops
from dsv4.ops.projections import layer_compressor_projections
from dsv4.reference.compressor import finish_entries, pool_windows
import triton
import triton.language as tl
from dsv4.kernels.quant import bf16_round, rsqrtf
from dsv4.kernels.torch_order import rms_norm_bf16, torch_sum_sq
from dsv4.kernels.write.entry import rope_last64
from dsv4.reference.primitives import rms_norm
from dsv4.reference.rope import apply_rope

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.write_path import differences, make_cache, write_step  # noqa: E402


@triton.jit
def _finish_rows(x_ptr, w_ptr, pos_ptr, inv_freq_ptr, y_ptr, rot_ptr, scratch_ptr, num_emit, eps, C: tl.constexpr,
                 NORM: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, C)
    y = tl.load(x_ptr + e * C + cols)
    if NORM:
        y = rms_norm_bf16(y, tl.load(w_ptr + cols), eps, num_emit, scratch_ptr + e * C, C, 512)
    tl.store(y_ptr + e * C + cols, y)
    _, rot = rope_last64(y, tl.load(pos_ptr + e).to(tl.float32), inv_freq_ptr, C)
    tl.store(rot_ptr + e * 64 + tl.arange(0, 64), rot)


@triton.jit
def _rms_parts(x_ptr, out_ptr, scratch_ptr, eps, C: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, C)
    xb = bf16_round(tl.load(x_ptr + e * C + cols))
    tl.store(scratch_ptr + e * C + cols, xb)
    tl.debug_barrier()
    s = torch_sum_sq(scratch_ptr + e * C, C, 32)
    ms = s * (1.0 / C)
    r = rsqrtf(ms + eps)
    o = tl.arange(0, 1)
    tl.store(out_ptr + e * 3 + o, ms)
    tl.store(out_ptr + e * 3 + 1 + o, ms + eps)
    tl.store(out_ptr + e * 3 + 2 + o, r)


def check_finish(pooled, norm, positions, inv_freq, eps, act_dtype, label):
    """The Triton RMSNorm and RoPE pieces vs torch's, row by row, on the same pooled input (all rows at once)."""
    E, C = pooled.shape
    y = torch.empty_like(pooled)
    rot = torch.empty(E, 64, device=pooled.device)
    scratch = torch.empty_like(pooled)
    _finish_rows[(E,)](pooled.contiguous(), norm.float().contiguous(), positions.contiguous(), inv_freq, y, rot, scratch,
                       E, eps, C=C, NORM=True, num_warps=4, enable_fp_fusion=False)
    ty = rms_norm(pooled.to(act_dtype), norm, eps)
    bad_rows = (y != ty.float()).any(1)
    trot = apply_rope(ty, positions, inv_freq)[:, -64:].float()
    # RoPE of the torch-normed rows through the Triton piece, to separate the two
    _finish_rows[(E,)](ty.float().contiguous(), norm.float().contiguous(), positions.contiguous(),
                       inv_freq, torch.empty_like(y), rot, scratch, E, eps, C=C, NORM=False, num_warps=4, enable_fp_fusion=False)
    bad_rope = (rot != trot).any(1)
    parts = torch.empty(E, 3, device=pooled.device)
    _rms_parts[(E,)](pooled.contiguous(), parts, scratch, eps, C=C, num_warps=4, enable_fp_fusion=False)
    xb = pooled.to(act_dtype).float()
    t_ms = xb.pow(2).mean(-1)
    t_r = torch.rsqrt(t_ms + eps)
    print(f"    [{label}] rows where the mean of squares differs: {int((parts[:, 0] != t_ms).sum())}; "
          f"mean+eps: {int((parts[:, 1] != t_ms + eps).sum())}; rsqrt: {int((parts[:, 2] != t_r).sum())}; "
          f"rsqrt of torch's own mean+eps through libdevice differs: see below", flush=True)
    for e in bad_rows.nonzero().flatten()[:3].tolist():
        yrow = rms_norm(pooled[e:e + 1].to(act_dtype), norm, eps)[0].float()
        j = (y[e] != ty[e].float()).nonzero().flatten().tolist()
        print(f"      row {e}: elts {j[:4]} triton {y[e, j[:4]].tolist()} torch {ty[e, j[:4]].float().tolist()}; "
              f"ms {parts[e, 0].item()!r} vs {t_ms[e].item()!r}; r {parts[e, 2].item()!r} vs {t_r[e].item()!r}; "
              f"w*(xb*r) torch-order {(norm.float()[j[:4]] * (xb[e, j[:4]] * t_r[e])).tolist()}", flush=True)
    print(f"    [{label}] E={E}: RMSNorm rows differing from torch: {int(bad_rows.sum())} "
          f"(first {bad_rows.nonzero().flatten()[:5].tolist()}); RoPE rows differing: {int(bad_rope.sum())} "
          f"(first {bad_rope.nonzero().flatten()[:5].tolist()})", flush=True)
    if bad_rope.any():
        e = int(bad_rope.nonzero()[0])
        j = int((rot[e] != trot[e]).nonzero()[0])
        pos = int(positions[e])
        ang = torch.tensor([pos], dtype=torch.float32, device=pooled.device) * inv_freq[j // 2]
        print(f"      row {e} pos {pos} rope elt {j}: triton {rot[e, j].item()!r} torch {trot[e, j].item()!r}; "
              f"angle {ang.item()!r} cos {ang.cos().item()!r} sin {ang.sin().item()!r}", flush=True)

dev = "cuda"
CFG = dsv4.ModelConfig.preset("v4-flash")
li, M = 2, 4
batch_n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
lay = Attention(dsv4.AttentionWeights.random(CFG, li, seed=7, device=dev), CFG, li, backend="torch")
rng = random.Random(batch_n)
ids = [f"r{i}" for i in range(batch_n)]
plans = [{r: rng.randint(1, 300) for r in ids}] + [{r: 1 for r in ids} for _ in range(5)]
nblocks = 8 + sum(sum(p.values()) for p in plans) // 256 + 3 * batch_n
ca = make_cache(CFG, [li], dev, batch_n, num_blocks=nblocks, block_size=256)
cb = make_cache(CFG, [li], dev, batch_n, num_blocks=nblocks, block_size=256)
g = torch.Generator(device=dev).manual_seed(batch_n)
nm = ca.numerics
w, inv_freq = lay._weights_on(torch.device(dev), nm)
for step, plan in enumerate(plans):
    for rid in plan:
        if rid not in ca:
            ca.add_request(rid)
            cb.add_request(rid)
    ba, bb = ca.prepare_forward(plan), cb.prepare_forward(plan)
    x = torch.randn(ba.num_tokens, CFG.hidden_size, generator=g, device=dev)
    state0 = {k: t.clone() for k, t in ca.state.tensors[li].items()}
    write_step(torch_ops, lay, ca, ba, x)
    snap_state = {k: t.clone() for k, t in cb.state.tensors[li].items()}
    snap_pool = {k: t.clone() for k, t in cb.pool.tensors[li].items()}
    runs = []
    for rep in range(2):  # is the Triton write path deterministic on identical inputs?
        for k, t in snap_state.items():
            cb.state.tensors[li][k].copy_(t)
        for k, t in snap_pool.items():
            cb.pool.tensors[li][k].copy_(t)
        write_step(triton_ops, lay, cb, bb, x)
        runs.append(differences(ca, cb, li))
    print(f"step {step}: differences vs torch over 2 identical Triton runs: {runs}", flush=True)
    d = differences(ca, cb, li)
    print(f"step {step}: E={ba.num_emit[M]} T={ba.num_tokens} diffs={d}", flush=True)
    if not d or not ba.num_emit[M]:
        continue
    for ci, (pname, storage, prefix, cw) in enumerate((
            ("kv_pages", ca.schemas[li].kv_storage, "", w.compressor),
            ("index_pages", ca.schemas[li].index_storage, "index_", w.indexer.compressor))):
        ea = storage.read_bytes(ca.pool.tensors[li][pname], ba.emit_block[M], ba.emit_slot[M])
        eb = storage.read_bytes(cb.pool.tensors[li][pname], ba.emit_block[M], ba.emit_slot[M])
        bad = (ea != eb).nonzero().tolist()
        print(f"  {pname}: segments {storage.segments}, {len(bad)} differing bytes", flush=True)
        if not bad:
            continue
        # torch's compressor step again from the state before the step (the cache's state put back afterwards),
        # capturing the windows it pools
        after = {k: t.clone() for k, t in ca.state.tensors[li].items()}
        for k, t in state0.items():
            ca.state.tensors[li][k].copy_(t)
        captured = []

        def capture(kv, gate):
            captured.append((kv, gate))
            return pool_windows(kv, gate)

        torch_ops.pool_windows = capture
        lstep = lay.layer_step(ba, ca, torch_ops.plan_step(ba, ca))
        xa = x.to(nm.act_dtype)  # the projections as the layer computes them (one stacked GEMM on CUDA)
        entries = torch_ops.compressor_step(lstep, xa, cw, prefix, layer_compressor_projections(lstep, xa)[ci])
        torch_ops.pool_windows = pool_windows
        for k, t in after.items():
            ca.state.tensors[li][k].copy_(t)
        skv, sgate = captured[0]
        pooled = pool_windows(skv, sgate)
        check_finish(pooled, cw.norm, ba.emit_position[M], inv_freq, CFG.norm_eps, nm.act_dtype, pname)
        for e, col in bad[:8]:
            req = int(ba.emit_request[M][e])
            print(f"  entry {e} (request slot {req}, entry index {int(ba.emit_entry[M][e])}), byte {col}: "
                  f"torch {ea[e, col].item():#04x} triton {eb[e, col].item():#04x}", flush=True)
            v = entries[e].float()
            if pname == "kv_pages" and col < 448:
                blk = v[(col // 64) * 64:(col // 64 + 1) * 64]
                amax = blk.abs().max().item()
                print(f"    bf16 value {v[col].item()!r} block amax {amax!r}; block scale byte torch "
                      f"{ea[e, 576 + col // 64].item()} triton {eb[e, 576 + col // 64].item()}", flush=True)
            elif pname == "index_pages":
                from dsv4 import formats
                rot = formats.hadamard_transform(v)
                jj = (col % 64) * 2
                print(f"    rotated values {rot[jj].item()!r} {rot[jj + 1].item()!r} block amax "
                      f"{rot[(jj // 32) * 32:(jj // 32 + 1) * 32].abs().max().item()!r}", flush=True)
                da, db = storage.decode(ea[e:e + 1])[0], storage.decode(eb[e:e + 1])[0]
                dif = (da != db).nonzero().flatten().tolist()
                print(f"    decoded differences at {dif}: torch {da[dif].tolist()} triton {db[dif].tolist()}; "
                      f"torch qdq {nm.qdq_index(v)[dif].tolist()}; rotated {rot[dif].tolist()}; "
                      f"scales torch {ea[e, 64:].tolist()} triton {eb[e, 64:].tolist()}", flush=True)
            else:
                print(f"    (scale or rope byte) value around: {v[448:].tolist()[:4]}", flush=True)
        # does torch's result for these entries depend on E (the batch of entries computed together)?
        es = sorted({e for e, _ in bad})
        for e in es:
            p1 = pool_windows(skv[e:e + 1], sgate[e:e + 1])
            f1 = finish_entries(pooled[e:e + 1], cw.norm, ba.emit_position[M][e:e + 1], inv_freq, CFG.norm_eps,
                                nm.act_dtype)
            xb = pooled.to(nm.act_dtype).float()
            full = xb.pow(2).mean(-1)[e]
            sub = {}
            for n in (1, 8, 16, 64, 1024, 4096, 8192):
                lo = max(0, min(e - n // 2, xb.shape[0] - n))
                sub[n] = bool(xb[lo:lo + n].pow(2).mean(-1)[e - lo] == full)
            print(f"    entry {e}: torch mean of squares in sub-batches equals the full batch's: {sub}", flush=True)
            print(f"    entry {e}: pooled alone == batched {torch.equal(p1[0], pooled[e])}; "
                  f"finish alone == batched {torch.equal(f1[0], entries[e])}", flush=True)
    # resync so later steps test their own numerics
    for k, t in ca.state.tensors[li].items():
        cb.state.tensors[li][k].copy_(t)
    for k, t in ca.pool.tensors[li].items():
        cb.pool.tensors[li][k].copy_(t)
