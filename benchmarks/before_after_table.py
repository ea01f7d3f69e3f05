"""The tables of ``benchmarks/bench_before_after.sh``: normkit / torch before and after, per
op case (both allocators) and per model and small call, each side's values over its rounds.

    python benchmarks/before_after_table.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def _span(values):
    lo, hi = min(values), max(values)
    return f"{lo:.3f}" if abs(hi - lo) < 5e-4 else f"{lo:.3f}-{hi:.3f}"


def ops_table(out: Path) -> list[str]:
    ratios = defaultdict(lambda: defaultdict(list))       # case -> side -> [nk/torch]
    for path in sorted(out.glob("ops-*.json")):
        side = path.stem.split("-")[1]
        for alloc, block in json.loads(path.read_text())["allocators"].items():
            for r in block["results"]:
                key = (r["op"], tuple(r["shape"]), r["dtype"], r.get("layout", ""), r["mode"], alloc)
                ratios[key][side].append(r["normkit_s"] / r["torch_s"])
    lines = ["| op | shape | dtype | layout | mode | allocator | before: nk/torch | after: nk/torch |",
             "|---|---|---|---|---|---|---:|---:|"]
    for key, sides in ratios.items():
        shape = "x".join(str(s) for s in key[1])
        lines.append(f"| {key[0]} | {shape} | {key[2]} | {key[3]} | {key[4]} | {key[5]} | "
                     f"{_span(sides.get('before', [0]))} | {_span(sides.get('after', [0]))} |")
    return lines


def models_table(out: Path) -> list[str]:
    models = defaultdict(lambda: defaultdict(list))
    calls = defaultdict(lambda: defaultdict(list))
    for path in sorted(out.glob("models-*.json")):
        side = path.stem.split("-")[1]
        report = json.loads(path.read_text())
        for r in report["models"]:
            control = r.get("control")
            models[(r["model"], r["mode"])][side].append((r["ratio"], control))
        for r in report["calls"]:
            calls[(r["case"], r["pass_"])][side].append(r["ratio"])
    lines = ["| model | mode | before (control) | after (control) |", "|---|---|---:|---:|"]
    for (model, mode), sides in models.items():
        cells = []
        for side in ("before", "after"):
            pairs = sides.get(side, [])
            cells.append(", ".join(f"{a:.3f}" + (f" ({c:.3f})" if c else "") for a, c in pairs))
        lines.append(f"| {model} | {mode} | {cells[0]} | {cells[1]} |")
    lines += ["", "| small call | pass | before: nk/torch | after: nk/torch |",
              "|---|---|---:|---:|"]
    for (case, kind), sides in calls.items():
        lines.append(f"| {case} | {kind} | {_span(sides.get('before', [0]))} | "
                     f"{_span(sides.get('after', [0]))} |")
    return lines


def main(argv=None):
    out = Path((argv or sys.argv[1:])[0])
    print("\n".join(ops_table(out)))
    print()
    print("\n".join(models_table(out)))


if __name__ == "__main__":
    main()
