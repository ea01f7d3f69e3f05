"""The scalers on PyTorch tensors under scikit-learn's array API dispatch
(``normkit.preprocessing._array_api``), against scikit-learn's scalers.
scikit-learn's estimator checks cover it too (``check_array_api_input`` in
test_preprocessing.py, with ``SCIPY_ARRAY_API=1``, which conftest sets)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
sklearn = pytest.importorskip("sklearn")
from sklearn import preprocessing as sk  # noqa: E402

from normkit import preprocessing as nk  # noqa: E402



def _dispatch_available() -> bool:
    """Whether scikit-learn can turn array API dispatch on here: it needs SciPy's array
    API mode (SCIPY_ARRAY_API=1, which conftest sets) and, before 1.7, the array-api-compat
    package (the dev extra's)."""
    try:
        with sklearn.config_context(array_api_dispatch=True):
            return True
    except (ImportError, RuntimeError):
        return False


pytestmark = pytest.mark.skipif(not _dispatch_available(),
                                reason="scikit-learn's array API dispatch cannot be enabled")

CASES = [("StandardScaler", {}), ("StandardScaler", {"with_mean": False}),
         ("MinMaxScaler", {}), ("MinMaxScaler", {"feature_range": (-2, 3), "clip": True})]


def _data(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 5, generator=gen, dtype=torch.float64) * 3 + 7
    x[3, 1] = float("nan")
    return x.to(dtype), (torch.randn(9, 5, generator=gen) * 5).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name,params", CASES)
def test_tensors_in_tensors_out_with_scikit_learns_values(name, params, dtype):
    """Tensors in, tensors of the input's dtype out, fitted attributes float64 tensors; the
    values scikit-learn's scaler computes from the same data as NumPy arrays (its own
    tensor path is not the oracle: 1.6's StandardScaler does not take tensors)."""
    x, held_out = _data(dtype)
    with sklearn.config_context(array_api_dispatch=True):
        ours = getattr(nk, name)(**params).fit(x[:25]).partial_fit(x[25:])
        got = ours.transform(held_out)
        back = ours.inverse_transform(got)
    theirs = getattr(sk, name)(**params).fit(x[:25].numpy()).partial_fit(x[25:].numpy())
    want = theirs.transform(held_out.numpy())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    assert type(got) is torch.Tensor and got.dtype == dtype
    seen = ours.n_samples_seen_                 # (a float64 0-d tensor, an int: as theirs)
    assert type(seen) is (int if name == "MinMaxScaler" else torch.Tensor), type(seen)
    torch.testing.assert_close(got, torch.from_numpy(want), equal_nan=True, **tol)
    torch.testing.assert_close(back, torch.from_numpy(theirs.inverse_transform(want)), **tol)
    for attr in ("mean_", "var_", "scale_", "min_", "data_min_", "data_max_", "data_range_"):
        mine, other = getattr(ours, attr, None), getattr(theirs, attr, None)
        if other is None:
            assert mine is None, attr
            continue
        assert type(mine) is torch.Tensor and mine.dtype == torch.float64, attr
        torch.testing.assert_close(mine, torch.from_numpy(other).double(), rtol=1e-6,
                                   atol=1e-9)


def test_sample_weight_fit_transform_and_numpy_after_tensors():
    """``sample_weight`` as a tensor; ``fit_transform``; a NumPy transform of a scaler
    fitted on tensors returns NumPy (scikit-learn 1.9 refuses it; normkit is lenient)."""
    x, held_out = _data(torch.float64)
    w = torch.rand(40, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    theirs = sk.StandardScaler().fit(x.numpy(), sample_weight=w.numpy())
    with sklearn.config_context(array_api_dispatch=True):
        ours = nk.StandardScaler()
        got = ours.fit_transform(x, sample_weight=w)
        as_numpy = ours.transform(held_out.numpy())
    assert type(got) is torch.Tensor
    torch.testing.assert_close(got, torch.from_numpy(theirs.transform(x.numpy())),
                               equal_nan=True)
    assert isinstance(as_numpy, np.ndarray)
    np.testing.assert_allclose(as_numpy, theirs.transform(held_out.numpy()), rtol=1e-12)


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
    types as scikit-learn's (NumPy, or CSR), or its error (1.6 with a recent
    array-api-compat refuses a DataFrame under dispatch)."""
    pd = pytest.importorskip("pandas")
    sparse = pytest.importorskip("scipy.sparse")
    X = np.random.default_rng(0).normal(size=(6, 3))
    inputs = [pd.DataFrame(X, columns=list("abc")), X.tolist(), sparse.csr_matrix(X),
              (X * 10).astype(np.int64), X.astype(np.float32)]
    with sklearn.config_context(array_api_dispatch=True):
        for data in inputs:
            params = {"with_mean": False} if sparse.issparse(data) else {}
            try:
                want = sk.StandardScaler(**params).fit(data).transform(data)
            except TypeError as error:
                with pytest.raises(type(error)):
                    nk.StandardScaler(**params).fit(data)
                continue
            got = nk.StandardScaler(**params).fit(data).transform(data)
            assert type(got) is type(want) and got.dtype == want.dtype, type(data)


def test_save_of_a_scaler_fitted_on_tensors(tmp_path):
    """The scaler file holds the statistics; the loaded scaler is a NumPy one."""
    x, held_out = _data(torch.float64)
    for cls in (nk.StandardScaler, nk.MinMaxScaler):
        with sklearn.config_context(array_api_dispatch=True):
            fitted = cls().fit(x)
            want = fitted.transform(held_out)
        fitted.save(tmp_path / "scaler.json")
        got = cls.load(tmp_path / "scaler.json").transform(held_out.numpy())
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-12)
