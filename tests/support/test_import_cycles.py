"""No import cycle among dsv4's modules (``tools/import_cycles.py``), and the checker finds the cycles it should."""

from __future__ import annotations

from pathlib import Path

from support.interpreter import run_python

CHECKER = "tools/import_cycles.py"


def _check(src_root: Path | None = None, package: str | None = None):
    args = [CHECKER] + ([str(src_root), package] if src_root is not None else [])
    return run_python(args, interpret=False, timeout=120)


def test_dsv4_has_no_import_cycle():
    result = _check()
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("no import cycles") == 2


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checker_finds_import_time_and_deferred_cycles(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from . import b\n",                                   # a -> b -> a at import time
        "pkg/b.py": "from .a import x\nx = 1\n",
        "pkg/c.py": "from .d import y\n",                                   # c -> d -> c only inside a function
        "pkg/d.py": "y = 1\ndef f():\n    from pkg.c import z\n",
        "pkg/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .f import g\n",  # annotations
        "pkg/f.py": "from .e import TYPE_CHECKING\n",
    })
    result = _check(tmp_path, "pkg")
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    import_time = [line for line in lines if line.startswith("cycle") and "(at import time)" in line]
    deferred = [line for line in lines if line.startswith("cycle") and "inside functions" in line]
    assert import_time == ["cycle of 2 modules (at import time): pkg.a, pkg.b"]
    assert deferred == ["cycle of 2 modules (counting imports inside functions): pkg.a, pkg.b",
                        "cycle of 2 modules (counting imports inside functions): pkg.c, pkg.d"]
    assert "pkg.a -> pkg.b -> pkg.a" in result.stdout


def test_checker_passes_a_package_without_cycles(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "from .a import x\n", "pkg/a.py": "x = 1\n",
                      "pkg/b.py": "from .a import x\ndef f():\n    from . import a\n"})
    result = _check(tmp_path, "pkg")
    assert result.returncode == 0, result.stdout + result.stderr
