"""Summarise a per-SASS-instruction ncu profile (the ``NAME.sass.csv`` that ``benchmarks/gpu_profile.sh`` writes):
where a kernel's instructions and stall samples go — by opcode, by stall reason, and by code segment.

A segment is a run of consecutive instructions with the same execution count (straight-line code between
branches): its count says which role or loop it belongs to (e.g. 2,046 = once per main entry of an 8K CSA chunk,
8,184 = four times per entry: a loop body), its size how much code the role spends there. No GPU needed::

    python benchmarks/ncu_sass_summary.py out/csa_entries.sass.csv [--share 0.8]
"""

from __future__ import annotations

import argparse
import collections
import csv


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def _opcode(source: str) -> str:
    words = source.split()
    if not words:
        return "?"
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]  # skip a predicate guard
    return op.split(".")[0]


def summarise(path: str, share: float = 0.8) -> str:
    """The report for one ``--page source --print-source sass --csv`` export, one section per kernel it holds;
    segments below ``share`` % of the instructions and of the samples are left out."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    starts = [i for i, r in enumerate(rows) if r[:1] == ["Kernel Name"]] or [0]
    return "\n\n".join(_summarise_kernel(path, rows[a:b], share) for a, b in zip(starts, starts[1:] + [len(rows)]))


def _summarise_kernel(path: str, rows: list[list[str]], share: float) -> str:
    name = rows[0][1] if rows[0][:1] == ["Kernel Name"] else "?"
    header = next(r for r in rows if "Address" in r and "Source" in r)
    data = [r for r in rows[rows.index(header) + 1:] if len(r) == len(header)]
    col = {h: i for i, h in enumerate(header)}
    executed = [_number(r[col["Instructions Executed"]]) for r in data]
    samples = [_number(r[col["Warp Stall Sampling (All Samples)"]]) for r in data]
    sources = [r[col["Source"]] for r in data]
    total_exec, total_samples = sum(executed) or 1.0, sum(samples) or 1.0
    out = [f"{path} [{name}]: {int(sum(executed)):,} warp instructions executed, {int(sum(samples)):,} stall samples"]

    by_op: collections.Counter = collections.Counter()
    by_op_samples: collections.Counter = collections.Counter()
    for src, n, s in zip(sources, executed, samples):
        by_op[_opcode(src)] += n
        by_op_samples[_opcode(src)] += s
    out.append("opcode       % executed  % samples")
    out += [f"  {op:10s} {100 * n / total_exec:9.1f} {100 * by_op_samples[op] / total_samples:9.1f}"
            for op, n in by_op.most_common(20)]

    stall_cols = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    stalls = {h[len("stall_"):]: sum(_number(r[col[h]]) for r in data) for h in stall_cols}
    out.append("stalls: " + ", ".join(f"{k} {100 * v / total_samples:.1f}%"
                                      for k, v in sorted(stalls.items(), key=lambda kv: -kv[1])[:8]))

    out.append("segments (first-last instruction, count = executions of each, % executed, % samples, top opcodes)")
    start = 0
    for k in range(1, len(data) + 1):
        if k < len(data) and executed[k] == executed[start]:
            continue
        seg_exec, seg_samples = sum(executed[start:k]), sum(samples[start:k])
        if 100 * seg_exec / total_exec >= share or 100 * seg_samples / total_samples >= share:
            ops = collections.Counter(_opcode(s) for s in sources[start:k]).most_common(5)
            out.append(f"  {start:6d}-{k - 1:6d} ({k - start:5d} instr) count {int(executed[start]):8d} "
                       f"{100 * seg_exec / total_exec:5.1f}% {100 * seg_samples / total_samples:5.1f}%  "
                       + " ".join(f"{op}:{n}" for op, n in ops))
        start = k
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="a NAME.sass.csv written by benchmarks/gpu_profile.sh")
    ap.add_argument("--share", type=float, default=0.8, help="show segments from this %% of instructions or samples")
    a = ap.parse_args()
    print(summarise(a.csv, a.share))


if __name__ == "__main__":
    main()
