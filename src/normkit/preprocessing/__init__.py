"""Feature scaling: scikit-learn estimators over normkit's mergeable statistics.

``StandardScaler`` and ``MinMaxScaler`` are drop-ins for scikit-learn's (fit, partial_fit,
transform, inverse_transform, set_output, the same fitted attributes) that compute their
statistics in one pass with float64 accumulators, keep float32 data float32, fit Dask
collections (``preprocessing._dask``), and save to readable JSON. ``standard_score`` and
``min_max_scale`` are their function twins. Requires scikit-learn (extra ``sklearn``);
numba (extra ``fast``) makes them multi-threaded.
"""

from normkit.preprocessing._persist import ScalerFileError
from normkit.preprocessing._persist import load as _load
from normkit.preprocessing._scalers import (
    SCALERS,
    MinMaxScaler,
    StandardScaler,
    min_max_scale,
    standard_score,
)

__all__ = [
    "MinMaxScaler",
    "ScalerFileError",
    "StandardScaler",
    "load_scaler",
    "min_max_scale",
    "standard_score",
]


def load_scaler(path):
    """Read a scaler file written by ``save`` (either kind) and return the fitted scaler."""
    return _load(path, SCALERS)
