"""Markdown tables and a summary from `normkit bench --json` reports.

    normkit bench --allocators default no-mmap thp --json > run1.json
    normkit bench --allocators default no-mmap thp --json > run2.json
    python benchmarks/bench_table.py run1.json run2.json --format readme   # the README table
    python benchmarks/bench_table.py run1.json run2.json --format docs     # docs/performance.md
    python benchmarks/bench_table.py run1.json run2.json --format summary  # misses and ranges

The first report gives the times; each further one adds its normkit/torch ratios (no-mmap,
default) to the last column.
"no-mmap" is the setting that shows the kernels' own cost, so the ratios the summary checks
against the issue's targets are the no-mmap ones of every report given.
"""

from __future__ import annotations

import argparse
import json

DT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}
LAY = {"contiguous": "contig", "channels_last": "ch_last"}

# the per-op targets: (op, dtype or None, layout or None, mode, bound on nk/torch)
TARGETS = [
    ("rms_norm", None, None, "fwd+bwd", 0.33),
    ("batch_norm", None, "contiguous", "fwd", 0.4),
    ("instance_norm", None, None, "fwd", 0.5),
    ("layer_norm", "bfloat16", None, "fwd+bwd", 0.5),
]


def _key(r):
    return (r["op"], tuple(r["shape"]), r["dtype"], r["layout"], r["mode"])


def _rows(report, allocator):
    block = report["allocators"].get(allocator)
    return {} if block is None else {_key(r): r for r in block["results"]}


def _name(k):
    op, shape, dt, lay, mode = k
    return f"{op} | {'x'.join(map(str, shape))} | {DT[dt]} | {LAY[lay]} | {mode}"


def _ms(s):
    return f"{s * 1e3:.1f}"


def table(reports, full):
    main = _rows(reports[0], "no-mmap")
    default = _rows(reports[0], "default")
    thp = _rows(reports[0], "thp")
    later = [(_rows(r, "no-mmap"), _rows(r, "default")) for r in reports[1:]]
    runs = "run 2" if len(reports) == 2 else f"runs 2-{len(reports)}"
    if full:
        head = ["op", "shape", "dtype", "layout", "mode", "normkit ms", "torch ms", "copy ms",
                "**nk/torch**", "nk/copy", "torch/copy", "GB/s", "default: nk/torch",
                "nk/copy", "thp: nk/torch"] + [f"{runs}: nk/torch, default"] * bool(later)
    else:
        head = ["op", "shape", "dtype", "layout", "mode", "normkit ms", "torch ms", "copy ms",
                "nk/torch", "nk/copy", "default alloc: nk/torch",
                ] + [f"{runs}: nk/torch (no-mmap, default)"] * bool(later)
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---" if i < 5 else "---:" for i in range(len(head))) + "|"]
    for k, r in main.items():
        cells = [_ms(r["normkit_s"]), _ms(r["torch_s"]), _ms(r["copy_s"])]
        ratio = f"{r['normkit_over_torch']:.2f}"
        cells.append(f"**{ratio}**" if full else ratio)
        cells.append(f"{r['normkit_over_copy']:.2f}")
        if full:
            cells += [f"{r['torch_over_copy']:.2f}", f"{r['normkit_gbps']:.1f}"]
        d = default.get(k)
        cells.append(f"{d['normkit_over_torch']:.2f}" if d else "")
        if full:
            cells.append(f"{d['normkit_over_copy']:.2f}" if d else "")
            t = thp.get(k)
            cells.append(f"{t['normkit_over_torch']:.2f}" if t else "")
        if later:
            cells.append("; ".join(", ".join(f"{x['normkit_over_torch']:.2f}"
                                             for x in (a.get(k), b.get(k)) if x)
                                   for a, b in later))
        lines.append(f"| {_name(k)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _span(values):
    return f"{min(values):.2f}-{max(values):.2f}" if values else "-"


def summary(reports):
    runs = [_rows(r, "no-mmap") for r in reports]
    keys = list(runs[0])
    out = []

    def ratios(k, field="normkit_over_torch", rows=runs):
        return [r[k][field] for r in rows if k in r]

    out.append("no-mmap, nk/torch >= 1.0 in at least one run (the 'never slower' misses):")
    for k in keys:
        v = ratios(k)
        if max(v) >= 1.0:
            out.append(f"  {_name(k)}: " + ", ".join(f"{x:.2f}" for x in v))
    out.append("no-mmap, nk/torch per op (all runs):")
    for op in dict.fromkeys(k[0] for k in keys):
        out.append(f"  {op}: " + _span([x for k in keys if k[0] == op for x in ratios(k)]))
    for alloc in ("default", "thp"):
        rows = [_rows(r, alloc) for r in reports]
        v = [r[k]["normkit_over_torch"] for r in rows for k in r]
        if v:
            above = [sum(r[k]["normkit_over_torch"] > 1.0 for k in r) for r in rows]
            out.append(f"{alloc}: nk/torch {_span(v)} over {len(v)} measurements; "
                       f"above 1.0 per run: {above}")
            for op in dict.fromkeys(k[0] for k in keys):
                out.append(f"  {op}: " + _span([r[k]["normkit_over_torch"] for r in rows
                                                for k in r if k[0] == op]))
    out.append("no-mmap, nk/copy (all runs): fp32 fwd <= 1.3 target, fwd+bwd <= 3.0 target")
    for k in keys:
        if k[2] == "float32":
            v = ratios(k, "normkit_over_copy")
            t = ratios(k, "torch_over_copy")
            bound = 1.3 if k[4] == "fwd" else 3.0
            mark = "met" if max(v) <= bound else ("met once" if min(v) <= bound else "missed")
            out.append(f"  {_name(k)}: nk {', '.join(f'{x:.2f}' for x in v)} ({mark}); "
                       f"torch {', '.join(f'{x:.2f}' for x in t)}")
    fwd = [x for k in keys if k[2] == "float32" and k[4] == "fwd"
           for x in ratios(k, "normkit_over_copy")]
    both = [x for k in keys if k[4] == "fwd+bwd" for x in ratios(k, "normkit_over_copy")]
    out.append(f"  fp32 fwd span {_span(fwd)}; fwd+bwd span (all dtypes) {_span(both)}")
    out.append("the issue's ratio targets (no-mmap, all runs):")
    for op, dt, lay, mode, bound in TARGETS:
        for k in keys:
            if k[0] == op and k[4] == mode and dt in (None, k[2]) and lay in (None, k[3]):
                v = ratios(k)
                mark = "met" if max(v) <= bound else ("met once" if min(v) <= bound else "missed")
                c = ratios(k, "normkit_over_copy")
                tc = ratios(k, "torch_over_copy")
                out.append(f"  {_name(k)} <= {bound}: {', '.join(f'{x:.2f}' for x in v)} "
                           f"({mark}); nk/copy {_span(c)}, bound as copies "
                           f"{_span([bound * x for x in tc])}")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("reports", nargs="+", help="JSON files from `normkit bench --json`")
    p.add_argument("--format", choices=("readme", "docs", "summary"), default="readme")
    a = p.parse_args(argv)
    reports = []
    for path in a.reports:
        with open(path) as f:
            reports.append(json.load(f))
    if a.format == "summary":
        print(summary(reports))
    else:
        print(table(reports, full=a.format == "docs"))


if __name__ == "__main__":
    main()
