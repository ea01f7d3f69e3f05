"""Keep numba's on-disk cache of the kernels true to the sources they were compiled from.

numba keys a cached kernel to the file that defines it (its modification time and size),
but the kernels of ``rows``, ``planes`` and ``channels_last`` inline code from ``half``,
``stores``, ``moments``, ``tuning`` and ``normkit.stats_numba``. Edit one of those and the
families would go on loading kernels compiled from the old code. So the package records a
digest of all those sources beside the cached files, and when it differs, it removes the
cached kernels before any is loaded; they are compiled anew on first use.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from normkit._numba_cache import cache_dir

STAMP = "normkit-kernel-sources.sha1"

#: the package's modules with no jitted code (dispatch and bookkeeping): editing them
#: keeps the compiled kernels
NOT_KERNELS = frozenset({"__init__.py", "__main__.py", "plans.py", "native.py",
                         "compiling.py", "_cache.py"})


def sources_digest(paths) -> str:
    """SHA-1 over the names and contents of ``paths``."""
    h = hashlib.sha1()
    for p in sorted(Path(p) for p in paths):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def drop_stale(cache_dir, digest) -> int:
    """Remove numba's cached files (``*.nbi``, ``*.nbc``) in ``cache_dir`` unless its stamp
    says they were compiled from sources with ``digest``; returns how many were removed.
    Another process removing or writing the same files at the same time is harmless: a
    missing cache entry is compiled again."""
    cache_dir = Path(cache_dir)
    stamp = cache_dir / STAMP
    try:
        if stamp.read_text() == digest:
            return 0
    except OSError:
        pass
    removed = 0
    for f in list(cache_dir.glob("*.nbi")) + list(cache_dir.glob("*.nbc")):
        try:
            f.unlink()
            removed += 1
        except OSError:
            pass
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        stamp.write_text(digest)
    except OSError:          # a read-only install: numba cannot cache there either
        pass
    return removed


def check_package_cache() -> None:
    """Drop this package's cached kernels if any of their sources changed since."""
    here = Path(__file__).resolve().parent
    import normkit.stats_numba as shared

    kernels = [p for p in here.glob("*.py") if p.name not in NOT_KERNELS]
    digest = sources_digest(kernels + [Path(shared.__file__)])
    found = cache_dir(str(here / "rows.py"))   # the folder numba itself picks
    if found is not None:
        drop_stale(found, digest)
