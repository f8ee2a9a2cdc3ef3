"""Helpers shared by the test modules (importable as ``support.*``: pyproject's ``pythonpath = ["tests"]``).

No test module imports another; what two of them share lives here, by topic:

* ``interpreter`` — the one place a test starts a Python subprocess (a script, or pytest on a module), by default
  under the Triton interpreter with no GPU;
* ``bf16`` — BF16-step comparisons of kernel outputs with the torch backend's;
* ``rounding`` — an exact-rational model of binary floating-point rounding (the formats' oracle);
* ``oracle`` — what the cache should hold, and layer outputs against the stateless reference;
* ``prefix`` — prefix-cache cases, bit-identity of outputs, a request's state rows and block pages;
* ``write_path`` — the write ops of one layer step through two caches, and the bytes that differ;
* ``attention`` — a sparse-attention step over a real cache (random entries), and the two backends compared;
* ``ptx`` — a small interpreter of the PTX instructions the kernels' inline assembly uses;
* ``hf`` — transformers' DeepSeek-V4 attention and a tiny causal LM with realistic-scale weights;
* ``stacks`` — a block-scaled FP8 stack holding its weights, and their views at their places.
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The repository's root (``src/``, ``tests/``, ``docs/`` below it)."""
