"""``normkit.backends._memory.empty_like``: torch's empty_like, with the 2 MiB-aligned
interior of large outputs advised MADV_HUGEPAGE (and nothing else changed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from normkit.backends import _memory

HUGE = 1 << 21


@pytest.mark.parametrize("shape,fmt", [((3, 5), torch.contiguous_format),
                                       ((64, 256, 16, 16), torch.channels_last),
                                       ((2048, 2048), torch.contiguous_format)])
def test_same_as_torch_empty_like(shape, fmt):
    x = torch.randn(shape).contiguous(memory_format=fmt)
    y = _memory.empty_like(x)
    assert y.shape == x.shape and y.dtype == x.dtype and y.stride() == x.stride()


def test_large_outputs_advise_their_aligned_interior(monkeypatch):
    calls = []
    monkeypatch.setattr(_memory, "_MADVISE", lambda addr, n, advice: calls.append((addr, n, advice)))
    small = _memory.empty_like(torch.empty(1024, 1024))          # 4 MiB: below the limit
    assert calls == [] and small.numel() == 1024 * 1024
    big = _memory.empty_like(torch.empty(4096, 1024, 3))       # 48 MiB
    (addr, n, advice), = calls
    start, end = big.data_ptr(), big.data_ptr() + big.numel() * 4
    assert advice == 14 and addr % HUGE == 0 and n % HUGE == 0
    assert start <= addr < start + HUGE and end - HUGE < addr + n <= end


@pytest.mark.parametrize("setting", [None, "0", "1"])
def test_opt_in_by_the_environment(setting):
    # off unless NORMKIT_HUGE_PAGES=1 (and then only where THP is in madvise mode)
    code = ("from normkit.backends import _memory; import sys; "
            "sys.exit(10 + _memory.huge_pages_advised())")
    env = {"PATH": ""} if setting is None else {"NORMKIT_HUGE_PAGES": setting, "PATH": ""}
    advised = setting == "1" and "[madvise]" in _memory.thp_mode() and sys.platform == "linux"
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 10 + advised


@pytest.mark.skipif(_memory._MINCORE is None, reason="mincore is Linux-only")
@pytest.mark.skipif("MALLOC_MMAP_MAX_" in os.environ, reason="large blocks come from the heap")
def test_resident_tells_touched_memory_from_a_fresh_mapping():
    import mmap

    assert _memory.resident(torch.zeros(1 << 20))                  # written: in RAM
    # a new anonymous mapping of 64 MiB, nothing touched yet (made here: whether
    # torch.empty maps anew depends on the allocator's state after the tests before)
    region = mmap.mmap(-1, 64 << 20)
    fresh = torch.frombuffer(region, dtype=torch.float32)
    assert not _memory.resident(fresh)
    fresh.fill_(1.0)
    assert _memory.resident(fresh)
    assert not _memory.resident(torch.empty(0))
    del fresh
    region.close()
