"""Scalers on Dask collections, on a real multi-process LocalCluster, against the in-memory fit
and scikit-learn."""

from __future__ import annotations

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
dd = pytest.importorskip("dask.dataframe")
distributed = pytest.importorskip("distributed")
pd = pytest.importorskip("pandas")
pytest.importorskip("sklearn")
from sklearn import preprocessing as skp  # noqa: E402

from normkit.preprocessing import MinMaxScaler, StandardScaler  # noqa: E402


@pytest.fixture(scope="module")
def client():
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                       host="127.0.0.1", dashboard_address=None)
    with distributed.Client(cluster) as c:
        yield c
    cluster.close()


def rel(a, b):
    return float(np.nanmax(np.abs(a - b) / np.maximum(np.abs(b), 1e-300)))


def data(n=1000, p=4, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, p)) * [1.0, 1e-3, 1e4, 2.0] + [1e15, 0.0, -3.0, 5.0]
    X[rng.random(X.shape) < 0.03] = np.nan
    return X


def test_dask_array_fit_equals_in_memory(client):
    X = data()
    dX = da.from_array(X, chunks=(137, 2))  # odd row chunks, features split too
    s = StandardScaler().fit(dX)
    ref = StandardScaler().fit(X)
    assert rel(s.mean_, ref.mean_) <= 1e-12
    assert rel(s.var_, ref.var_) <= 1e-12
    np.testing.assert_array_equal(s.n_samples_seen_, ref.n_samples_seen_)
    m = MinMaxScaler().fit(dX)
    np.testing.assert_array_equal(m.data_min_, np.nanmin(X, axis=0))
    np.testing.assert_array_equal(m.data_max_, np.nanmax(X, axis=0))
    assert m.n_samples_seen_ == X.shape[0]

    Z = s.transform(dX)
    assert isinstance(Z, da.Array)  # lazy
    np.testing.assert_allclose(Z.compute(), ref.transform(X), rtol=1e-12, atol=1e-12)
    back = s.inverse_transform(Z).compute()
    np.testing.assert_allclose(back, X, rtol=1e-12)
    np.testing.assert_allclose(m.transform(dX).compute(), skp.MinMaxScaler().fit(X).transform(X), atol=1e-12)


def test_dask_array_weights_and_float32(client):
    X = data(600)[:, 1:]
    w = np.random.default_rng(1).uniform(0, 2, size=600)
    s = StandardScaler().fit(da.from_array(X, chunks=(100, 3)), sample_weight=w)
    ref = skp.StandardScaler().fit(X, sample_weight=w)
    np.testing.assert_allclose(s.mean_, ref.mean_, rtol=1e-12)
    np.testing.assert_allclose(s.var_, ref.var_, rtol=1e-9)
    X32 = X.astype(np.float32)
    s32 = StandardScaler().fit(da.from_array(X32, chunks=(77, 3)))
    assert rel(s32.var_, StandardScaler().fit(X32).var_) <= 1e-12
    assert s32.transform(da.from_array(X32, chunks=(77, 3))).dtype == np.float32


def test_dask_dataframe_fit_and_lazy_transform(client):
    X = data(800)
    df = pd.DataFrame(X, columns=["a", "b", "c", "d"])
    ddf = dd.from_pandas(df, npartitions=5)
    s = StandardScaler().fit(ddf)
    ref = StandardScaler().fit(df)
    assert list(s.feature_names_in_) == ["a", "b", "c", "d"]
    assert rel(s.mean_, ref.mean_) <= 1e-12 and rel(s.var_, ref.var_) <= 1e-12
    out = s.transform(ddf)
    assert isinstance(out, dd.DataFrame) and list(out.columns) == ["a", "b", "c", "d"]
    np.testing.assert_allclose(out.compute().to_numpy(), ref.transform(df), rtol=1e-12, atol=1e-12)
    m = MinMaxScaler().fit(ddf)
    np.testing.assert_allclose(m.transform(ddf).compute().to_numpy(),
                               skp.MinMaxScaler().fit_transform(X), atol=1e-12)


def test_dask_errors(client):
    X = data(50)
    s = StandardScaler().fit(X)
    with pytest.raises(ValueError, match="X has 3 features, but StandardScaler is expecting 4"):
        s.transform(da.from_array(X[:, :3], chunks=10))
    with pytest.raises(ValueError, match="2-D Dask array"):
        StandardScaler().fit(da.from_array(X[:, 0], chunks=10))
    ddf = dd.from_pandas(pd.DataFrame({"a": [1.0, 2.0], "s": ["x", "y"]}), npartitions=1)
    with pytest.raises(ValueError, match=r"non-numeric columns: \['s'\]"):
        MinMaxScaler().fit(ddf)
    bad = X.copy()
    bad[3, 1] = np.inf
    with pytest.raises(ValueError, match="infinity"):
        StandardScaler().fit(da.from_array(bad, chunks=10))
    # weights of the blocks are checked where they are read: before, a NaN weight left its
    # block of rows out of the statistics without a word, an infinite one was called
    # "infinity in X"
    w = np.ones(X.shape[0])
    for value, text in ((np.nan, "NaN or infinite"), (np.inf, "NaN or infinite"),
                        (-1.0, "negative")):
        w[13] = value
        with pytest.raises(ValueError, match=text):
            StandardScaler().fit(da.from_array(X, chunks=10), sample_weight=w)
