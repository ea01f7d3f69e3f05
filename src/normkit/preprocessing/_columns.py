"""Column helpers shared by the scalers and their Dask path: which columns are numeric,
where each column's statistics are shifted to, whether an input is a Dask collection."""

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
