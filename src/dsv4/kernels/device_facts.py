"""``facts(device)``: the ``DeviceFacts`` of a real device, for a step's launch plan.

Two of the facts come from kernels that probe the device (the attention kernel's resident clusters, whether
torch's blockwise FP8 GEMM works there); those kernels import ``kernels.device``, so the probing lives here,
above them, rather than in ``device`` itself.
"""

from __future__ import annotations

import functools

import torch

from .device import DeviceFacts, interpreting, is_sm90, sm_count

__all__ = ["facts"]


def facts(device: torch.device | str) -> DeviceFacts:
    """The facts of ``device`` (cheap after the first call: every query is cached)."""
    device = torch.device(device)
    sm90 = is_sm90(device)
    clusters = fp8_gemm = None
    if sm90:
        from .attention import sm90_serial  # compiles one kernel when a plan first asks

        index = device.index if device.index is not None else torch.cuda.current_device()
        clusters = functools.partial(sm90_serial.resident_clusters, index)
    if device.type == "cuda":
        from .project.fp8_gemm import scaled_mm_works  # one probe per device (imports triton)

        fp8_gemm = "scaled_mm" if scaled_mm_works(device) else "bf16"
    return DeviceFacts(kernels=device.type == "cuda" or interpreting(), sm_count=sm_count(device), sm90=sm90,
                       resident_clusters=clusters, fp8_gemm=fp8_gemm,
                       streams=device.type == "cuda" and not interpreting())
