"""A plan's kernel entries compiled side by side on a new machine.

A plan needs two callbacks, its forward and its backward entry (``args.callback``), and
on an empty numba cache each takes 2-10 s to compile, on one thread. ``callbacks``
compiles the first in this process and hands the others to a helper process, which
compiles them into numba's cache at the same time; this process then loads them from
there, in milliseconds. So the first call of a plan waits for its slowest entry rather
than for the sum.

The helper is one ``python -c`` process of this interpreter, package and cache folder,
not a ``multiprocessing`` child: those are spawned by importing the user's main script
again. It is started at the first need and kept while compilations come, so that only
the first pays its start (about 1.5 s) and numba's own warm-up (about 4 s), both while
this process compiles; ``IDLE_S`` after its last task its input is closed and it leaves
(it holds about 370 MB while it lives: torch and numba imported).
With one core (or ``ENABLED = False``), or where the helper cannot start or fails, this
process compiles the entry itself, as it did before the helper: slower, the same callback.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
from pathlib import Path

import numba
import numpy as np

from normkit.backends.cpu import args, entries

__all__ = ["callbacks", "plan_callbacks", "ENABLED", "IDLE_S"]

#: whether the helper is used: more than one core, and ``sys.executable`` a Python (not a
#: frozen application's binary); False: every entry compiles here
ENABLED = (os.cpu_count() or 1) > 1 and not getattr(sys, "frozen", False)
#: seconds without a task after which the helper's input is closed (it then exits)
IDLE_S = 30.0

_lock = threading.Lock()      # one caller at a time talks to the helper
_helper = None                # the running helper (subprocess.Popen), or None
_idle = None                  # the timer that closes it


def plan_callbacks(family) -> tuple:
    """The forward and the backward callback of a plan of ``family`` (``plans``)."""
    return callbacks((family.forward_entry, family.backward_entry), family.proto,
                     family.sproto, family.activation is not None)


def callbacks(kernels, proto, sproto, fused=False) -> tuple:
    """``args.callback(entry, proto, sproto, fused)`` of each entry in ``kernels``; those in
    neither this process nor numba's cache, past the first, compiled by the helper while
    this process compiles the first."""
    fresh = [e for e in kernels if not args.compiled(e, proto, sproto, fused)]
    # (numba's cache probed only where a helper could take something)
    cold = ([e for e in fresh if not args.cached(e, proto, sproto, fused)]
            if ENABLED and len(fresh) > 1 else [])
    if len(cold) > 1:
        with _lock:
            helper = _ask(cold[1:], proto, sproto, fused)
            try:
                args.callback(cold[0], proto, sproto, fused)
            finally:
                for _ in cold[1:]:              # one line per entry; none: the helper died
                    if helper is not None and not helper.stdout.readline():
                        break
                _close_later()
    return tuple(args.callback(e, proto, sproto, fused) for e in kernels)


def _ask(cold, proto, sproto, fused):
    """The helper (started if none runs) with one task per entry of ``cold`` written to
    it; None where it cannot start or take them."""
    global _helper
    if _idle is not None:
        _idle.cancel()
    tasks = "".join(f"{e.__name__} {proto.dtype.str} {sproto.dtype.str} {int(fused)}\n"
                    for e in cold)
    for _ in range(2):                          # a helper that left just now: start anew
        try:
            if _helper is None or _helper.poll() is not None:
                _helper = _start()
            _helper.stdin.write(tasks)
            _helper.stdin.flush()
            return _helper
        except OSError:                         # (BrokenPipeError among them)
            _helper = None
    return None


def _start():
    # this process's numba cache folder, and the folder it found normkit in, appended to
    # the helper's path (the folder may be on this process's sys.path alone)
    package = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ)
    if numba.config.CACHE_DIR:
        env["NUMBA_CACHE_DIR"] = numba.config.CACHE_DIR
    code = (f"import sys; sys.path.append({package!r}); "
            f"from normkit.backends.cpu import compiling; compiling.serve()")
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            bufsize=1)


def _close_later() -> None:
    global _idle
    _idle = threading.Timer(IDLE_S, _close)
    _idle.daemon = True
    _idle.start()


def _close() -> None:
    """Close the helper (after ``IDLE_S``, or at exit: an idle one, since a call waits for
    its entries, so that no child process and pipes are left to the interpreter's end)."""
    global _helper
    with _lock:
        helper, _helper = _helper, None
    if helper is not None:
        helper.stdin.close()                    # the helper reads to the end and exits
        helper.wait()
        helper.stdout.close()


def _forget_in_child() -> None:
    """A forked child has no helper of its own: it drops its copies of the parent's pipes
    (so that the helper still leaves when the parent closes them) and starts its own."""
    global _helper, _idle, _lock
    helper, _helper, _idle, _lock = _helper, None, None, threading.Lock()
    if helper is not None:
        helper.stdin.close()
        helper.stdout.close()


if hasattr(os, "register_at_fork"):          # (POSIX; Windows does not fork)
    os.register_at_fork(after_in_child=_forget_in_child)
atexit.register(_close)


def serve() -> None:
    """The helper: compile each task read from standard input into numba's cache and
    answer with its entry's name, until the input ends."""
    args.quiet()
    for line in sys.stdin:
        name, storage, stats, fused = line.split()
        args.callback(getattr(entries, name), np.empty(0, storage), np.empty(0, stats),
                      fused == "1")
        sys.stdout.write(name + "\n")
        sys.stdout.flush()
