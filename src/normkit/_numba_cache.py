"""Where numba keeps the compiled kernels of a module on disk, and whether it can.

The kernels are jitted with ``cache=True``: numba stores their machine code and loads it
in later processes instead of compiling again (seconds to a minute on 2 cores). It looks
for a writable folder in order: ``NUMBA_CACHE_DIR``, the module's own ``__pycache__``,
then a per-user folder (``~/.cache/numba``). A read-only install run where the home folder
is not writable either (a container with a read-only root filesystem, a serverless
runtime) has none, and there numba's decorator refuses ``cache=True`` with a RuntimeError
at import. So normkit asks numba's own search first, with a stand-in function from the
module's file, and where it finds no folder compiles without the disk cache, saying so
once (the first call of each kind then compiles in every process).
"""

from __future__ import annotations

import functools
import os
import warnings

__all__ = ["cache_dir", "can_cache"]


def _stand_in(path):
    """A function whose code says it was defined in ``path`` (what numba's search reads)."""
    namespace: dict = {}
    exec(compile("def stand_in():\n    pass\n", path, "exec"), namespace)
    return namespace["stand_in"]


@functools.lru_cache(maxsize=None)
def cache_dir(path: str) -> str | None:
    """The folder numba caches the jitted functions of the module at ``path`` in (numba's
    own choice, ``NUMBA_CACHE_DIR`` and ``NUMBA_CACHE_LOCATOR_CLASSES`` honoured), or None
    where it finds none writable."""
    from numba.core.caching import FunctionCache

    try:
        return FunctionCache(_stand_in(os.path.abspath(path))).cache_path
    except RuntimeError as error:          # numba's "no locator available", and only that
        if "no locator" not in str(error):
            raise
        return None


def can_cache(path: str) -> bool:
    """Whether the kernels of the module at ``path`` can take ``cache=True``; where not, a
    RuntimeWarning once per folder that says what it costs and how to avoid it."""
    if cache_dir(path) is not None:
        return True
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in _warned:
        _warned.add(folder)
        warnings.warn(
            f"normkit: numba finds no writable folder to cache the compiled kernels of "
            f"{folder} (not its __pycache__, not the user's cache folder under "
            f"HOME={os.environ.get('HOME', '')!r}): they compile again in each process, "
            f"seconds to a minute on first use. Set NUMBA_CACHE_DIR to a writable folder "
            f"to keep them", RuntimeWarning, stacklevel=3)
    return False


_warned: set = set()
