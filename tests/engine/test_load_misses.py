"""``engine.load_misses``: why the warm-up's load pass compiled a kernel, from the specialisations the compile
workers and the load pass launched (strings as Triton's JIT hook formats them)."""

from __future__ import annotations

from dsv4.engine.load_misses import explain_load_compiles, split_spec

_WORKER = {
    "_write[num_warps=4, num_stages=3](a: ('*fp32', 'D'), n: ('i32', 'D'), B: 4)",
    "_write[num_warps=4, num_stages=3](a: ('*fp32', 'D'), n: ('i32', ''), B: 8)",
    "_norm[num_warps=4](x: ('*bf16', 'D'))",
}


def test_split_spec_keeps_tuple_types_whole() -> None:
    head, args = split_spec("_write[num_warps=4, num_stages=3](a: ('*fp32', 'D'), n: ('i32', ''), B: 4)")
    assert head == "_write[num_warps=4, num_stages=3]"
    assert args == {"a": "('*fp32', 'D')", "n": "('i32', '')", "B": "4"}
    assert split_spec("_k[num_warps=1]()") == ("_k[num_warps=1]", {})


def test_explain_names_the_differing_argument_the_cache_miss_and_the_unknown_kernel() -> None:
    records = [("_write", 4.0), ("_write", 0.01), ("_norm", 6.0), ("_other", 1.0), ("_write", 0.7)]
    specs = [
        "_write[num_warps=4, num_stages=3](a: ('*fp32', ''), n: ('i32', 'D'), B: 4)",  # a: not 16-byte aligned
        "_write[num_warps=4, num_stages=3](a: ('*fp32', 'D'), n: ('i32', 'D'), B: 4)",  # fast: a load, not listed
        "_norm[num_warps=4](x: ('*bf16', 'D'))",  # a worker's very spec: the disk cache missed
        "_other[num_warps=1]()",
        "_write[num_warps=8, num_stages=3](a: ('*fp32', 'D'), n: ('i32', ''), B: 8)",  # other launch options
    ]
    lines = explain_load_compiles(records, specs, _WORKER)
    assert [line.split(" ", 1)[0] for line in lines] == ["_norm", "_write", "_other", "_write"]  # slowest first
    assert "disk cache missed" in lines[0]
    assert "a: ('*fp32', '') here, ('*fp32', 'D') in a worker" in lines[1] and "n:" not in lines[1]
    assert "no worker launched this kernel" in lines[2]
    assert "options [num_warps=8, num_stages=3] here, [num_warps=4, num_stages=3] in a worker" in lines[3]
    assert explain_load_compiles(records, specs, _WORKER, limit=1) == lines[:1]
