"""normkit's optional dependencies (pyproject.toml's extras): a missing one is reported
with the extra that installs it, not as a bare ``No module named ...``::

    try:
        import torch
    except ModuleNotFoundError as error:
        raise needs(error, "normkit.nn") from None
"""

from __future__ import annotations

__all__ = ["EXTRAS", "message", "needs"]

#: each optional top-level module, and the extra of normkit that installs it
EXTRAS = {"torch": "torch", "numba": "fast", "sklearn": "sklearn", "pyarrow": "io",
          "tqdm": "io", "dask": "dask", "distributed": "dask", "matplotlib": "study",
          "mnist1d": "study", "triton": "gpu"}


def message(error: ModuleNotFoundError, feature: str) -> str | None:
    """What to tell the user when ``feature`` (a module or a command of normkit) failed
    with ``error``: which optional dependency is missing and how to install it; None when
    ``error`` is not about one of them."""
    root = (error.name or "").partition(".")[0]
    if root not in EXTRAS:
        return None
    return (f"{feature} needs {root}, which is not installed here: "
            f"pip install 'normkit[{EXTRAS[root]}]'")


def needs(error: ModuleNotFoundError, feature: str) -> ModuleNotFoundError:
    """The error to raise for ``error``: one naming the extra that installs the missing
    module, or ``error`` itself when that module is not an optional dependency."""
    text = message(error, feature)
    return error if text is None else ModuleNotFoundError(text, name=error.name)
