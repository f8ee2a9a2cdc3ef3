"""StepBatch's fixed-capacity emit metadata and ``copy_`` (the CUDA-graph replay recipe), on the CPU."""

import pytest
import torch

import dsv4
from dsv4.cache import HybridCache

TINY = dsv4.ModelConfig.preset("tiny")


def _cache():
    cache = HybridCache(TINY, layers=[1, 2], max_requests=4, num_blocks=64, block_size=32)
    for r in "abc":
        cache.add_request(r)
    return cache


def test_padded_emit_lists_hold_the_emitted_entries_then_padding():
    cache = _cache()
    b = cache.prepare_forward({"a": 37, "b": 5, "c": 1}, max_blocks=6)
    assert b.block_tables.shape == (3, 6)
    for m in b.ratios:
        E, cap = b.num_emit[m], b.emit_capacity[m]
        assert cap == sum(-(-n // m) for n in b.num_new) >= E
        assert b.emit_pad_request[m][:E].tolist() == b.emit_request[m].tolist()
        assert b.emit_pad_entry[m][:E].tolist() == b.emit_entry[m].tolist()
        assert (b.emit_pad_request[m][E:] == -1).all()
        assert b.num_emit_device[m].tolist() == [E]


def test_copy_writes_in_place_and_checks_geometry():
    cache = _cache()
    cache.prepare_forward({"a": 30, "b": 3, "c": 17})
    static = cache.prepare_forward({"a": 1, "b": 1, "c": 1}, max_blocks=8)
    ptrs = {n: getattr(static, n).data_ptr() for n in static._STATIC}
    emit_ptr = static.emit_pad_request[4].data_ptr()
    for _ in range(5):
        fresh = cache.prepare_forward({"a": 1, "b": 1, "c": 1})  # narrower table: copied and −1 padded
        static.copy_(fresh)
        for n in static._STATIC:
            assert getattr(static, n).data_ptr() == ptrs[n]
            assert torch.equal(getattr(static, n), getattr(fresh, n))
        assert static.emit_pad_request[4].data_ptr() == emit_ptr
        w = fresh.block_tables.shape[1]
        assert torch.equal(static.block_tables[:, :w], fresh.block_tables)
        assert (static.block_tables[:, w:] == -1).all()
        for m in static.ratios:
            assert torch.equal(static.emit_pad_request[m], fresh.emit_pad_request[m])
            assert torch.equal(static.num_emit_device[m], fresh.num_emit_device[m])
            assert static.num_emit[m] == fresh.num_emit[m]
        assert static.start_positions == fresh.start_positions
    with pytest.raises(ValueError, match="num_new"):
        static.copy_(cache.prepare_forward({"a": 2, "b": 1, "c": 1}))
    with pytest.raises(ValueError, match="max_blocks"):
        cache.prepare_forward({"a": 1}, max_blocks=0)
