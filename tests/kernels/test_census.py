"""``kernels.census``: recording the specialisations host code launches without compiling or running them, and
compiling one recorded specialisation on its own.

CPU: the hook's bookkeeping (what it records, what it skips, what it leaves to a device query, the in-memory kernels
set aside and restored), the name resolution that refuses anything outside the package. GPU: a census of a real
layer step writes nothing to the cache and compiles nothing; the specialisations it lists, compiled in another
process, are every binary the real step needs (it adds nothing to the disk cache).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

import dsv4.ops.triton_ops  # noqa: E402,F401 - every kernel module imported
from dsv4.kernels import census  # noqa: E402
from dsv4.kernels.census import KernelSpec, LaunchCensus, compile_cost, device_query, jit_function  # noqa: E402

GEMM = "dsv4.kernels.project.block_gemm._block_fp8_gemm_kernel"
ATTENTION = "dsv4.kernels.attention.sm90_serial._sparse_attention_sm90_kernel"


def _data(name: str, key: str) -> str:
    return json.dumps({"name": name, "key": key, "signature": {}, "constant_keys": [], "constant_vals": [],
                       "attrs_keys": [], "attrs_vals": [], "options": {}})


def _hook_call(c: LaunchCensus, name: str, key: str):
    """What Triton's ``_call_hook`` passes a ``jit_cache_hook`` before compiling (the parts the census reads)."""
    return c._hook(key=key, repr=name, fn=None, compile={"key": key, "specialization_data": _data(name, key)},
                   is_manual_warmup=False, already_compiled=False)


def test_spec_from_data_validates() -> None:
    spec = KernelSpec.from_data(_data(GEMM, "k1"))
    assert (spec.name, spec.key) == (GEMM, "k1")
    for bad in ("not json", json.dumps({"name": GEMM}), json.dumps({"name": 3, "key": "k"}), json.dumps([1])):
        with pytest.raises(ValueError, match="specialization data"):
            KernelSpec.from_data(bad)


def test_census_records_each_specialisation_once_and_skips_it() -> None:
    previous = []
    knobs = triton.knobs.runtime
    old = knobs.jit_cache_hook
    knobs.jit_cache_hook = lambda *a, **k: previous.append(k["key"])
    try:
        with LaunchCensus() as c:
            assert knobs.jit_cache_hook == c._hook
            assert _hook_call(c, GEMM, "a") is True  # True: Triton neither compiles nor launches
            assert _hook_call(c, GEMM, "b") is True
            assert _hook_call(c, GEMM, "a") is True
            assert _hook_call(c, ATTENTION, "a") is True
            assert _hook_call(c, "triton.language.standard.some_kernel", "x") is True  # skipped, not recorded
            with device_query():  # compiled for real: passed on to the hook installed before, not recorded
                assert _hook_call(c, ATTENTION, "probe") is None
        assert knobs.jit_cache_hook is not c._hook  # restored
        assert [(s.name, s.key) for s in c.specs] == [(GEMM, "a"), (GEMM, "b"), (ATTENTION, "a")]
        assert previous == ["probe"]
    finally:
        knobs.jit_cache_hook = old


def test_census_sets_in_memory_kernels_aside() -> None:
    """A kernel already in the process's memory would launch without asking the hook: the census empties those
    caches while it runs (and again after a device query compiled into them), and restores them after."""
    fn = jit_function(GEMM)
    cache = {"kept": object()}
    fn.device_caches["census-test"] = (cache, {}, None, None, None)
    try:
        with LaunchCensus():
            assert cache == {}
            with device_query():
                cache["probe"] = object()  # what a device query's compile leaves
            assert cache == {}
        assert list(cache) == ["kept"]
    finally:
        del fn.device_caches["census-test"]


