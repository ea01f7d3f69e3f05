"""The NumPy reference against torch: forward against torch.nn.functional, the hand-derived
backward against torch autograd (``fakeloss = (out * dout).sum()``)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as TF  # noqa: E402

from normkit import reference as R  # noqa: E402


def _t(a, grad=True):
    return torch.tensor(a, dtype=torch.float64, requires_grad=grad)


RNG = np.random.default_rng(0)
X4 = RNG.normal(size=(3, 4, 5, 2)) * 2 + 1
W4, B4 = RNG.uniform(0.5, 1.5, size=4), RNG.normal(size=4)
RM, RV = RNG.normal(size=4), RNG.uniform(0.5, 2, size=4)

CASES = {
    "batch_norm_train": (
        lambda: R.batch_norm_forward(X4, None, None, W4, B4, training=True),
        lambda x, w, b: TF.batch_norm(x, None, None, w, b, training=True)),
    "batch_norm_eval": (
        lambda: R.batch_norm_forward(X4, RM, RV, W4, B4, training=False),
        lambda x, w, b: TF.batch_norm(x, _t(RM, False), _t(RV, False), w, b, training=False)),
    "instance_norm": (
        lambda: R.instance_norm_forward(X4, W4, B4),
        lambda x, w, b: TF.instance_norm(x, weight=w, bias=b)),
    "instance_norm_running": (
        lambda: R.instance_norm_forward(X4, W4, B4, running_mean=RM, running_var=RV,
                                        use_input_stats=False),
        lambda x, w, b: TF.instance_norm(x, _t(RM, False), _t(RV, False), w, b,
                                         use_input_stats=False)),
    "group_norm": (
        lambda: R.group_norm_forward(X4, 2, W4, B4),
        lambda x, w, b: TF.group_norm(x, 2, w, b)),
    "layer_norm": (
        lambda: R.layer_norm_forward(X4, (5, 2), np.ones((5, 2)) * 1.3, np.full((5, 2), 0.2)),
        lambda x, w, b: TF.layer_norm(x, [5, 2], w, b)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_backward_match_torch(name):
    ref_fn, torch_fn = CASES[name]
    out, cache = ref_fn()
    w = cache["weight"]
    x = _t(X4)
    if name == "layer_norm":
        wt, bt = _t(np.ones((5, 2)) * 1.3), _t(np.full((5, 2), 0.2))
    else:
        wt, bt = _t(W4), _t(B4)
    y = torch_fn(x, wt, bt)
    np.testing.assert_allclose(out, y.detach().numpy(), atol=1e-12)
    dout = RNG.normal(size=out.shape)
    fakeloss = (y * _t(dout, False)).sum()
    fakeloss.backward()
    dx, dw, db = R.normalize_backward(dout, cache)
    np.testing.assert_allclose(dx, x.grad.numpy(), atol=1e-11)
    np.testing.assert_allclose(dw, wt.grad.numpy(), atol=1e-11)
    np.testing.assert_allclose(db, bt.grad.numpy(), atol=1e-11)
    assert w is not None


def test_rms_norm_matches_torch():
    x = RNG.normal(size=(4, 7))
    w = RNG.uniform(0.5, 1.5, size=7)
    out, cache = R.rms_norm_forward(x, (7,), w, eps=1e-6)
    xt, wt = _t(x), _t(w)
    y = TF.rms_norm(xt, [7], wt, eps=1e-6)
    np.testing.assert_allclose(out, y.detach().numpy(), atol=1e-12)
    dout = RNG.normal(size=out.shape)
    (y * _t(dout, False)).sum().backward()
    dx, dw, db = R.rms_norm_backward(dout, cache)
    assert db is None
    np.testing.assert_allclose(dx, xt.grad.numpy(), atol=1e-11)
    np.testing.assert_allclose(dw, wt.grad.numpy(), atol=1e-11)


def test_batch_norm_running_update_matches_torch():
    rm, rv = torch.tensor(RM), torch.tensor(RV)
    TF.batch_norm(torch.tensor(X4), rm, rv, training=True, momentum=0.3)
    _, cache = R.batch_norm_forward(X4, RM, RV, training=True, momentum=0.3)
    np.testing.assert_allclose(cache["new_running_mean"], rm.numpy(), rtol=1e-12)
    np.testing.assert_allclose(cache["new_running_var"], rv.numpy(), rtol=1e-12)


def test_instance_norm_running_update_matches_torch():
    rm, rv = torch.tensor(RM), torch.tensor(RV)
    TF.instance_norm(torch.tensor(X4), rm, rv, momentum=0.3)
    _, cache = R.instance_norm_forward(X4, running_mean=RM, running_var=RV, momentum=0.3)
    np.testing.assert_allclose(cache["new_running_mean"], rm.numpy(), rtol=1e-12)
    np.testing.assert_allclose(cache["new_running_var"], rv.numpy(), rtol=1e-12)
