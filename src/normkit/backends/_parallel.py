"""Running a CPU kernel over ranges of work items on torch's own threads.

Every CPU kernel is a serial, GIL-free (numba ``nogil``) loop over a range ``[lo, hi)``
of independent work items. ``launch`` splits the items into ``threads`` contiguous ranges
and runs one range per thread.

The threads are torch's: when torch's intra-op parallelism is OpenMP (the Linux wheels:
GNU libgomp in ``torch/lib``), ``launch`` opens a parallel region of *that* runtime with
``GOMP_parallel``, so the work runs on the team that runs torch's own ops. This matters
because an OpenMP worker keeps spinning on its core for a while after each region (its
wait policy); work handed to any other thread right after a torch op has to share that
core with the spinner (``docs/performance.md`` has the measurement). Each thread of the
team runs a small Python callback (ctypes) that looks up its range and calls the kernel,
which releases the GIL at once.

Elsewhere (no OpenMP runtime of torch's found, other systems), and in a process forked
from one that ran a parallel region (GNU OpenMP is not fork-safe: torch's own parallel ops
hang in such a child unless it calls ``torch.set_num_threads(1)``), a small
``ThreadPoolExecutor`` runs the ranges, the calling thread taking the first; it is
recreated after ``fork``.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["launch", "backend", "team_addresses"]

_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


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
        lib.GOMP_parallel.argtypes = [_CALLBACK, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        lib.GOMP_parallel.restype = None
        lib.omp_get_thread_num.restype = ctypes.c_int
        lib.omp_get_num_threads.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return lib


_OMP = _torch_openmp()
_JOBS = {}                       # key -> (kernel, args, bounds, errors) of running launches
_KEYS = itertools.count(1)


def _run_team_member(key):
    kernel, args, bounds, errors = _JOBS[key]
    tid, team = _OMP.omp_get_thread_num(), _OMP.omp_get_num_threads()
    try:
        # a team smaller than asked for (a nested region) still covers every range
        for lo, hi in bounds[tid::team]:
            kernel(*args, lo, hi)
    except BaseException as e:   # noqa: BLE001 -- re-raised by the launching thread
        errors.append(e)


_TEAM_CALLBACK = _CALLBACK(_run_team_member)

_POOL = None
_POOL_LOCK = threading.Lock()


def _after_fork_in_child():
    # the child has none of the parent's threads: neither the pool's nor OpenMP's team
    global _POOL, _OMP
    _POOL, _OMP = None, None


os.register_at_fork(after_in_child=_after_fork_in_child)


def _pool(size):
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers < size:
            _POOL = ThreadPoolExecutor(max_workers=size, thread_name_prefix="normkit-cpu")
        return _POOL


def team_addresses():
    """The addresses of ``GOMP_parallel``, ``omp_get_thread_num`` and
    ``omp_get_num_threads`` of torch's OpenMP runtime (the C++ node opens its parallel
    regions there, ``cpu/native.cpp``), or None where ``backend()`` is not ``"openmp"``."""
    if _OMP is None:
        return None
    return tuple(ctypes.cast(f, ctypes.c_void_p).value
                 for f in (_OMP.GOMP_parallel, _OMP.omp_get_thread_num,
                           _OMP.omp_get_num_threads))


def backend() -> str:
    """``"openmp"`` (torch's team) or ``"threads"`` (normkit's own pool)."""
    return "openmp" if _OMP is not None else "threads"


def launch(kernel, total, threads, *args):
    """``kernel(*args, lo, hi)`` over [0, total) in ``threads`` contiguous ranges at once."""
    threads = max(1, min(threads, total))
    step = -(-total // threads)
    bounds = [(lo, min(total, lo + step)) for lo in range(0, total, step)]
    if len(bounds) == 1:
        kernel(*args, 0, total)
        return
    if _OMP is not None:
        key, errors = next(_KEYS), []
        _JOBS[key] = (kernel, args, bounds, errors)
        try:
            _OMP.GOMP_parallel(_TEAM_CALLBACK, key, len(bounds), 0)   # releases the GIL
        finally:
            del _JOBS[key]
        if errors:
            raise errors[0]
        return
    futures = [_pool(len(bounds) - 1).submit(kernel, *args, lo, hi) for lo, hi in bounds[1:]]
    kernel(*args, *bounds[0])
    for f in futures:
        f.result()
