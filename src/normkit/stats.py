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

__all__ = ["Moments", "Range", "merge_moments", "merge_rows", "merge_all"]


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


def merge_rows(count, mean, m2):
    """Merge moments stacked along dim 0 into the moments of their union.

    ``count`` has shape ``(P, 1)`` or ``(P, G)``, ``mean`` and ``m2`` ``(P, G)``: ``P``
    partial statistics (chunks, threads, ranks) of ``G`` groups. Merged pairwise in a tree
    of ``ceil(log2 P)`` vectorized steps (row ``i`` with row ``i + P // 2``), so rounding
    grows with ``log P``, not ``P``; an odd row out of a step is carried and merged at the
    end. Only slicing and arithmetic: NumPy arrays and torch tensors alike. Returns the
    rows ``(count[0], mean[0], m2[0])`` of the union.
    """
    carried = []
    while count.shape[0] > 1:
        half = count.shape[0] // 2
        if count.shape[0] % 2:
            carried.append((count[-1:], mean[-1:], m2[-1:]))
        lo, hi = slice(0, half), slice(half, 2 * half)
        count, mean, m2 = merge_moments(count[lo], mean[lo], m2[lo], count[hi], mean[hi], m2[hi])
    for part in reversed(carried):
        count, mean, m2 = merge_moments(count, mean, m2, *part)
    return count[0], mean[0], m2[0]


def merge_all(parts):
    """Merge a non-empty list of ``Moments`` (of the same groups) or of ``Range`` into one.

    Moments are first brought to a common shift (the first part's, per group, where it has
    data), then merged by ``merge_rows``; ranges take the NaN-ignoring min and max.
    """
    first = parts[0]
    if isinstance(first, Range):
        return Range(np.fmin.reduce([p.min for p in parts]), np.fmax.reduce([p.max for p in parts]))
    shift, seen = first.shift, np.asarray(first.count) > 0
    for p in parts[1:]:                     # a group empty so far takes the next part's shift
        shift = np.where(seen, shift, p.shift)
        seen = seen | (np.asarray(p.count) > 0)
    parts = [p.with_shift(shift) for p in parts]
    shape = np.shape(first.mean)
    count, mean, m2 = (np.stack([np.broadcast_to(np.asarray(getattr(p, f), dtype=np.float64), shape)
                                 for p in parts]) for f in ("count", "mean", "m2"))
    return Moments(*merge_rows(count, mean, m2), shift)


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

    @classmethod
    def from_groups(cls, values, groups, n_groups: int, shift, weights=None) -> "Moments":
        """Two-pass moments of the 1-D ``values`` per group, ``groups[i]`` the group of
        ``values[i]`` (the stored values of a sparse matrix by column, say), relative to
        ``shift`` (one per group), in float64 accumulators; ``weights`` weights each value.
        NaN values are ignored. Groups without values get count, mean and m2 0."""
        shift = np.asarray(shift, dtype=np.float64)
        values = np.asarray(values)
        keep = ~np.isnan(values)
        if not keep.all():
            groups, values = groups[keep], values[keep]
            weights = None if weights is None else np.asarray(weights)[keep]
        d = values - shift[groups]                    # float64 (shift is float64)

        def total(v=None):
            return np.bincount(groups, v, minlength=n_groups)
        if weights is None:                           # (no products with ones)
            count = total().astype(np.float64)
            safe = np.where(count == 0, 1.0, count)
            mean = total(d) / safe
            dev = d - mean[groups]
            resid, squares = total(dev), total(dev * dev)
        else:
            w = np.asarray(weights, np.float64)
            count = total(w)
            safe = np.where(count == 0, 1.0, count)
            mean = total(w * d) / safe
            dev = d - mean[groups]
            wdev = w * dev
            resid, squares = total(wdev), total(wdev * dev)
        m2 = squares - resid * resid / safe           # corrected two-pass, as from_array
        return cls(count, mean + resid / safe, m2, shift)

    def with_shift(self, shift) -> "Moments":
        """The same moments kept relative to another ``shift`` (``mean`` moves by the
        difference; ``count`` and ``m2`` do not change). Empty groups get mean 0, so that
        they stay exact no-ops of a merge whatever the shifts."""
        mean = np.where(np.asarray(self.count) > 0, self.mean + (self.shift - shift), 0.0)
        return Moments(self.count, mean, self.m2, shift)

    def merge(self, other: "Moments") -> "Moments":
        """Return the moments of the union of both sets (Chan et al.).

        The result keeps this set's shift, except for groups where this set is empty:
        those take the other's shift, so an empty start (``Moments.empty``) does not
        throw away the shift that keeps large offsets exact.
        """
        shift = np.where(np.asarray(self.count) == 0, other.shift, self.shift)
        a, b = self.with_shift(shift), other.with_shift(shift)
        return Moments(*merge_moments(a.count, a.mean, a.m2, b.count, b.mean, b.m2), shift)

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
