"""``convert(model, fuse_activation=True)``: the BatchNorm-then-activation pairs of
``nn.Sequential`` neighbours and of forward statements (a torchvision-style BasicBlock,
transformers' ResNet, RegNet, MobileNetV2, EfficientNet) fused into the BatchNorm; the
converted model equals the untouched one in training and eval; a shared activation
module stays; ``revert`` restores everything; the report lists pairs fused and left."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import normkit
import normkit.nn as nknn
from normkit.conversion.activation import FusedActivation


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock, as written there (one ReLU module, two calls)."""

    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        out += identity
        out = self.relu(out)
        return out


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.act = nn.LeakyReLU(0.3)

    def forward(self, x):
        return self.act(self.bn(x)) * 2


def _net():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU6(), BasicBlock(4),
                         nn.BatchNorm2d(4), nn.SiLU(), nn.BatchNorm2d(4), nn.Tanh())


def _train_and_eval_equal(model, make_input, out=lambda o: o, tol=1e-5):
    """The converted ``model`` against a deep copy of it taken before converting."""
    untouched = copy.deepcopy(model)
    report = normkit.convert(model, fuse_activation=True)
    for training in (True, False):
        model.train(training), untouched.train(training)
        torch.manual_seed(3)
        x = make_input()
        y, want = out(model(x)), out(untouched(x))
        torch.testing.assert_close(y, want, rtol=tol, atol=tol)
        if training:
            (y ** 2).mean().backward()
            (want ** 2).mean().backward()
            for (n, p), q in zip(untouched.named_parameters(), model.parameters()):
                scale = float(p.grad.abs().max()) + 1e-3
                torch.testing.assert_close(q.grad / scale, p.grad / scale, rtol=10 * tol,
                                           atol=10 * tol, msg=n)
            for (n, b), c in zip(untouched.named_buffers(), model.buffers()):
                torch.testing.assert_close(c, b, rtol=tol, atol=tol, msg=n)
    return report


def test_sequential_and_forward_pairs_fused_shared_relu_kept():
    torch.manual_seed(0)
    model = _net()
    report = _train_and_eval_equal(model, lambda: torch.randn(2, 3, 9, 9))
    assert isinstance(model[2], FusedActivation) and model[1].activation == "relu6"
    assert isinstance(model[5], FusedActivation) and model[4].activation == "silu"
    block = model[3]
    assert block.bn1.activation == "relu" and block.bn2.activation is None
    assert type(block.relu) is nn.ReLU           # still called after the residual add
    fused = [how for _, _, how in report.activations_fused]
    assert len(fused) == 3 and any(h.startswith("bn1, then relu") for h in fused)
    (left,) = report.activations_left
    assert left[0] == "6" and "Tanh computes none of" in left[2]
    assert "fused 3 activation(s)" in str(report)
    assert set(model.state_dict()) == set(_net().state_dict())


def test_revert_restores_everything():
    torch.manual_seed(0)
    model = _net()
    before = repr(model)
    normkit.convert(model, fuse_activation=True)
    normkit.revert(model)
    assert repr(model) == before
    assert type(model[3]) is BasicBlock and type(model[2]) is nn.ReLU6


def test_nested_call_and_leaky_slope():
    torch.manual_seed(0)
    model = Nested()
    report = _train_and_eval_equal(model, lambda: torch.randn(5, 4))
    assert model.bn.activation == "leaky_relu" and model.bn.negative_slope == 0.3
    assert report.activations_fused


def test_shared_activation_module_in_sequential_is_left():
    relu = nn.ReLU()
    model = nn.Sequential(nn.BatchNorm1d(3), relu, nn.Linear(3, 3), relu)
    report = normkit.convert(model, fuse_activation=True)
    assert model[0].activation is None and model[1] is relu
    assert "registered elsewhere" in report.activations_left[0][2]


def test_opt_in():
    model = _net()
    normkit.convert(model)
    assert model[1].activation is None and type(model[2]) is nn.ReLU6


