"""``normkit.backends.cpu.rows``: LayerNorm / RMSNorm against torch and the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("numba")

import normkit.functional as NF  # noqa: E402
from _cpu_cases import (DTYPES, check_against_reference, check_against_torch,  # noqa: E402
                        check_prefetch_changes_nothing, inputs, np64, run,
                        threaded)  # noqa: F401 -- the fixture, used by name
from normkit import grouping as G  # noqa: E402
from normkit import reference  # noqa: E402
from normkit.backends import cpu  # noqa: E402

pytestmark = pytest.mark.usefixtures("threaded")

LAYER_SHAPES = [((5, 123, 123), 1), ((3, 7), 1), ((1, 1536), 1), ((4, 3, 5), 2)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,k", LAYER_SHAPES, ids=str)
def test_layer_norm(shape, k, dtype):
    ns = shape[-k:]
    x, w, b, dy = inputs(shape, dtype, 1, offset=3.0)
    # a generator of its own: with the global one the weights depended on the tests run
    # before in the worker, and torch's bf16 dweight fell outside the tolerance for some
    gen = torch.Generator().manual_seed(1)
    w = w.new_ones(ns) + 0.1 * torch.randn(ns, generator=gen).to(dtype)
    b = torch.randn(ns, generator=gen).to(dtype)
    got = run(lambda x, w, b: NF.layer_norm(x, ns, w, b), x, w, b, dy)
    check_against_reference(got, lambda x, w, b: reference.layer_norm_forward(x, ns, w, b),
                            x, w, b, dy, dtype)
    check_against_torch(got, run(lambda x, w, b: F.layer_norm(x, ns, w, b), x, w, b, dy), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,k", LAYER_SHAPES, ids=str)
def test_rms_norm(shape, k, dtype):
    ns = shape[-k:]
    x, _, _, dy = inputs(shape, dtype, 1)
    w = (torch.rand(ns) + 0.5).to(dtype)
    eps = 1e-6
    got = run(lambda x, w, b: NF.rms_norm(x, ns, w, eps), x, w, None, dy)
    check_against_reference(got, lambda x, w, b: reference.rms_norm_forward(x, ns, w, eps),
                            x, w, None, dy, dtype)
    check_against_torch(got, run(lambda x, w, b: F.rms_norm(x, ns, w, eps), x, w, None, dy),
                        dtype)


def test_layer_norm_large_offset_small_spread_and_constant_rows():
    # values near 1e6 with a spread of 1: the variance must survive (no E[x^2] - E[x]^2);
    # the fp32 mean itself is rounded to half an ulp of 1e6 (0.03), which bounds y's error
    x = (1e6 + torch.randn(64, 300, dtype=torch.float64)).float()
    x[3] = 1e6 + 0.5                                        # a constant row: var = 0
    w, b = torch.rand(300) + 0.5, torch.randn(300)
    y, mean, rstd, var = cpu.forward(x, G.layer(x.shape, 1), w, b, 1e-5)
    ry, cache = reference.layer_norm_forward(np64(x), [300], np64(w), np64(b))
    assert torch.isfinite(y).all()
    np.testing.assert_allclose(np64(rstd), cache["rstd"], rtol=1e-4)
    np.testing.assert_allclose(np64(mean), cache["mean"], rtol=1e-7)
    np.testing.assert_allclose(np64(y), ry, atol=2e-3, rtol=0)
    np.testing.assert_allclose(np64(y[3]), np64(b), atol=1e-6)
    x64 = x.double() + torch.randn(64, 300, dtype=torch.float64) * 1e-3
    y64 = NF.layer_norm(x64, [300], w.double(), b.double())
    ry64, _ = reference.layer_norm_forward(np64(x64), [300], np64(w), np64(b))
    np.testing.assert_allclose(np64(y64), ry64, atol=1e-6)


def test_layer_norm_without_affine_and_with_expanded_grad():
    x = torch.randn(6, 33, requires_grad=True)
    y = NF.layer_norm(x, [33])
    y.sum().backward()                                      # grad has zero strides
    xr = x.detach().clone().requires_grad_(True)
    F.layer_norm(xr, [33]).sum().backward()
    torch.testing.assert_close(y, F.layer_norm(xr.detach(), [33]))
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["layer", "rms"])
def test_prefetch_changes_nothing(op, dtype, monkeypatch):
    check_prefetch_changes_nothing(op, dtype, monkeypatch)


@pytest.mark.parametrize("op", ["layer", "rms"])
def test_weight_gradient_over_many_rows_keeps_float64s_digits(op):
    """dweight and dbias sum a column over every row, one row after another (the vector
    lanes run along the row): over 2^18 rows in float32 that was 1.2e-5 off float64 (torch's
    LayerNorm's 1.1e-5); runs of ``rows.GRAD_ROWS`` rows added in float64 keep 2e-7."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 18, 64, generator=gen) + 0.5
    dy = torch.randn(1 << 18, 64, generator=gen)
    w, b = torch.rand(64, generator=gen) + 0.5, torch.randn(64, generator=gen)

    def run(f, dtype):
        xi, wi, bi = (t.to(dtype).detach().requires_grad_() for t in (x, w, b))
        y = (f.layer_norm(xi, (64,), wi, bi) if op == "layer"
             else f.rms_norm(xi, (64,), wi) + bi)
        y.backward(dy.to(dtype))
        return [t.grad.double() for t in (xi, wi, bi)]

    want = run(F, torch.float64)
    for name, got, exact in zip(("dx", "dweight", "dbias"), run(NF, torch.float32), want):
        err = ((got - exact).abs().max() / exact.abs().max()).item()
        assert err < 5e-7, f"{op} {name}: relative error {err:.1e}"
