"""``normkit.backends.cpu``: the interface (supports/forward/backward) and layout choice."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("numba")

import normkit.functional as NF  # noqa: E402
from normkit import backends  # noqa: E402
from normkit import grouping as G  # noqa: E402
from normkit.backends import cpu, torch_ops  # noqa: E402
from normkit.backends.cpu import rows  # noqa: E402


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
    calls = []
    real = rows.rows_forward

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(rows, "rows_forward", spy)
    NF.layer_norm(torch.randn(3, 7), [7])
    assert calls
