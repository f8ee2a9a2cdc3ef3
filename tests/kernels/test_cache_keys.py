"""``kernels.cache_keys``: two processes that hash the kernels in different orders (as a warm-up's compile worker
and its load pass launch them) end with the same Triton cache keys, so one finds the other's binaries on disk."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

_SCRIPT = r"""
import sys
from dsv4.kernels.write.csa_entries import csa_entries_kernel as csa
from dsv4.kernels.write.compressor import write_before_attention_kernel as fused
from dsv4.kernels.write.window import window_entries_block as window
first = {"csa": csa, "fused": fused, "window": window}[sys.argv[1]]
first.cache_key  # what a process launching that kernel first hashes first
import dsv4.ops.triton_ops  # canonical_cache_keys on import
print(csa.cache_key, fused.cache_key, window.cache_key)
"""


def _keys(first: str) -> str:
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.abspath(src), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _SCRIPT, first], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_cache_keys_do_not_depend_on_which_kernel_was_hashed_first() -> None:
    keys = {first: _keys(first) for first in ("csa", "fused", "window")}
    assert len(set(keys.values())) == 1, keys
