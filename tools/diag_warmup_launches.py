"""Which Triton specialisations a warm-up's compile workers launch versus its load pass, on the CPU (issue 36).

Every ``@triton.jit`` / ``@gluon.jit`` launch is intercepted: Triton's own binder (for an sm_90 CUDA target)
computes the specialisation it would key the compiled kernel by (argument types, ``== 1`` / divisible-by-16
integers, 16-byte-aligned pointers, constexprs, options), the launch itself does nothing. The layer's host logic
runs as on an H200 (``DeviceFacts`` of 132 SMs, Hopper, the Triton path for CPU tensors).

Two ways of running ``engine.shape_run.run_shape`` over the same step shapes are compared:

* ``worker``: one task per (shape, layer kind), ``layers=[li]`` — what the compile workers' fallback submits (``engine.compile_workers``);
* ``load``: one run per shape with every kind, ``layers=[...]`` — what ``warm_up``'s load pass runs.

Prints every specialisation the load pass launches that no worker task launched (those compile in the main
process), grouped by kernel, with the argument that differs.

    PYTHONPATH=src python tools/diag_warmup_launches.py [--max-tokens 1024]
    PYTHONPATH=src python tools/diag_warmup_launches.py --census      # specialisations per kernel (≈ 13 min here)
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch


def install_recorder(launch: bool = False) -> list:
    """Intercept every JIT launch: record ``(kernel name, specialisation key, bound argument names)``."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime import jit as tjit

    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    binders: dict[int, object] = {}
    launches: list = []

    class _Compiled:  # what cluster_launch / warmup callers touch
        packed_metadata = (4, 1, 0)
        function = 0

        def _init_handles(self) -> None:
            pass

        def __getitem__(self, grid):
            return lambda *a, **k: None

    real = tjit.JITFunction.run
    from triton.experimental.gluon._runtime import GluonJITFunction

    real_gluon = GluonJITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if launch:  # on the GPU: record what Triton's own binder computes, then launch for real
            bound, spec, options = self.device_caches[tjit.driver.active.get_current_device()][4](*args, **kwargs)
            launches.append((self._fn_name, tjit.compute_cache_key({}, spec, options), list(bound), spec, options,
                             bool(warmup)))
            return (real_gluon if self.is_gluon() else real)(self, *args, grid=grid, warmup=warmup, **kwargs)
        binder = binders.get(id(self))
        if binder is None:
            binder = binders[id(self)] = tjit.create_function_from_signature(self.signature, self.params, backend)
        kwargs["debug"] = kwargs.get("debug", self.debug)
        bound, spec, options = binder(*args, **kwargs)
        key = tjit.compute_cache_key({}, spec, options)
        launches.append((self._fn_name, key, list(bound), spec, options, bool(warmup)))
        return _Compiled()

    tjit.JITFunction.run = run
    GluonJITFunction.run = run
    return launches


def pretend_h200() -> None:
    """Plan and launch as on an H200 while the tensors stay on the CPU."""
    import dsv4.ops.triton_ops  # noqa: F401 - every kernel module
    from dsv4.kernels.device import DeviceFacts

    h200 = DeviceFacts(kernels=True, sm_count=132, sm90=True, resident_clusters=lambda n: 132 // n, fp8_gemm="bf16")
    for name, mod in list(sys.modules.items()):
        if not name.startswith("dsv4.") or mod is None:
            continue
        for attr, fake in (("runs_here", lambda t: True), ("interpreting", lambda: False),
                           ("is_sm90", lambda d: True), ("sm_count", lambda d: 132), ("facts", lambda d: h200)):
            if hasattr(mod, attr) and callable(getattr(mod, attr)) and name != "dsv4.kernels.device_facts" or (
                    name == "dsv4.kernels.device_facts" and attr != "facts" and hasattr(mod, attr)):
                setattr(mod, attr, fake)
    import dsv4.layer

    dsv4.layer.Attention._validate = lambda self, *a: None  # it refuses CPU tensors for the triton backend
    from dsv4.kernels.attention import cluster_launch

    cluster_launch._allow = lambda compiled, cluster: None  # asks the CUDA driver
    _shape_only_matmuls()


def _shape_only_matmuls() -> None:
    """The torch GEMMs between the launches give tensors of the right shape, dtype and strides but no values
    (an 8192-token step's projections would take minutes on the CPU; no launch depends on their values)."""
    import torch.nn.functional as F

    def shaped(op):
        def run(*a, **k):
            meta = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in a]
            out = op(*meta, **{n: (v.to("meta") if isinstance(v, torch.Tensor) else v) for n, v in k.items()})
            return torch.empty_strided(out.shape, out.stride(), dtype=out.dtype)
        return run

    F.linear = shaped(F.linear)
    torch.matmul = shaped(torch.matmul)
    torch.bmm = shaped(torch.bmm)
    torch.einsum = shaped(torch.einsum)


