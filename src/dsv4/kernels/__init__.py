"""Triton kernels for Hopper GPUs (H100/H200). Each module holds one kernel family: its ``@triton.jit`` kernels
and their launchers; ``dsv4.ops.triton_*`` glue them into the backend interface (``dsv4.ops.BACKEND_OPS``).

Importing a kernel module needs ``triton``; this package itself imports nothing so that CPU-only installs work.
"""
