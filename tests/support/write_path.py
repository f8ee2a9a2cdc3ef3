"""Shared driver for the write-path tests (Triton vs torch backend): run the same steps through two caches and
compare every byte the write path touches. Used by the write-path tests on the GPU and under the Triton
interpreter."""

from __future__ import annotations

import dataclasses

import torch

import dsv4
from dsv4.cache import HybridCache
from dsv4.compressor_stack import compressor_stack
from dsv4.ops import torch_ops

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


def write_step(ops, layer_obj, cache, batch, x, **launch):
    """The write ops of one layer step, as ``Attention.forward_with_aux`` calls them (no attention): ``ops`` is a
    backend module (``torch_ops`` / ``triton_ops``). The window KV goes through the torch backend's norm in both
    cases, so that only the write path is compared. ``launch``: ``plan_write``'s ``parts`` / ``separate_entries``
    (a launch shape of the same kernels that the rule would not pick for this step)."""
    plan = ops.plan_step(batch, cache)
    if launch:
        from dsv4.kernels.write.plan import plan_write

        lp = plan.layer(layer_obj.kind)
        write = plan_write(ratio=lp.write.ratio, overlap=lp.write.overlap, has_index=lp.write.has_index,
                           tokens=batch.num_tokens, requests=batch.num_requests, max_new=batch.max_new,
                           emit_capacity=batch.emit_capacity.get(lp.write.ratio, 0), **launch)
        plan = dataclasses.replace(plan, layers={**plan.layers, layer_obj.kind: dataclasses.replace(lp, write=write)})
    step = layer_obj.layer_step(batch, cache, plan)
    if step.ratio:  # the layer's weights are stacked: on CUDA, one GEMM for every compressor projection
        assert compressor_stack(step.weights) is not None
    x = x.to(cache.numerics.act_dtype)
    kv = torch_ops.window_kv(step, x)
    kv = ops.new_entries(step, x, kv)
    ops.append_swa(step, kv)
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
