"""torch's own OpenMP runtime, where the C++ executor runs its threads.

Every CPU kernel is a serial, GIL-free loop over a range ``[lo, hi)`` of independent work
items; the C++ plan (``cpu/native.cpp``) splits the items into contiguous ranges and runs
one per thread in a parallel region of torch's OpenMP runtime (``GOMP_parallel``), so the
work runs on the team that runs torch's own ops. That matters because an OpenMP worker
keeps spinning on its core for a while after each region (its wait policy); work handed
to any other thread right after a torch op has to share that core with the spinner
(``docs/performance.md``). This module finds that runtime (the Linux wheels: GNU libgomp
in ``torch/lib``) and hands its addresses to the C++ side.

Without one (other systems, a build of torch on another threading library) every plan
runs on one thread. In a process forked from one that ran a parallel region (GNU OpenMP
is not fork-safe: torch's own parallel ops hang in such a child unless it calls
``torch.set_num_threads(1)``) the C++ side forgets the team (``pthread_atfork``) and runs
the ranges one after the other.
"""

from __future__ import annotations

import ctypes
import os

import torch

__all__ = ["backend", "team_addresses"]


def _torch_openmp():
    """The OpenMP runtime torch's ATen runs on (a ctypes library), or None."""
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps") as f:
            mapped = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return None
    runtimes = sorted(p for p in mapped
                      if os.path.basename(p).startswith(("libgomp", "libiomp5", "libomp")))
    torch_dir = os.path.dirname(torch.__file__)
    own = [p for p in runtimes if p.startswith(torch_dir)]
    # torch's bundled copy if it has one; otherwise the runtime only if it is unambiguous
    candidates = own or (runtimes if len(runtimes) == 1 else [])
    if not candidates:
        return None
    try:
        lib = ctypes.CDLL(candidates[0])
        functions = (lib.GOMP_parallel, lib.omp_get_thread_num, lib.omp_get_num_threads)
    except (OSError, AttributeError):
        return None
    return functions


_OMP = _torch_openmp()


def team_addresses():
    """The addresses of ``GOMP_parallel``, ``omp_get_thread_num`` and
    ``omp_get_num_threads`` of torch's OpenMP runtime, or None where ``backend()`` is not
    ``"openmp"``."""
    if _OMP is None:
        return None
    return tuple(ctypes.cast(f, ctypes.c_void_p).value for f in _OMP)


def backend() -> str:
    """``"openmp"`` (torch's team: plans run threaded) or ``"serial"``."""
    return "openmp" if _OMP is not None else "serial"