def test_only_the_package_s_kernels_resolve() -> None:
    assert jit_function(GEMM) is dsv4.kernels.project.block_gemm._block_fp8_gemm_kernel
    for name in ("os.system", "triton.language.standard.max", GEMM + "x", ""):
        with pytest.raises(KeyError, match="not a JIT function"):
            jit_function(name)
    with pytest.raises(KeyError):
        census.compile_spec(KernelSpec.from_data(_data("os.system", "k")))


def test_compile_cost_counts_the_callees() -> None:
    gemm = jit_function(GEMM)
    assert compile_cost(GEMM) > len(gemm.src)  # its quantization helpers count too
    assert compile_cost(ATTENTION) > compile_cost(GEMM)


# ---------------------------------------------------------------------------------------------------------- GPU

_CHILD = r"""
import json, sys
import torch
import dsv4
from dsv4.engine.shape_run import kind_layers, run_shape
from dsv4.engine.shape_store import StepShape
from dsv4.kernels.census import KernelSpec, LaunchCensus, compile_spec
from dsv4.engine.jit_clock import JitClock
cfg = dsv4.ModelConfig.preset("tiny")
shape = StepShape((5, 1, 3), 4)
args = (cfg, kind_layers(cfg, range(cfg.num_layers)), "official", "triton", 64, shape, "cuda")
if sys.argv[1] == "census":
    with LaunchCensus() as c:
        run_shape(*args)
    for s in c.specs:
        compile_spec(s)
    print(json.dumps([s.data for s in c.specs]))
else:
    with JitClock() as clock:
        run_shape(*args)
    print(json.dumps(clock.kernels))
"""


def _child(mode: str, cache_dir: str) -> str:
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env = {**os.environ, "TRITON_CACHE_DIR": cache_dir,
           "PYTHONPATH": os.pathsep.join([os.path.abspath(src), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def _cache_entries(cache_dir: str) -> set[str]:
    return {d for d in os.listdir(cache_dir) if os.path.isdir(os.path.join(cache_dir, d))}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_census_specs_are_every_binary_the_real_step_needs(tmp_path) -> None:
    specs = json.loads(_child("census", str(tmp_path)))
    assert specs, "the census saw no launch"
    names = {KernelSpec.from_data(d).name for d in specs}
    assert any("attention" in n for n in names) and any("write" in n for n in names), names
    compiled = _cache_entries(str(tmp_path))
    kernels = int(_child("run", str(tmp_path)))  # a fresh process runs the shape for real
    assert kernels > 0
    assert _cache_entries(str(tmp_path)) == compiled  # every binary it launched was on disk already


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_census_writes_nothing() -> None:
    """Inside a census a layer step runs on the host only: the cache's tensors stay bit for bit as they were (only
    the step's accounting moves), where the same step run for real writes them; the specialisations are recorded."""
    import dsv4
    from dsv4.cache import HybridCache

    cfg = dsv4.ModelConfig.preset("tiny")
    layers = list(range(cfg.num_layers))
    attn = {li: dsv4.Attention(dsv4.AttentionWeights.random(cfg, li, seed=li, device="cuda"), cfg, li,
                               backend="triton", nan_policy="off") for li in layers}  # a census's outputs: garbage
    x = torch.randn(9, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)

    def step(recording: bool) -> tuple[list[str], list]:
        cache = HybridCache(cfg, layers=layers, max_requests=2, num_blocks=16, block_size=64, device="cuda")
        for r in ("a", "b"):
            cache.add_request(r)
        batch = cache.prepare_forward({"a": 6, "b": 3})
        snap = cache.snapshot()
        c = LaunchCensus() if recording else None
        with c if c is not None else torch.no_grad(), torch.no_grad():
            for li in layers:
                attn[li](x, batch, cache, attn[0].plan_step(batch, cache))
        torch.cuda.synchronize()
        return [d for d in cache.differences(snap) if not d.startswith("step accounting")], (c.specs if c else [])

    diffs, specs = step(recording=True)
    assert diffs == [] and len(specs) >= 3
    real, _ = step(recording=False)
    assert real, "the real step wrote nothing: the check above would prove nothing"