def workload_shapes(max_tokens: int) -> tuple[list, list]:
    """The acceptance run's eager shapes and graph shapes (64 x 8192 + 256, the GPU defaults), from the scheduling
    replayed on a ``meta`` cache by an engine stand-in (no layers built)."""
    import types

    import dsv4
    from dsv4.engine import EngineConfig
    from dsv4.engine.runner import Engine
    from dsv4.engine.warmup import graph_shapes, plan_step_shapes
    from dsv4.engine.requests import make_requests
    from dsv4.numerics import resolve_numerics

    cfg = dsv4.ModelConfig.preset("v4-flash")
    conf = EngineConfig(backend="triton", device="cpu", max_running=64, max_batched_tokens=8192, block_size=256)
    eng = types.SimpleNamespace(cfg=cfg, config=conf, layer_ids=list(range(cfg.num_layers + cfg.num_mtp_layers)), parallel=None,
                                device=torch.device("cpu"), numerics=resolve_numerics("official"))
    eng._want_graphs = lambda: True
    eng.build_cache = types.MethodType(Engine.build_cache, eng)
    reqs = make_requests(64, "8192", "256", seed=0)
    eager, buckets = plan_step_shapes(eng, reqs)
    return [s for s in eager if sum(s.num_new) <= max_tokens], graph_shapes(eng, reqs, buckets)


def process_state(device: str) -> dict:
    """What a process's kernels may depend on besides the step: device facts, Triton's cache dir and the
    environment variables that enter its disk-cache key."""
    import os

    from triton import knobs
    from triton._C.libtriton import get_cache_invalidating_env_vars

    import dsv4.ops.triton_ops as tops

    f = tops.facts(torch.device(device))
    return {"sm_count": f.sm_count, "sm90": f.sm90, "fp8_gemm": f.fp8_gemm,
            "clusters": [f.resident_clusters(n) if f.resident_clusters else None for n in (2, 4, 8, 16)],
            "cache_dir": knobs.cache.dir, "env": sorted(get_cache_invalidating_env_vars().items()),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}


_LAUNCHES: list = []


def _init(device: str) -> None:
    """Spawned worker: the recorder (and on the CPU the H200 stand-in), then ``compile_workers.start_worker``'s
    work."""
    _LAUNCHES[:] = [install_recorder(launch=device != "cpu")]
    if device == "cpu":
        pretend_h200()
    else:
        from dsv4.engine.compile_workers import start_worker

        start_worker(device)


def _task(cfg, layers: list[int], shape, device: str) -> tuple[list, dict]:
    """One ``run_shape`` in this process: its launches' ``(kernel, specialisation, arg names, spec)``."""
    from dsv4.engine.shape_run import run_shape

    rec = _LAUNCHES[0]
    start = len(rec)
    run_shape(cfg, layers, "official", "triton", 256, shape, device)
    return [(n, k, names, spec) for n, k, names, spec, _, _ in rec[start:]], process_state(device)


def _setup(args) -> tuple:
    """This process's recorder, and the run's ``(cfg, one layer per kind, eager shapes, graph shapes)``."""
    import dsv4
    from dsv4.engine.shape_run import kind_layers

    _init(args.device)
    eager, graph = workload_shapes(args.max_tokens)
    if args.requests:
        eager = [s for s in eager if len(s.num_new) in args.requests]
    cfg = dsv4.ModelConfig.preset("v4-flash")
    return cfg, kind_layers(cfg, range(cfg.num_layers)), eager, graph


