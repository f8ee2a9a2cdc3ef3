"""The Gluon attention kernels' key dequantization PTX, executed on the CPU (no triton needed).

``dsv4.kernels.ptx.DEQUANT_E4M3`` (and ``DEQUANT_E4M3_WORDS``, the same text with the warp-specialized kernel's
operands) turns four E4M3 codes and a block's UE8M0 exponent into four BF16 values ``code · 2**(e − 127)``. Here the
PTX text runs instruction by instruction (``support.ptx.run_ptx``) over every code in every byte position and
every exponent 0–254 (the word variant: the exponents around each branch of the scaling), against torch's own E4M3
decode times the power of two, rounded to BF16 once.
"""

from __future__ import annotations

import torch

import pytest

from dsv4.kernels.ptx import DEQUANT_E4M3, DEQUANT_E4M3_WORDS

from support.ptx import MASK32, run_ptx


def scale_pair(e: int) -> tuple[int, int]:
    """The two BF16 multipliers the kernel passes for exponent ``e``, each repeated in both halves of a word."""
    s1 = (min(e, 134) + 120) << 7
    s2 = (max(e, 134) - 7) << 7
    return s1 | s1 << 16, s2 | s2 << 16


def expected_bits(codes: torch.Tensor, e: int) -> torch.Tensor:
    """int32 BF16 bit patterns of ``decode(code) · 2**(e − 127)`` rounded once (NaN codes excluded by callers)."""
    x = codes.view(torch.float8_e4m3fn).double() * 2.0 ** (e - 127)
    return x.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF


def scale_operands(variant: str, e: int) -> dict[str, int]:
    """The scale operands of each PTX variant: Triton's ``pack=4`` passes each BF16 pair twice (``$3``/``$4`` and
    ``$5``/``$6``), the word variant once each (``$3``, ``$4``)."""
    s1, s2 = scale_pair(e)
    if variant == "bytes":
        return {"$3": s1, "$4": s1, "$5": s2, "$6": s2}
    return {"$3": s1, "$4": s2}


@pytest.mark.parametrize("variant, exponents", [
    ("bytes", range(0, 255)),
    ("words", (0, 1, 7, 100, 120, 127, 133, 134, 135, 136, 200, 253, 254)),
])
def test_dequant_ptx_every_code(variant: str, exponents) -> None:
    text = DEQUANT_E4M3 if variant == "bytes" else DEQUANT_E4M3_WORDS
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    # Words of four codes: each finite code appears in each byte position.
    n = finite.numel()
    words = [[int(finite[(i + j * 61) % n]) for j in range(4)] for i in range(n)]
    for e in exponents:
        scales = scale_operands(variant, e)
        for quad in words:
            w = sum(b << (8 * j) for j, b in enumerate(quad))
            regs = run_ptx(text, {"$2": w, **scales})
            got = [regs["$0"] & 0xFFFF, regs["$0"] >> 16, regs["$1"] & 0xFFFF, regs["$1"] >> 16]
            want = expected_bits(torch.tensor(quad, dtype=torch.uint8), e).tolist()
            assert got == want, (e, [hex(b) for b in quad], [hex(g) for g in got], [hex(x) for x in want])
    assert all(r <= MASK32 for r in regs.values())


def test_dequant_variants_differ_only_in_operands() -> None:
    """The two texts are one conversion: renaming the word variant's second scale operand gives the other."""
    assert DEQUANT_E4M3_WORDS.replace("$4", "$5") == DEQUANT_E4M3
