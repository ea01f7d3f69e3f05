"""StandardScaler and MinMaxScaler: scikit-learn estimators over normkit's statistics core.

Both scalers are the "stats" and "standardize" steps of normkit's one recipe, with the
statistics reduced over samples (axis 0) and kept per feature:

* ``StandardScaler`` keeps ``Moments`` (count, shift-relative mean, m2) and maps
  ``z = (x - mean_) / scale_`` with ``scale_ = sqrt(var_)`` and the *biased* variance
  ``var_ = m2 / count`` (as scikit-learn does);
* ``MinMaxScaler`` keeps a ``Range`` (min, max) and maps ``y = x * scale_ + min_`` with
  ``scale_ = (hi - lo) / (data_max_ - data_min_)`` and ``min_ = lo - data_min_ * scale_``.

``fit`` is ``reset`` plus ``partial_fit``; every ``partial_fit`` computes the batch's
statistics in one pass (``_kernels``) and merges them with the Chan rule, so a stream of
chunks gives the statistics of the whole. Statistics are float64 whatever the input dtype;
float32 input is read in place (no float64 copy) and float32 (float16) output is produced
by one rounding of a float64 result.

Differences from scikit-learn, all on the side of accuracy:

* the mean and variance carry a per-feature shift (the feature's first finite value), so a
  column offset by 1e15 keeps its small variance exactly;
* a feature counts as constant (scale 1) when its standard deviation -- or, for
  MinMaxScaler, its range -- is within ten rounding units of its magnitude
  (``std <= 10 * eps * |mean|``). scikit-learn's bound also grows with the sample count
  because its own variance loses accuracy with it; normkit's does not;
* fitted statistics (``data_min_``, ``scale_``, ...) are float64 even for float32 input.
"""

from __future__ import annotations

import numbers

import numpy as np

try:
    from sklearn.base import BaseEstimator, OneToOneFeatureMixin, TransformerMixin
except ModuleNotFoundError as error:   # (an optional dependency)
    from normkit._extras import needs

    raise needs(error, "normkit.preprocessing") from None

from sklearn.utils.validation import _check_sample_weight, check_is_fitted, validate_data

from normkit.preprocessing import _kernels, _persist, _sparse
from normkit.preprocessing._array_api import dispatch, host
from normkit.preprocessing._columns import check_weights, first_finite, is_dask, non_numeric_columns
from normkit.stats import Moments, Range

__all__ = ["MinMaxScaler", "StandardScaler", "min_max_scale", "standard_score"]

_FLOAT_DTYPES = (np.float64, np.float32, np.float16)      # (other dtypes: float64)
_EPS = np.finfo(np.float64).eps


def _validate(est, X, *, reset, in_place=False, accept_sparse=False):
    """``validate_data`` with normkit's messages; infinity is checked later, in the kernels."""
    if not accept_sparse and _sparse.issparse(X):
        raise TypeError(
            f"{type(est).__name__} takes dense input only: shifting by each feature's minimum "
            "would turn every zero of a sparse matrix into a stored value. Scale it with "
            "StandardScaler(with_mean=False) (or scikit-learn's MaxAbsScaler), or pass "
            "X.toarray() if it fits in memory.")
    try:
        return validate_data(est, X, reset=reset, dtype=_FLOAT_DTYPES, ensure_all_finite=False,
                             force_writeable=in_place, accept_sparse=accept_sparse)
    except (TypeError, ValueError) as exc:
        text = str(exc)
        if not any(s in text for s in ("could not convert", "argument must be", "Unable to convert")):
            raise
        bad = non_numeric_columns(X)
        where = f" (non-numeric columns: {bad})" if bad else ""
        raise type(exc)(
            f"{type(est).__name__} needs numeric input{where}: {text}. Select the numeric "
            "columns first (e.g. df.select_dtypes('number') or sklearn.compose.ColumnTransformer); "
            "the `normkit scale` command passes the other columns through unchanged."
        ) from exc


