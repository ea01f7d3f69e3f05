"""The scalers on arrays of other libraries (PyTorch, CuPy, ...) under scikit-learn's array
API dispatch (``sklearn.set_config(array_api_dispatch=True)``), as scikit-learn's own
``StandardScaler`` and ``MinMaxScaler`` take them: outputs and fitted attributes in the
input's namespace and on its device.

normkit's kernels run on NumPy, so such an input is moved to the host (no copy for a CPU
tensor), scaled there, and the result moved back: correct on every device, but on a GPU
each call crosses to the host and back. The statistics are float64 (float32 on a device
without float64, as scikit-learn's). scikit-learn's helpers in ``sklearn.utils._array_api``
are the ones its estimators use, unchanged from 1.6 (the lower bound) to 1.9.
"""

from __future__ import annotations

import functools

import numpy as np
from sklearn import config_context, get_config
from sklearn.utils._array_api import (_convert_to_numpy, _is_numpy_namespace,
                                      _max_precision_float_dtype, get_namespace_and_device)

__all__ = ["dispatch", "host", "namespace", "to_namespace"]


def namespace(X):
    """``(xp, device)`` of ``X`` when it is an array of a library other than NumPy (an
    object with ``__dlpack__``: a tensor, a CuPy array, ...) and array API dispatch is on;
    None otherwise (NumPy, lists, frames, sparse matrices)."""
    if not get_config()["array_api_dispatch"]:
        return None
    return _foreign(X)


def _foreign(X):
    """``(xp, device)`` of another library's array ``X``, else None (dispatch on or not)."""
    if isinstance(X, (np.ndarray, np.generic)) or not hasattr(X, "__dlpack__"):
        return None
    with config_context(array_api_dispatch=True):
        xp, compliant, device = get_namespace_and_device(X)
    if not compliant or _is_numpy_namespace(xp):
        return None
    return xp, device


def host(a):
    """``a`` as a NumPy array on the host where it is another library's array (a fitted
    attribute, also read with dispatch off, as by ``save``; or an input), else ``a``."""
    found = _foreign(a)
    return a if found is None else _convert_to_numpy(a, found[0])


def to_namespace(a, xp, device, dtype=None):
    """The NumPy array ``a`` in ``xp`` on ``device``: in its own dtype, or float64
    statistics in the device's most precise float (``dtype="stats"``)."""
    if dtype == "stats":
        dtype = _max_precision_float_dtype(xp, device)
        a = a.astype(np.float64 if dtype == xp.float64 else np.float32, copy=False)
    return xp.asarray(a, device=device)


def dispatch(method):
    """The scaler method ``method(self, X, ...)`` taking another library's arrays: ``X`` and
    the other array arguments moved to the host, the method run there, then its output
    (or, for ``fit``/``partial_fit``, the fitted arrays) moved to ``X``'s namespace and
    device. The NumPy code reads fitted attributes through ``host``."""
    @functools.wraps(method)
    def run(self, X, *args, **kwargs):
        found = namespace(X)
        if found is None:
            return method(self, X, *args, **kwargs)
        xp, device = found
        out = method(self, host(X), *map(host, args),
                     **{k: host(v) for k, v in kwargs.items()})
        if out is not self:
            return to_namespace(out, xp, device)
        for name, value in list(vars(self).items()):
            if name.endswith("_") and not name.startswith("_") and \
                    isinstance(value, (np.ndarray, np.float64)) and value.dtype == np.float64:
                setattr(self, name, to_namespace(np.asarray(value), xp, device, "stats"))
        return self
    return run
