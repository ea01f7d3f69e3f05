"""The NumPy reference of BatchNorm followed by an activation against torch autograd:
forward against ``act(F.batch_norm(...))``, the hand-derived backward against autograd's
(``fakeloss = (out * dout).sum()``), in float64."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as TF  # noqa: E402

from normkit import reference as R  # noqa: E402
from normkit.activation import NAMES  # noqa: E402

RNG = np.random.default_rng(3)
RM, RV = RNG.normal(size=5), RNG.uniform(0.5, 2, size=5)

TORCH_ACT = {"relu": TF.relu, "relu6": TF.relu6, "silu": TF.silu,
             "leaky_relu": lambda z: TF.leaky_relu(z, 0.2)}


@pytest.mark.parametrize("activation", NAMES)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape", [(4, 5), (3, 5, 7), (2, 5, 3, 4), (2, 5, 2, 3, 2)])
@pytest.mark.parametrize("affine", [True, False])
def test_reference_against_autograd(activation, training, shape, affine):
    x = RNG.normal(size=shape) * 3 + 0.5
    w = RNG.uniform(-1.5, 1.5, size=5) if affine else None
    b = RNG.normal(size=5) * 2 if affine else None
    dout = RNG.normal(size=shape)
    y, cache = R.batch_norm_act_forward(x, RM, RV, w, b, training, 0.1, 1e-5, activation, 0.2)
    dx, dw, db = R.batch_norm_act_backward(dout, cache)

    xt = torch.tensor(x, requires_grad=True)
    wt = None if w is None else torch.tensor(w, requires_grad=True)
    bt = None if b is None else torch.tensor(b, requires_grad=True)
    rm, rv = torch.tensor(RM), torch.tensor(RV)
    yt = TORCH_ACT[activation](TF.batch_norm(xt, rm, rv, wt, bt, training, 0.1, 1e-5))
    (yt * torch.tensor(dout)).sum().backward()          # fakeloss
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-9, atol=1e-10)
    if affine:
        np.testing.assert_allclose(dw, wt.grad.numpy(), rtol=1e-9, atol=1e-10)
        np.testing.assert_allclose(db, bt.grad.numpy(), rtol=1e-9, atol=1e-10)
    if training:                                       # the running update as BatchNorm's
        np.testing.assert_allclose(cache["new_running_mean"], rm.numpy(), rtol=1e-12)
        np.testing.assert_allclose(cache["new_running_var"], rv.numpy(), rtol=1e-12)


@pytest.mark.parametrize("activation", NAMES)
def test_derivative_at_the_kinks(activation):
    """act'(z) where torch's backward defines it by convention: z = 0 (and 6 for relu6)."""
    z = torch.tensor([0.0, 6.0, -1.0, 1.0, 7.0], dtype=torch.float64, requires_grad=True)
    TORCH_ACT[activation](z).backward(torch.ones_like(z))
    np.testing.assert_allclose(R.activation_derivative(z.detach().numpy(), activation, 0.2),
                               z.grad.numpy(), rtol=1e-12)


def test_unknown_activation_names_the_choices():
    with pytest.raises(ValueError, match="relu6"):
        R.activation_forward(np.zeros(2), "gelu")
