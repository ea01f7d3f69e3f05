"""Batch Renormalization: against torch BatchNorm (r_max = 1, d_max = 0), the NumPy
reference, autograd of the paper's formula with r and d detached, and gradcheck."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn as tnn

import normkit.functional as F
import normkit.nn as nkn
from normkit import reference as R

TOL = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=2e-5, rtol=2e-5)}
SHAPES = [(5, 3), (4, 3, 7), (3, 2, 5, 3), (2, 3, 2, 3, 4)]
TORCH_BN = {2: tnn.BatchNorm1d, 3: tnn.BatchNorm1d, 4: tnn.BatchNorm2d, 5: tnn.BatchNorm3d}
RENORM = {2: nkn.BatchRenorm1d, 3: nkn.BatchRenorm1d, 4: nkn.BatchRenorm2d,
          5: nkn.BatchRenorm3d}


def _data(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    c = shape[1]
    x = torch.randn(shape, generator=gen, dtype=dtype) * 2 + 1
    g = torch.randn(shape, generator=gen, dtype=dtype)
    w = torch.rand(c, generator=gen, dtype=dtype) + 0.5
    b = torch.randn(c, generator=gen, dtype=dtype)
    # running statistics off the batch's, so that r and d are far from 1 and 0
    rm = torch.randn(c, generator=gen, dtype=dtype) * 3
    rv = torch.rand(c, generator=gen, dtype=dtype) * 8 + 0.05
    return x, g, w, b, rm, rv


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("momentum", [0.1, None])
def test_limits_one_and_zero_is_batchnorm(shape, dtype, momentum):
    c = shape[1]
    ref = TORCH_BN[len(shape)](c, momentum=momentum, dtype=dtype)
    brn = RENORM[len(shape)](c, momentum=momentum, dtype=dtype, r_max=1.0, d_max=0.0)
    x, g, w, b, _, _ = _data(shape, dtype)
    with torch.no_grad():
        for m in (ref, brn):
            m.weight.copy_(w), m.bias.copy_(b)
    for step in range(3):
        xr, xb = (x + step).requires_grad_(), (x + step).requires_grad_()
        yr, yb = ref(xr), brn(xb)
        (yr * g).sum().backward()
        (yb * g).sum().backward()
        torch.testing.assert_close(yb, yr, **TOL[dtype])
        torch.testing.assert_close(xb.grad, xr.grad, **TOL[dtype])
    for name in ("weight", "bias"):
        torch.testing.assert_close(getattr(brn, name).grad, getattr(ref, name).grad,
                                   **TOL[dtype])
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(brn, name), getattr(ref, name), **TOL[dtype])
    ref.eval(), brn.eval()
    torch.testing.assert_close(brn(x), ref(x), **TOL[dtype])


def _renorm_autograd(x, w, b, rm, rv, eps, r_max, d_max):
    """The paper's formula written with torch ops, r and d detached: an oracle for the
    reference's hand-derived backward that shares no code with it."""
    dims = [0] + list(range(2, x.dim()))
    shape = [1, -1] + [1] * (x.dim() - 2)
    mu = x.mean(dims, keepdim=True)
    sigma_b = torch.sqrt(((x - mu) ** 2).mean(dims, keepdim=True) + eps)
    sigma = torch.sqrt(rv.view(shape) + eps)
    r = (sigma_b / sigma).clamp(1 / r_max, r_max).detach()
    d = ((mu - rm.view(shape)) / sigma).clamp(-d_max, d_max).detach()
    return w.view(shape) * ((x - mu) / sigma_b * r + d) + b.view(shape), r, d


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("r_max,d_max", [(1.5, 0.5), (3.0, 5.0), (100.0, 100.0)])
def test_reference_backward_matches_autograd_of_the_formula(shape, r_max, d_max):
    x, g, w, b, rm, rv = _data(shape, torch.float64, seed=1)
    xt, wt, bt = (t.clone().requires_grad_() for t in (x, w, b))
    y, r, d = _renorm_autograd(xt, wt, bt, rm, rv, 1e-5, r_max, d_max)
    y.backward(g)
    yr, cache = R.batch_renorm_forward(x.numpy(), rm.numpy(), rv.numpy(), w.numpy(),
                                       b.numpy(), training=True, r_max=r_max, d_max=d_max)
    dx, dw, db = R.batch_renorm_backward(g.numpy(), cache)
    np.testing.assert_allclose(yr, y.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(cache["r"].ravel(), r.ravel().numpy(), rtol=1e-12)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dw, wt.grad.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(db, bt.grad.numpy(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("affine", [True, False])
def test_functional_matches_reference(shape, dtype, affine):
    x, g, w, b, rm, rv = _data(shape, dtype, seed=2)
    if not affine:
        w = b = None
    r_max, d_max = 1.7, 0.6
    # channel 0's running mean far from its batch mean (d clipped), channel 1's on it
    offset = torch.zeros_like(rm)
    offset[0] = 10.0
    rm = x.mean([0] + list(range(2, x.dim()))) + offset
    xt = x.clone().requires_grad_()
    wt = None if w is None else w.clone().requires_grad_()
    bt = None if b is None else b.clone().requires_grad_()
    rmt, rvt = rm.clone(), rv.clone()
    y = F.batch_renorm(xt, rmt, rvt, wt, bt, training=True, momentum=0.2, r_max=r_max,
                       d_max=d_max)
    y.backward(g)
    f64 = (lambda t: None if t is None else t.double().numpy())
    yr, cache = R.batch_renorm_forward(f64(x), f64(rm), f64(rv), f64(w), f64(b), True, 0.2,
                                       1e-5, r_max, d_max)
    dx, dw, db = R.batch_renorm_backward(f64(g), cache)
    clipped = np.abs(cache["d"]) == d_max
    assert clipped.any() and not clipped.all()            # the test covers both sides
    tol = TOL[dtype]
    close = (lambda a, e: np.testing.assert_allclose(a.detach().double().numpy(), e,
                                                     rtol=tol["rtol"] * 10, atol=tol["atol"] * 10))
    close(y, yr)
    close(xt.grad, dx)
    if affine:
        close(wt.grad, dw)
        close(bt.grad, db)
    close(rmt, cache["new_running_mean"])
    close(rvt, cache["new_running_var"])


@pytest.mark.parametrize("shape", [(4, 3), (3, 2, 5), (2, 2, 3, 2)], ids=str)
def test_gradcheck_where_r_and_d_are_clipped(shape):
    """r and d are stop-gradient: the true derivative of the forward equals the
    hand-derived gradient only where r and d are locally constant, i.e. clipped."""
    x, _, w, b, _, _ = _data(shape, torch.float64, seed=3)
    c = shape[1]
    rv = torch.full((c,), 1e4, dtype=torch.float64)       # r ~ 0.02: clipped at 1 / r_max
    rm = torch.full((c,), 1e3, dtype=torch.float64)       # d ~ -10: clipped at -d_max

    def fn(x, w, b):
        return F.batch_renorm(x, rm.clone(), rv.clone(), w, b, training=True, r_max=2.0,
                              d_max=1.5)

    args = tuple(t.clone().requires_grad_() for t in (x, w, b))
    assert torch.autograd.gradcheck(fn, args)


def test_unclipped_training_output_is_the_eval_output():
    """Without clipping, x̂·r + d = (x - running_mean) / sigma: the training output is
    what eval mode gives with the running statistics before the update."""
    x, _, w, b, rm, rv = _data((6, 3, 4), torch.float64, seed=4)
    m = nkn.BatchRenorm1d(3, dtype=torch.float64, r_max=1e6, d_max=1e6, warmup_steps=0,
                          r_max_steps=0, d_max_steps=0)
    with torch.no_grad():
        m.weight.copy_(w), m.bias.copy_(b), m.running_mean.copy_(rm), m.running_var.copy_(rv)
    y_eval = m.eval()(x)
    y_train = m.train()(x)
    torch.testing.assert_close(y_train, y_eval, **TOL[torch.float64])
    assert not torch.allclose(m.running_mean, rm)        # and the statistics moved on


def test_warmup_schedule():
    m = nkn.BatchRenorm2d(2, warmup_steps=10, r_max_steps=20, d_max_steps=5, r_max=3.0,
                          d_max=5.0)
    assert m.limits(0) == (1.0, 0.0)
    assert m.limits(10) == (1.0, 0.0)
    assert m.limits(15) == (2.0 - 0.5, 5.0)
    assert m.limits(30) == (3.0, 5.0) == m.limits(10 ** 6)
    assert m.limits() == (1.0, 0.0)                          # num_batches_tracked = 0
    x = torch.randn(4, 2, 3, 3)
    for _ in range(15):
        m(x)
    assert int(m.num_batches_tracked) == 15 and m.limits() == (1.5, 5.0)
    paper = nkn.BatchRenorm1d(2)
    assert paper.limits(5000) == (1.0, 0.0) and paper.limits(45000) == (3.0, 5.0)
    assert paper.limits(30000) == (1.0 + 2.0 * 25000 / 40000, 5.0)


def test_warmup_is_batchnorm():
    """During the warm-up the layer is BatchNorm, whatever its final limits."""
    torch.manual_seed(5)
    ref = tnn.BatchNorm2d(3)
    brn = nkn.BatchRenorm2d(3, warmup_steps=3, r_max_steps=0, d_max_steps=0)
    for _ in range(3):
        x = torch.randn(4, 3, 2, 2) * 4 + 2
        torch.testing.assert_close(brn(x), ref(x), **TOL[torch.float32])
    assert not torch.allclose(brn(x), ref(x))                # step 3: renormalizing


def test_state_dict_is_batchnorm_state_dict():
    ref = tnn.BatchNorm2d(4)
    ref(torch.randn(8, 4, 3, 3))
    brn = nkn.BatchRenorm2d(4)
    assert brn.state_dict().keys() == ref.state_dict().keys()
    brn.load_state_dict(ref.state_dict())
    x = torch.randn(2, 4, 3, 3)
    torch.testing.assert_close(brn.eval()(x), ref.eval()(x))
    assert "r_max=3.0" in repr(brn)


def test_errors():
    with pytest.raises(ValueError, match="track_running_stats=False"):
        nkn.BatchRenorm1d(3, track_running_stats=False)
    with pytest.raises(ValueError, match="r_max >= 1"):
        nkn.BatchRenorm1d(3, r_max=0.5)
    with pytest.raises(ValueError, match="step counts"):
        nkn.BatchRenorm1d(3, warmup_steps=-1)
    with pytest.raises(ValueError, match="expected 4D"):
        nkn.BatchRenorm2d(3)(torch.randn(2, 3))
    with pytest.raises(ValueError, match="running_mean and running_var"):
        F.batch_renorm(torch.randn(4, 3), None, None, training=True)
    with pytest.raises(ValueError, match="more than 1 value"):
        F.batch_renorm(torch.randn(1, 3), torch.zeros(3), torch.ones(3), training=True)
    m = nkn.BatchRenorm2d(3)
    with pytest.raises(ValueError, match="applies no activation"):   # (it was ignored)
        m.activation = "relu"
    m.activation = None
    assert m.activation is None and "activation" not in repr(m)
