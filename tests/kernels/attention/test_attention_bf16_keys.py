"""A step's keys dequantized once into BF16 rows (``attention.bf16_keys``), against the storage's decode.

Runs the Triton kernel under the interpreter on the CPU (it converts no FP8 in hardware: the E4M3 codes are decoded
from their bits) and on a GPU when there is one: every ring slot and every entry a request's tokens see, bit for
bit equal to ``KVStorage.read`` (the exact FP32 decode) rounded once to BF16; zero rows beyond; the FP8 pages
untouched. (That the attention kernel gives the same bits with these rows as with the pages: GPU tests in
``test_attention_gpu.py``.)
"""

from __future__ import annotations

import pytest
import torch

from support.interpreter import run_interpreted, run_script

pytest.importorskip("triton")

_SCRIPT = r"""
import sys, torch
from support.attention import FLASH, PRO, make_case
from dsv4.config import LayerKind
from dsv4.kernels.attention.bf16_keys import bf16_keys

import dsv4
device = sys.argv[1]
TINY = dsv4.ModelConfig.preset("tiny")  # a 16-token window (less than one 64-row chunk), 32-token blocks
for cfg, kind, prefix, step, bs in ((FLASH, LayerKind.CSA, [3000, 0], [300, 77], 256),
                                    (PRO, LayerKind.HCA, [1000, 40], [200, 9], 256),
                                    (FLASH, LayerKind.SWA, [200, 5], [70, 1], 256),
                                    (TINY, LayerKind.SWA, [30, 3], [40, 2], 32),
                                    (TINY, LayerKind.CSA, [300, 0], [41, 5], 32),
                                    (TINY, LayerKind.HCA, [300, 7], [41, 5], 32)):
    layer, batch, args, _, _ = make_case(cfg, kind, prefix, step, device, seed=len(prefix) + prefix[0],
                                         block_size=bs)
    m, W, bs = args["m"], batch.window, batch.block_size
    entries = batch.addressable_entries(m) if m else 0
    pool = layer.kv_pages if m else None
    before = (layer.ring.clone(), None if pool is None else pool.clone())
    rows = bf16_keys(layer.ring, pool, batch.block_tables, batch.cu_seqlens, batch.start_pos, batch.token_slots,
                     window=W, ratio=m, block_size=bs, entries=entries).cpu()
    assert torch.equal(layer.ring, before[0]) and (pool is None or torch.equal(pool, before[1]))
    storage = layer.schema.kv_storage
    for b, (start, new) in enumerate(zip(batch.start_positions, batch.num_new)):
        slot = int(batch.slots[b])
        ring = storage.read(layer.ring, torch.full((W,), slot, device=device), torch.arange(W, device=device))
        assert torch.equal(rows[b, :W].view(torch.int16), ring.cpu().to(torch.bfloat16).view(torch.int16)), (kind, b)
        seen = (start + new) // m if m else 0
        if seen:
            i = torch.arange(seen)
            blocks = batch.block_tables[b].cpu()[(i * m) // bs].long()
            want = storage.read(pool, blocks.to(device), ((i * m % bs) // m).to(device)).cpu().to(torch.bfloat16)
            assert torch.equal(rows[b, W:W + seen].view(torch.int16), want.view(torch.int16)), (kind, b)
        assert not rows[b, W + seen:].any(), (kind, b)
print("ok")
"""


def test_bf16_keys_interpreted() -> None:
    """The kernel under the Triton interpreter (CPU): CSA, HCA and window-only layers, two requests each, at
    V4's shapes and the tiny config's (a window shorter than one chunk of rows)."""
    run_interpreted(_SCRIPT, "cpu")


@pytest.mark.gpu
def test_bf16_keys_gpu() -> None:
    """The same checks on the GPU (the compiled kernel)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    run_script(_SCRIPT, "cuda", interpret=False)
