"""normkit.preprocessing against scikit-learn and exact rational arithmetic.

Every numeric expectation comes from scikit-learn, ``fractions.Fraction``/``math.fsum`` or
plain NumPy on float64 copies -- never from normkit itself. Each test runs on both kernel
paths (numba and NumPy) through the ``backend`` fixture.
"""

from __future__ import annotations

import json
import math
import tracemalloc
import warnings
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("sklearn")
from sklearn import preprocessing as skp  # noqa: E402
from sklearn.exceptions import NotFittedError  # noqa: E402
from sklearn.utils.estimator_checks import parametrize_with_checks  # noqa: E402

from normkit.preprocessing import (  # noqa: E402
    MinMaxScaler,
    ScalerFileError,
    StandardScaler,
    _kernels,
    load_scaler,
    min_max_scale,
    standard_score,
)

BACKENDS = ["numba", "numpy"] if _kernels.numba is not None else ["numpy"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setattr(_kernels, "USE_NUMBA", request.param == "numba")
    # small blocks and chunks so that the tests' small arrays cross block boundaries
    monkeypatch.setattr(_kernels, "NUMPY_BLOCK_ROWS", 37)
    monkeypatch.setattr(_kernels, "CHUNK_ROWS", 64)
    return request.param


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.maximum(np.abs(b), np.finfo(np.float64).tiny)
    return float(np.nanmax(np.abs(a - b) / scale)) if a.size else 0.0


def make_data(shape, dtype, seed=0, nan_frac=0.0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=shape) * rng.uniform(0.1, 10, size=shape[1]) + rng.uniform(-5, 5, shape[1])
    if nan_frac:
        X[rng.random(shape) < nan_frac] = np.nan
    return X.astype(dtype)


# --------------------------------------------------------------------------- estimator checks
def _fails_on_this_scikit_learn(estimator):
    """The checks that this scikit-learn fails for its own scaler of the same settings."""
    import sklearn
    from packaging.version import Version

    if (Version(sklearn.__version__) < Version("1.7")
            and isinstance(estimator, StandardScaler) and estimator.with_mean):
        # 1.6 fits sparse data with the default with_mean=True, which scikit-learn's
        # StandardScaler() refuses as normkit's does ("Cannot center sparse matrices")
        return {"check_sample_weight_equivalence_on_sparse_data":
                "scikit-learn < 1.7 centers sparse data here; its own StandardScaler fails too"}
    return {}


@parametrize_with_checks([StandardScaler(), StandardScaler(with_mean=False),
                          StandardScaler(with_mean=False, with_std=False),
                          MinMaxScaler(), MinMaxScaler(feature_range=(-2, 3), clip=True)],
                         expected_failed_checks=_fails_on_this_scikit_learn)
def test_sklearn_estimator_checks(estimator, check):
    if _needs_a_missing_gpu(check):
        pytest.skip("a CUDA array API check on a machine without a GPU")
    check(estimator)


def _needs_a_missing_gpu(check) -> bool:
    """Whether ``check`` is one of scikit-learn's array API checks on CUDA where torch has
    no GPU: it runs them wherever torch is *built* with CUDA (a PyPI wheel on a CPU-only
    machine), and they fail in ``torch.asarray``, for its own scalers as for ours."""
    keywords = getattr(check, "keywords", {})
    devices = {keywords.get("device_name")} | {getattr(v, "device", None)
                                                for v in keywords.values()}
    if "cuda" not in devices:
        return False
    try:
        import torch
    except ModuleNotFoundError:    # (the scalers' own install: NumPy and scikit-learn alone)
        return True
    return not torch.cuda.is_available()


def test_estimator_checks_numpy_path(monkeypatch):
    from unittest import SkipTest

    from sklearn.utils.estimator_checks import estimator_checks_generator

    monkeypatch.setattr(_kernels, "USE_NUMBA", False)
    ran = 0
    for est in (StandardScaler(), MinMaxScaler()):
        for e, check in estimator_checks_generator(
                est, expected_failed_checks=_fails_on_this_scikit_learn(est), mark="skip"):
            if _needs_a_missing_gpu(check):
                continue
            try:
                check(e)
                ran += 1
            except SkipTest:          # (as check_estimator: a library or device missing)
                pass
    assert ran > 50


# --------------------------------------------------------------------------- vs scikit-learn
SHAPES = [(1, 1), (2, 3), (7, 5), (123, 17), (300, 2)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("with_mean,with_std", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("nan_frac", [0.0, 0.1])
def test_standard_matches_sklearn(backend, shape, dtype, with_mean, with_std, nan_frac):
    X = make_data(shape, dtype, nan_frac=nan_frac)
    ours = StandardScaler(with_mean=with_mean, with_std=with_std).fit(X)
    ref = skp.StandardScaler(with_mean=with_mean, with_std=with_std).fit(X)
    np.testing.assert_allclose(ours.mean_, ref.mean_, rtol=1e-12, atol=1e-14)
    if with_std:
        np.testing.assert_allclose(ours.var_, ref.var_, rtol=1e-10, atol=1e-14)
        np.testing.assert_allclose(ours.scale_, ref.scale_, rtol=1e-10)
    else:
        assert ours.var_ is None and ours.scale_ is None
    np.testing.assert_array_equal(ours.n_samples_seen_, ref.n_samples_seen_)
    Z, Zr = ours.transform(X), ref.transform(X)
    assert Z.dtype == Zr.dtype == dtype
    tol = 1e-10 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(Z, Zr, rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.isnan(Z), np.isnan(X))  # NaN kept in transform
    np.testing.assert_allclose(ours.inverse_transform(Z), ref.inverse_transform(Zr),
                               rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("feature_range,clip", [((0, 1), False), ((-3, 2.5), True)])
@pytest.mark.parametrize("nan_frac", [0.0, 0.1])
def test_minmax_matches_sklearn(backend, shape, dtype, feature_range, clip, nan_frac):
    X = make_data(shape, dtype, nan_frac=nan_frac)
    ours = MinMaxScaler(feature_range, clip=clip).fit(X)
    ref = skp.MinMaxScaler(feature_range=feature_range, clip=clip).fit(X)
    for name in ("data_min_", "data_max_", "data_range_", "scale_", "min_"):
        # scikit-learn keeps float32 statistics for float32 input; normkit keeps float64
        tol = 1e-5 if dtype == np.float32 else 1e-12
        np.testing.assert_allclose(getattr(ours, name), getattr(ref, name), rtol=tol, atol=tol,
                                   err_msg=name)
    assert ours.n_samples_seen_ == ref.n_samples_seen_
    X_new = make_data(shape, dtype, seed=1) * 2  # held-out data exercises clip
    Z, Zr = ours.transform(X_new), ref.transform(X_new)
    assert Z.dtype == Zr.dtype == dtype
    tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(Z, Zr, rtol=tol, atol=tol)
    np.testing.assert_allclose(ours.inverse_transform(Z), ref.inverse_transform(Zr), rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_sample_weight_matches_sklearn(backend, dtype):
    X = make_data((91, 4), dtype, nan_frac=0.05)
    w = np.random.default_rng(3).uniform(0, 3, size=91)
    w[:5] = 0.0
    ours = StandardScaler().fit(X, sample_weight=w)
    ref = skp.StandardScaler().fit(X, sample_weight=w)
    np.testing.assert_allclose(ours.mean_, ref.mean_, rtol=1e-6 if dtype == np.float32 else 1e-12)
    np.testing.assert_allclose(ours.var_, ref.var_, rtol=1e-5 if dtype == np.float32 else 1e-10)
    np.testing.assert_allclose(ours.n_samples_seen_, ref.n_samples_seen_, rtol=1e-5)
    # partial_fit with weights, in pieces
    part = StandardScaler()
    for sl in (slice(0, 40), slice(40, 91)):
        part.partial_fit(X[sl], sample_weight=w[sl])
    np.testing.assert_allclose(part.var_, ref.var_, rtol=1e-5 if dtype == np.float32 else 1e-10)
    # neither centering nor scaling: still the weights' sum (docs/scalers.md), which
    # scikit-learn gives with centering; without it, it counts samples
    bare = StandardScaler(with_mean=False, with_std=False).fit(X, sample_weight=w)
    np.testing.assert_allclose(bare.n_samples_seen_, ref.n_samples_seen_, rtol=1e-5)


def test_weights_that_count_nothing_are_refused(backend):
    """A negative weight (which scikit-learn 1.9 takes into its sums) is refused: the
    kernels take weights as counts, and before a block of rows whose weights summed to
    <= 0 was left out without a word (NaN statistics for all-negative weights)."""
    X = make_data((60, 3), np.float64)
    import scipy.sparse as sp

    w = np.ones(60)
    w[7] = -0.5
    for fit in (StandardScaler().fit, StandardScaler().partial_fit,
                StandardScaler(with_mean=False).fit):
        with pytest.raises(ValueError, match=r"1 negative value\(s\) \(the smallest -0.5, at row 7\)"):
            fit(X, sample_weight=w)
        with pytest.raises(ValueError, match="negative"):
            fit(X, sample_weight=-np.ones(60))
    with pytest.raises(ValueError, match="negative"):
        StandardScaler(with_mean=False).fit(sp.csr_matrix(X), sample_weight=w)
    with pytest.raises(ValueError, match="sample_weight contains NaN"):      # scikit-learn's
        StandardScaler().fit(X, sample_weight=np.r_[np.nan, np.ones(59)])
    # zero weights leave rows out, as in scikit-learn
    w[7] = 0.0
    ref = skp.StandardScaler().fit(X, sample_weight=w)
    np.testing.assert_allclose(StandardScaler().fit(X, sample_weight=w).var_, ref.var_, rtol=1e-12)


def test_finite_values_whose_squares_overflow_are_named_so():
    """Values beyond about 1e154 are finite, but their variance is not a float64:
    scikit-learn's statistics come out NaN; normkit refuses, and says it is an overflow,
    not an infinity in X (which it said before)."""
    X = np.random.default_rng(0).normal(size=(50, 3))
    X[:, 1] *= 1e200
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert np.isnan(skp.StandardScaler().fit(X).var_[1])
    with pytest.raises(ValueError, match=r"variance of features \[1\] overflows float64 in fit") as info:
        StandardScaler().fit(X)
    assert "infinity" not in str(info.value)
    np.testing.assert_allclose(StandardScaler().fit(X / 1e200).scale_[1],
                               skp.StandardScaler().fit(X / 1e200).scale_[1], rtol=1e-12)
    X[4, 2] = -np.inf           # an infinity in X: named so, by feature (no count of values)
    for scaler in (StandardScaler(with_mean=False), MinMaxScaler()):
        with pytest.raises(ValueError, match=r"contains infinity in fit \(features \[1\]\)"):
            scaler.fit(X[:, [0, 2]])


def test_fit_transform_and_twins_match_sklearn(backend):
    X = make_data((57, 6), np.float64, nan_frac=0.05)
    np.testing.assert_allclose(StandardScaler().fit_transform(X), skp.StandardScaler().fit_transform(X), rtol=1e-10)
    for axis in (0, 1):
        np.testing.assert_allclose(standard_score(X, axis=axis), skp.scale(X, axis=axis), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(min_max_scale(X, (-1, 2), axis=axis),
                                   skp.minmax_scale(X, (-1, 2), axis=axis), rtol=1e-12, atol=1e-12)
    v = X[:, 0]
    np.testing.assert_allclose(standard_score(v), skp.scale(v), rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="axis must be 0"):
        standard_score(X, axis=2)


# --------------------------------------------------------------------------- exactness
def exact_mean_var(column):
    xs = [Fraction(float(v)) for v in column if not math.isnan(v)]
    mean = sum(xs) / len(xs)
    return mean, sum((x - mean) ** 2 for x in xs) / len(xs)


@pytest.mark.parametrize("chunk", [3, 64, 250])
def test_partial_fit_equals_fit_with_offsets(backend, chunk):
    rng = np.random.default_rng(7)
    n = 500
    X = np.column_stack([
        rng.normal(size=n) + 1e15,                      # large offset, unit spread
        rng.normal(size=n) * 1e-8 + 1e15,               # ... and a spread below 1 ulp of 1e15
        rng.normal(size=n) * 1e6,                       # mixed magnitudes
        rng.normal(size=n) * 1e-6 - 3.0,
        np.round(rng.normal(size=n) * 10) + 1e15,        # integers at 1e15: exact data
    ])
    X[rng.random(X.shape) < 0.02] = np.nan
    full = StandardScaler().fit(X)
    part = StandardScaler()
    for i in range(0, n, chunk):
        part.partial_fit(X[i:i + chunk])
    assert rel_err(part.mean_, full.mean_) <= 1e-12
    assert rel_err(part.var_, full.var_) <= 1e-12
    np.testing.assert_array_equal(part.n_samples_seen_, full.n_samples_seen_)
    for j in range(X.shape[1]):
        mean, var = exact_mean_var(X[:, j])
        # the mean is exact to rounding of its own size plus rounding of the spread around it
        spread = Fraction(float(np.nanmax(np.abs(X[:, j] - float(mean)))))
        assert abs(Fraction(full.mean_[j]) - mean) <= (abs(mean) + spread) * Fraction(1, 10**15), j
        if var > 0:
            assert abs(Fraction(full.var_[j]) - var) <= var * Fraction(1, 10**6), j
            assert abs(Fraction(part.var_[j]) - var) <= var * Fraction(1, 10**6), j


def test_float32_mean_as_accurate_as_float64(backend):
    rng = np.random.default_rng(11)
    X = (rng.normal(size=(20000, 3)) * [1.0, 1e3, 1e-3] + [1e4, -7.0, 0.5]).astype(np.float32)
    s = StandardScaler().fit(X)
    eps = np.finfo(np.float64).eps
    for j in range(3):
        col = X[:, j].astype(np.float64)
        exact = float(sum(Fraction(float(v)) for v in col) / col.size)
        float64_err = abs(np.mean(col) - exact)  # NumPy's pairwise sum on a float64 copy
        std = float(np.std(col))
        assert abs(s.mean_[j] - exact) <= max(4 * float64_err, 8 * eps * (abs(exact) + std))
        var = math.fsum((col - exact) ** 2) / col.size
        assert abs(s.var_[j] - var) <= 1e-12 * var
    assert s.mean_.dtype == np.float64


def test_float32_fit_makes_no_float64_copy(backend):
    X = make_data((60000, 10), np.float32)
    StandardScaler().fit(X[:100])  # compile / warm up outside the measurement
    MinMaxScaler().fit(X[:100])
    tracemalloc.start()
    s = StandardScaler().fit(X)
    m = MinMaxScaler().fit(X)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < X.nbytes // 2, peak  # a float64 copy would be 2 * X.nbytes
    assert s.transform(X).dtype == np.float32 and m.transform(X).dtype == np.float32


def test_constant_and_near_constant_features(backend):
    n = 50
    X = np.column_stack([np.full(n, 0.1), np.full(n, 1e15), 1e9 + np.linspace(0, 1e-7, n), np.zeros(n)])
    s = StandardScaler().fit(X)
    ref = skp.StandardScaler().fit(X)
    np.testing.assert_array_equal(s.scale_, ref.scale_)  # all constant: scale 1
    Z = s.transform(X)
    assert np.all(np.isfinite(Z)) and np.abs(Z).max() < 1e-6
    m = MinMaxScaler().fit(X)
    exact = [0, 1, 3]  # truly constant: as scikit-learn
    np.testing.assert_allclose(m.transform(X)[:, exact], skp.MinMaxScaler().fit_transform(X)[:, exact], atol=1e-12)
    # column 2 spans one ulp of 1e9: scikit-learn stretches that rounding step to the full
    # range; normkit treats it as constant (scale 1) instead of dividing by ~0
    assert m.scale_[2] == 1.0
    np.testing.assert_allclose(m.transform(X)[:, 2], X[:, 2] - X[:, 2].min(), atol=0)


def test_nan_ignored_in_fit_kept_in_transform(backend):
    X = np.array([[1.0, np.nan], [np.nan, np.nan], [3.0, 4.0], [5.0, np.nan]])
    s = StandardScaler().fit(X)
    np.testing.assert_allclose(s.mean_, [3.0, 4.0])
    np.testing.assert_allclose(s.var_, [8 / 3, 0.0])
    np.testing.assert_array_equal(s.n_samples_seen_, [3, 1])
    Z = s.transform(X)
    np.testing.assert_array_equal(np.isnan(Z), np.isnan(X))
    allnan = StandardScaler().fit(np.full((3, 2), np.nan))
    ref = skp.StandardScaler().fit(np.full((3, 2), np.nan))
    np.testing.assert_array_equal(allnan.mean_, ref.mean_)
    m = MinMaxScaler().fit(X)
    np.testing.assert_allclose(m.data_min_, [1.0, 4.0])
    np.testing.assert_array_equal(np.isnan(m.transform(X)), np.isnan(X))


@pytest.mark.parametrize("sparse", [False, True])
def test_partial_fit_of_a_feature_missing_from_the_first_batches(backend, sparse):
    """A feature with no value in a batch (all NaN there: the first two batches for
    feature 1, the second for feature 0) keeps the statistics of its values in the others,
    as a fit on all the rows gives them. (scikit-learn 1.9.1's partial_fit gives such a
    feature NaN statistics from then on, and its transform then refuses the NaN scale.)"""
    import scipy.sparse as sps

    batches = [np.array([[1.0, np.nan, 0.0]]), np.array([[np.nan, np.nan, 2.0]]),
               np.array([[2.0, 5.0, np.nan], [4.0, 7.0, 3.0]])]
    whole = np.vstack(batches)
    make = sps.csr_matrix if sparse else np.asarray
    scalers = [(StandardScaler, skp.StandardScaler, {"with_mean": not sparse},
                ("mean_", "var_", "scale_", "n_samples_seen_"))]
    if not sparse:
        scalers.append((MinMaxScaler, skp.MinMaxScaler, {},
                        ("data_min_", "data_max_", "scale_", "min_", "n_samples_seen_")))
    for ours, theirs, kwargs, attributes in scalers:
        part = ours(**kwargs)
        for batch in batches:
            part.partial_fit(make(batch))
        ref = theirs(**kwargs).fit(make(whole))
        for name in attributes:
            np.testing.assert_allclose(getattr(part, name), getattr(ref, name), rtol=1e-15,
                                       err_msg=f"{ours.__name__}.{name}")
        Z = part.transform(make(whole))
        np.testing.assert_allclose(Z.toarray() if sparse else Z,
                                   (lambda z: z.toarray() if sparse else z)(
                                       ref.transform(make(whole))), rtol=1e-14)


# --------------------------------------------------------------------------- properties
@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 60), p=st.integers(1, 4), cuts=st.lists(st.integers(1, 59), max_size=5),
       offset=st.sampled_from([0.0, 1e6, -1e12, 1e15]), seed=st.integers(0, 2**16))
def test_property_partial_fit_equals_fit(n, p, cuts, offset, seed):
    X = np.random.default_rng(seed).normal(size=(n, p)) + offset
    full = StandardScaler().fit(X)
    ref = skp.StandardScaler().fit(X)
    part = StandardScaler()
    bounds = [0] + sorted({c for c in cuts if c < n}) + [n]
    for a, b in zip(bounds[:-1], bounds[1:]):
        part.partial_fit(X[a:b])
    # the mean to 1e-12 of the data's scale (|mean| + std): a mean near 0 has no digits of its own
    scale = np.abs(full.mean_) + np.sqrt(full.var_)
    assert np.all(np.abs(part.mean_ - full.mean_) <= 1e-12 * scale)
    assert rel_err(part.var_, full.var_) <= 1e-12
    np.testing.assert_allclose(full.mean_, ref.mean_, rtol=1e-12, atol=1e-12 * float(scale.max()))
    mm = MinMaxScaler()
    for a, b in zip(bounds[:-1], bounds[1:]):
        mm.partial_fit(X[a:b])
    np.testing.assert_array_equal(mm.data_min_, X.min(axis=0))
    np.testing.assert_array_equal(mm.data_max_, X.max(axis=0))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), shift=st.floats(-1e9, 1e9), scale=st.floats(1e-3, 1e3))
def test_property_shift_scale_invariance(seed, shift, scale):
    X = np.random.default_rng(seed).normal(size=(40, 3))
    Z = StandardScaler().fit_transform(X)
    # X * scale + shift rounds each value by ~eps * |shift|, i.e. eps * |shift| / scale in units of std
    tol = 1e-9 + 20 * np.finfo(np.float64).eps * abs(shift) / scale
    np.testing.assert_allclose(StandardScaler().fit_transform(X * scale + shift), Z, atol=tol)


# --------------------------------------------------------------------------- errors
def test_errors_are_clear(backend):
    X = make_data((10, 3), np.float64)
    with pytest.raises(NotFittedError, match="not fitted"):
        StandardScaler().transform(X)
    with pytest.raises(NotFittedError, match="not fitted"):
        MinMaxScaler().inverse_transform(X)
    s = StandardScaler().fit(X)
    with pytest.raises(ValueError, match="X has 2 features, but StandardScaler is expecting 3"):
        s.transform(X[:, :2])
    with pytest.raises(ValueError, match="X has 4 features"):
        s.partial_fit(np.hstack([X, X[:, :1]]))
    X_inf = X.copy()
    X_inf[2, 1] = np.inf
    with pytest.raises(ValueError, match="infinity"):
        StandardScaler().fit(X_inf)
    with pytest.raises(ValueError, match="infinity"):
        MinMaxScaler().fit(X_inf)
    with pytest.raises(ValueError, match="infinity"):
        s.transform(X_inf)
    before = X_inf.copy()
    with pytest.raises(ValueError, match="infinity"):
        s.transform(X_inf, copy=False)
    np.testing.assert_array_equal(X_inf, before)  # refused before writing in place
    with pytest.raises(ValueError, match="smaller than maximum"):
        MinMaxScaler(feature_range=(1, 0)).fit(X)
    with pytest.raises(ValueError, match="two finite numbers"):
        MinMaxScaler(feature_range=(0, 1, 2)).fit(X)
    import scipy.sparse as sp

    with pytest.raises(ValueError, match="Pass with_mean=False"):
        StandardScaler().fit(sp.csr_matrix(X))
    with pytest.raises(TypeError, match="dense input only"):
        MinMaxScaler().fit(sp.csr_matrix(X))


def test_non_numeric_input_names_the_columns():
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame({"a": [1.0, 2.0], "city": ["x", "y"], "b": [3.0, 4.0]})
    with pytest.raises(ValueError, match=r"numeric input \(non-numeric columns: \['city'\]\).*select_dtypes"):
        StandardScaler().fit(df)
    with pytest.raises(ValueError, match="numeric input"):
        MinMaxScaler().fit(np.array([["1", "a"]], dtype=object))


def test_copy_false_transforms_in_place(backend):
    X = make_data((20, 3), np.float64)
    expected = skp.StandardScaler().fit_transform(X)
    s = StandardScaler(copy=False).fit(X)
    Z = s.transform(X)
    assert Z is X
    np.testing.assert_allclose(X, expected, rtol=1e-12)


# --------------------------------------------------------------------------- dataframes
def test_set_output_pandas_and_feature_names():
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame(make_data((30, 3), np.float64), columns=["x", "y", "z"])
    s = StandardScaler().set_output(transform="pandas").fit(df)
    assert list(s.feature_names_in_) == ["x", "y", "z"]
    assert list(s.get_feature_names_out()) == ["x", "y", "z"]
    out = s.transform(df)
    assert isinstance(out, pd.DataFrame) and list(out.columns) == ["x", "y", "z"]
    np.testing.assert_allclose(out.to_numpy(), skp.StandardScaler().fit_transform(df), rtol=1e-10)
    m = MinMaxScaler().set_output(transform="pandas").fit(df)
    assert isinstance(m.transform(df), pd.DataFrame)


def test_set_output_polars():
    pl = pytest.importorskip("polars")
    X = make_data((30, 2), np.float64)
    df = pl.DataFrame({"u": X[:, 0], "v": X[:, 1]})
    for est in (StandardScaler(), MinMaxScaler()):
        out = est.set_output(transform="polars").fit_transform(df)
        # the column names scikit-learn's own scaler keeps (before 1.9 it reads none from
        # polars 2: x0, x1)
        names = getattr(skp, type(est).__name__)().set_output(transform="polars").fit_transform(df)
        assert isinstance(out, pl.DataFrame) and out.columns == names.columns
        ref = type(est)().fit_transform(X)
        np.testing.assert_allclose(out.to_numpy(), ref, rtol=1e-12)


# --------------------------------------------------------------------------- persistence
@pytest.mark.parametrize("make", [lambda: StandardScaler(), lambda: StandardScaler(with_mean=False),
                                  lambda: MinMaxScaler((-1, 1), clip=True)])
def test_save_load_round_trip(tmp_path, make):
    pd = pytest.importorskip("pandas")
    X = make_data((40, 3), np.float64, nan_frac=0.05)
    X[:, 2] += 1e15
    df = pd.DataFrame(X, columns=["a", "b", "c"])
    est = make().fit(df)
    path = tmp_path / "scaler.json"
    est.save(path)
    doc = json.loads(path.read_text())
    assert doc["format_version"] == 1 and doc["feature_names_in"] == ["a", "b", "c"]
    back = type(est).load(path)
    assert back.get_params() == est.get_params()
    for name in ("mean_", "var_", "scale_", "min_", "data_min_", "data_max_", "n_samples_seen_"):
        if getattr(est, name, None) is not None:
            np.testing.assert_array_equal(getattr(back, name), getattr(est, name), err_msg=name)
    np.testing.assert_array_equal(back.transform(df), est.transform(df))
    assert list(back.feature_names_in_) == ["a", "b", "c"]
    assert type(load_scaler(path)) is type(est)


def test_partial_fit_continues_after_load(tmp_path):
    X = make_data((100, 3), np.float64) + 1e15
    a = StandardScaler().partial_fit(X[:60])
    a.save(tmp_path / "s.json")
    b = StandardScaler.load(tmp_path / "s.json").partial_fit(X[60:])
    full = skp.StandardScaler().fit(X - 1e15)  # X - 1e15 is exact here, and has the same variance
    np.testing.assert_allclose(b.var_, full.var_, rtol=1e-9)


def test_corrupt_or_mismatched_files(tmp_path):
    X = make_data((10, 2), np.float64)
    path = tmp_path / "s.json"
    StandardScaler().fit(X).save(path)
    good = path.read_text()

    path.write_text(good[: len(good) // 2])
    with pytest.raises(ScalerFileError, match="not valid JSON.*corrupt or truncated"):
        StandardScaler.load(path)
    path.write_text(good)
    with pytest.raises(ScalerFileError, match="holds a StandardScaler, not a MinMaxScaler"):
        MinMaxScaler.load(path)
    doc = json.loads(good)
    doc["format_version"] = 99
    path.write_text(json.dumps(doc))
    with pytest.raises(ScalerFileError, match="newer than this normkit reads.*upgrade"):
        load_scaler(path)
    doc = json.loads(good)
    doc["state"]["mean_"][0] += 1.0
    path.write_text(json.dumps(doc))
    with pytest.raises(ScalerFileError, match=r"state.mean_ disagrees .* features \[0\]"):
        load_scaler(path)
    doc = json.loads(good)
    doc["state"]["moments"]["m2"] = [1.0]
    path.write_text(json.dumps(doc))
    with pytest.raises(ScalerFileError, match="1 values in state.moments.m2 for n_features_in=2"):
        load_scaler(path)
    path.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ScalerFileError, match="not a normkit scaler file"):
        load_scaler(path)
    doc = json.loads(good)
    del doc["state"]
    path.write_text(json.dumps(doc))
    with pytest.raises(ScalerFileError, match="lacks the entry 'state'"):
        load_scaler(path)
    with pytest.raises(NotFittedError):
        StandardScaler().save(tmp_path / "unfitted.json")
    assert not (tmp_path / "unfitted.json").exists()


@pytest.mark.parametrize("where, value, said", [
    (("estimator",), ["StandardScaler"], "unknown estimator"),
    (("params",), [1, 2], "params that are not a mapping"),
    (("params", "with_mean"), "DELETE", r"lacks the params \['with_mean'\]"),
    (("params", "with_std"), "no", "'with_std' parameter of StandardScaler must be a bool"),
    (("params", "copy"), [True], "'copy' parameter"),
    (("params", "offset"), 1.0, "unexpected keyword argument 'offset'"),
    (("n_features_in",), "2", "invalid n_features_in '2'"),
    (("feature_names_in",), ["a", 1], "not a list of strings"),
    (("feature_names_in",), ["a"], "1 feature names for n_features_in=2"),
    (("state", "mean_"), ["a", "b"], "non-numeric values in state.mean_"),
    (("state", "moments"), "DELETE", "lacks the entry state.moments"),
    (("state", "n_samples_seen_"), [3, 3], "state.n_samples_seen_ disagrees"),
    (("state", "weighted"), "no", "state.weighted must be true or false"),
    (("state", "n_samples_seen_"), -1, "n_samples_seen_ must be a count of rows, got -1"),
])
def test_a_damaged_file_is_named_and_refused(tmp_path, where, value, said):
    """Every damage found by editing each entry of a saved file (to another type, or
    deleting it) is a ScalerFileError that says what: before, a list as the estimator
    or params that were not a mapping raised a TypeError / AttributeError, and a flag
    that was not a bool, or a missing one (its default used instead), loaded."""
    path = tmp_path / "s.json"
    frame = pytest.importorskip("pandas").DataFrame(make_data((10, 2), np.float64),
                                                    columns=["a", "b"])
    make = MinMaxScaler if "count of rows" in said else StandardScaler
    make().fit(frame).save(path)
    path.write_text(json.dumps(_damaged(json.loads(path.read_text()), where, value)))
    with pytest.raises(ScalerFileError, match=said):
        load_scaler(path)


def _damaged(doc, where, value):
    """A copy of the file's ``doc`` with the entry at the path ``where`` set to ``value``
    (``"DELETE"``: deleted)."""
    doc = json.loads(json.dumps(doc))
    node = doc
    for key in where[:-1]:
        node = node[key]
    if value == "DELETE":
        del node[where[-1]]
    else:
        node[where[-1]] = value
    return doc


def _entries(doc, at=()):
    """The path of every entry of a scaler file (a list's first two items)."""
    items = doc.items() if isinstance(doc, dict) else (
        enumerate(doc[:2]) if isinstance(doc, list) else ())
    for key, value in items:
        yield at + (key,)
        yield from _entries(value, at + (key,))


@pytest.mark.parametrize("make", [StandardScaler, MinMaxScaler])
def test_every_entry_damaged_gives_the_files_error_or_a_scaler_that_works(tmp_path, make):
    """Each entry of a saved file (named features), replaced by a value of another kind or
    deleted: loading raises ScalerFileError, or gives a scaler that transforms."""
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame(make_data((10, 3), np.float64), columns=["a", "b", "c"])
    path = tmp_path / "s.json"
    make().fit(frame).save(path)
    good = json.loads(path.read_text())
    junk = [None, 0, -1, 1.5, "x", [], {}, [1, 2], ["a"], True, 1e308, {"a": 1}, "DELETE"]
    for where in list(_entries(good)):
        for value in junk:
            path.write_text(json.dumps(_damaged(good, where, value)))
            with warnings.catch_warnings():     # (1e308 overflows on the way to refusal)
                warnings.simplefilter("ignore", RuntimeWarning)
                try:
                    scaler = load_scaler(path)
                except ScalerFileError:
                    continue
                if where[0] != "feature_names_in":   # (renamed features: sklearn's refusal)
                    scaler.transform(frame)


@pytest.mark.parametrize("make, name, value", [
    (lambda v: StandardScaler(with_mean=v), "with_mean", "x"),
    (lambda v: StandardScaler(with_std=v), "with_std", [1]),
    (lambda v: StandardScaler(copy=v), "copy", None),
    (lambda v: MinMaxScaler(clip=v), "clip", "yes"),
    (lambda v: MinMaxScaler(copy=v), "copy", 0)])
def test_a_flag_that_is_not_a_bool_is_refused_at_fit_as_sklearn_does(make, name, value):
    """scikit-learn's parameter validation refuses these at fit (a ValueError and a
    TypeError); before, normkit read a string or a list as true."""
    X = make_data((10, 3), np.float64)
    theirs = {"with_mean": skp.StandardScaler, "with_std": skp.StandardScaler,
              "clip": skp.MinMaxScaler}.get(name)
    for error in (ValueError, TypeError):
        with pytest.raises(error, match=f"'{name}' parameter .* must be a bool"):
            make(value).fit(X)
        if theirs is not None:
            with pytest.raises(error):
                theirs(**{name: value}).fit(X)
    make(np.bool_(True)).fit(X)                          # numpy's bool is a bool here too


@pytest.mark.parametrize("make", [StandardScaler, MinMaxScaler])
def test_float16_is_preserved_and_rounded_once(make, backend):
    # scikit-learn keeps float16 too; normkit's output is the float64 map of the data
    # rounded once (scikit-learn's rounds its statistics to float16 first: 1-2 units off)
    X = make_data((300, 4), np.float16)
    ours, theirs = make().fit(X), getattr(skp, make.__name__)().fit(X)
    Z = ours.transform(X)
    assert Z.dtype == np.float16 == theirs.transform(X).dtype
    X64 = X.astype(np.float64)
    if make is StandardScaler:
        np.testing.assert_allclose(ours.mean_, X64.mean(axis=0), rtol=1e-13)
        exact = (X64 - X64.mean(axis=0)) / X64.std(axis=0)
    else:
        lo, hi = X64.min(axis=0), X64.max(axis=0)
        exact = (X64 - lo) / (hi - lo)
    np.testing.assert_array_equal(Z, exact.astype(np.float16))
    back = ours.inverse_transform(Z)
    assert back.dtype == np.float16
