"""``cache.workspace.Workspace``: named scratch buffers — each request a contiguous view of the asked shape and dtype,
the same memory on later requests that fit, a larger buffer when one does not, zeros where asked, no aliasing
between names."""

from __future__ import annotations

import pytest
import torch

from dsv4.cache.workspace import Workspace


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int32, torch.uint8,
                                   torch.float8_e4m3fn])
def test_views_have_the_asked_shape_dtype_and_bytes(dtype: torch.dtype) -> None:
    ws = Workspace("cpu")
    t = ws.get("a", (3, 5), dtype)
    assert t.dtype == dtype and t.shape == (3, 5) and t.is_contiguous()
    assert ws.nbytes == 15 * torch.empty((), dtype=dtype).element_size()


def test_requests_reuse_the_buffer_until_one_is_larger() -> None:
    ws = Workspace("cpu")
    first = ws.get("a", (64,), torch.float32)
    again = ws.get("a", (8, 4), torch.int32)  # fewer bytes: the same memory
    assert again.data_ptr() == first.data_ptr() and ws.nbytes == 256
    grown = ws.get("a", (65,), torch.float32)
    assert ws.nbytes == 260 and grown.shape == (65,)
    other = ws.get("b", (64,), torch.float32)
    assert other.data_ptr() != grown.data_ptr()  # names never alias
    ws.clear()
    assert ws.nbytes == 0


def test_zeroed_buffers_are_zero_when_made() -> None:
    ws = Workspace("cpu")
    z = ws.get("counters", (4, 4), torch.int32, zero=True)
    assert bool((z == 0).all())
    z.fill_(7)  # a user that breaks the contract is seen on the next request, not cleared
    assert bool((ws.get("counters", (4, 4), torch.int32, zero=True) == 7).all())
    assert bool((ws.get("counters", (32,), torch.int32, zero=True) == 0).all())  # grown: zero again
