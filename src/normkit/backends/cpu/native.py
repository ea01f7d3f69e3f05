"""The CPU executor: every CPU call of normkit's kernels runs in a C++ ``Plan``
(``native.cpp``), one per shape.

``build`` makes it from a family's decisions (``plans``): the family's two kernel entries
compiled as C callbacks (``args.callback``, one compilation per storage and statistics
dtype, kept in numba's cache), the argument array with the plan's constants
(``args.constants``), each direction's stages and scratch (``args.Work``), the
statistics' shape, the defaults for a missing weight or bias, and the grouping (for the
double backward). The Plan allocates with ATen, runs the kernels -- in ranges on torch's
OpenMP team when threaded (``_parallel.team_addresses``) -- and updates BatchNorm's
running buffers, with no Python between the call and the kernels; its ``apply`` does the
same and records its autograd node (``NormNode``), whose backward is differentiated
through ``torch.ops.normkit.norm_backward`` (double backward).

The extension is compiled with ``torch.utils.cpp_extension.load`` the first time it is
needed by an install (a C++ compiler and ninja, about 20-40 s, announced on standard
error, while the first call's kernels compile; cached in the install's own folder below
torch's extension folder, ``TORCH_EXTENSIONS_DIR``, and loaded in milliseconds after);
``python -m normkit.backends.cpu`` compiles it ahead of time (``make setup`` does). Without a
compiler, or with ``NORMKIT_NATIVE=0``, there is no CPU executor: every CPU call takes the
composite torch path (``normkit.backends.torch_ops``: correct, slower), with one warning
that says so.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from normkit.backends import _parallel
from normkit.backends.cpu import args, compiling

__all__ = ["build", "build_folder", "extension", "enabled", "switch"]

#: the extension's C++ sources, in this package: the executor, and what it does to tensors
#: beside running kernels
SOURCES = ("native.cpp", "native_support.cpp")


def build(family, x):
    """The C++ ``Plan`` that runs the calls of ``family`` (a ``plans`` object built for
    ``x``); the extension must be loaded (``extension()``)."""
    ext = extension()
    g, act = family.grouping, family.activation
    forward, backward = compiling.plan_callbacks(family)
    ones, zeros = _defaults(family.params, family.sdtype)
    return ext.Plan(x.new_empty(0), forward.address, backward.address,
                    args.constants(family, family.forward_entry, family.backward_entry),
                    list(family.forward_work), list(family.backward_work),
                    list(family.stat_shape), ones, zeros, g.kind,
                    list(g.view), list(g.reduce),
                    None if g.param_view is None else list(g.param_view), family.center,
                    family.threads, family.rows_of_channels, family.huge, family.stream_bytes,
                    family.stream_fresh, "" if act is None else act.name,
                    0.0 if act is None else act.slope)


_DEFAULTS: dict = {}


def _defaults(params, sdtype):
    """The weight and bias (ones, zeros) that a plan reads where a call gives none, one
    pair per size and dtype for every plan (read only). A pair of its own per plan, small
    aligned tensors made while large ones were freed, split the freed memory into pieces
    that glibc could neither reuse for the next, larger, input nor give back: 1.9 GB kept
    after 512 new sequence lengths of four LayerNorms (docs/performance.md, "Inputs of
    many shapes")."""
    pair = _DEFAULTS.get((params, sdtype))
    if pair is None:
        ones = torch.ones(params, dtype=sdtype)
        pair = _DEFAULTS[(params, sdtype)] = (ones, torch.zeros(params, dtype=sdtype))
    return pair


def enabled() -> bool:
    """Whether the environment leaves the path on (``NORMKIT_NATIVE`` unset, or not 0)."""
    return os.environ.get("NORMKIT_NATIVE", "1").strip().lower() not in ("0", "false", "no",
                                                                           "off")


_extension = None          # the loaded module; False: unavailable or switched off
_loading = threading.RLock()   # one thread loads or builds it; the others wait for it


def extension(meanwhile=None):
    """The compiled C++ extension (built on first use), or None. ``meanwhile``: work that
    the caller needs next, done while the extension builds (a build runs in a compiler
    process, leaving this one free: the first call compiles its kernels then)."""
    global _extension
    if _extension is None:
        with _loading:
            if _extension is None:
                _extension = _load(meanwhile) if enabled() else _switched_off()
    return _extension or None


def _switched_off():
    warnings.warn("NORMKIT_NATIVE=0: normkit's C++ executor is switched off, and "
                  "normalizations on the CPU take the slower composite torch path",
                  RuntimeWarning, stacklevel=3)
    return False


def switch(on: bool) -> None:
    """Turn the path on (the extension loaded at the next plan, unless ``NORMKIT_NATIVE=0``)
    or off for this process, and forget every plan so that the next calls choose again
    (tests run both paths this way)."""
    global _extension
    import normkit.backends as dispatch

    _extension = None if on else False
    dispatch.clear_plans()


def _load(meanwhile=None):
    """The extension, loaded or built; False (with a warning) where it cannot be. A build
    runs in a thread (its compiler in other processes) while this one does ``meanwhile``."""
    from torch.utils import cpp_extension

    sources = [Path(__file__).with_name(name) for name in SOURCES]
    try:
        folder = build_folder()
        building = _say_if_building(folder, sources)
    except OSError:            # (no extension folder: the build meets it too, and says so)
        folder, building = None, False
    if meanwhile is None or not building:
        return _build(cpp_extension, sources, folder)
    with ThreadPoolExecutor(1) as pool:
        built = pool.submit(_build, cpp_extension, sources, folder)
        try:
            meanwhile()
        finally:
            ext = built.result()
    return ext


def _build(cpp_extension, sources, folder):
    try:
        with _ninja_on_path(), _sole_builder(folder):
            ext = cpp_extension.load(name="normkit_native", sources=[str(s) for s in sources],
                                     extra_cflags=["-O2"],
                                     build_directory=None if folder is None else str(folder))
        ext.set_slots(args.SLOTS)
        team = _parallel.team_addresses()
        if team is not None:
            ext.set_team(*team)
        return ext
    except Exception as error:   # no compiler, no ninja, no headers: the composite path
        warnings.warn(
            f"normkit could not build its C++ executor ({type(error).__name__}: "
            f"...{str(error)[-600:]}); normalizations on the CPU take the slower composite "
            f"torch path. It needs a C++ compiler, ninja (`pip install ninja`) and a "
            f"writable build folder (TORCH_EXTENSIONS_DIR); set NORMKIT_NATIVE=0 to skip "
            f"the attempt", RuntimeWarning, stacklevel=1)
        return False


def build_folder() -> Path:
    """The folder this install builds its extension in: one per folder of normkit's
    sources, below torch's extension folder. With one folder for all, two installs on a
    machine (two environments, a checkout beside a wheel) rebuilt it in turn, 20-40 s at
    each switch: torch's build starts over for sources at another path."""
    from torch.utils import cpp_extension

    key = hashlib.sha256(str(Path(__file__).resolve().parent).encode()).hexdigest()[:12]
    return Path(cpp_extension._get_build_directory(f"normkit_native-{key}", False))


def _say_if_building(folder, sources) -> bool:
    """Whether a build comes (none built for these sources yet), said in one line on
    standard error: what, how long, and how to do it ahead of time."""
    newer = max(source.stat().st_mtime for source in sources)
    ninja = folder / "build.ninja"
    if (ninja.exists() and all(str(source) in ninja.read_text() for source in sources)
            and any(p.stat().st_mtime >= newer for p in folder.glob("normkit_native*.so"))):
        return False
    print("normkit: compiling its C++ executor once for this install (about 20-40 s); "
          "`python -m normkit.backends.cpu` does it ahead of time", file=sys.stderr, flush=True)
    return True


@contextlib.contextmanager
def _sole_builder(folder):
    """This process alone builds and loads the extension in ``folder`` while it holds an
    OS lock on ``normkit.lock`` there, which the system releases however the process ends.
    torch's build takes its own lock, a file that only its holder removes; one left by a
    process killed mid-build (a kernel restart, a job's time limit) made every later
    process wait for it forever. Under the OS lock, such a file has no live holder and is
    removed. (No ``fcntl``, as on Windows, or a file system that refuses the lock: torch's
    lock alone.)"""
    try:
        import fcntl
    except ImportError:
        fcntl = None
    held = None
    if folder is not None and fcntl is not None:
        try:
            held = open(folder / "normkit.lock", "a")
            fcntl.flock(held, fcntl.LOCK_EX)      # released when the file closes
        except OSError:
            if held is not None:
                held.close()
            held = None
    if held is None:
        yield
        return
    with held:
        left = folder / "lock"
        if _lock_file_blocks() and left.exists():
            print(f"normkit: removing {left}, left by a build of the C++ executor that did "
                  f"not finish", file=sys.stderr, flush=True)
            left.unlink(missing_ok=True)
        yield


def _lock_file_blocks() -> bool:
    """Whether torch's build lock is a file whose existence blocks (its ``FileBaton``: 2.13
    has it). 2.14.1 and 2.15.0 hold an OS lock on that file instead, which stays after every
    build: removing it there would say "did not finish" at each start, and could take the
    file from under a live holder."""
    from torch.utils import cpp_extension

    return hasattr(cpp_extension, "FileBaton")


@contextlib.contextmanager
def _ninja_on_path():
    """The ninja of the ``ninja`` package (the ``fast`` extra) on PATH for the build alone,
    where PATH has none (torch's build looks it up there); PATH restored after."""
    try:
        import ninja
    except ImportError:
        yield
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR in path.split(os.pathsep):
        yield
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path
