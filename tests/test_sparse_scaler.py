"""StandardScaler on SciPy sparse matrices against scikit-learn's: fitted statistics (NaN,
weights, chunks), the map and its output format, and the errors for centering."""

from __future__ import annotations

from fractions import Fraction

import warnings

import numpy as np
import pytest

pytest.importorskip("sklearn")
sparse = pytest.importorskip("scipy.sparse")
from sklearn import preprocessing as skp  # noqa: E402

from normkit.preprocessing import (MinMaxScaler, StandardScaler, _kernels,  # noqa: E402
                                   min_max_scale, standard_score)

BACKENDS = ["numba", "numpy"] if _kernels.numba is not None else ["numpy"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setattr(_kernels, "USE_NUMBA", request.param == "numba")
    return request.param


FORMATS = [sparse.csr_matrix, sparse.csc_matrix, sparse.csr_array, sparse.coo_matrix]


def make_sparse(shape=(200, 9), dtype=np.float64, seed=0, nan=True):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=shape) * rng.uniform(0.5, 20, shape[1]) + rng.uniform(-3, 3, shape[1])
    X[rng.random(shape) < 0.7] = 0.0
    X[:, 0] = 0.0                                   # an all-zero column
    X[:, 1] = rng.normal(size=shape[0])             # a column without zeros
    if nan:
        X[rng.random(shape) < 0.05] = np.nan
    return sparse.csr_matrix(X.astype(dtype))


def assert_fitted_like(ours, theirs, rtol=1e-12):
    np.testing.assert_allclose(ours.mean_, theirs.mean_, rtol=rtol, atol=1e-13)
    np.testing.assert_allclose(ours.var_, theirs.var_, rtol=rtol, atol=1e-13)
    np.testing.assert_allclose(ours.scale_, theirs.scale_, rtol=rtol)
    np.testing.assert_array_equal(ours.n_samples_seen_, theirs.n_samples_seen_)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_fit_and_transform_equal_sklearn(fmt, dtype, backend):
    X = fmt(make_sparse(dtype=dtype))
    ours, theirs = StandardScaler(with_mean=False), skp.StandardScaler(with_mean=False)
    got, want = ours.fit_transform(X), theirs.fit_transform(X)
    assert_fitted_like(ours, theirs, rtol=1e-12 if dtype == np.float64 else 1e-6)
    assert type(got) is type(want) and got.format == "csr" and got.dtype == want.dtype
    np.testing.assert_allclose(got.toarray(), want.toarray(), rtol=4 * np.finfo(dtype).eps)
    back = ours.inverse_transform(got)
    np.testing.assert_allclose(back.toarray(), X.toarray(), rtol=8 * np.finfo(dtype).eps)
    assert type(back) is type(want)


def test_weights_and_chunks_equal_sklearn_on_the_whole(backend):
    X = make_sparse((300, 7), seed=2)
    w = np.random.default_rng(3).uniform(0.1, 3, X.shape[0])
    theirs = skp.StandardScaler(with_mean=False).fit(X, sample_weight=w)
    ours = StandardScaler(with_mean=False)
    for a, b in [(0, 40), (40, 41), (41, 300)]:        # a chunk of one row too
        ours.partial_fit(X[a:b].tocsc(), sample_weight=w[a:b])
    np.testing.assert_allclose(ours.n_samples_seen_, theirs.n_samples_seen_, rtol=1e-14)
    ours.n_samples_seen_ = theirs.n_samples_seen_        # (weight sums: rounding apart)
    assert_fitted_like(ours, theirs, rtol=1e-11)
    unweighted = StandardScaler(with_mean=False).partial_fit(X[:100]).partial_fit(X[100:])
    assert_fitted_like(unweighted, skp.StandardScaler(with_mean=False).fit(X), rtol=1e-11)


def _exact_mean_var(column):
    x = [Fraction(v) for v in column]
    mean = sum(x) / len(x)
    return float(mean), float(sum((a - mean) ** 2 for a in x) / len(x))


def test_variance_of_large_values_among_zeros(backend):
    # stored values near 1e9 with a small spread, among zeros or without any: the exact
    # mean and variance (rational arithmetic) within a few rounding units
    rng = np.random.default_rng(4)
    n = 1000
    among_zeros = np.where(rng.random(n) < 0.3, 1e9 + rng.normal(size=n), 0.0)
    no_zeros = 1e9 + rng.normal(size=n) * 1e-3
    dense = np.stack([among_zeros, no_zeros], axis=1)
    ours = StandardScaler(with_mean=False).fit(sparse.csc_matrix(dense))
    for j in range(2):
        mean, var = _exact_mean_var(dense[:, j])
        np.testing.assert_allclose(ours.mean_[j], mean, rtol=4e-16)
        np.testing.assert_allclose(ours.var_[j], var, rtol=1e-14)


def test_copy_false_scales_csr_in_place_and_with_std_false_keeps_values():
    X = make_sparse(nan=False)
    ours = StandardScaler(with_mean=False, copy=False).fit(X)
    before = X.toarray()
    out = ours.transform(X)
    assert out is X and not np.array_equal(X.toarray(), before)
    plain = StandardScaler(with_mean=False, with_std=False).fit(X)
    assert plain.mean_ is None and plain.scale_ is None
    np.testing.assert_array_equal(plain.transform(X).toarray(), X.toarray())
    assert plain.n_samples_seen_ == skp.StandardScaler(with_mean=False, with_std=False).fit(
        X).n_samples_seen_


def test_centering_and_infinity_are_refused_with_what_to_do():
    X = make_sparse(nan=False)
    with pytest.raises(ValueError, match="with_mean=False"):
        StandardScaler().fit(X)
    dense_fit = StandardScaler().fit(X.toarray())
    with pytest.raises(ValueError, match="with_mean=False"):
        dense_fit.transform(X)
    with pytest.raises(ValueError, match="with_mean=False"):
        dense_fit.inverse_transform(X)
    bad = X.copy()
    bad.data[3] = np.inf
    with pytest.raises(ValueError, match="infinity"), warnings.catch_warnings():
        warnings.simplefilter("error")   # the refusal alone, no NumPy warning before it
        StandardScaler(with_mean=False).fit(bad)
    with pytest.raises(ValueError, match="infinity"):
        StandardScaler(with_mean=False).fit(X).transform(bad)
    with pytest.raises(TypeError, match="StandardScaler\\(with_mean=False\\)"):
        MinMaxScaler().fit(X)
    for twin in (standard_score, min_max_scale):
        with pytest.raises(TypeError, match="StandardScaler\\(with_mean=False\\)"):
            twin(X)


@pytest.mark.skipif(_kernels.numba is None, reason="the jitted path needs numba")
def test_jitted_group_moments_are_the_numpy_path_bit_for_bit(monkeypatch):
    X = make_sparse((500, 11), seed=7)
    w = np.random.default_rng(8).uniform(0.1, 3, X.shape[0])
    fitted = []
    for use_numba in (True, False):
        monkeypatch.setattr(_kernels, "USE_NUMBA", use_numba)
        fitted.append(StandardScaler(with_mean=False).fit(X, sample_weight=w))
        fitted.append(StandardScaler(with_mean=False).fit(X.tocsc()))
    for a, b in zip(fitted[:2], fitted[2:]):
        for name in ("mean_", "var_", "n_samples_seen_"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