def _fused_then_folded(model):
    """``model`` converted with ``fuse_activation=True``, trained a step, in eval: an input,
    the model's output on it and the folded model, checked equal on it."""
    torch.manual_seed(0)
    normkit.convert(model, fuse_activation=True)
    model(torch.randn(4, 3, 6, 6))                 # running statistics away from 0 / 1
    model.eval()
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        want = model(x)
        folded = normkit.fold(model).model
        torch.testing.assert_close(folded(x), want, rtol=1e-5, atol=1e-5)
    return x, want, folded


def test_fold_keeps_the_activation():
    _, _, folded = _fused_then_folded(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4),
                                                    nn.ReLU()))
    assert type(folded[1].act) is nn.ReLU          # (in the FoldedBatchNorm's input check)


class _SiLUBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.SiLU()

    def forward(self, x):
        y = self.conv(x)
        y = self.bn(y)
        y = self.act(y)
        return y


@pytest.mark.parametrize("make", [lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4),
                                                        nn.SiLU()), _SiLUBlock],
                         ids=["sequential", "forward"])
def test_revert_after_fold_applies_the_activation_once(make):
    # revert gives the fused SiLU back to its module (or forward statement); the folded
    # BatchNorm stops applying it (it was applied twice: 0.21 off)
    torch.manual_seed(0)
    x, want, folded = _fused_then_folded(make())
    report = normkit.revert(folded)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), want, rtol=1e-5, atol=1e-5)
    assert any("given back" in why for _, _, why in report.activations_fused)
    assert not [m for m in folded.modules() if isinstance(m, (nknn.BatchNorm2d,
                                                              FusedActivation))]


transformers = pytest.importorskip("transformers")


def _resnet(**kw):
    return transformers.ResNetModel(transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], **kw))


def _regnet():
    return transformers.RegNetModel(transformers.RegNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=8))


def _mobilenet_v2():
    return transformers.MobileNetV2Model(transformers.MobileNetV2Config(
        depth_multiplier=0.25, image_size=32))


def _efficientnet():
    return transformers.EfficientNetModel(transformers.EfficientNetConfig(
        width_coefficient=0.1, depth_coefficient=0.1, image_size=32, hidden_dim=128))


MODELS = {"resnet-basic": lambda: _resnet(layer_type="basic"),
          "resnet-bottleneck": lambda: _resnet(layer_type="bottleneck"),
          "regnet": _regnet, "mobilenet_v2": _mobilenet_v2, "efficientnet": _efficientnet}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "cl"])
def test_transformers_models(name, channels_last):
    torch.manual_seed(0)
    model = MODELS[name]()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    report = _train_and_eval_equal(
        model, lambda: torch.randn(2, 3, 64, 64).contiguous(memory_format=fmt),
        out=lambda o: o.last_hidden_state, tol=1e-3)       # (deep: rounding adds up)
    assert report.activations_fused, str(report)
    fused = [m for m in model.modules() if getattr(m, "activation", None) in
             ("relu", "relu6", "silu")]
    assert len(fused) == len(report.activations_fused)


class _CountRelu(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.relu, torch.ops.aten.relu_):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_resnet18_forward_dispatches_only_the_residual_relus():
    """transformers' ResNet-18 config: 17 ReLUs, 9 right after a BatchNorm (fused), the 8
    after the residual adds left to aten."""
    model = transformers.ResNetModel(transformers.ResNetConfig(
        embedding_size=64, hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2],
        layer_type="basic"))
    x = torch.randn(2, 3, 64, 64)
    counter = _CountRelu()
    with torch.no_grad(), counter:
        model(x)
    assert counter.count == 17
    report = normkit.convert(model, fuse_activation=True)
    assert len(report.activations_fused) == 9
    for training in (True, False):
        model.train(training)
        counter = _CountRelu()
        with counter:
            model(x)
        assert counter.count == 8
