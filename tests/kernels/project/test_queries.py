"""``queries`` (per-head RMSNorm + RoPE of the query projection): the Triton kernel vs the torch backend.

The kernel sums the 512 squares in another order than torch's reduce kernel, so a query may differ in its last
BF16 bit; everything else is the same operations. Both tests check every element within one BF16 step of the torch
backend and nearly all of them equal: on the CPU under the Triton interpreter (logic, addressing, the rope pairs
as words; a column block of a wider output read in place, the same bits as its copy) and on the GPU (marked gpu).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from support.bf16 import check_queries
from support.interpreter import run_interpreted

pytestmark_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

_SCRIPT = r"""
import torch
from dsv4.kernels.project.queries import queries
from dsv4.reference.primitives import rms_norm
from dsv4.reference.rope import apply_rope
from support.bf16 import check_queries
g = torch.Generator().manual_seed(3)
T, H = 7, 3
q = (torch.randn(T, H, 512, generator=g) * torch.exp(2 * torch.randn(T, H, 1, generator=g))).bfloat16()
pos = torch.tensor([0, 1, 5, 127, 4096, 70000, 1048575])
inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
check_queries(queries(q, pos, inv, 1e-6), apply_rope(rms_norm(q, None, 1e-6), pos, inv))
# the heads' column block of a wider GEMM output (the stacked [W_qb; W_Iq] projection: tokens 2,560 elements apart
# here, the indexer's 1,024 columns after the heads'), and one that does not start the row: read in place, the
# same bits as their contiguous copies
wide = (torch.randn(T, H * 512 + 1024, generator=g) * torch.exp(2 * torch.randn(T, 1, generator=g))).bfloat16()
for block in (wide[:, : H * 512], wide[:, 512 : 512 + H * 512]):
    heads = block.unflatten(-1, (H, 512))
    assert heads.stride() == (H * 512 + 1024, 512, 1)
    got = queries(heads, pos, inv, 1e-6)
    assert got.is_contiguous() and torch.equal(got, queries(heads.contiguous(), pos, inv, 1e-6))
    check_queries(got, apply_rope(rms_norm(heads, None, 1e-6), pos, inv))
print("ok")
"""


@pytestmark_triton
def test_queries_kernel_in_interpreter_matches_torch() -> None:
    run_interpreted(_SCRIPT)


@pytest.mark.gpu
@pytest.mark.parametrize("T, H", [(1, 64), (64, 64), (4099, 64), (64, 128)], ids=["1x64", "64x64", "4099x64", "64x128"])
def test_queries_kernel_matches_torch_on_gpu(T: int, H: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    from dsv4.kernels.project.queries import queries
    from dsv4.reference.primitives import rms_norm
    from dsv4.reference.rope import apply_rope

    g = torch.Generator(device="cuda").manual_seed(T + H)
    q = torch.randn(T, H, 512, generator=g, device="cuda") * torch.exp(2 * torch.randn(T, H, 1, generator=g,
                                                                                      device="cuda"))
    q = q.bfloat16()
    pos = torch.randint(0, 1 << 20, (T,), generator=g, device="cuda")
    inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32, device="cuda") / 64))
    check_queries(queries(q, pos, inv, 1e-6), apply_rope(rms_norm(q, None, 1e-6), pos, inv))


def test_queries_kernel_rejects_bad_input() -> None:
    pytest.importorskip("triton")
    from dsv4.kernels.project.queries import queries

    inv = torch.ones(32)
    pos = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"bf16 \[T, H, 512\]"):
        queries(torch.zeros(2, 3, 512), pos, inv, 1e-6)  # fp32
    with pytest.raises(ValueError, match=r"bf16 \[T, H, 512\]"):
        queries(torch.zeros(2, 3, 256, dtype=torch.bfloat16), pos, inv, 1e-6)
    with pytest.raises(ValueError, match=r"bf16 \[T, H, 512\]"):
        queries(torch.zeros(2, 512, 3, dtype=torch.bfloat16).transpose(1, 2), pos, inv, 1e-6)  # channels strided
    odd = torch.zeros(2, 3 * 512 + 1, dtype=torch.bfloat16)[:, : 3 * 512].unflatten(-1, (3, 512))
    with pytest.raises(ValueError, match="even number of elements apart"):
        queries(odd, pos, inv, 1e-6)  # tokens an odd number of elements apart: the rope words would straddle
    gapped = torch.zeros(2, 3, 1024, dtype=torch.bfloat16)[..., :512]
    with pytest.raises(ValueError, match="heads 512"):
        queries(gapped, pos, inv, 1e-6)  # heads 1,024 apart
    with pytest.raises(ValueError, match="out must be"):
        queries(torch.zeros(2, 3, 512, dtype=torch.bfloat16), pos, inv, 1e-6, out=torch.zeros(2, 3, 512))
