"""Old-vs-new table of the quick benchmarks ``benchmarks/gpu_session.sh ab`` wrote: for every row name present in
both trees, the median µs of each tree's runs and their ratio (new / old), largest changes first.

    python benchmarks/ab_table.py OUT_DIR
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys


def main() -> None:
    out = sys.argv[1]
    times: dict[tuple[str, str], dict[str, list[float]]] = {}
    for path in glob.glob(os.path.join(out, "*_*_*.json")):
        bench, tree = os.path.basename(path).split("_")[:2]
        try:
            rows = json.load(open(path))["rows"]
        except (OSError, ValueError, KeyError):
            continue
        for r in rows:
            if isinstance(r.get("us"), (int, float)):
                times.setdefault((bench, r["name"]), {}).setdefault(tree, []).append(r["us"])
    lines = []
    for (bench, name), t in times.items():
        if "old" in t and "new" in t:
            old, new = statistics.median(t["old"]), statistics.median(t["new"])
            lines.append((abs(new / old - 1), f"{bench:<10}{name[:60]:<62}{old:10.1f}{new:10.1f}{new / old:8.3f}"))
    print(f"{'bench':<10}{'row':<62}{'old us':>10}{'new us':>10}{'new/old':>8}")
    for _, line in sorted(lines, reverse=True):
        print(line)
    ratios = [float(line.split()[-1]) for _, line in lines]
    if ratios:
        print(f"{len(ratios)} rows; median new/old {statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}")


if __name__ == "__main__":
    main()
