"""Atomic file writes: the scaler files, the study's results and ``normkit scale`` outputs.

A file is written to a hidden temporary ``.NAME.<random>.tmp`` beside its destination and renamed
over it only when complete, so readers see the old file or the new one, never half of one.
The writer holds an advisory lock (``flock``) on its temporary file while it writes; a later
write to the same destination removes the temporaries whose lock is free, the ones left by a
run that was killed, and leaves those of a writer still at work. Errors name the destination
the caller gave, never the temporary file.
"""

from __future__ import annotations

import glob
import os
import tempfile
from contextlib import contextmanager

try:
    import fcntl
except ImportError:  # Windows: no flock; stale temporaries are left alone there
    fcntl = None

__all__ = ["atomic_path", "write_text_atomic"]


def _folder_of(path: str) -> str:
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{path}: the folder {os.path.dirname(path) or folder} does not exist; "
                                "create it first or write elsewhere.")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a folder; give a file name to write.")
    return folder


def _remove_stale(folder: str, name: str):
    """Delete the temporaries of ``name`` in ``folder`` that no live writer holds."""
    if fcntl is None:
        return
    for tmp in glob.glob(os.path.join(glob.escape(folder), f".{glob.escape(name)}.*.tmp")):
        try:
            fd = os.open(tmp, os.O_RDONLY)
        except OSError:
            continue  # gone already, or not ours to read
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a writer holds it
        else:
            os.unlink(tmp)
        finally:
            os.close(fd)


@contextmanager
def atomic_path(path):
    """Yield a temporary path beside ``path``; rename it to ``path`` if the block succeeds,
    delete it otherwise. Stale temporaries of earlier, interrupted writes to ``path`` are
    removed first."""
    path = os.fspath(path)
    folder = _folder_of(path)
    name = os.path.basename(path)
    _remove_stale(folder, name)
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    except OSError as exc:
        raise type(exc)(exc.errno, f"{path}: cannot write into {folder}: {exc.strerror}") from None
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd closes, or when this process dies
        yield tmp
        os.replace(tmp, path)
    finally:
        os.close(fd)
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text_atomic(path, text: str):
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
