"""BatchNorm fused with its activation in the CPU executor's kernels (``cpu.act_stores``).

Against the float64 reference (``reference.batch_norm_act_*``) and against torch (its
BatchNorm, then its activation), on NCHW planes (large and small), channels_last and
(N, C), training and eval, serial and threaded, streamed and plain stores; bit for bit
against the unfused normkit output followed by torch's activation where the operations
are the same.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import normkit.functional as NF
from normkit import backends, reference
from normkit import grouping as G
from normkit.activation import Activation

from _cpu_cases import CL, TOL, close, np64

cpu = pytest.importorskip("normkit.backends.cpu")
pytestmark = pytest.mark.skipif(cpu.native.extension() is None, reason="no CPU executor")

ACTS = ["relu", "relu6", "leaky_relu", "silu"]
SLOPE = 0.2
TORCH_ACT = {"relu": F.relu, "relu6": F.relu6, "silu": F.silu,
             "leaky_relu": lambda t: F.leaky_relu(t, SLOPE)}
# (shape, memory format): NCHW planes, small planes, channels_last, (N, C)
CASES = [((4, 6, 9, 11), None), ((5, 6, 3, 2), None), ((4, 6, 5, 7), "cl"), ((24, 7), None)]


@pytest.fixture(params=["serial", "threaded"])
def threads(request, monkeypatch):
    if request.param == "threaded":
        from normkit.backends.cpu import tuning

        monkeypatch.setattr(tuning, "SERIAL_BELOW", 0)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    backends.clear_plans()
    yield request.param
    backends.clear_plans()


def _inputs(shape, fmt, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    c = shape[1]
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 0.3).to(dtype)
    if fmt == "cl":
        x = x.contiguous(memory_format=CL[len(shape)])
    w = (torch.rand(c, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    b = torch.randn(c, generator=gen, dtype=torch.float64).to(dtype)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    rm = torch.randn(c, generator=gen, dtype=torch.float64).to(dtype)
    rv = (torch.rand(c, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    return x, w, b, dy, rm, rv


def _fused(x, w, b, dy, rm, rv, training, act):
    x, w, b = (t.detach().requires_grad_() for t in (x, w, b))
    y = NF.batch_norm_act(x, rm, rv, w, b, training, 0.1, 1e-5, activation=act,
                          negative_slope=SLOPE)
    assert "NormNode" in y.grad_fn.name(), y.grad_fn.name()     # the executor, not torch_ops
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape, fmt", CASES)
def test_against_reference_and_torch(threads, shape, fmt, dtype, training, act):
    x, w, b, dy, rm, rv = _inputs(shape, fmt, dtype)
    rm_k, rv_k = rm.clone(), rv.clone()
    y, dx, dw, db = _fused(x, w, b, dy, rm_k, rv_k, training, act)
    assert y.dtype == dtype and y.stride() == x.stride()
    rm_r, rv_r = np64(rm), np64(rv)
    want, cache = reference.batch_norm_act_forward(np64(x), rm_r, rv_r, np64(w), np64(b),
                                                   training, 0.1, 1e-5, act, SLOPE)
    dx_r, dw_r, db_r = reference.batch_norm_act_backward(np64(dy), cache)
    tol = TOL[dtype]
    close(np64(y), want, dtype, "y")
    close(np64(dx), dx_r, dtype, "dx")
    close(np64(dw), dw_r, dtype, "dw")
    close(np64(db), db_r, dtype, "db")
    if training:                                          # the running statistics
        close(np64(rm_k), cache["new_running_mean"], dtype, "running_mean")
        close(np64(rv_k), cache["new_running_var"], dtype, "running_var")
    # torch: its BatchNorm, then its activation (in float64, on the same inputs)
    xs, ws, bs = (np64(t) for t in (x, w, b))
    xt, wt, bt = (torch.from_numpy(a).requires_grad_() for a in (xs, ws, bs))
    yt = TORCH_ACT[act](F.batch_norm(xt, torch.from_numpy(np64(rm)), torch.from_numpy(np64(rv)),
                                     wt, bt, training, 0.1, 1e-5))
    yt.backward(torch.from_numpy(np64(dy)))
    for got, ref, what in ((y, yt, "y"), (dx, xt.grad, "dx"), (dw, wt.grad, "dw"),
                           (db, bt.grad, "db")):
        err = np.abs(np64(got) - ref.detach().numpy()).max() / max(
            np.abs(ref.detach().numpy()).max(), 1e-6)
        assert err <= tol, f"{what} against torch: {err:.1e}"


@pytest.mark.parametrize("act", ["relu", "relu6", "leaky_relu"])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape, fmt", CASES + [((2, 3, 64, 130), None)])
@pytest.mark.parametrize("stream", [False, True])
def test_forward_bits_equal_unfused_then_torch(threads, shape, fmt, training, act, stream,
                                               monkeypatch):
    """float32: act(z) of the fused store equals torch's activation of the unfused
    kernel's output, bit for bit (the same operations), plain and streamed stores."""
    if stream:
        from normkit.backends.cpu import tuning

        monkeypatch.setattr(tuning, "STREAM_BYTES", 64)
        monkeypatch.setattr(tuning, "STREAM_FRESH", True)
        backends.clear_plans()
    x, w, b, _, rm, rv = _inputs(shape, fmt, torch.float32, seed=1)
    with torch.no_grad():
        fused = NF.batch_norm_act(x, rm.clone(), rv.clone(), w, b, training, 0.1, 1e-5,
                                  activation=act, negative_slope=SLOPE)
        plain = TORCH_ACT[act](NF.batch_norm(x, rm.clone(), rv.clone(), w, b, training, 0.1,
                                             1e-5))
    assert torch.equal(fused, plain)


