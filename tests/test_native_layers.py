"""The layers keep their C++ plan between calls (``nn.batchnorm._BatchNorm._eval_node_call``,
``nn._kept.KeptNode``): each layer's kept plan runs, matches torch and the full path, and is
dropped or refused where the layer's state or input changes (a new epoch, a copy, a
subclass, another device, a per-call option)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

pytest.importorskip("numba")
import normkit.functional as NF  # noqa: E402
import normkit.nn as nknn  # noqa: E402
from normkit.backends.cpu import native  # noqa: E402
from normkit.nn._kept import KeptPlan  # noqa: E402

if not native.enabled():
    pytest.skip("NORMKIT_NATIVE=0: the C++ node is switched off", allow_module_level=True)


pytestmark = pytest.mark.usefixtures("native_on")


# ---- eval BatchNorm layers keep their node (nn.batchnorm._BatchNorm._eval_node_call) ----

def _eval_bn(c=6, shape=(3, 6, 5, 4), dtype=torch.float32):
    torch.manual_seed(0)
    ours, theirs = nknn.BatchNorm2d(c).to(dtype), torch.nn.BatchNorm2d(c).to(dtype)
    for m in (ours, theirs):
        with torch.no_grad():
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
            m.weight.uniform_(0.5, 1.5)
            m.bias.uniform_(-1, 1)
    theirs.load_state_dict(ours.state_dict())
    return ours.eval(), theirs.eval(), torch.randn(shape).to(dtype)


def test_eval_layer_keeps_its_node_and_matches_the_full_path_and_torch():
    ours, theirs, x = _eval_bn()
    with torch.no_grad():
        y = ours(x)
        assert hasattr(ours.__dict__["_eval_plan"][1][0], "apply")     # the kept node ran
        full = NF.batch_norm(x, ours.running_mean, ours.running_var, ours.weight, ours.bias)
        torch.testing.assert_close(y, full, rtol=0, atol=0)
        torch.testing.assert_close(y, theirs(x))
    y.add_(1.0)                                                # an output of its own


def test_eval_layer_plan_checks_what_it_is_given():
    ours, theirs, x = _eval_bn()
    with torch.no_grad():
        ours(x)
        ours.weight.data = torch.ones(5)                       # same Parameter, wrong size
        with pytest.raises(RuntimeError, match="a weight or bias of 6 elements"):
            ours(x)
        ours.weight.data = theirs.weight.data.clone()
        ours.running_var.data = ours.running_var.data.double()  # another dtype: converted
        torch.testing.assert_close(ours(x), theirs(x))
        ours.running_var.data = ours.running_var.data.float()
        ours.double(), theirs.double()                         # a new key: rebuilt
        torch.testing.assert_close(ours(x.double()), theirs(x.double()))


def test_eval_layer_node_is_dropped_with_the_plans_and_not_copied():
    ours, theirs, x = _eval_bn()
    with torch.no_grad():
        ours(x)
        native.switch(False)                                   # clear_plans: a new epoch
        torch.testing.assert_close(ours(x), theirs(x))
        assert not hasattr(ours.__dict__["_eval_plan"][1][0], "apply")   # the composite
        native.switch(True)
        ours(x)
        assert hasattr(ours.__dict__["_eval_plan"][1][0], "apply")
    for twin in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))):
        assert "_eval_plan" not in twin.__dict__
        with torch.no_grad():
            torch.testing.assert_close(twin(x), theirs(x))


def test_eval_layer_node_not_used_with_grad_or_by_subclasses():
    ours, theirs, x = _eval_bn()

    class Sub(nknn.BatchNorm2d):
        pass

    sub = Sub(6).eval()
    sub.load_state_dict(ours.state_dict())
    y = ours(x)                                                # grad enabled: the full path
    assert "_eval_plan" not in ours.__dict__ and y.requires_grad
    with torch.no_grad():
        torch.testing.assert_close(sub(x), theirs(x))
    assert "_eval_plan" not in sub.__dict__


def _kept_against_torch(ours, theirs, x, slot, dtype):
    """Both layers with and without grad: ours ran its node kept in ``slot``, and its
    output and gradients are torch's (bfloat16: the tolerances of conftest)."""
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
    gtol = dict(rtol=5e-2, atol=2.5e-1) if dtype == torch.bfloat16 else {}
    for grad in (True, False):
        xs = [x.clone().requires_grad_(grad) for _ in range(2)]
        with torch.set_grad_enabled(grad):
            y, ty = ours(xs[0]), theirs(xs[1])
        assert hasattr(ours.__dict__[slot][1][0], "apply")   # the kept C++ plan ran
        torch.testing.assert_close(y, ty, **tol)
        if grad:
            y.square().sum().backward()
            ty.square().sum().backward()
            torch.testing.assert_close(xs[0].grad, xs[1].grad, **gtol)
            torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, **gtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_training_layer_keeps_its_node_and_matches_torch(dtype):
    ours, theirs, x = _eval_bn(dtype=dtype)
    ours.train(), theirs.train()
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
    for momentum in (0.1, None):
        ours.momentum = theirs.momentum = momentum
        _kept_against_torch(ours, theirs, x, "_train_plan", dtype)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_keeps_its_node_on_channels_last(dtype):
    # channels_last (the columns family), in training and eval, a node per layout: the
    # same shape in NCHW next takes a node of its own
    ours, theirs, x = _eval_bn(dtype=dtype)
    xc = x.contiguous(memory_format=torch.channels_last)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
    with torch.no_grad():
        torch.testing.assert_close(ours(xc), theirs(xc), **tol)
    assert hasattr(ours._eval_plan[1][0], "apply")
    assert ours(xc).is_contiguous(memory_format=torch.channels_last)
    ours.train(), theirs.train()
    for data in (xc, x):
        _kept_against_torch(ours, theirs, data, "_train_plan", dtype)
        assert ours._train_plan[0][1] == data.stride()
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), **tol)


