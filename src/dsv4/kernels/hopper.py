"""Whether a device is a Hopper GPU (compute capability 9.x): the Gluon kernels' (``*_sm90`` modules) one device
requirement besides Gluon itself."""

from __future__ import annotations

import torch

__all__ = ["is_sm90"]


def is_sm90(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA device of compute capability 9.x (H100 / H200)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
