"""``normkit.backends.cpu``: the interface (supports/forward/backward) and layout choice."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("numba")

import normkit.functional as NF  # noqa: E402
from normkit import backends  # noqa: E402
from normkit import grouping as G  # noqa: E402
from normkit.backends import cpu, torch_ops  # noqa: E402
from normkit.backends.cpu import entries, native  # noqa: E402


def test_dispatch_picks_the_numba_backend_on_cpu():
    x = torch.randn(4, 8, 5, 5)
    assert backends.select(x, G.layer(x.shape, 2)) is cpu
    assert backends.select(x, G.batch(x.shape)) is cpu
    assert backends.select(x.to(memory_format=torch.channels_last), G.group(x.shape, 2)) is cpu
    assert backends.select(x.bfloat16(), G.instance(x.shape), fixed=True) is cpu
    # what it does not handle falls back to the composite path
    assert backends.select(x, G.dims(x.shape, (0, 2))) is torch_ops
    assert backends.select(x.transpose(2, 3), G.layer(x.shape, 1)) is torch_ops
    assert backends.select(x.to(torch.int32), G.layer(x.shape, 1)) is torch_ops


def test_layout_names_the_kernel_family():
    x = torch.randn(4, 8, 5, 5)
    assert cpu.layout(x.view(-1, 5), G.layer(x.shape, 1)) == "rows"
    assert cpu.layout(x.view(4, 8, 25), G.batch(x.shape)) == "nchw"
    xc = x.to(memory_format=torch.channels_last)
    assert cpu.layout(xc.view(4, 8, 25), G.instance(x.shape)) == "channels_last"
    # (N, C) BatchNorm: one position per channel, a row of C channels
    assert cpu.layout(torch.randn(7, 6).view(7, 6, 1), G.batch((7, 6))) == "channels_last"
    rows_apart = torch.randn(6, 20)[:, :10]                        # (M, K), rows not adjacent
    assert cpu.layout(rows_apart, G.layer(rows_apart.shape, 1)) is None


def test_functional_runs_the_numba_kernels(monkeypatch):
    """(the Python plans' path; the C++ node's is in test_native.py)"""
    calls = []
    real = entries.rows_forward

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(entries, "rows_forward", spy)
    native.switch(False)
    try:
        NF.layer_norm(torch.randn(3, 7), [7])
    finally:
        native.switch(True)
    assert calls


def test_cached_kernels_are_dropped_when_a_source_changes(tmp_path):
    """numba keys a cached kernel to its own file only; the package's digest of all its
    sources decides whether the cached kernels may be loaded."""
    from normkit.backends.cpu import _cache

    src = tmp_path / "src"
    src.mkdir()
    (src / "stores.py").write_text("A = 1\n")
    (src / "rows.py").write_text("B = 2\n")
    cache = tmp_path / "cache"
    digest = _cache.sources_digest(src.glob("*.py"))
    assert _cache.drop_stale(cache, digest) == 0           # nothing cached yet: stamp written
    for name in ("rows.rows_forward-40.py311.nbi", "rows.rows_forward-40.py311.1.nbc"):
        (cache / name).write_bytes(b"compiled")
    assert _cache.drop_stale(cache, digest) == 0           # same sources: kept
    assert len(list(cache.glob("*.nb?"))) == 2
    (src / "stores.py").write_text("A = 3\n")              # a file the kernels inline
    changed = _cache.sources_digest(src.glob("*.py"))
    assert changed != digest
    assert _cache.drop_stale(cache, changed) == 2          # stale: removed
    assert not list(cache.glob("*.nb?"))
    assert _cache.drop_stale(cache, changed) == 0
