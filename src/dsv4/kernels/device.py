"""Device facts the kernels and their launch plans need, each asked one way, and the entry layout they read.

* ``interpreting()``: Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``; tests only).
* ``runs_here(t)``: the Triton kernels can take ``t`` (a CUDA tensor, or any tensor under the interpreter).
* ``sm_count(device)``: streaming multiprocessors of a CUDA device (cached); ``INTERPRETER_SMS`` elsewhere.
* ``is_sm90(device)``: a Hopper GPU (compute capability 9.x) with Gluon importable — where the ``*_sm90`` kernels run.
* ``DeviceFacts``: all of these as one record, what a step's launch plan reads (``kernels.device_facts.facts``
  fills one in for a real device: it asks kernels that probe it, which import this module).

The byte layout of the cache entries (584-B KV entries, 68-B MXFP4 indexer keys) is ``dsv4.formats.layouts``'s;
it is re-exported here so that kernels and launchers state it once.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable

import torch

from ..formats.layouts import (
    FP8_KEY_BYTES,
    INDEXER_KEY_DIM,
    KV_DATA_BYTES,
    KV_DIM,
    KV_ENTRY_BYTES,
    KV_FP8_BLOCK,
    KV_NOPE_DIM,
    KV_ROPE_DIM,
    KV_SCALE_BYTES,
    MXFP4_KEY_BYTES,
)

__all__ = [
    "DeviceFacts", "FP8_KEY_BYTES", "INDEXER_KEY_DIM", "INTERPRETER_SMS", "KV_DATA_BYTES", "KV_DIM", "KV_ENTRY_BYTES",
    "KV_FP8_BLOCK", "KV_NOPE_DIM", "KV_ROPE_DIM", "KV_SCALE_BYTES", "MXFP4_KEY_BYTES", "has_gluon", "interpreting",
    "is_sm90", "runs_here", "sm_count",
]

#: Multiprocessors a launch plans for when the kernels run in the interpreter (no device to ask).
INTERPRETER_SMS = 4


def interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (``TRITON_INTERPRET=1``): CPU tensors, no inline PTX."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def runs_here(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can take ``t``: a CUDA tensor, or any tensor under the interpreter."""
    return t.is_cuda or interpreting()


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device | str) -> int:
    """Streaming multiprocessors of ``device`` (cached per device); ``INTERPRETER_SMS`` off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def has_gluon() -> bool:
    """Whether Triton's Gluon dialect (Triton ≥ 3.4) is importable."""
    try:
        from triton.experimental import gluon  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _cuda_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def is_sm90(device: torch.device | str) -> bool:
    """Whether ``device`` is a Hopper GPU (compute capability 9.x: H100 / H200) and Gluon is available — where the
    ``*_sm90`` kernels run."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting() or not has_gluon():
        return False
    return _cuda_major(device.index if device.index is not None else torch.cuda.current_device()) == 9


@dataclass(frozen=True)
class DeviceFacts:
    """What a step's launch plan needs to know about the device it runs on (``device_facts.facts``; tests build one by hand to
    plan for an H200 on any machine).

    Attributes:
        kernels: the Triton kernels run there (a CUDA device, or the interpreter).
        sm_count: its streaming multiprocessors.
        sm90: a Hopper GPU with Gluon (the ``*_sm90`` kernels run).
        resident_clusters: ``n -> how many clusters of n one-multiprocessor programs the device holds at once``
            (``None``: never merge split partials in clusters).
        fp8_gemm: how the FP8 projections' GEMM runs there (``kernels.project.fp8_gemm.GEMMS``: ``"scaled_mm"``
            where torch takes the blockwise recipe, else ``"bf16"``; ``None`` off CUDA: the torch reference).
        streams: independent launches can run on a second stream beside the current one (a CUDA device).
    """

    kernels: bool
    sm_count: int
    sm90: bool
    resident_clusters: Callable[[int], int] | None = None
    fp8_gemm: str | None = None
    streams: bool = False