def test_training_layer_one_value_per_channel_still_refused():
    bn = nknn.BatchNorm1d(4)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        bn(torch.randn(1, 4))
    assert int(bn.num_batches_tracked) == 1            # counted once, as torch does


# ---- LayerNorm, GroupNorm, RMSNorm layers keep their node too (nn._kept.KeptNode) --------

PER_SAMPLE = {
    "layer": (lambda m: m.LayerNorm(16), (4, 5, 16)),
    "group": (lambda m: m.GroupNorm(2, 6), (3, 6, 5, 4)),
    "rms": (lambda m: m.RMSNorm(16), (4, 5, 16)),
    "rms-eps": (lambda m: m.RMSNorm(16, eps=1e-3), (4, 5, 16)),
}


def _per_sample(name, dtype=torch.float32):
    make, shape = PER_SAMPLE[name]
    torch.manual_seed(0)
    ours, theirs = make(nknn).to(dtype), make(torch.nn).to(dtype)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        if getattr(ours, "bias", None) is not None:
            ours.bias.uniform_(-1, 1)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs, torch.randn(shape).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_group_norm_layer_keeps_a_node_per_layout(dtype):
    # channels_last, then NCHW of the same shape: a node each (strides in the key), both
    # torch's values, the channels_last output channels_last
    ours, theirs, x = _per_sample("group", dtype)
    xc = x.contiguous(memory_format=torch.channels_last)
    for data in (xc, x):
        _kept_against_torch(ours, theirs, data, "_plan", dtype)
        assert ours._plan[0][1] == data.stride()
    assert ours(xc).is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(PER_SAMPLE))
def test_per_sample_layer_keeps_its_node_and_matches_torch(name, dtype):
    ours, theirs, x = _per_sample(name, dtype)
    _kept_against_torch(ours, theirs, x, "_plan", dtype)
    with torch.no_grad():                                      # bit for bit the full path
        full = {"layer": lambda: NF.layer_norm(x, (16,), ours.weight, ours.bias),
                "group": lambda: NF.group_norm(x, 2, ours.weight, ours.bias),
                "rms": lambda: NF.rms_norm(x, (16,), ours.weight),
                "rms-eps": lambda: NF.rms_norm(x, (16,), ours.weight, 1e-3)}[name]()
        torch.testing.assert_close(ours(x), full, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["layer", "group", "rms"])
