"""Huge pages and streaming stores of the CPU outputs: ``normkit.backends._memory`` says
whether to advise huge pages; the C++ plan (``cpu/native.cpp``) advises the 2 MiB-aligned
interior of a large output and asks whether an output's memory is mapped already (where
streaming stores pay)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from normkit import grouping as G
from normkit.backends import _memory
from normkit.backends.cpu import native, plans

HUGE = 1 << 21


def _ext():
    ext = native.extension()
    assert ext is not None
    return ext


@pytest.mark.parametrize("elements", [1024 * 1024, 4096 * 1024 * 3, 5])
def test_huge_interior_is_aligned_and_inside(elements):
    t = torch.empty(elements)
    lo, n = _ext().huge_interior(t)
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * 4
    if n:
        assert lo % HUGE == 0 and n % HUGE == 0
        assert start <= lo < start + HUGE and end - HUGE < lo + n <= end
    else:
        assert end - start < 2 * HUGE


@pytest.mark.parametrize("setting", [None, "0", "1"])
def test_opt_in_by_the_environment(setting):
    # off unless NORMKIT_HUGE_PAGES=1 (and then only where THP is in madvise mode); a
    # plan advises only outputs of at least HUGE_MIN_BYTES
    code = ("from normkit.backends import _memory; import sys; "
            "sys.exit(10 + _memory.huge_pages_advised())")
    env = {"PATH": ""} if setting is None else {"NORMKIT_HUGE_PAGES": setting, "PATH": ""}
    advised = setting == "1" and "[madvise]" in _memory.thp_mode() and sys.platform == "linux"
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 10 + advised


def test_plans_advise_large_outputs_only(monkeypatch):
    monkeypatch.setattr(plans, "huge_pages_advised", lambda: True)
    small, big = torch.empty(1024, 1024), torch.empty(4096, 1024)     # 4 MiB, 16 MiB
    assert not plans.Rows(small, G.layer(small.shape, 1), True, False).huge
    assert plans.Rows(big, G.layer(big.shape, 1), True, False).huge
    monkeypatch.setattr(plans, "huge_pages_advised", lambda: False)
    assert not plans.Rows(big, G.layer(big.shape, 1), True, False).huge


@pytest.mark.skipif(sys.platform != "linux", reason="mincore is Linux-only here")
@pytest.mark.skipif("MALLOC_MMAP_MAX_" in os.environ, reason="large blocks come from the heap")
def test_resident_tells_touched_memory_from_a_fresh_mapping():
    import mmap

    ext = _ext()
    assert ext.resident(torch.zeros(1 << 20))                      # written: in RAM
    # a new anonymous mapping of 64 MiB, nothing touched yet (made here: whether
    # torch.empty maps anew depends on the allocator's state after the tests before)
    region = mmap.mmap(-1, 64 << 20)
    fresh = torch.frombuffer(region, dtype=torch.float32)
    assert not ext.resident(fresh)
    fresh.fill_(1.0)
    assert ext.resident(fresh)
    assert not ext.resident(torch.empty(0))
    del fresh
    region.close()
