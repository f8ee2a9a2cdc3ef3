"""``tools/sm90_resources.py`` describes every kernel it compiles by the kernel's own arguments: a kernel that gains,
loses or renames a constexpr must not leave the tool compiling a specialisation it no longer has (the ``queries``
entry still named ``ROWS`` after the kernel's programs became one per token and block of heads)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect

import pytest

from support import REPO_ROOT

OPTIONS = {"num_warps", "num_stages", "maxnreg", "enable_fp_fusion", "_types"}


def _tool():
    spec = importlib.util.spec_from_file_location("sm90_resources", REPO_ROOT / "tools" / "sm90_resources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_entry_names_arguments_its_kernel_has() -> None:
    pytest.importorskip("triton.experimental.gluon")
    tool = _tool()
    for key, (target, _types, defaults, _div16) in tool.KERNELS.items():
        module, name = target.split(":")
        kernel = getattr(importlib.import_module(module), name)
        constexprs = {p.name for p in kernel.params if p.is_constexpr}
        stale = set(defaults) - OPTIONS - constexprs
        assert not stale, f"{key}: not constexprs of {name}: {stale}"
        missing = {p.name for p in kernel.params
                   if p.is_constexpr and p.default is inspect.Parameter.empty and p.name not in defaults}
        assert not missing, f"{key}: constexprs without a value: {missing}"


def test_queries_entry_compiles_for_sm90() -> None:
    pytest.importorskip("triton.experimental.gluon")
    compiled = _tool().compile_sm90("queries")
    assert "ld.global" in compiled.asm["ptx"]