def _raise_inf(est, where, n_inf=None):
    """Refuse infinity in X, with the count of values where it is known."""
    count = "" if n_inf is None else f" ({n_inf} value{'s' if n_inf != 1 else ''})"
    raise ValueError(
        f"Input X contains infinity{count} in {where}; "
        f"{type(est).__name__} ignores NaN but cannot scale infinite values. Replace them, e.g. "
        "X[np.isinf(X)] = np.nan (NaN is ignored in fit and kept in transform)."
    )


def _out_array(est, X, copy):
    """Output buffer for a transform: X itself (in place) or a new array like it."""
    if copy:
        return np.empty_like(X)
    n_inf = int(np.isinf(X).sum())  # refuse before writing anything in place
    if n_inf:
        _raise_inf(est, "transform", n_inf)
    return X


class InvalidParameterError(ValueError, TypeError):
    """A constructor parameter of a type or value the scaler cannot take (a ValueError and
    a TypeError, as scikit-learn's own)."""


class _ScalerBase(OneToOneFeatureMixin, TransformerMixin, BaseEstimator):
    """Shared plumbing: Dask dispatch, persistence, tags, the parameters' check."""

    #: the parameters that take a bool (scikit-learn's "boolean" constraint)
    _flags: tuple = ("copy",)

    def _check_params(self):
        """Refuse, at fit and at load, a parameter the scaler cannot take, as scikit-learn
        does: a flag that is not a bool (a string or a list would otherwise count as
        true)."""
        for name in self._flags:
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise InvalidParameterError(
                    f"The {name!r} parameter of {type(self).__name__} must be a bool, got "
                    f"{value!r} ({type(value).__name__}); pass True or False.")

    def save(self, path):
        """Write the fitted scaler to ``path`` as readable JSON (format version, feature names,
        statistics); the file is written to a temporary name and renamed at the end."""
        check_is_fitted(self)
        _persist.save(self, path)

    @classmethod
    def load(cls, path):
        """Read a scaler written by :meth:`save`; raises ``ValueError`` naming the problem when
        the file is corrupt, of another format version, or holds another kind of scaler."""
        return _persist.load(path, SCALERS, expected=cls)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.allow_nan = True
        tags.transformer_tags.preserves_dtype = ["float64", "float32", "float16"]
        tags.array_api_support = True                   # (_array_api)
        return tags


