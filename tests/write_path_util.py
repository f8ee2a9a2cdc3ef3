"""Shared driver for the write-path tests (Triton vs torch backend): run the same steps through two caches and
compare every byte the write path touches. Used by test_gpu_write_path.py and test_triton_interpret_write.py."""

from __future__ import annotations

import torch

import dsv4
from dsv4.cache import HybridCache
from dsv4.config import LayerKind
from dsv4.ops import torch_ops
from dsv4.reference.primitives import linear, rms_norm
from dsv4.reference.rope import rope_inv_freq

WRITE_STATE = ("ring", "ring_positions", "tail_kv", "tail_gate", "prev_kv", "prev_gate", "index_tail_kv",
               "index_tail_gate", "index_prev_kv", "index_prev_gate")


def make_cache(cfg, layers, device, max_requests, num_blocks=256, block_size=64, poison=True):
    cache = HybridCache(cfg, layers=layers, max_requests=max_requests, num_blocks=num_blocks, block_size=block_size,
                        device=device, numerics="official")
    if poison:  # unwritten pool bytes must compare equal too: fill both caches with the same garbage
        g = torch.Generator(device="cpu").manual_seed(123)
        for d in cache.pool.tensors.values():
            for t in d.values():
                t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
    return cache


def write_step(ops, layer_obj, cache, batch, x):
    """The write ops of one layer step, as ``Attention.forward_with_aux`` calls them (no attention)."""
    cfg, nm = cache.cfg, cache.numerics
    w, inv_freq = layer_obj._weights_on(x.device)
    layer = cache.layer(layer_obj.layer_idx)
    x = x.to(nm.act_dtype)
    kv_in = rms_norm(linear(x, w.wkv, nm.act_dtype), w.kv_norm, cfg.norm_eps)
    if layer_obj.kind is LayerKind.SWA:
        kv = ops.window_entries(kv_in, batch.positions, inv_freq, nm, cfg.nope_dim)
    else:
        comps = [(w.compressor, "kv")]
        if layer_obj.kind is LayerKind.CSA:
            comps.append((w.indexer.compressor, "index"))
        kv = ops.compress(layer, batch, x, comps, layer_obj.ratio, layer_obj.kind is LayerKind.CSA, inv_freq,
                          cfg.norm_eps, nm, cfg.nope_dim, kv_in)
    ops.append_swa(layer, batch, kv)
    return kv


def differences(c1, c2, li):
    """Names of the cache tensors of layer ``li`` whose bytes differ, with the count of differing bytes."""
    out = []
    for name, t in c1.state.tensors[li].items():
        u = c2.state.tensors[li][name]
        d = (t.contiguous().view(torch.uint8) != u.contiguous().view(torch.uint8)).sum().item()
        if d:
            out.append((f"state.{name}", d))
    for name, t in c1.pool.tensors.get(li, {}).items():
        d = (t != c2.pool.tensors[li][name]).sum().item()
        if d:
            out.append((f"pool.{name}", d))
    return out
