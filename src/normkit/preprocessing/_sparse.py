"""StandardScaler on SciPy sparse matrices (CSR and CSC, ``*_matrix`` or ``*_array``):
scaling without centering, which keeps every zero a zero.

A column's statistics are those of its stored values and of its implicit zeros, merged
with the Chan rule of ``normkit.stats``: the stored values' moments by column
(``_kernels.group_moments``, NaN ignored), then ``z`` zeros, whose mean relative to the
shift is ``-shift`` and whose m2 is 0. The map divides (``transform``) or multiplies
(``inverse_transform``) each stored value by its column's ``scale_``, in float64, rounded
once to the input's dtype; the output is CSR, as scikit-learn's.
"""

from __future__ import annotations

import numpy as np
from scipy import sparse

from normkit.preprocessing import _kernels
from normkit.stats import Moments

__all__ = ["issparse", "refuse_centering", "column_moments", "scale_columns"]

issparse = sparse.issparse


def refuse_centering(est, where):
    raise ValueError(
        f"{type(est).__name__} cannot center a sparse matrix in {where}: subtracting the mean "
        "would turn every zero into a stored value. Pass with_mean=False (scaling keeps the "
        "zeros), or X.toarray() if the dense matrix fits in memory.")


def _columns(X):
    """The column of each stored value of a CSR or CSC ``X``."""
    if X.format == "csr":
        return X.indices
    return np.repeat(np.arange(X.shape[1]), np.diff(X.indptr))


def _rows(X):
    """The row of each stored value of a CSR or CSC ``X``."""
    if X.format == "csc":
        return X.indices
    return np.repeat(np.arange(X.shape[0]), np.diff(X.indptr))


def column_moments(X, shift, weights=None) -> Moments:
    """Moments of each column of the sparse ``X`` (CSR or CSC) relative to ``shift``,
    implicit zeros included, NaN ignored; ``weights`` (one per row) weights each row."""
    n, p = X.shape
    if not X.has_canonical_format:            # duplicate entries: summed, on a copy
        X = X.copy()
        X.sum_duplicates()
    cols = _columns(X)
    w = None if weights is None else np.asarray(weights, np.float64)[_rows(X)]
    # each row holds in each column a stored value (NaN ones not counted) or a zero
    stored, held = _kernels.group_moments(X.data, cols, p, shift, w)
    if weights is None:
        zeros = (n - held).astype(np.float64)
    else:
        zeros = np.maximum(np.sum(weights) - np.bincount(cols, w, minlength=p), 0.0)
        zeros[held == n] = 0.0
    return stored.merge(Moments(zeros, -np.asarray(shift, np.float64), np.zeros(p), shift))


def scale_columns(X, scale, inverse, copy):
    """``X`` (CSR or CSC) with each stored value divided by its column's ``scale`` (times
    it where ``inverse``), as CSR; a copy unless ``copy`` is False and ``X`` is CSR already."""
    X = X.tocsr(copy=copy) if X.format == "csr" else X.tocsr()
    if scale is None:
        return X
    factor = np.take(np.asarray(scale, np.float64), X.indices)
    # in float64, rounded once to X's dtype (float64 data: in place, no temporary)
    out = X.data if X.data.dtype == np.float64 else None
    values = np.multiply(X.data, factor, out=out) if inverse else \
        np.divide(X.data, factor, out=out)
    if out is None:
        X.data[...] = values
    return X
