"""``build_step_batch`` against a per-request Python oracle of the ``StepBatch`` definitions, the packed layout
(one device buffer, 16-B aligned views), and ``StepBatch.copy_``'s one-copy path against its field-by-field one."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from dsv4.cache.batch import StepBatch, build_step_batch
from dsv4.cache.schema import blocks_for_tokens


def _case(rng: random.Random, B: int | None = None, num_new: list[int] | None = None, width_extra: int = 0):
    ratios = sorted(rng.sample([2, 4, 8], rng.randint(1, 3)))
    block_size = rng.choice([8, 16, 32])
    B = len(num_new) if num_new else (B or rng.randint(1, 6))
    num_new = num_new or [rng.randint(1, 40) for _ in range(B)]
    starts = [rng.randint(0, 300) for _ in range(B)]
    blocks = rng.sample(range(1000), sum(blocks_for_tokens(s + n, ratios[0], block_size) for s, n in zip(starts, num_new)))
    tables, at = [], 0
    for s, n in zip(starts, num_new):
        k = blocks_for_tokens(s + n, ratios[0], block_size)
        tables.append(blocks[at : at + k])
        at += k
    return dict(request_ids=[f"r{b}" for b in range(B)], num_new=num_new, start_positions=starts,
                slots=rng.sample(range(64), B), block_tables=tables, ratios=ratios, block_size=block_size,
                window=rng.choice([4, 8, 128]), max_blocks=max(len(t) for t in tables) + width_extra)


def _oracle(request_ids, num_new, start_positions, slots, block_tables, ratios, block_size, window, max_blocks):
    """Every field from its definition, one request and one token at a time."""
    o: dict = {"token_request": [], "positions": [], "token_slots": [], "ring_slots": [], "ring_keep": []}
    cu = [0]
    for b, (s, n) in enumerate(zip(start_positions, num_new)):
        for t in range(s, s + n):
            o["token_request"].append(b)
            o["positions"].append(t)
            o["token_slots"].append(slots[b])
            o["ring_slots"].append(t % window)
            o["ring_keep"].append(t >= s + n - window)
        cu.append(cu[-1] + n)
    o["cu_seqlens"] = cu
    o["start_pos"] = list(start_positions)
    o["end_pos"] = [s + n for s, n in zip(start_positions, num_new)]
    o["slots"] = list(slots)
    o["block_tables"] = [list(t) + [-1] * (max_blocks - len(t)) for t in block_tables]
    o["ring_rows"] = [i for i, k in enumerate(o["ring_keep"]) if k]
    for m in ratios:
        before = [s // m for s in start_positions]
        after = [e // m for e in o["end_pos"]]
        req, entry = [], []
        for b in range(len(num_new)):
            for i in range(before[b], after[b]):
                req.append(b)
                entry.append(i)
        cap = sum(-(-n // m) for n in num_new)
        per = {
            "entries_before": before, "entries_after": after,
            "entries_to_emit": [a - b for a, b in zip(after, before)],
            "cu_emit": [0] + [sum(a - b for a, b in zip(after[: k + 1], before[: k + 1])) for k in range(len(before))],
            "emit_request": req, "emit_entry": entry,
            "emit_block": [block_tables[b][(i * m) // block_size] for b, i in zip(req, entry)],
            "emit_slot": [((i * m) % block_size) // m for i in entry],
            "emit_position": [i * m for i in entry],
            "visible_entries": [(t + 1) // m for t in o["positions"]],
            "emit_pad_request": req + [-1] * (cap - len(req)), "emit_pad_entry": entry + [0] * (cap - len(entry)),
            "num_emit_device": [len(req)],
        }
        for k, v in per.items():
            o.setdefault(k, {})[m] = v
        o.setdefault("num_emit", {})[m] = len(req)
        o.setdefault("emit_capacity", {})[m] = cap
    return o


_DTYPES = {
    "token_request": torch.int32, "cu_seqlens": torch.int32, "block_tables": torch.int32, "ring_keep": torch.bool,
    "emit_request": torch.int32, "emit_pad_request": torch.int32, "num_emit_device": torch.int32,
}


@pytest.mark.parametrize("seed", range(12))
def test_build_step_batch_matches_the_definitions(seed: int) -> None:
    rng = random.Random(seed)
    case = _case(rng, width_extra=rng.randint(0, 3))
    batch = build_step_batch(**case)
    want = _oracle(**case)
    for name in StepBatch._STATIC + ("block_tables",):
        t = getattr(batch, name)
        assert t.dtype == _DTYPES.get(name, torch.int64), name
        assert t.tolist() == want[name], name
    for name in StepBatch._PER_RATIO_STATIC + StepBatch._PER_RATIO_VARIABLE:
        for m in case["ratios"]:
            t = getattr(batch, name)[m]
            assert t.dtype == _DTYPES.get(name, torch.int64), (name, m)
            assert t.tolist() == want[name][m], (name, m)
    assert batch.num_emit == want["num_emit"] and batch.emit_capacity == want["emit_capacity"]
    assert batch.num_new == case["num_new"] and batch.start_positions == case["start_positions"]
    assert all(type(v) is int for v in batch.num_new + batch.start_positions)
    assert batch.num_tokens == sum(case["num_new"]) and batch.max_new == max(case["num_new"])
    # one buffer: every tensor a 16-B aligned view of it (the alignment a tensor of its own has)
    base, end = batch.packing.buffer.data_ptr(), batch.packing.buffer.data_ptr() + batch.packing.buffer.numel()
    for name in StepBatch._STATIC + ("block_tables",):
        t = getattr(batch, name)
        assert t.data_ptr() % 16 == 0 and base <= t.data_ptr() <= end and t.is_contiguous(), name


def test_build_step_batch_refuses_uncovered_entries() -> None:
    case = _case(random.Random(3), B=2, num_new=[40, 40])
    case["block_tables"] = [t[:-1] for t in case["block_tables"]]  # the last emitted entry has no block
    with pytest.raises(AssertionError, match="do not cover"):
        build_step_batch(**case)


@pytest.mark.parametrize("seed", range(4))
def test_copy_one_buffer_equals_field_by_field(seed: int) -> None:
    """``copy_`` between two packed batches of one geometry (one copy of the buffer's head) leaves the static
    batch exactly as copying every field does; a field replaced by assignment is noticed (field by field)."""
    rng = random.Random(100 + seed)
    num_new = [rng.randint(1, 9) for _ in range(rng.randint(1, 5))]
    a = _case(rng, num_new=num_new)
    b = _case_like(rng, a, num_new)
    width = max(a["max_blocks"], b["max_blocks"])
    static = build_step_batch(**dict(a, max_blocks=width))
    fresh = build_step_batch(**dict(b, max_blocks=width))
    assert static._packed_head() and fresh._packed_head()
    by_field = dataclasses.replace(build_step_batch(**dict(a, max_blocks=width)), packing=None)
    static.copy_(fresh)
    by_field.copy_(fresh)
    for name in StepBatch._STATIC + ("block_tables",):
        assert torch.equal(getattr(static, name), getattr(fresh, name)), name
        assert torch.equal(getattr(by_field, name), getattr(fresh, name)), name
    for name in StepBatch._PER_RATIO_STATIC:
        for m in a["ratios"]:
            assert torch.equal(getattr(static, name)[m], getattr(fresh, name)[m]), (name, m)
    # a replaced field is copied as it is now, not as the buffer holds it
    other = build_step_batch(**dict(b, max_blocks=width))
    other.positions = other.positions + 1000
    assert not other._packed_head()
    static.copy_(other)
    assert torch.equal(static.positions, other.positions)


def _case_like(rng: random.Random, a: dict, num_new: list[int]) -> dict:
    """Another step of ``a``'s geometry: the same tokens per request, ratios, block size and window."""
    m0, bs = a["ratios"][0], a["block_size"]
    starts = [rng.randint(0, 300) for _ in num_new]
    need = [blocks_for_tokens(s + n, m0, bs) for s, n in zip(starts, num_new)]
    blocks = rng.sample(range(1000), sum(need))
    tables, at = [], 0
    for k in need:
        tables.append(blocks[at : at + k])
        at += k
    return dict(a, start_positions=starts, slots=rng.sample(range(64), len(num_new)), block_tables=tables,
                max_blocks=max(need))
