"""BatchNorm followed by an activation, fused (``normkit.functional.batch_norm(...,
activation=...)``, the layers' ``activation``): against the float64 reference and against
torch's BatchNorm then its activation, forward, backward and the running statistics, every
pair kind in training and eval, (N, C), NCHW, channels_last and 3d, fp32/bf16/fp16, on
the kernels and on the composite torch ops; gradcheck and gradgradcheck;
torch.compile(fullgraph=True), torch.export and ONNX equal to eager."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import normkit.functional as F
import normkit.nn as nknn
from normkit import reference as R
from normkit.activation import NAMES

SLOPE = 0.2
TORCH_ACT = {"relu": TF.relu, "relu6": TF.relu6, "silu": TF.silu,
             "leaky_relu": lambda z: TF.leaky_relu(z, SLOPE)}
# (shape, memory format)
SHAPES = [((6, 5), None), ((3, 5, 7), None), ((2, 5, 4, 3), None),
          ((2, 5, 4, 3), torch.channels_last), ((2, 5, 3, 2, 3), None)]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _input(shape, fmt, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 0.3).to(dtype)
    return x.contiguous(memory_format=fmt) if fmt is not None else x


def _params(c, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(c, generator=g, dtype=torch.float64) * 2 - 0.5
    b = torch.randn(c, generator=g, dtype=torch.float64)
    rm = torch.randn(c, generator=g, dtype=torch.float64) * 0.3
    rv = torch.rand(c, generator=g, dtype=torch.float64) + 0.5
    return w, b, rm, rv


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("shape, fmt", SHAPES, ids=[f"{s}-{'cl' if f else 'c'}" for s, f in SHAPES])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("activation", NAMES)
def test_functional_against_reference(activation, training, shape, fmt, dtype):
    x = _input(shape, fmt, dtype).requires_grad_()
    w64, b64, rm64, rv64 = _params(shape[1])
    w, b = w64.float().requires_grad_(), b64.float().requires_grad_()
    rm, rv = rm64.float(), rv64.float()
    y = F.batch_norm_act(x, rm, rv, w, b, training, 0.1, 1e-5, activation=activation,
                     negative_slope=SLOPE)
    assert y.dtype == dtype and y.shape == x.shape
    if fmt is not None:
        assert y.is_contiguous(memory_format=fmt)
    dout = _input(shape, None, torch.float64, seed=5)
    y.backward(dout.to(dtype))
    want, cache = R.batch_norm_act_forward(x.detach().double().numpy(), rm64.numpy(),
                                           rv64.numpy(), w.detach().double().numpy(),
                                           b.detach().double().numpy(), training, 0.1, 1e-5,
                                           activation, SLOPE)
    dx, dw, db = R.batch_norm_act_backward(dout.numpy(), cache)
    tol = TOL[dtype]
    torch.testing.assert_close(y.double(), torch.from_numpy(want), **tol)
    torch.testing.assert_close(x.grad.double(), torch.from_numpy(dx), **tol)
    scale = max(1.0, float(np.abs(dw).max()))                     # sums over N * S elements
    torch.testing.assert_close(w.grad.double() / scale, torch.from_numpy(dw) / scale, **tol)
    torch.testing.assert_close(b.grad.double() / scale, torch.from_numpy(db) / scale, **tol)
    if training:
        torch.testing.assert_close(rm.double(), torch.from_numpy(cache["new_running_mean"]),
                                   **tol)
        torch.testing.assert_close(rv.double(), torch.from_numpy(cache["new_running_var"]),
                                   **tol)


@pytest.fixture(params=["kernels", "composite"])
def path(request, monkeypatch):
    """The route a fused call takes: normkit's kernels, or the composite torch ops (what
    runs without the C++ executor, and what torch.compile decomposes to)."""
    if request.param == "composite":
        from normkit.backends.cpu import native
        monkeypatch.setenv("NORMKIT_NATIVE", "0")
        native.switch(False)
        yield request.param
        native.switch(True)
    else:
        yield request.param


@pytest.mark.parametrize("shape, fmt", SHAPES, ids=[f"{s}-{'cl' if f else 'c'}" for s, f in SHAPES])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("activation", NAMES)
def test_fused_equals_torch_then_activation(activation, training, shape, fmt, path):
    """fp32: against torch's BatchNorm followed by torch's activation (forward, gradients,
    running statistics), on both routes."""
    w64, b64, rm64, rv64 = _params(shape[1])
    w64 = w64 * 4                              # z crosses relu6's top
    results = []
    for fused in (True, False):
        x = _input(shape, fmt, torch.float32).requires_grad_()
        w, b = w64.float().requires_grad_(), b64.float().requires_grad_()
        rm, rv = rm64.float(), rv64.float()
        if fused:
            y = F.batch_norm_act(x, rm, rv, w, b, training, activation=activation,
                             negative_slope=SLOPE)
        else:
            y = TORCH_ACT[activation](TF.batch_norm(x, rm, rv, w, b, training))
        y.backward(_input(shape, None, torch.float32, seed=7))
        results.append((y, x.grad, w.grad, b.grad, rm, rv))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("activation", NAMES)
def test_gradcheck(activation, training):
    x = _input((3, 4, 5), None, torch.float64).requires_grad_()
    w, b, rm, rv = _params(4)
    w.requires_grad_(), b.requires_grad_()

    def fn(x, w, b):
        return F.batch_norm_act(x, rm.clone(), rv.clone(), w, b, training, activation=activation,
                            negative_slope=SLOPE)
    assert torch.autograd.gradcheck(fn, (x, w, b))
    # the double backward (the operator's formula, torch_ops.activation_grad); the
    # piecewise-linear ones have a second derivative away from their kinks, and no
    # pre-activation of this input lies within 1e-3 of one
    z = R.batch_norm_forward(x.detach().numpy(), rm.numpy(), rv.numpy(), w.detach().numpy(),
                             b.detach().numpy(), training)[0]
    assert min(np.abs(z).min(), np.abs(z - 6).min()) > 1e-3
    assert torch.autograd.gradgradcheck(fn, (x, w, b))


def test_layer_activation_attribute_repr_and_state_dict():
    plain = nknn.BatchNorm2d(3)
    fused = nknn.BatchNorm2d(3, activation="leaky_relu", negative_slope=SLOPE)
    assert fused.activation == "leaky_relu" and fused.negative_slope == SLOPE
    assert "activation='leaky_relu', negative_slope=0.2" in repr(fused)
    assert "activation" not in repr(plain)
    assert list(fused.state_dict()) == list(plain.state_dict())
    fused.load_state_dict(plain.state_dict())
    x = _input((2, 3, 4, 4), None, torch.float32)
    for training in (True, False):
        plain.train(training), fused.train(training)
        torch.testing.assert_close(fused(x), TF.leaky_relu(plain(x), SLOPE))
    fused.activation = "relu6"                   # a change drops the kept plans
    torch.testing.assert_close(fused(x), TF.relu6(plain(x)))
    fused.activation = None
    torch.testing.assert_close(fused(x), plain(x))
    copied = pickle.loads(pickle.dumps(nknn.BatchNorm1d(3, activation="silu")))
    assert copied.activation == "silu"


def test_bad_activation_errors_name_the_fix():
    with pytest.raises(ValueError, match="relu6"):
        nknn.BatchNorm2d(3, activation="gelu")
    with pytest.raises(TypeError, match="activation='relu'"):
        F.batch_norm_act(torch.randn(4, 3), None, None, training=True, activation=TF.relu)
    with pytest.raises(ValueError, match="negative_slope"):
        F.batch_norm_act(torch.randn(4, 3), None, None, training=True, activation="leaky_relu",
                     negative_slope=float("nan"))


# ---------------------------------------------------------------- PyTorch 2

class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = nknn.BatchNorm2d(4, activation="relu")
        self.bn2 = nknn.BatchNorm2d(4, activation="silu")

    def forward(self, x):
        return self.bn2(self.bn(self.conv(x)))


@pytest.mark.parametrize("decomposed", [True, False], ids=["decomposed", "operator"])
def test_compile_fullgraph_equals_eager(decomposed):
    from normkit import ops
    torch.manual_seed(0)
    eager = _Net()
    model = copy.deepcopy(eager)
    ops.compile_decomposed(decomposed)
    try:
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        for training in (True, False):
            eager.train(training), model.train(training)
            x = torch.randn(2, 3, 8, 8)
            ye, yc = eager(x), compiled(x)
            torch.testing.assert_close(yc, ye, rtol=1e-5, atol=1e-5)
            if training:
                ye.square().sum().backward()
                yc.square().sum().backward()
                for p, q in zip(eager.parameters(), model.parameters()):
                    torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-4)
                for p, q in zip(eager.buffers(), model.buffers()):
                    torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    finally:
        ops.compile_decomposed(True)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_export_equals_eager(train):
    from normkit import ops
    torch.manual_seed(0)
    model = _Net().train(train)
    x = torch.randn(2, 3, 8, 8)
    ep = torch.export.export(copy.deepcopy(model), (x,))
    targets = {str(n.target) for n in ep.graph.nodes if "normkit" in str(n.target)}
    assert targets == {"normkit.norm_forward.default"}
    want = model(x)
    torch.testing.assert_close(ep.module()(x), want, rtol=0, atol=0)
    decomposed = ep.run_decompositions(ops.decompositions())
    torch.testing.assert_close(decomposed.module()(x), want, rtol=1e-5, atol=1e-5)


def test_onnx_equals_eager(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    model = _Net().eval()
    x = torch.randn(2, 3, 8, 8)
    program = torch.onnx.export(model, (x,), dynamo=True, verbose=False)
    path = tmp_path / "bn_act.onnx"
    program.save(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(got), model(x), rtol=1e-4, atol=1e-4)


_LLVM_RUN = """
import re, sys
import torch
from normkit.backends.cpu import args, entries, plans
entry = getattr(entries, sys.argv[1])
for fused in (False, True):
    llvm = args.callback(entry, *plans.protos(torch.float64), fused).inspect_llvm()
    print(llvm.count("fcmp"), bool(re.search(r"@(llvm[.])?exp[f.(]", llvm)))
