"""StandardScaler(with_mean=False) on a SciPy CSR matrix, normkit against scikit-learn:
fit and transform, interleaved repeats, medians; normkit's fit also on its NumPy path
(``_kernels.USE_NUMBA = False``). A 200,000 x 20,000 matrix with 4 M random stored values
by default. docs/scalers.md ("Sparse matrices") quotes it.

    PYTHONPATH=src python benchmarks/bench_sparse_scaler.py [--rows R] [--cols C] [--nnz N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import scipy.sparse as sp
from sklearn.preprocessing import StandardScaler as SkScaler

from normkit.preprocessing import StandardScaler, _kernels


def _time(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--cols", type=int, default=20_000)
    ap.add_argument("--nnz", type=int, default=4_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    X = sp.csr_matrix((rng.random(args.nnz), (rng.integers(0, args.rows, args.nnz),
                                              rng.integers(0, args.cols, args.nnz))),
                      shape=(args.rows, args.cols))
    X.sum_duplicates()
    ours, theirs = StandardScaler(with_mean=False), SkScaler(with_mean=False)
    np.testing.assert_allclose(ours.fit(X).var_, theirs.fit(X).var_, rtol=1e-12)

    def numpy_fit():
        _kernels.USE_NUMBA, before = False, _kernels.USE_NUMBA
        try:
            StandardScaler(with_mean=False).fit(X)
        finally:
            _kernels.USE_NUMBA = before
    cases = {"fit normkit": lambda: ours.fit(X), "fit scikit-learn": lambda: theirs.fit(X),
             "fit normkit (NumPy path)": numpy_fit,
             "transform normkit": lambda: ours.transform(X),
             "transform scikit-learn": lambda: theirs.transform(X)}
    times = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            times[name].append(_time(fn))
    print(f"{X.shape[0]} x {X.shape[1]}, {X.nnz} stored values, median of {args.repeats}")
    for name, ts in times.items():
        print(f"  {name:26s} {statistics.median(ts) * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
