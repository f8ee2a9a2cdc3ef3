"""``test_indexer_kernels.py``'s CPU tests, which run the indexer and top-k kernels in Triton's interpreter only
when ``TRITON_INTERPRET=1`` is set for the whole process (setting it inside a test would leak into other modules):
here in a subprocess, so that a plain ``pytest`` run (CI) covers them — scores for every key format vs the
reference, the PTX conversion's integer twin, every top-k algorithm on rows with ties, ±inf, −0 and short counts.
Skipped when triton is not installed, and in a process that already interprets (the module then runs directly)."""

from __future__ import annotations

from pathlib import Path

from support.interpreter import module_in_the_interpreter


test_indexer_kernels_in_the_interpreter = module_in_the_interpreter(Path(__file__).with_name("test_indexer_kernels.py"))