def test_per_sample_layer_refusals_take_the_full_path(name):
    ours, theirs, x = _per_sample(name)
    with torch.no_grad():
        ours(x)
        ours.weight.data = torch.ones(5)                       # same Parameter, wrong size
        with pytest.raises(RuntimeError):
            ours(x)
        ours.weight.data = theirs.weight.data.clone()
        with pytest.raises(RuntimeError):                      # another input: checked
            ours(torch.randn(3, 7, 5, 4) if name == "group" else torch.randn(4, 5, 17))
        ours.double(), theirs.double()                         # a new key: rebuilt
        torch.testing.assert_close(ours(x.double()), theirs(x.double()))
        native.switch(False)                                   # a new epoch: no node
        torch.testing.assert_close(ours(x.double()), theirs(x.double()))
        assert not hasattr(ours.__dict__["_plan"][1][0], "apply")
        native.switch(True)
    for twin in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))):
        assert "_plan" not in twin.__dict__
    sub = type("Sub", (type(ours),), {})                       # subclasses: the full path
    layer = copy.deepcopy(ours)
    layer.__class__ = sub
    with torch.no_grad():
        torch.testing.assert_close(layer(x.double()), theirs(x.double()))
    assert "_plan" not in layer.__dict__


def test_layer_moved_back_to_the_cpu_builds_its_node_again():
    # what a layer kept for an input on another device (no node) is not used for the
    # same shape on the CPU (a model trained on a GPU, then run on the CPU)
    layer = nknn.LayerNorm(16).double().to("meta")
    x = torch.randn(4, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        layer(x.to("meta"))
        assert not hasattr(layer.__dict__["_plan"][1][0], "apply")
        layer = layer.to_empty(device="cpu")
        layer.reset_parameters()
        y = layer(x)
    assert hasattr(layer.__dict__["_plan"][1][0], "apply")
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (16,)))


def test_rms_norm_layer_with_an_offset_or_a_casting_takes_the_full_path():
    layer = nknn.RMSNorm(16, offset=1.0, casting="gemma")
    x = torch.randn(4, 16)
    with torch.no_grad():
        y = layer(x)
        torch.testing.assert_close(y, NF.rms_norm(x, (16,), layer.weight, offset=1.0,
                                                  casting="gemma"), rtol=0, atol=0)
    assert "_plan" not in layer.__dict__                       # nothing kept


INFERENCE = {
    "batch": (lambda m: m.BatchNorm2d(6), (3, 6, 5, 4)),
    "instance": (lambda m: m.InstanceNorm2d(6, affine=True, track_running_stats=True),
                 (3, 6, 5, 4)),
    **PER_SAMPLE,
}


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("name", list(INFERENCE))
def test_layers_under_inference_mode_are_torchs(name, layout):
    # serving code runs models under torch.inference_mode(): the layers (and their kept
    # plans) take those calls (inference tensors in and out, no autograd), in training mode too, where the
    # running statistics (ordinary tensors) are updated in place as torch's are
    make, shape = INFERENCE[name]
    torch.manual_seed(0)
    ours, theirs = make(nknn), make(torch.nn)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(shape)
    if layout == "channels_last" and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    for training in (True, False):
        ours.train(training), theirs.train(training)
        with torch.inference_mode():
            y, ty = ours(x * 2 + 1), theirs(x * 2 + 1)
        assert y.is_inference() and not y.requires_grad
        torch.testing.assert_close(y, ty)
        torch.testing.assert_close(ours.state_dict(), theirs.state_dict())
    if isinstance(ours, KeptPlan):                             # (InstanceNorm keeps none)
        plans = [v for k, v in vars(ours).items() if k in ("_plan", "_eval_plan",
                                                           "_train_plan")]
        assert plans and all(hasattr(found[0], "apply") for _, found in plans)
