"""The Python subprocess of the kernel tests, started from here only.

``TRITON_INTERPRET=1`` must be set before Triton compiles anything and would leak into every other test of the
process, so the tests that run kernels in Triton's CPU interpreter run them in a fresh process: a script
(``run_script`` / ``run_interpreted``) or pytest on a test module (``run_pytest_interpreted``). The child imports
this tree's ``dsv4`` (``src``) and the ``support`` package (``tests``) ahead of any inherited ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from support import REPO_ROOT

#: this process runs under the Triton interpreter (the subprocess of ``run_pytest_interpreted``)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
#: a test that runs only in that subprocess (``module_in_the_interpreter`` starts it)
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs under TRITON_INTERPRET=1 (see the module docstring)")


def run_python(argv: list[str], *, interpret: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python argv...`` in the repository root with ``src`` and ``tests`` importable; under the Triton interpreter
    with no GPU visible when ``interpret``, else as this process runs. Output captured as text."""
    path = [str(REPO_ROOT / "src"), str(REPO_ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    if interpret:
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, *argv], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def run_script(script: str, *args: str, interpret: bool = True, timeout: float = 600) -> None:
    """Run ``script`` (``python -c``, with ``args`` in ``sys.argv[1:]``); it must exit 0 with ``ok`` as the last
    thing it prints."""
    res = run_python(["-c", script, *args], interpret=interpret, timeout=timeout)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]


def run_interpreted(script: str, *args: str, timeout: float = 600) -> None:
    """``run_script`` under the Triton interpreter, no GPU."""
    run_script(script, *args, interpret=True, timeout=timeout)


def run_pytest_interpreted(module: Path, *pytest_args: str, timeout: float = 900) -> None:
    """pytest on the test module ``module`` under the Triton interpreter (its ``gpu`` tests deselected): it must
    pass, with at least one test run and none failed."""
    res = run_python(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", *pytest_args, str(module)],
                     interpret=True, timeout=timeout)
    tail = res.stdout[-3000:] + res.stderr[-2000:]
    assert res.returncode == 0, tail
    assert " passed" in res.stdout and " failed" not in res.stdout, tail


def module_in_the_interpreter(module: Path, *pytest_args: str) -> Callable[[], None]:
    """A test that runs pytest on ``module`` under the Triton interpreter (``run_pytest_interpreted``): its
    ``interpreted`` tests run there. Skipped without triton, and in a process that already interprets (there the
    module's tests run directly)."""

    @pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
    @pytest.mark.skipif(INTERPRETED, reason="this process interprets: the module's tests run directly")
    def test() -> None:
        run_pytest_interpreted(module, *pytest_args)

    return test
