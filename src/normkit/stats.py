"""Mergeable statistics: the one place that knows how to combine partial statistics.

Every normalization in normkit needs, per group of numbers, a count, a mean and a spread
(or a minimum and a maximum for range scaling). Those statistics are often computed in
pieces -- chunks of a file, partitions of a Dask array, the ranks of a distributed job,
successive mini-batches -- and then combined. This module holds the combination rules.

Moments
    ``(count, mean, m2)`` with ``m2 = sum((x - mean)**2)``. Two sets merge exactly with
    the pairwise rule of Chan, Golub & LeVeque (1979)::

        delta   = mean_new - mean_old
        count   = count_old + count_new
        mean    = mean_old + delta * count_new / count
        m2      = m2_old + m2_new + delta**2 * count_old * count_new / count

    The biased variance is ``m2 / count``; the unbiased one ``m2 / (count - 1)``.
    ``E[x**2] - E[x]**2`` is never used: it cancels catastrophically when the mean is large
    compared with the spread.

    A ``shift`` is kept beside the mean: statistics are accumulated for ``x - shift`` and the
    public mean is ``shift + mean``. With the shift set to a value of the data (the first
    row), columns offset by 1e15 keep their small deltas exact through every merge.

Range
    ``(min, max)``; merging takes the element-wise min and max, ignoring NaN.

The merge functions use only arithmetic operators, so they work unchanged on NumPy arrays,
Python floats and torch tensors (SyncBatchNorm merges per-rank torch statistics with them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Moments", "Range", "merge_moments"]


def merge_moments(count_old, mean_old, m2_old, count_new, mean_new, m2_new):
    """Chan/Golub/LeVeque merge of two partial ``(count, mean, m2)`` triples.

    Works on anything with arithmetic operators (NumPy arrays, floats, torch tensors).
    Groups with ``count == 0`` on either side merge to the other side exactly; the
    division guard only avoids 0/0 when both sides are empty.
    """
    count = count_old + count_new
    # both sides empty -> keep zeros; the guard is a no-op wherever count > 0
    safe = count + (count == 0)
    delta = mean_new - mean_old
    frac_new = count_new / safe
    mean = mean_old + delta * frac_new
    m2 = m2_old + m2_new + delta * delta * count_old * frac_new
    return count, mean, m2


@dataclass(frozen=True)
class Moments:
    """Count, mean and sum of squared deviations of a set of groups, mergeable.

    Attributes
    ----------
    count : array of float64
        Number (or total weight) of the values seen, per group.
    mean : array
        Mean of ``x - shift`` per group.
    m2 : array
        ``sum(w * (x - mean)**2)`` per group.
    shift : array or 0.0
        Reference value subtracted before accumulating.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.arange(10.0).reshape(5, 2) + 1e15
    >>> a = Moments.from_array(x[:2]).merge(Moments.from_array(x[2:]))
    >>> a.variance().tolist()
    [8.0, 8.0]
    """

    count: Any
    mean: Any
    m2: Any
    shift: Any = 0.0

    @classmethod
    def empty(cls, n_groups: int, shift=0.0) -> "Moments":
        z = np.zeros(n_groups, dtype=np.float64)
        return cls(z, z.copy(), z.copy(), shift)

    @classmethod
    def from_array(cls, x, axis=0, shift=None, weights=None) -> "Moments":
        """Two-pass moments of ``x`` along ``axis`` in float64 accumulators.

        ``shift`` defaults to the first slice of ``x`` along ``axis`` (0 where it is not
        finite). NaN values are ignored: they add neither to the count nor to the sums.
        ``weights`` (shape ``x.shape[axis]``) weights each slice.
        """
        x = np.asarray(x)
        x = np.moveaxis(x, axis, 0)
        if shift is None:
            shift = (np.where(np.isfinite(x[0]), x[0], 0.0).astype(np.float64)
                     if x.shape[0] else np.zeros(x.shape[1:], np.float64))
        shift = np.asarray(shift, dtype=np.float64)
        d = x - shift  # float64 (shift is float64); one temporary per chunk
        nan = np.isnan(d)
        has_nan = bool(nan.any())
        if has_nan:
            d = np.where(nan, 0.0, d)
        w = np.ones(x.shape[0]) if weights is None else np.asarray(weights, np.float64)
        wb = w.reshape((-1,) + (1,) * (x.ndim - 1))
        wv = np.where(nan, 0.0, wb) if has_nan else np.broadcast_to(wb, d.shape)
        count = wv.sum(axis=0)
        safe = np.where(count == 0, 1.0, count)
        mean = (wv * d).sum(axis=0) / safe
        dev = d - mean
        if has_nan:
            dev = np.where(nan, 0.0, dev)
        # corrected two-pass (Bjorck): the residual sum removes the rounding of pass one
        resid = (wv * dev).sum(axis=0)
        m2 = (wv * dev * dev).sum(axis=0) - resid * resid / safe
        mean = mean + resid / safe
        return cls(count.astype(np.float64), mean, m2, shift)

    def merge(self, other: "Moments") -> "Moments":
        """Return the moments of the union of both sets (Chan et al.).

        The result keeps this set's shift, except for groups where this set is empty:
        those take the other's shift, so an empty start (``Moments.empty``) does not
        throw away the shift that keeps large offsets exact.
        """
        shift = np.where(np.asarray(self.count) == 0, other.shift, self.shift)
        self_mean = self.mean + (self.shift - shift)
        other_mean = other.mean + (other.shift - shift)
        count, mean, m2 = merge_moments(self.count, self_mean, self.m2,
                                        other.count, other_mean, other.m2)
        return Moments(count, mean, m2, shift)

    def total_mean(self):
        """The mean of the data (``shift + mean``)."""
        return self.shift + self.mean

    def variance(self, ddof: int = 0):
        """``m2 / (count - ddof)``; NaN where that count is not positive."""
        denom = self.count - ddof
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(denom > 0, self.m2 / np.where(denom > 0, denom, 1), np.nan)


@dataclass(frozen=True)
class Range:
    """Element-wise minimum and maximum per group, mergeable; NaN is ignored."""

    min: Any
    max: Any

    @classmethod
    def from_array(cls, x, axis=0) -> "Range":
        x = np.asarray(x)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices give NaN
            return cls(np.nanmin(x, axis=axis), np.nanmax(x, axis=axis))

    def merge(self, other: "Range") -> "Range":
        return Range(np.fmin(self.min, other.min), np.fmax(self.max, other.max))
