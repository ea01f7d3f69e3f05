"""Benchmark normkit's scalers against scikit-learn (fit and transform).

Run:  python benchmarks/bench_scalers.py [--rows 2000000] [--cols 50] [--repeats 5] [--csv out.csv]

Interleaved repeats (each repeat times every contender once, in turn), median times. Reports,
per dtype and operation, the time of scikit-learn and of normkit, their ratio, the time of a
plain memory copy of X (the floor for a pass that reads X and writes an array like it) and
normkit's effective bandwidth. numba runs on 2 threads; scikit-learn is single-threaded
NumPy. Results are checked equal to 1e-12 relative (float64) before timing.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("NUMBA_NUM_THREADS", "2")

import numpy as np  # noqa: E402


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--cols", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--csv", help="also write the table as CSV here")
    args = ap.parse_args(argv)

    import numba
    from sklearn import preprocessing as skp

    from normkit.preprocessing import MinMaxScaler, StandardScaler

    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    rows = []
    for dtype in (np.float64, np.float32):
        X = (rng.standard_normal((args.rows, args.cols)) * 3.0 + 10.0).astype(dtype)
        gb = X.nbytes / 1e9
        pairs = {"StandardScaler": (StandardScaler, skp.StandardScaler),
                 "MinMaxScaler": (MinMaxScaler, skp.MinMaxScaler)}
        for name, (ours_cls, ref_cls) in pairs.items():
            ours, ref = ours_cls().fit(X), ref_cls().fit(X)  # warm up (numba compile) and check
            Zo, Zr = ours.transform(X), ref.transform(X)
            attrs = ("mean_", "var_") if name == "StandardScaler" else ("data_min_", "data_max_")
            fit_err = max(float(np.max(np.abs(getattr(ours, a) - getattr(ref, a)) / np.abs(getattr(ref, a))))
                          for a in attrs)
            # outputs are in units of the feature's spread: error relative to max(|z|, 1)
            Zr64 = Zr.astype(np.float64)
            tr_err = float(np.max(np.abs(Zo.astype(np.float64) - Zr64) / np.maximum(np.abs(Zr64), 1.0)))
            del Zo, Zr
            t = {k: [] for k in ("copy", "sk_fit", "nk_fit", "sk_tr", "nk_tr")}
            for _ in range(args.repeats):
                t["copy"].append(timed(lambda: X.copy()))
                t["sk_fit"].append(timed(lambda: ref_cls().fit(X)))
                t["nk_fit"].append(timed(lambda: ours_cls().fit(X)))
                t["sk_tr"].append(timed(lambda: ref.transform(X)))
                t["nk_tr"].append(timed(lambda: ours.transform(X)))
            med = {k: statistics.median(v) for k, v in t.items()}
            for op, sk, nk, err in (("fit", med["sk_fit"], med["nk_fit"], fit_err),
                                    ("transform", med["sk_tr"], med["nk_tr"], tr_err)):
                moved = gb if op == "fit" else 2 * gb  # read X (and write the output)
                rows.append({
                    "estimator": name, "dtype": np.dtype(dtype).name, "op": op,
                    "sklearn_s": sk, "normkit_s": nk, "speedup": sk / nk,
                    "copy_s": med["copy"], "normkit_vs_copy": nk / med["copy"],
                    "normkit_GBps": moved / nk, "max_rel_err": err,
                })
        del X
    header = ("estimator", "dtype", "op", "sklearn_s", "normkit_s", "speedup", "copy_s",
              "normkit_vs_copy", "normkit_GBps", "max_rel_err")
    print(f"X = {args.rows:,} x {args.cols}, numba threads = {args.threads}, median of {args.repeats}")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        cells = [r[h] if isinstance(r[h], str) else (f"{r[h]:.2e}" if h == "max_rel_err" else f"{r[h]:.3f}")
                 for h in header]
        print("| " + " | ".join(cells) + " |")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=header)
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
