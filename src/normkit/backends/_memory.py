"""Whether large CPU outputs are advised transparent huge pages (``NORMKIT_HUGE_PAGES=1``).

A fresh output of 100 MiB comes from ``mmap`` (glibc serves blocks above its mmap
threshold that way), so the first write to each 4 KiB page faults into the kernel: about
25,000 faults per output, several memory copies' worth of time, torch's outputs and
normkit's alike. Where the kernel runs transparent huge pages in ``madvise`` mode (a
common default), the C++ plan (``cpu/native.cpp``, ``advise_huge``) marks the 2 MiB-aligned
interior of a large new output ``MADV_HUGEPAGE`` before anything touches it, so it faults
2 MiB at a time (``docs/performance.md``). torch does the same for its own allocations
with ``THP_MEM_ALLOC_ENABLE=1``.

The advice is opt-in: ``NORMKIT_HUGE_PAGES=1`` in the environment. It wins for one large
op called again and again (the op benchmarks), but it lost in whole models, where each
step maps its large blocks anew and the huge-page faults' zeroing and compaction cost
more system time than they save (``docs/performance.md``). It changes no value and no
layout; it is skipped for outputs under ``HUGE_MIN_BYTES``, off Linux, and when huge pages
are ``never`` (nothing to gain) or ``always`` (already used).
"""

from __future__ import annotations

import os
import sys

__all__ = ["HUGE_MIN_BYTES", "huge_pages_advised", "thp_mode"]

HUGE_MIN_BYTES = 8 << 20   # smaller outputs keep the default


def thp_mode() -> str:
    """The kernel's transparent-huge-page setting, e.g. ``"always [madvise] never"``
    (the bracketed one is in force), or ``"unknown"``."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def huge_pages_advised() -> bool:
    """Whether large outputs are advised huge pages on this machine and in this
    environment."""
    return (sys.platform == "linux" and os.environ.get("NORMKIT_HUGE_PAGES", "0") == "1"
            and "[madvise]" in thp_mode())