"""


@pytest.mark.parametrize("entry", ["channels_small_backward", "columns_forward"])
def test_a_batchnorm_without_activation_compiles_none_of_its_code(entry, tmp_path):
    """A BatchNorm kernel entry compiles twice (``args.callback``'s ``fused``): without an
    activation its machine code has none of the activation's (no SiLU's ``exp``), which
    halves a first unfused call's compilation; with one it has it."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))       # compiled here: LLVM kept
    r = subprocess.run([sys.executable, "-c", _LLVM_RUN, entry], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (plain_compares, plain_exp), (fused_compares, fused_exp) = (
        line.split() for line in r.stdout.split("\n")[:2])
    assert (plain_exp, fused_exp) == ("False", "True")
    assert int(plain_compares) < int(fused_compares)


def test_plans_take_the_callback_of_their_activation(monkeypatch):
    """An unfused BatchNorm's plan runs the entries compiled without an activation; a fused
    one the entries with it."""
    from normkit import backends
    from normkit.backends.cpu import args

    seen = []
    real = args.callback
    monkeypatch.setattr(args, "callback", lambda entry, proto, sproto, fused=False: (
        seen.append((entry.__name__, fused)) or real(entry, proto, sproto, fused)))
    x = _input((2, 5, 4, 3), None, torch.float32)
    for activation in (None, "relu"):
        backends.clear_plans()
        if activation is None:
            F.batch_norm(x, None, None, training=True)
        else:
            F.batch_norm_act(x, None, None, training=True, activation=activation)
    backends.clear_plans()
    assert seen[:2] == [(name, False) for name, _ in seen[:2]]
    assert seen[2:] == [(name, True) for name, _ in seen[2:]] and len(seen) == 4
