"""Output tensors of the CPU kernels, backed by transparent huge pages where they help.

A fresh output of 100 MiB comes from ``mmap`` (glibc serves blocks above its mmap
threshold that way), so the first write to each 4 KiB page faults into the kernel: about
25,000 faults per output, several memory copies' worth of time, torch's outputs and
normkit's alike. Where the kernel runs transparent huge pages in
``madvise`` mode (a common default), ``empty_like`` marks the 2 MiB-aligned interior of a
large new output ``MADV_HUGEPAGE`` before anything touches it, so it faults 2 MiB at a
time (``docs/performance.md`` has the measurement). torch does the same for its own
allocations with ``THP_MEM_ALLOC_ENABLE=1``.

The advice is opt-in: ``NORMKIT_HUGE_PAGES=1`` in the environment. It wins for one large
op called again and again (the op benchmarks), but it lost in whole models, where each
step maps its large blocks anew and the huge-page faults' zeroing and compaction cost
more system time than they save (``docs/performance.md``, "Whole models and the per-call
cost"). It changes no value and no layout; it is skipped for outputs under 8 MiB, off
Linux, and when huge pages are ``never`` (nothing to gain) or ``always`` (already used).
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

__all__ = ["empty_like", "huge_pages_advised", "resident", "thp_mode"]

_HUGE = 1 << 21            # 2 MiB, the x86-64 and arm64 (4 KiB base page) huge page
HUGE_MIN_BYTES = 4 * _HUGE  # smaller outputs keep the default
_MADV_HUGEPAGE = 14


def thp_mode() -> str:
    """The kernel's transparent-huge-page setting, e.g. ``"always [madvise] never"``
    (the bracketed one is in force), or ``"unknown"``."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def _madvise():
    """libc's ``madvise`` where advising huge pages can help, else None."""
    if sys.platform != "linux" or os.environ.get("NORMKIT_HUGE_PAGES", "0") != "1":
        return None
    if "[madvise]" not in thp_mode():
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def huge_pages_advised() -> bool:
    """Whether ``empty_like`` advises huge pages for large outputs on this machine."""
    return _MADVISE is not None


def empty_like(t):
    """``torch.empty_like(t)`` (same dtype and memory format), its large interior advised
    ``MADV_HUGEPAGE``."""
    out = torch.empty_like(t)
    nbytes = out.numel() * out.element_size()
    if _MADVISE is not None and nbytes >= HUGE_MIN_BYTES:
        start = out.data_ptr()
        lo = -(-start // _HUGE) * _HUGE
        hi = (start + nbytes) // _HUGE * _HUGE
        if hi > lo:
            _MADVISE(lo, hi - lo, _MADV_HUGEPAGE)   # advice only: a failure changes nothing
    return out


def _mincore():
    """libc's ``mincore`` (Linux), or None."""
    if sys.platform != "linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    fn.restype = ctypes.c_int
    return fn


_MINCORE = _mincore()
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident(t) -> bool:
    """Whether the last page of t's memory is already in RAM (``mincore``): true for a
    block the allocator reuses, false for one it has just mapped (large blocks under
    glibc's default settings), whose pages fault in -- zeroed, so in cache -- at the
    first write. (The last page, because glibc writes a header at the start of a new
    mapping.) False where it cannot tell."""
    nbytes = t.numel() * t.element_size()
    if _MINCORE is None or nbytes == 0:
        return False
    page = (t.data_ptr() + nbytes - 1) // _PAGE * _PAGE
    vec = (ctypes.c_ubyte * 1)()
    if _MINCORE(page, _PAGE, vec) != 0:
        return False
    return bool(vec[0] & 1)