@pytest.mark.parametrize("dtype, ulps", [(torch.float32, 2), (torch.bfloat16, 1)])
def test_silu_store_against_torch_silu(dtype, ulps):
    """SiLU is computed as torch's kernel computes it, ``z / (1 + exp(-z))`` in float32,
    with libm's ``expf`` where torch's vectorized loop has SLEEF's (1 ulp): in float32
    4.5 % of the elements differ from torch's silu of the same z, by at most 2 ulps
    (measured); bfloat16 rounds once from float32 (measured: torch's silu of the float32
    z, rounded, bit for bit), where the unfused path rounds z to bfloat16 first."""
    x, w, b, _, rm, rv = _inputs((4, 6, 33, 17), None, dtype, seed=2)
    with torch.no_grad():
        fused = NF.batch_norm_act(x, rm, rv, w, b, False, 0.1, 1e-5, activation="silu")
        z = NF.batch_norm(x.float(), rm.float(), rv.float(), w.float(), b.float(), False,
                          0.1, 1e-5)
        want = F.silu(z).to(dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert (fused.view(bits).int() - want.view(bits).int()).abs().max() <= ulps


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("fmt", [None, "cl"])
def test_gradcheck(act, training, fmt):
    x, w, b, _, rm, rv = _inputs((3, 4, 3, 5), fmt, torch.float64, seed=3)
    x, w, b = (t.detach().requires_grad_() for t in (x, w, b))

    def fn(x, w, b):
        return NF.batch_norm_act(x, rm.clone(), rv.clone(), w, b, training, 0.1, 1e-5,
                                 activation=act, negative_slope=SLOPE)
    assert "NormNode" in fn(x, w, b).grad_fn.name()
    assert torch.autograd.gradcheck(fn, (x, w, b))


def test_layer_runs_the_executor():
    """A fused nn.BatchNorm2d in training and eval: its output's grad_fn is the C++ node
    (training), and eval is torch's eval BatchNorm then ReLU (to rounding: torch folds
    the statistics into one scale and shift)."""
    import normkit.nn as nn

    m = nn.BatchNorm2d(6, activation="relu")
    x = torch.randn(4, 6, 8, 8, requires_grad=True)
    y = m(x)
    assert "NormNode" in y.grad_fn.name()
    ref = torch.nn.BatchNorm2d(6)
    ref.load_state_dict(m.state_dict())
    m.eval(), ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(m(x), F.relu(ref(x)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["instance", "group", "layer"])
def test_other_norms_refuse_an_activation(kind):
    from normkit.backends.cpu.plans import ChannelsLast, Planes, Rows

    x = torch.randn(2, 4, 3, 5)
    grouping, family = {"instance": (G.instance(x.shape), Planes),
                        "group": (G.group(x.shape, 2), Planes),
                        "layer": (G.layer(x.shape, 2), Rows)}[kind]
    assert not cpu.supports_activation(x.view(grouping.view), grouping,
                                                Activation("relu"))
    with pytest.raises(ValueError, match="fused into BatchNorm"):
        family(x, grouping, True, False, Activation("relu"))
    with pytest.raises(ValueError, match="fused into BatchNorm"):
        ChannelsLast(x.contiguous(memory_format=torch.channels_last), G.instance(x.shape),
                     True, False, Activation("relu"))