class StandardScaler(_ScalerBase):
    r"""Standardize features: remove the mean and scale to unit variance.

    .. math::

        z = \frac{x - \mu}{\sigma}, \qquad
        \mu = \frac{\sum_i w_i x_i}{\sum_i w_i}, \qquad
        \sigma^2 = \frac{\sum_i w_i (x_i - \mu)^2}{\sum_i w_i}

    per feature, with the *biased* variance (as scikit-learn). A drop-in for
    ``sklearn.preprocessing.StandardScaler``: same constructor, defaults, fitted attributes
    and errors, on arrays, frames and SciPy sparse matrices (CSR/CSC, ``with_mean=False``:
    scaled, never centered; CSR out); ``partial_fit`` merges batches exactly (Chan et al.),
    NaN is ignored in fit and kept in transform, and a feature whose standard deviation is
    within rounding of zero gets ``scale_ = 1`` (never a division by ~0).

    Parameters
    ----------
    copy : bool, default=True
        If False, transform in place when the input is already a float ndarray.
    with_mean : bool, default=True
        Center the data before scaling.
    with_std : bool, default=True
        Scale the data to unit variance.

    Attributes
    ----------
    mean_ : ndarray of shape (n_features,) or None
        Per-feature mean (float64); None when ``with_mean=False`` and ``with_std=False``.
    var_ : ndarray of shape (n_features,) or None
        Per-feature biased variance (float64); None when ``with_std=False``.
    scale_ : ndarray of shape (n_features,) or None
        ``sqrt(var_)``, 1 for constant features; None when ``with_std=False``.
    n_samples_seen_ : int or ndarray of shape (n_features,)
        Samples (or total weight) seen per feature, an int when equal for all features.
    n_features_in_ : int
    feature_names_in_ : ndarray of shape (n_features_in_,)
        Defined when ``X`` had string column names.

    Examples
    --------
    >>> import numpy as np
    >>> from normkit.preprocessing import StandardScaler
    >>> X = np.array([[0.0, 1e15], [2.0, 1e15 + 2.0]])
    >>> s = StandardScaler().fit(X)
    >>> s.var_.tolist(), s.transform(X).tolist()
    ([1.0, 1.0], [[-1.0, -1.0], [1.0, 1.0]])
    """

    _flags = ("copy", "with_mean", "with_std")

    def __init__(self, *, copy=True, with_mean=True, with_std=True):
        self.copy = copy
        self.with_mean = with_mean
        self.with_std = with_std

    def _reset(self):
        for name in ("n_samples_seen_", "mean_", "var_", "scale_", "_moments", "_weighted"):
            if hasattr(self, name):
                delattr(self, name)

    @dispatch
    def fit(self, X, y=None, sample_weight=None):
        """Compute the mean and standard deviation of ``X`` (array, DataFrame or Dask
        collection); ``sample_weight`` weights each row."""
        self._reset()
        return self.partial_fit(X, y, sample_weight)

    @dispatch
    def partial_fit(self, X, y=None, sample_weight=None):
        """Merge the statistics of the batch ``X`` into those seen so far."""
        self._check_params()
        if is_dask(X):
            from normkit.preprocessing import _dask

            moments = _dask.fit_moments(self, X, sample_weight)
            old = getattr(self, "_moments", None)
            if old is not None:  # continue in the shift of the statistics seen so far
                moments = moments.with_shift(np.where(old.count > 0, old.shift, moments.shift))
            self._update_moments(moments, sample_weight is not None, "fit")
            return self
        first = not hasattr(self, "n_samples_seen_")
        X = _validate(self, X, reset=first, accept_sparse=("csr", "csc"))
        if self.with_mean and _sparse.issparse(X):
            _sparse.refuse_centering(self, "fit")
        weights = None
        if sample_weight is not None:
            weights = check_weights(_check_sample_weight(sample_weight, X, dtype=np.float64))
        self._update_moments(self._batch_moments(X, weights), weights is not None, "fit")
        return self

    # -- statistics --------------------------------------------------------------------
    def _batch_moments(self, X, weights):
        """Moments of one validated batch, in the shift of the statistics seen so far (a
        sparse one's first: 0, its implicit zeros' value)."""
        sparse = _sparse.issparse(X)
        shift = np.zeros(X.shape[1]) if sparse else first_finite(X)
        old = getattr(self, "_moments", None)
        if old is not None:
            shift = np.where(old.count > 0, old.shift, shift)
        return (_sparse if sparse else _kernels).column_moments(X, shift, weights)

    def _update_moments(self, new: Moments, weighted: bool, where: str):
        """Check a batch's moments for infinity, merge them in, and set the attributes."""
        mean_ok = np.isfinite(new.mean)
        bad = (new.count > 0) & ~(mean_ok & np.isfinite(new.m2))
        if (bad & mean_ok).any():       # finite values whose squares overflow
            raise ValueError(
                f"The variance of features {np.flatnonzero(bad & mean_ok).tolist()} overflows "
                f"float64 in {where}: their values reach beyond about 1e154, whose squares "
                "pass float64's largest number, 1.8e308. Divide X by a power of ten first.")
        if bad.any():
            _raise_inf(self, f"{where} (features {np.flatnonzero(bad).tolist()})")
        old = getattr(self, "_moments", None)
        if old is None:
            moments = new
        else:  # same shift where the old side has data; empty features adopt the new one
            old = Moments(old.count, old.mean, old.m2, new.shift)
            moments = old.merge(new)
        self._moments = moments
        self._weighted = bool(getattr(self, "_weighted", False) or weighted)
        self._set_attributes()

    def _set_attributes(self):
        mo = self._moments
        count = np.asarray(mo.count, dtype=np.float64)
        # scikit-learn reports float counts once moments are computed, int counts otherwise
        computed = self.with_mean or self.with_std or self._weighted
        seen = count.copy() if computed else count.astype(np.int64)
        self.n_samples_seen_ = seen[0] if seen.min() == seen.max() else seen
        if not (self.with_mean or self.with_std):
            self.mean_ = self.var_ = self.scale_ = None
            return
        with np.errstate(invalid="ignore"):
            self.mean_ = np.where(count > 0, mo.total_mean(), np.nan)
        if self.with_std:
            self.var_ = np.asarray(mo.variance(0), dtype=np.float64)
            constant = self.var_ <= (10 * _EPS * np.abs(self.mean_)) ** 2
            self.scale_ = np.where(constant, 1.0, np.sqrt(self.var_))
        else:
            self.var_ = self.scale_ = None

    # -- maps --------------------------------------------------------------------------
    def _center_scale(self):
        sub = host(self.mean_) if self.with_mean else 0.0
        div = host(self.scale_) if self.with_std else 1.0
        return sub, div

    @dispatch
    def transform(self, X, copy=None):
        """``(X - mean_) / scale_``; NaN stays NaN. Dask collections transform lazily."""
        check_is_fitted(self)
        if is_dask(X):
            from normkit.preprocessing import _dask

            return _dask.transform(self, X, inverse=False)
        copy = self.copy if copy is None else copy
        X = _validate(self, X, reset=False, in_place=not copy, accept_sparse="csr")
        if _sparse.issparse(X):
            return self._scale_sparse(X, copy, inverse=False)
        return self._apply(X, _out_array(self, X, copy), inverse=False)

    @dispatch
    def inverse_transform(self, X, copy=None):
        """``X * scale_ + mean_``: back to the original units."""
        check_is_fitted(self)
        if is_dask(X):
            from normkit.preprocessing import _dask

            return _dask.transform(self, X, inverse=True)
        copy = self.copy if copy is None else copy
        X = _validate(self, X, reset=False, in_place=not copy, accept_sparse="csr")
        if _sparse.issparse(X):
            return self._scale_sparse(X, copy, inverse=True)
        return self._apply(X, _out_array(self, X, copy), inverse=True)

    def _scale_sparse(self, X, copy, inverse):
        """The map on a validated CSR matrix: scaled (in place unless ``copy``), never
        centered."""
        where = "inverse_transform" if inverse else "transform"
        if self.with_mean:
            _sparse.refuse_centering(self, where)
        n_inf = int(np.isinf(X.data).sum())
        if n_inf:
            _raise_inf(self, where, n_inf)
        return _sparse.scale_columns(X, host(self.scale_), inverse, copy)

    def _apply(self, X, out, inverse):
        """The map on a validated 2-D float array, written into ``out``."""
        sub, div = self._center_scale()
        if inverse:
            n_inf = _kernels.multiply_add(X, div, sub, out)
        else:
            n_inf = _kernels.subtract_divide(X, sub, div, out)
        if n_inf:
            _raise_inf(self, "inverse_transform" if inverse else "transform", n_inf)
        return out

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.sparse = not self.with_mean     # (centering a sparse X is refused)
        return tags

    # -- persistence -------------------------------------------------------------------
    def _get_state(self):
        mo = self._moments
        return {
            "n_samples_seen_": np.asarray(mo.count, dtype=np.float64),
            "mean_": host(self.mean_), "var_": host(self.var_), "scale_": host(self.scale_),
            "weighted": self._weighted,
            "moments": {"count": mo.count, "shift": mo.shift, "mean": mo.mean, "m2": mo.m2},
        }

    def _set_state(self, state, check):
        m = state["moments"]
        self._moments = Moments(check("moments.count", m["count"]), check("moments.mean", m["mean"]),
                                check("moments.m2", m["m2"]), check("moments.shift", m["shift"]))
        if not isinstance(state["weighted"], bool):
            raise ValueError(f"state.weighted must be true or false, got {state['weighted']!r}")
        self._weighted = state["weighted"]
        self._set_attributes()
        return {"mean_": self.mean_, "var_": self.var_, "scale_": self.scale_,
                "n_samples_seen_": self._moments.count}