def census(args) -> int:
    """Every distinct specialisation the workload launches, counted per kernel, with the arguments that vary."""
    cfg, layers, eager, graph = _setup(args)
    specs: dict[str, dict] = defaultdict(dict)
    for shape in eager + graph:
        recs, _ = _task(cfg, layers, shape, args.device)
        for name, key, names, spec in recs:
            specs[name].setdefault(key, (names, spec))
    print(f"{len(eager)} eager + {len(graph)} graph shapes, layers {layers}: "
          f"{sum(len(k) for k in specs.values())} specialisations")
    for name, keys in sorted(specs.items(), key=lambda kv: -len(kv[1])):
        names = next(iter(keys.values()))[0]
        varying = [f"{nm}({n})" for j, nm in enumerate(names)
                   if (n := len({repr(v[1][j]) if j < len(v[1]) else None for v in keys.values()})) > 1]
        print(f"{len(keys):4d}  {name}: varies in {', '.join(varying[:8])}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=1 << 30, help="eager shapes of at most this many tokens")
    p.add_argument("--requests", type=int, nargs="*", help="only eager shapes of these request counts")
    p.add_argument("--device", default="cpu", help="cpu (launches recorded, not run; an H200 stand-in) or cuda")
    p.add_argument("--workers", type=int, default=2, help="spawned worker processes")
    p.add_argument("--census", action="store_true",
                   help="only count the distinct specialisations per kernel (this process, load-pass order)")
    args = p.parse_args()
    if args.census:
        return census(args)
    import concurrent.futures
    import multiprocessing

    cfg, layers, eager, graph = _setup(args)
    shapes = eager + graph
    print(f"{len(eager)} eager shapes + {len(graph)} graph shapes; layers {layers}; device {args.device}")
    seen: dict[str, dict] = {"worker": defaultdict(list), "load": defaultdict(list)}
    states: dict[str, set] = {"worker": set(), "load": set()}
    order = sorted(shapes, key=lambda s: -sum(s.num_new))  # as compile_workers submits them
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.workers, mp_context=ctx, initializer=_init,
                                                initargs=(args.device,)) as pool:
        jobs = {pool.submit(_task, cfg, [li], shape, args.device): (shape, (li,)) for shape in order for li in layers}
        for f in concurrent.futures.as_completed(jobs):
            shape, ls = jobs[f]
            recs, state = f.result()
            states["worker"].add(repr(state))
            for name, key, names, spec in recs:
                seen["worker"][(name, key)].append((shape, ls, names, spec))
    for shape in shapes:  # the load pass: this process, every kind, replay order
        recs, state = _task(cfg, layers, shape, args.device)
        states["load"].add(repr(state))
        for name, key, names, spec in recs:
            seen["load"][(name, key)].append((shape, tuple(layers), names, spec))
    for mode in ("worker", "load"):
        print(f"{mode} process state(s): {sorted(states[mode])}")
    missing = [k for k in seen["load"] if k not in seen["worker"]]
    print(f"worker specialisations {len(seen['worker'])}, load pass {len(seen['load'])}, "
          f"load-pass ones no worker launched: {len(missing)}")
    by_kernel = defaultdict(list)
    for k in missing:
        by_kernel[k[0]].append(k)
    for name, keys in by_kernel.items():
        print(f"\n{name}: {len(keys)} specialisation(s) only in the load pass")
        for k in keys[:4]:
            shape, ls, names, spec = seen["load"][k][0]
            twins = [w for w in seen["worker"] if w[0] == name]
            print(f"  shape {shape.num_new[:4]}{'...' if len(shape.num_new) > 4 else ''} x{len(shape.num_new)} "
                  f"width {shape.width}, layers {ls}")
            wspecs = [s for (n, wk), v in seen["worker"].items() if n == name for (sh, _, _, s) in v if sh == shape]
            if wspecs:
                diff = [(nm, a, b) for nm, a, b in zip(names, spec, wspecs[0]) if a != b]
                print(f"    differs from the worker's launch of this shape in: {diff}")
            else:
                print(f"    no worker launched {name} for this shape ({len(twins)} worker specialisations of it)")
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
