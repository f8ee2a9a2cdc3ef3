"""A small interpreter of the PTX instructions the kernels' inline assembly uses, over 32-bit registers: the PTX
texts of ``dsv4.kernels.ptx`` run on the CPU, instruction by instruction (the Triton interpreter cannot run PTX)."""

from __future__ import annotations

import re

import torch

MASK32 = 0xFFFFFFFF


def prmt(a: int, b: int, c: int) -> int:
    """PTX ``prmt.b32`` in its default mode: byte i of the result is byte ``c[4i+2:4i]`` of ``{b, a}``, or that
    byte's sign replicated when ``c[4i+3]`` is set."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = pool[sel & 7]
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * i)
    return out


def lop3(a: int, b: int, c: int, lut: int) -> int:
    """PTX ``lop3.b32``: bit i of the result is bit ``4·a_i + 2·b_i + c_i`` of ``lut`` (``lut`` evaluated on
    a = 0xF0, b = 0xCC, c = 0xAA is the function's truth table)."""
    out = 0
    for i in range(32):
        j = ((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | ((c >> i) & 1)
        out |= ((lut >> j) & 1) << i
    return out


def mul_bf16x2(a: int, b: int) -> int:
    """PTX ``mul.rn.bf16x2``: each 16-bit half of ``a`` times that of ``b`` as BF16, rounded once to nearest even
    (subnormals kept). The FP32 product of two BF16 values is exact (8-bit significands, exponents in range), so
    torch's FP32 multiply and one cast model it."""
    halves = torch.tensor([a & 0xFFFF, a >> 16, b & 0xFFFF, b >> 16], dtype=torch.int32).to(torch.int16)
    x = halves.view(torch.bfloat16).float()
    r = (x[:2] * x[2:]).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return int(r[0]) | int(r[1]) << 16


def run_ptx(text: str, operands: dict[str, int]) -> dict[str, int]:
    """Execute the instructions ``and or shl shr prmt lop3 mov`` (``.b32``), ``add sub`` (``.s32``), ``mad.lo.u32`` and ``mul.rn.bf16x2`` of
    ``text`` over 32-bit registers."""
    regs = dict(operands)

    def value(tok: str) -> int:
        tok = tok.strip()
        if re.fullmatch(r"0x[0-9a-fA-F]+|\d+", tok):
            return int(tok, 0) & MASK32
        return regs[tok]

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *src = [t.strip() for t in rest.split(",")]
        v = [value(t) for t in src]
        if op == "and.b32":
            r = v[0] & v[1]
        elif op == "or.b32":
            r = v[0] | v[1]
        elif op == "shl.b32":
            r = (v[0] << v[1]) & MASK32
        elif op == "shr.b32":
            r = v[0] >> v[1]
        elif op == "lop3.b32":
            r = lop3(*v)
        elif op == "prmt.b32":
            r = prmt(*v)
        elif op == "sub.s32":
            r = (v[0] - v[1]) & MASK32
        elif op == "add.s32":
            r = (v[0] + v[1]) & MASK32
        elif op == "mov.b32":
            r = v[0]
        elif op == "mad.lo.u32":
            r = (v[0] * v[1] + v[2]) & MASK32
        elif op == "mul.rn.bf16x2":
            r = mul_bf16x2(v[0], v[1])
        else:
            raise NotImplementedError(f"PTX instruction {op!r} is not modelled here")
        regs[dst] = r
    return regs