class MinMaxScaler(_ScalerBase):
    r"""Scale each feature to ``feature_range`` by its minimum and maximum.

    .. math::

        y = x \cdot s + m, \qquad s = \frac{hi - lo}{\max x - \min x}, \qquad
        m = lo - s \min x

    A drop-in for ``sklearn.preprocessing.MinMaxScaler``: same constructor, defaults,
    fitted attributes and errors. NaN is ignored in fit and kept in transform; a feature whose
    range is within rounding of zero gets ``data_range`` treated as 1.

    Parameters
    ----------
    feature_range : tuple (lo, hi), default=(0, 1)
        Desired range of the transformed data; ``lo < hi``.
    copy : bool, default=True
        If False, transform in place when the input is already a float ndarray.
    clip : bool, default=False
        Clip transformed values of held-out data to ``feature_range``.

    Attributes
    ----------
    min_ : ndarray of shape (n_features,)
        Per-feature offset ``lo - data_min_ * scale_``.
    scale_ : ndarray of shape (n_features,)
        Per-feature factor ``(hi - lo) / data_range_``.
    data_min_, data_max_, data_range_ : ndarray of shape (n_features,)
        Per-feature minimum, maximum and their difference (float64, NaN ignored).
    n_samples_seen_ : int
    n_features_in_ : int
    feature_names_in_ : ndarray of shape (n_features_in_,)

    Examples
    --------
    >>> import numpy as np
    >>> from normkit.preprocessing import MinMaxScaler
    >>> MinMaxScaler().fit_transform(np.array([[1.0], [3.0], [np.nan]])).ravel().tolist()
    [0.0, 1.0, nan]
    """

    _flags = ("copy", "clip")

    def __init__(self, feature_range=(0, 1), *, copy=True, clip=False):
        self.feature_range = feature_range
        self.copy = copy
        self.clip = clip

    def _reset(self):
        for name in ("n_samples_seen_", "data_min_", "data_max_", "data_range_", "scale_", "min_"):
            if hasattr(self, name):
                delattr(self, name)

    def _check_params(self):
        super()._check_params()
        self._range_bounds()

    def _range_bounds(self):
        fr = self.feature_range
        ok = (isinstance(fr, (tuple, list)) and len(fr) == 2
              and all(isinstance(v, numbers.Real) and np.isfinite(v) for v in fr))
        if not ok:
            raise ValueError(
                f"feature_range must be a tuple (lo, hi) of two finite numbers; got {fr!r}. "
                "Pass e.g. feature_range=(0, 1)."
            )
        lo, hi = float(fr[0]), float(fr[1])
        if not lo < hi:
            raise ValueError(
                f"Minimum of desired feature range must be smaller than maximum. Got {fr!r}; "
                + ("swap the bounds." if lo > hi else "give two different bounds, e.g. (0, 1).")
            )
        return lo, hi

    @dispatch
    def fit(self, X, y=None):
        """Compute the per-feature minimum and maximum of ``X``."""
        self._reset()
        return self.partial_fit(X, y)

    @dispatch
    def partial_fit(self, X, y=None):
        """Merge the minimum and maximum of the batch ``X`` into those seen so far."""
        self._check_params()
        if is_dask(X):
            from normkit.preprocessing import _dask

            self._update_range(*_dask.fit_range(self, X), "fit")
            return self
        first = not hasattr(self, "n_samples_seen_")
        X = _validate(self, X, reset=first)
        self._update_range(_kernels.column_range(X), X.shape[0], "fit")
        return self

    def _update_range(self, new: Range, n_rows: int, where: str):
        empty = np.isnan(new.min)
        bad = ~empty & ~(np.isfinite(new.min) & np.isfinite(new.max))
        if bad.any():
            _raise_inf(self, f"{where} (features {np.flatnonzero(bad).tolist()})")
        if hasattr(self, "n_samples_seen_"):
            new = Range(host(self.data_min_), host(self.data_max_)).merge(new)
            n_rows = n_rows + self.n_samples_seen_
        self.n_samples_seen_ = int(n_rows)
        self.data_min_ = np.asarray(new.min, dtype=np.float64)
        self.data_max_ = np.asarray(new.max, dtype=np.float64)
        self._set_attributes()

    def _set_attributes(self):
        lo, hi = self._range_bounds()
        self.data_range_ = self.data_max_ - self.data_min_
        magnitude = np.fmax(np.abs(self.data_min_), np.abs(self.data_max_))
        constant = self.data_range_ <= 10 * _EPS * magnitude
        self.scale_ = (hi - lo) / np.where(constant, 1.0, self.data_range_)
        self.min_ = lo - self.data_min_ * self.scale_

    @dispatch
    def transform(self, X):
        """``X * scale_ + min_`` (clipped to ``feature_range`` when ``clip``)."""
        check_is_fitted(self)
        if is_dask(X):
            from normkit.preprocessing import _dask

            return _dask.transform(self, X, inverse=False)
        X = _validate(self, X, reset=False, in_place=not self.copy)
        return self._apply(X, _out_array(self, X, self.copy), inverse=False)

    @dispatch
    def inverse_transform(self, X):
        """``(X - min_) / scale_``: back to the original units."""
        check_is_fitted(self)
        if is_dask(X):
            from normkit.preprocessing import _dask

            return _dask.transform(self, X, inverse=True)
        X = _validate(self, X, reset=False, in_place=not self.copy)
        return self._apply(X, _out_array(self, X, self.copy), inverse=True)

    def _apply(self, X, out, inverse):
        """The map on a validated 2-D float array, written into ``out``."""
        if inverse:
            n_inf = _kernels.subtract_divide(X, host(self.min_), host(self.scale_), out)
        else:
            clip = self._range_bounds() if self.clip else None
            n_inf = _kernels.multiply_add(X, host(self.scale_), host(self.min_), out, clip=clip)
        if n_inf:
            _raise_inf(self, "inverse_transform" if inverse else "transform", n_inf)
        return out

    def _get_state(self):
        return {
            "n_samples_seen_": self.n_samples_seen_,
            "data_min_": host(self.data_min_), "data_max_": host(self.data_max_),
            "scale_": host(self.scale_), "min_": host(self.min_),
        }

    def _set_state(self, state, check):
        n = state["n_samples_seen_"]
        if type(n) is not int or n < 1:
            raise ValueError(f"state.n_samples_seen_ must be a count of rows, got {n!r}")
        self.n_samples_seen_ = n
        self.data_min_ = check("data_min_", state["data_min_"])
        self.data_max_ = check("data_max_", state["data_max_"])
        self._set_attributes()
        return {"scale_": self.scale_, "min_": self.min_}


