"""The scalers on PyTorch tensors under scikit-learn's array API dispatch, against
scikit-learn's own scalers given the same tensors (``normkit.preprocessing._array_api``).
scikit-learn's estimator checks cover it too (``check_array_api_input`` in
test_preprocessing.py, with ``SCIPY_ARRAY_API=1``, which conftest sets)."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
sklearn = pytest.importorskip("sklearn")
from sklearn import preprocessing as sk  # noqa: E402

from normkit import preprocessing as nk  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("SCIPY_ARRAY_API") != "1",
                                reason="scikit-learn's array API dispatch needs SCIPY_ARRAY_API=1")

CASES = [("StandardScaler", {}), ("StandardScaler", {"with_mean": False}),
         ("MinMaxScaler", {}), ("MinMaxScaler", {"feature_range": (-2, 3), "clip": True})]


def _data(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 5, generator=gen, dtype=torch.float64) * 3 + 7
    x[3, 1] = float("nan")
    return x.to(dtype), (torch.randn(9, 5, generator=gen) * 5).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name,params", CASES)
def test_tensors_in_tensors_out_as_scikit_learn(name, params, dtype):
    x, held_out = _data(dtype)
    with sklearn.config_context(array_api_dispatch=True):
        ours = getattr(nk, name)(**params).fit(x[:25]).partial_fit(x[25:])
        theirs = getattr(sk, name)(**params).fit(x[:25]).partial_fit(x[25:])
        got, want = ours.transform(held_out), theirs.transform(held_out)
        back, back_want = ours.inverse_transform(got), theirs.inverse_transform(want)
    assert type(got) is torch.Tensor and got.dtype == want.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-12,
                               atol=1e-5 if dtype == torch.float32 else 1e-12, equal_nan=True)
    torch.testing.assert_close(back, back_want, rtol=1e-5, atol=1e-5)  # (clipped: not X)
    for attr in ("mean_", "var_", "scale_", "min_", "data_min_", "data_max_", "data_range_"):
        mine, other = getattr(ours, attr, None), getattr(theirs, attr, None)
        if other is None:
            assert mine is None, attr
            continue
        assert type(mine) is torch.Tensor and mine.dtype == torch.float64, attr
        torch.testing.assert_close(mine, other.to(torch.float64), rtol=1e-6, atol=1e-9)


def test_sample_weight_fit_transform_and_numpy_after_tensors():
    """``sample_weight`` as a tensor; ``fit_transform``; a NumPy transform of a scaler
    fitted on tensors returns NumPy (scikit-learn 1.9 refuses it; normkit is lenient)."""
    x, held_out = _data(torch.float64)
    w = torch.rand(40, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with sklearn.config_context(array_api_dispatch=True):
        ours, theirs = nk.StandardScaler(), sk.StandardScaler()
        got, want = ours.fit_transform(x, sample_weight=w), theirs.fit_transform(x, sample_weight=w)
        torch.testing.assert_close(got, want, equal_nan=True)
        as_numpy, tensor = ours.transform(held_out.numpy()), theirs.transform(held_out)
    assert isinstance(as_numpy, np.ndarray)
    np.testing.assert_allclose(as_numpy, tensor.numpy(), rtol=1e-12)


def test_dispatch_off_and_numpy_inputs_unchanged():
    """Without dispatch a tensor is taken as any array-like (NumPy out), as scikit-learn
    does; with it, NumPy in gives NumPy out."""
    x, _ = _data(torch.float32)
    assert isinstance(nk.MinMaxScaler().fit_transform(x), np.ndarray)
    with sklearn.config_context(array_api_dispatch=True):
        out = nk.MinMaxScaler().fit(x.numpy()).transform(x.numpy())
    assert isinstance(out, np.ndarray) and out.dtype == np.float32


def test_other_inputs_under_dispatch_as_scikit_learn():
    """Frames, lists, sparse matrices and integer arrays with dispatch on: the same output
    types as scikit-learn's (NumPy, or CSR)."""
    pd = pytest.importorskip("pandas")
    sparse = pytest.importorskip("scipy.sparse")
    X = np.random.default_rng(0).normal(size=(6, 3))
    inputs = [pd.DataFrame(X, columns=list("abc")), X.tolist(), sparse.csr_matrix(X),
              (X * 10).astype(np.int64), X.astype(np.float32)]
    with sklearn.config_context(array_api_dispatch=True):
        for data in inputs:
            params = {"with_mean": False} if sparse.issparse(data) else {}
            got = nk.StandardScaler(**params).fit(data).transform(data)
            want = sk.StandardScaler(**params).fit(data).transform(data)
            assert type(got) is type(want) and got.dtype == want.dtype, type(data)
