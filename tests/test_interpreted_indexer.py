"""``tests/test_gpu_indexer.py``'s CPU tests, which run the indexer and top-k kernels in Triton's interpreter only
when ``TRITON_INTERPRET=1`` is set for the whole process (setting it inside a test would leak into other modules):
here in a subprocess, so that a plain ``pytest`` run (CI) covers them — scores for every key format vs the
reference, the PTX conversion's integer twin, every top-k algorithm on rows with ties, ±inf, −0 and short counts.
Skipped when triton is not installed, and in a process that already interprets (the module then runs directly)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this process interprets: run the module itself")
def test_indexer_kernels_in_the_interpreter() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu",
                        os.path.join(here, "test_gpu_indexer.py")],
                       cwd=os.path.dirname(here), env=env, capture_output=True, text=True, timeout=900)
    tail = r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and " failed" not in r.stdout, tail
