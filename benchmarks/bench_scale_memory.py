"""Peak memory and throughput of `normkit scale` as the input grows.

Run:  python benchmarks/bench_scale_memory.py [--sizes-mb 250,1000,2000] [--formats csv,parquet]
          [--actions fit,transform,inverse] [--dir /tmp/scale-bench] [--chunk-mb 16] [--csv out.csv]

For each format and size it writes a table of 8 float columns and one text column in
batches of 10,000 rows (so this script stays small whatever the size; in Parquet each batch
is a row group), then runs, each as a child process, ``normkit scale fit`` on it,
``transform`` of it into the same format and ``inverse`` of that output. The peak of the
child's anonymous resident memory (``RssAnon`` in ``/proc/PID/status``: the heap and the
allocators' pages, not the page cache of the files) is sampled every 5 ms. The first row of
each format is a one-batch file (about 2 MB): the process's start-up (interpreter, NumPy,
pyarrow, scikit-learn, numba). MB/s is input bytes per second of wall time, start-up
included. Each size's files are deleted before the next size is written.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time

import numpy as np

COLUMNS = 8


def write_table(path, fmt, target_bytes, seed=0):
    """Write batches of random rows to ``path`` until it holds at least ``target_bytes``."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    rows = 10_000
    tags = pa.array([f"tag{i % 997:05d}" for i in range(rows)])
    schema = pa.schema([(f"c{j}", pa.float64()) for j in range(COLUMNS)] + [("tag", pa.string())])
    writer = pq.ParquetWriter(path, schema) if fmt == "parquet" else pcsv.CSVWriter(path, schema)
    while os.path.getsize(path) < target_bytes:  # Parquet grows a row group at a time
        cols = [pa.array(rng.normal(size=rows) * 10.0 ** j) for j in range(COLUMNS)]
        writer.write_batch(pa.record_batch(cols + [tags], schema=schema))
    writer.close()


def peak_rss_anon(argv):
    """Run ``argv``; return (seconds, peak RssAnon in MB) of the child, failing on error."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    status = f"/proc/{proc.pid}/status"
    while proc.poll() is None:
        try:
            with open(status) as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        peak = max(peak, int(line.split()[1]))
                        break
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.005)
    err = proc.stderr.read().decode()
    proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{err}")
    return time.perf_counter() - t0, peak / 1024


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", default="250,1000,2000")
    ap.add_argument("--formats", default="csv,parquet")
    ap.add_argument("--dir", default="/tmp/scale-bench")
    ap.add_argument("--chunk-mb", default="16")
    ap.add_argument("--actions", default="fit,transform,inverse")
    ap.add_argument("--csv", help="also write the table as CSV here")
    args = ap.parse_args(argv)

    os.makedirs(args.dir, exist_ok=True)
    normkit = [sys.executable, "-m", "normkit", "scale"]
    common = ["--chunk-mb", args.chunk_mb, "--no-progress"]
    actions = args.actions.split(",")
    header = ["format", "action", "input_MB", "peak_RssAnon_MiB", "seconds", "MB_per_s"]
    results = []
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header), flush=True)
    for fmt in args.formats.split(","):
        for size_mb in [1] + [int(s) for s in args.sizes_mb.split(",")]:
            data = os.path.join(args.dir, f"in-{size_mb}.{fmt}")
            scaler = os.path.join(args.dir, "scaler.json")
            out = os.path.join(args.dir, f"out.{fmt}")
            back = os.path.join(args.dir, f"back.{fmt}")
            write_table(data, fmt, size_mb * 10**6)
            runs = {
                "fit": (data, normkit + ["fit", data, "-o", scaler] + common),
                "transform": (data, normkit + ["transform", data, "--scaler", scaler, "-o", out] + common),
                "inverse": (out, normkit + ["inverse", out, "--scaler", scaler, "-o", back] + common),
            }
            if "fit" not in actions:  # the others need a scaler file
                subprocess.run(runs["fit"][1], check=True, stderr=subprocess.DEVNULL)
            for action in actions:
                source, cmd = runs[action]
                if action == "inverse" and not os.path.exists(out):
                    subprocess.run(runs["transform"][1], check=True, stderr=subprocess.DEVNULL)
                mb = os.path.getsize(source) / 1e6
                seconds, peak = peak_rss_anon(cmd)
                row = [fmt, action, f"{mb:.0f}", f"{peak:.0f}", f"{seconds:.2f}", f"{mb / seconds:.1f}"]
                results.append(row)
                print("| " + " | ".join(row) + " |", flush=True)
            for path in (data, out, back):
                if os.path.exists(path):
                    os.unlink(path)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(header)
            w.writerows(results)


if __name__ == "__main__":
    main()