def _along(X, axis, scaler):
    if axis not in (0, 1):
        raise ValueError(f"axis must be 0 (scale each column) or 1 (each row); got {axis!r}.")
    if _sparse.issparse(X):
        raise TypeError(
            f"the function twin of {type(scaler).__name__} shifts each feature (by its mean "
            "or minimum), which would fill in a sparse matrix's zeros: it takes dense input. "
            "Scale a sparse X without shifting: StandardScaler(with_mean=False).fit_transform(X)")
    X = np.asarray(X)
    if X.ndim == 1:
        return scaler.fit_transform(X.reshape(-1, 1)).ravel()
    if axis == 0:
        return scaler.fit_transform(X)
    return scaler.fit_transform(X.T).T


def standard_score(X, axis=0):
    """Standard scores of ``X`` along ``axis``: ``(x - mean) / std`` per column (axis=0) or
    per row (axis=1), NaN ignored, the biased std; the function twin of
    :class:`StandardScaler` (``StandardScaler().fit_transform(X)`` for axis 0).

    >>> standard_score([[1.0, 2.0], [3.0, 2.0]]).tolist()
    [[-1.0, 0.0], [1.0, 0.0]]
    """
    return _along(X, axis, StandardScaler())


def min_max_scale(X, feature_range=(0, 1), axis=0):
    """Scale ``X`` to ``feature_range`` along ``axis`` by its minimum and maximum; the
    function twin of :class:`MinMaxScaler`.

    >>> min_max_scale([[1.0, 5.0], [3.0, 7.0]], feature_range=(-1, 1)).tolist()
    [[-1.0, -1.0], [1.0, 1.0]]
    """
    return _along(X, axis, MinMaxScaler(feature_range=feature_range))


#: the estimators a scaler file may hold, by the name stored in it
SCALERS = {"StandardScaler": StandardScaler, "MinMaxScaler": MinMaxScaler}
