"""Dask integration: fit normkit's scalers on Dask arrays and DataFrames in one pass.

Fitting is the map-reduce the statistics core was built for: every block (a row-chunk of
the array, or a partition of the DataFrame) computes its partial statistics where it lives
-- ``Moments`` for StandardScaler, ``Range`` plus a row count for MinMaxScaler -- and the
partials are merged by ``normkit.stats.merge_all`` (a pairwise Chan tree, as everywhere). Only
those small per-feature vectors travel; the data is read once. Transforms are lazy:
``map_blocks`` / ``map_partitions`` with the fitted scaler.

You do not call this module directly: ``StandardScaler().fit(dask_array)`` and
``scaler.transform(dask_dataframe)`` dispatch here, and the estimator merges what
``fit_moments`` / ``fit_range`` return into its own statistics. Requires the extra ``dask``.
"""

from __future__ import annotations

import numpy as np

import dask
import dask.array as da

from normkit.preprocessing import _kernels
from normkit.preprocessing._columns import check_weights, first_finite, non_numeric_columns
from normkit.stats import merge_all

__all__ = ["fit_moments", "fit_range", "transform"]


def _is_frame(X) -> bool:
    return hasattr(X, "columns") and hasattr(X, "map_partitions")


def _float_block(block):
    """A block or partition as a 2-D float32/float64 ndarray (float32 kept as is)."""
    arr = block.to_numpy() if hasattr(block, "to_numpy") else np.asarray(block)
    if arr.dtype not in (np.float32, np.float64):
        arr = arr.astype(np.float64)
    # row-major blocks: the kernels' fast layout, and one compiled signature on every worker
    return np.ascontiguousarray(arr)


def _block_moments(block, weights):
    X = _float_block(block)
    w = None if weights is None else check_weights(weights)
    return _kernels.column_moments(X, first_finite(X), w)


def _block_range(block):
    X = _float_block(block)
    return _kernels.column_range(X), X.shape[0]


def _blocks(est, X):
    """Check the collection's columns; return ``(delayed blocks, n_features, names)``."""

    if _is_frame(X):
        bad = non_numeric_columns(X._meta)
        if bad:
            raise ValueError(
                f"{type(est).__name__} needs numeric input (non-numeric columns: {bad}). Select the "
                "numeric columns first, e.g. ddf[[...numeric columns...]] or ddf.select_dtypes('number')."
            )
        names = [c for c in X.columns]
        return list(X.to_delayed()), len(names), names
    if X.ndim != 2:
        raise ValueError(f"Expected a 2-D Dask array (samples x features), got {X.ndim} dimension(s); "
                         "reshape it, e.g. X.reshape(-1, 1) for a single feature.")
    if X.dtype.kind not in "biuf":
        raise ValueError(f"{type(est).__name__} needs numeric input; the Dask array has dtype {X.dtype}.")
    X = X.rechunk({1: -1})  # whole rows per block: every block sees every feature
    return list(X.to_delayed().ravel()), X.shape[1], None


def _check_features(est, n_features, names, reset):
    if reset:
        est.n_features_in_ = n_features
        if names is not None and all(isinstance(c, str) for c in names):
            est.feature_names_in_ = np.asarray(names, dtype=object)
        elif hasattr(est, "feature_names_in_"):
            del est.feature_names_in_
        return
    if n_features != est.n_features_in_:
        raise ValueError(f"X has {n_features} features, but {type(est).__name__} is expecting "
                         f"{est.n_features_in_} features as input.")
    fitted = getattr(est, "feature_names_in_", None)
    if fitted is not None and names is not None and list(fitted) != [str(c) for c in names]:
        raise ValueError(f"The Dask collection's columns {list(names)} differ from the fitted feature "
                         f"names {list(fitted)}; select the columns in the fitted order.")


def _start(est, X):
    blocks, n_features, names = _blocks(est, X)
    _check_features(est, n_features, names, reset=not hasattr(est, "n_samples_seen_"))
    return blocks


def _range_and_rows(parts):
    return merge_all([r for r, _ in parts]), sum(n for _, n in parts)


def fit_range(est, X):
    """``(Range, n_rows)`` of the Dask collection ``X`` (one pass over X), for MinMaxScaler."""
    parts = [dask.delayed(_block_range, pure=True)(b) for b in _start(est, X)]
    return dask.compute(dask.delayed(_range_and_rows, pure=True)(parts))[0]


def fit_moments(est, X, sample_weight=None):
    """``Moments`` of the Dask collection ``X`` (one pass over X), for StandardScaler."""
    blocks = _start(est, X)
    weights = [None] * len(blocks)
    if sample_weight is not None:
        w = sample_weight
        if _is_frame(X):
            w = list(w.to_delayed()) if hasattr(w, "to_delayed") else None
            if w is None or len(w) != len(blocks):
                raise ValueError("With a Dask DataFrame, pass sample_weight as a Dask Series with the "
                                 "same partitions (e.g. a column of the same DataFrame).")
            weights = w
        else:
            if not hasattr(w, "rechunk"):
                w = da.from_array(np.asarray(w, dtype=np.float64), chunks=X.chunks[0])
            if w.shape != (X.shape[0],):
                raise ValueError(f"sample_weight has shape {w.shape}; expected ({X.shape[0]},), one "
                                 "weight per row of X.")
            weights = list(w.rechunk((X.chunks[0],)).to_delayed().ravel())
    parts = [dask.delayed(_block_moments, pure=True)(b, w) for b, w in zip(blocks, weights)]
    return dask.compute(dask.delayed(merge_all, pure=True)(parts))[0]


def _transform_array(block, est, inverse):
    X = _float_block(block)
    return est._apply(X, np.empty_like(X), inverse=inverse)


def _transform_frame(part, est, inverse):
    import pandas as pd

    Z = _transform_array(part, est, inverse)
    return pd.DataFrame(Z, index=part.index, columns=part.columns)


def transform(est, X, inverse):
    """Lazy (inverse) transform of a Dask array or DataFrame with the fitted ``est``."""

    if _is_frame(X):
        bad = non_numeric_columns(X._meta)
        if bad:
            raise ValueError(f"{type(est).__name__} needs numeric input (non-numeric columns: {bad}); "
                             "select the fitted feature columns first.")
        _check_features(est, len(X.columns), list(X.columns), reset=False)
        meta = _transform_frame(X._meta, est, inverse)
        return X.map_partitions(_transform_frame, est, inverse, meta=meta)
    if X.ndim != 2:
        raise ValueError(f"Expected a 2-D Dask array (samples x features), got {X.ndim} dimension(s).")
    _check_features(est, X.shape[1], None, reset=False)
    X = X.rechunk({1: -1})
    dtype = X.dtype if X.dtype in (np.float32, np.float64) else np.dtype(np.float64)
    return X.map_blocks(_transform_array, est, inverse, dtype=dtype)
