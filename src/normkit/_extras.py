"""normkit's optional dependencies (pyproject.toml's extras): a missing one is reported
with the extra that installs it, not as a bare ``No module named ...``::

    try:
        import torch
    except ModuleNotFoundError as error:
        raise needs(error, "normkit.nn") from None
"""

from __future__ import annotations

import warnings

__all__ = ["EXTRAS", "broken", "message", "needs"]

#: each optional top-level module, and the extra of normkit that installs it
EXTRAS = {"torch": "torch", "numba": "fast", "sklearn": "sklearn", "pyarrow": "io",
          "tqdm": "io", "dask": "dask", "distributed": "dask", "matplotlib": "study",
          "mnist1d": "study", "triton": "gpu", "llvmlite": "fast"}


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


def broken(error: ImportError, fast_path: str, instead: str, extra: str) -> None:
    """For an optional fast path that failed to import with ``error``: nothing where its
    dependency is not installed (the path is left out, as documented); where it is
    installed but fails (numba refusing a newer NumPy, say), a RuntimeWarning that names
    the error, what runs ``instead``, and the extra to reinstall."""
    if isinstance(error, ModuleNotFoundError) and error.name in EXTRAS:
        return
    warnings.warn(f"normkit: {fast_path} failed to import ({type(error).__name__}: {error}); "
                  f"{instead}. Reinstall the extra: pip install 'normkit[{extra}]'",
                  RuntimeWarning, stacklevel=3)
