"""Column helpers shared by the scalers and their Dask path: which columns are numeric,
where each column's statistics are shifted to, whether an input is a Dask collection, and
the check of the row weights."""

from __future__ import annotations

import numpy as np

#: rows scanned for each feature's first finite value (the shift); 0 beyond that
SHIFT_SCAN_ROWS = 4096


def is_dask(X) -> bool:
    return callable(getattr(X, "__dask_graph__", None))


def non_numeric_columns(X):
    """Names of the non-numeric columns of a pandas or polars frame, else ``[]``."""
    dtypes = getattr(X, "dtypes", None)
    columns = getattr(X, "columns", None)
    if dtypes is None or columns is None:
        return []
    names = []
    for name, dt in zip(columns, list(dtypes)):
        is_numeric = getattr(dt, "is_numeric", None)
        if callable(is_numeric):  # polars
            ok = is_numeric()
        else:
            try:
                ok = np.dtype(dt).kind in "biuf"
            except TypeError:  # pandas extension dtypes
                ok = getattr(dt, "_is_numeric", False)
        if not ok:
            names.append(str(name))
    return names


def first_finite(X):
    """Each column's first finite value among the first rows (float64; 0 where none)."""
    n, p = X.shape
    shift = np.zeros(p)
    todo = np.arange(p)
    for b0 in range(0, min(n, SHIFT_SCAN_ROWS), 256):
        blk = np.asarray(X[b0:b0 + 256][:, todo], dtype=np.float64)
        ok = np.isfinite(blk)
        found = ok.any(axis=0)
        rows = ok.argmax(axis=0)
        shift[todo[found]] = blk[rows[found], np.flatnonzero(found)]
        todo = todo[~found]
        if not todo.size:
            break
    return shift


def check_weights(w):
    """``w`` as float64, refused with a ValueError where a weight is NaN, infinite or
    negative. The moments take the weights as counts: a row of weight w counts w times. A
    negative weight is no count (it can make a variance negative), and a NaN or infinite
    one no number to count with. scikit-learn 1.9 refuses NaN and infinity in
    ``sample_weight`` and takes negative weights into its sums."""
    w = np.asarray(w, dtype=np.float64)
    bad = ~np.isfinite(w)
    if bad.any():
        raise ValueError(f"sample_weight holds {int(bad.sum())} NaN or infinite value(s) (the "
                         f"first at row {int(np.argmax(bad))}: {w[bad][0]}); every weight must "
                         "be a finite number >= 0.")
    if (w < 0).any():
        neg = w < 0
        raise ValueError(f"sample_weight holds {int(neg.sum())} negative value(s) (the smallest "
                         f"{float(w.min())}, at row {int(np.argmin(w))}); StandardScaler counts a row "
                         "of weight w as w samples, so every weight must be >= 0. Use 0 to "
                         "leave a row out.")
    return w
