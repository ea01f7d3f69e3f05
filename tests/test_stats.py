"""The statistics core and the scalers' row-block kernels against NumPy float64 references
and exact rational arithmetic."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from normkit.stats import Moments, Range, merge_all, merge_moments, merge_rows


def np_moments(x, w=None):
    """Reference: count, mean, m2 per column by NumPy on a float64 copy, NaN dropped."""
    x = np.asarray(x, np.float64)
    w = np.ones(x.shape[0]) if w is None else np.asarray(w, np.float64)
    out = []
    for j in range(x.shape[1]):
        ok = ~np.isnan(x[:, j])
        c = w[ok].sum()
        m = np.sum(w[ok] * x[ok, j]) / c if c else 0.0
        out.append((c, m, np.sum(w[ok] * (x[ok, j] - m) ** 2)))
    return [np.array(v) for v in zip(*out)]


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 30), min_size=3, max_size=3), seed=st.integers(0, 2**16),
       offset=st.sampled_from([0.0, 1e8, 1e15]))
def test_merge_is_associative_and_matches_numpy(sizes, seed, offset):
    rng = np.random.default_rng(seed)
    parts = [rng.normal(size=(n, 2)) + offset for n in sizes]
    a, b, c = (Moments.from_array(p) for p in parts)
    left, right = a.merge(b).merge(c), a.merge(b.merge(c))
    np.testing.assert_allclose(left.count, right.count)
    np.testing.assert_allclose(left.total_mean(), right.total_mean(), rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(left.m2, right.m2, rtol=1e-9, atol=1e-12)
    allx = np.concatenate(parts)
    if len(allx):
        count, mean, m2 = np_moments(allx - offset)  # exact: x - offset is representable here
        np.testing.assert_allclose(left.count, count)
        np.testing.assert_allclose(left.total_mean() - offset, mean, atol=1e-9 + 1e-15 * offset)
        np.testing.assert_allclose(left.m2, m2, rtol=1e-9, atol=1e-9)


def test_merge_moments_formula_on_scalars():
    x = [1.0, 2.0, 4.0, 7.0]
    c, m, q = merge_moments(2.0, 1.5, 0.5, 2.0, 5.5, 4.5)
    assert (c, m) == (4.0, 3.5)
    assert q == sum((v - 3.5) ** 2 for v in x)
    assert merge_moments(0.0, 0.0, 0.0, 0.0, 0.0, 0.0) == (0.0, 0.0, 0.0)


def test_from_array_nan_weights_and_offset():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3)) + [0.0, 1e15, -1e6]
    x[rng.random(x.shape) < 0.1] = np.nan
    w = rng.uniform(0, 2, size=40)
    mo = Moments.from_array(x, weights=w)
    count, _, _ = np_moments(x, w)
    np.testing.assert_allclose(mo.count, count)
    for j in range(3):
        vals = [(Fraction(float(v)), Fraction(float(wi))) for v, wi in zip(x[:, j], w) if not np.isnan(v)]
        tw = sum(wi for _, wi in vals)
        mean = sum(wi * v for v, wi in vals) / tw
        m2 = sum(wi * (v - mean) ** 2 for v, wi in vals)
        assert abs(Fraction(float(mo.total_mean()[j])) - mean) <= abs(mean) * Fraction(1, 10**15) + Fraction(1, 10**12)
        assert abs(Fraction(float(mo.m2[j])) - m2) <= m2 * Fraction(1, 10**9)


def test_range_merge_ignores_nan():
    a = Range.from_array(np.array([[1.0, np.nan], [3.0, np.nan]]))
    b = Range.from_array(np.array([[0.5, 2.0]]))
    r = a.merge(b)
    np.testing.assert_array_equal(r.min, [0.5, 2.0])
    np.testing.assert_array_equal(r.max, [3.0, 2.0])


kernels = pytest.importorskip("normkit.preprocessing._kernels")  # needs scikit-learn for the package


@pytest.mark.parametrize("use_numba", [True, False] if kernels.numba is not None else [False])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (1000, 7), (20001, 2)])
def test_kernels_match_numpy(monkeypatch, use_numba, dtype, shape):
    monkeypatch.setattr(kernels, "USE_NUMBA", use_numba)
    rng = np.random.default_rng(1)
    X = (rng.normal(size=shape) * 5 + 2).astype(dtype)
    X[rng.random(shape) < 0.05] = np.nan
    w = rng.uniform(0, 1, size=shape[0])
    for weights in (None, w):
        mo = kernels.column_moments(X, np.zeros(shape[1]), weights)
        count, mean, m2 = np_moments(X, weights)
        np.testing.assert_allclose(mo.count, count, rtol=1e-12)
        np.testing.assert_allclose(mo.total_mean(), mean, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(mo.m2, m2, rtol=1e-11, atol=1e-12)
    rg = kernels.column_range(X)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(rg.min, np.nanmin(X.astype(np.float64), axis=0))
        np.testing.assert_array_equal(rg.max, np.nanmax(X.astype(np.float64), axis=0))
    sub, div = rng.normal(size=shape[1]), rng.uniform(1, 2, size=shape[1])
    out = np.empty_like(X)
    assert kernels.subtract_divide(X, sub, div, out) == 0
    np.testing.assert_array_equal(out, ((X.astype(np.float64) - sub) / div).astype(dtype))
    X[0, 0] = np.inf
    assert kernels.multiply_add(X, div, sub, out, clip=(-1.0, 1.0)) == 1
    ref = np.clip(X.astype(np.float64) * div + sub, -1, 1).astype(dtype)
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize("parts", [1, 2, 3, 5, 8])
def test_merge_rows_equals_moments_of_the_union(parts, library):
    """The one merge tree (chunks, threads, ranks) on NumPy arrays and torch tensors."""
    as_array = np.asarray if library == "numpy" else pytest.importorskip("torch").from_numpy
    rng = np.random.default_rng(parts)
    sizes = rng.integers(0, 6, parts)
    sizes[0] = 0                                         # a part with no samples
    sizes[-1] += 2
    chunks = [rng.normal(1e6, 3.0, (n, 4)) for n in sizes]
    rows = [Moments.from_array(ch, shift=np.zeros(4)) if len(ch) else Moments.empty(4)
            for ch in chunks]
    count = as_array(np.array([[float(m.count[0])] for m in rows]))
    mean = as_array(np.stack([m.mean for m in rows]))
    m2 = as_array(np.stack([m.m2 for m in rows]))
    n, mu, m2_all = merge_rows(count, mean, m2)
    union = np.concatenate(chunks)
    assert float(n[0]) == len(union)
    np.testing.assert_allclose(np.asarray(mu), union.mean(0), rtol=1e-14)
    np.testing.assert_allclose(np.asarray(m2_all) / len(union), union.var(0), rtol=1e-8)


def test_merge_all_equals_sequential_merges():
    rng = np.random.default_rng(0)
    chunks = [rng.normal(1e9, 1.0, (n, 3)) for n in (0, 4, 7, 1, 5)]
    parts = [Moments.from_array(c, shift=c[0] if len(c) else None) if len(c) else Moments.empty(3)
             for c in chunks]
    merged = merge_all(parts)
    union = np.concatenate(chunks)
    exact = union - 1e9                                  # exact (Sterbenz): the reference
    np.testing.assert_allclose(merged.total_mean() - 1e9, exact.mean(0), rtol=1e-6)
    np.testing.assert_allclose(merged.variance(), exact.var(0), rtol=1e-9)
    ranges = merge_all([Range.from_array(c) for c in chunks if len(c)])
    np.testing.assert_array_equal(ranges.min, union.min(0))
    np.testing.assert_array_equal(ranges.max, union.max(0))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 60), groups=st.integers(1, 6), seed=st.integers(0, 10_000),
       offset=st.sampled_from([0.0, 1e6, -1e12]), weighted=st.booleans())
def test_from_groups_equals_numpy_on_each_group(n, groups, seed, offset, weighted):
    # values grouped by an index (a sparse matrix's stored values by column) against NumPy
    # on each group's float64 values; NaN ignored, empty groups zero
    rng = np.random.default_rng(seed)
    values = rng.normal(size=n) * 3 + offset
    values[rng.random(n) < 0.1] = np.nan
    index = rng.integers(0, groups, n)
    weights = rng.uniform(0.1, 2, n) if weighted else None
    got = Moments.from_groups(values, index, groups, np.full(groups, offset), weights)
    for g in range(groups):
        mine = index == g
        # (NumPy on the values less the offset: exact differences, so its m2 is accurate)
        count, mean, m2 = np_moments(values[mine][:, None] - offset,
                                     None if weights is None else weights[mine])
        mean = mean + offset
        np.testing.assert_allclose(got.count[g], count[0], rtol=1e-14)
        if count[0] > 0:
            np.testing.assert_allclose(got.total_mean()[g], mean[0], rtol=1e-15, atol=1e-13)
            np.testing.assert_allclose(got.m2[g], m2[0], rtol=1e-11, atol=1e-10)
        else:
            assert got.mean[g] == 0 and got.m2[g] == 0
