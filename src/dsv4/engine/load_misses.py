"""Why a warm-up's load pass compiled a kernel its compile workers should have left on disk (issue 36's question).

The load pass (``engine.warmup``, step 3) runs every step shape once more in the engine's process; each kernel
should then come from Triton's on-disk cache in milliseconds. A kernel that takes seconds was compiled there, for
one of two reasons, which ``explain_load_compiles`` tells apart from the specialisations (``JitClock.specs``)
the workers and the load pass launched:

* no worker launched that specialisation: the load pass runs something the workers did not — the differing
  arguments are named against the closest specialisation of the same kernel a worker did launch;
* a worker launched the very same specialisation, yet the disk cache missed: the binary's cache key differs
  outside the specialisation (environment, options, the kernel's source or globals in that process).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

__all__ = ["explain_load_compiles", "split_spec"]

_ARG = re.compile(r", (?=[A-Za-z_]\w*: )")


def split_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"name[options](a: t, b: u)"`` → ``("name[options]", {"a": "t", "b": "u"})`` (a JitClock spec)."""
    head, _, args = spec.partition("(")
    args = args[:-1] if args.endswith(")") else args
    out = {}
    for part in _ARG.split(args) if args else []:
        name, _, kind = part.partition(": ")
        out[name] = kind
    return head, out


def _difference(spec: str, others: Iterable[str]) -> str:
    """The arguments (or launch options) in which ``spec`` differs from the closest of ``others`` (same kernel)."""
    head, args = split_spec(spec)
    name = head.split("[", 1)[0]
    best: list[str] | None = None
    for other in others:
        o_head, o_args = split_spec(other)
        if o_head.split("[", 1)[0] != name:
            continue
        diff = [f"{a}: {args.get(a)} here, {o_args.get(a)} in a worker" for a in args.keys() | o_args.keys()
                if args.get(a) != o_args.get(a)]
        if o_head != head:
            diff.insert(0, f"options {head[len(name):]} here, {o_head[len(name):]} in a worker")
        if best is None or len(diff) < len(best):
            best = sorted(diff)
    if best is None:
        return "no worker launched this kernel at all"
    return "no worker launched this specialisation; the closest differs in " + "; ".join(best[:4])


def explain_load_compiles(records: Sequence[tuple[str, float]], specs: Sequence[str], worker_specs: set[str],
                          min_seconds: float = 0.5, limit: int = 12) -> list[str]:
    """One line per kernel the load pass took ≥ ``min_seconds`` for (slowest first, at most ``limit``): its name,
    seconds and why it compiled (see the module docstring). ``records`` / ``specs``: the load pass's
    ``JitClock``; ``worker_specs``: every spec the compile workers launched."""
    slow = sorted(((s, n, spec) for (n, s), spec in zip(records, specs) if s >= min_seconds), key=lambda r: -r[0])
    lines = []
    for seconds, name, spec in slow[:limit]:
        why = ("a worker launched the same specialisation, but the disk cache missed it" if spec in worker_specs
               else _difference(spec, worker_specs))
        lines.append(f"{name} {seconds:.1f} s: {why}")
    return lines
