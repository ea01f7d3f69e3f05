"""normkit layers under ``torch.fx``: symbolic tracing records each one as a single
``call_module`` node, as it records torch.nn's norms (its leaf modules), so the traced
module computes and updates running statistics as the converted model does; a layer
traced as the root says what to do."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn

import normkit
import normkit.nn as nk


class _Net(nn.Module):
    """Every normkit layer once, in one forward."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nk.BatchNorm2d(8)
        self.renorm = nk.BatchRenorm2d(8, warmup_steps=0)
        self.sync = nk.SyncBatchNorm(8)
        self.gn = nk.GroupNorm(2, 8)
        self.inorm = nk.InstanceNorm2d(8, affine=True, track_running_stats=True)
        self.bn1 = nk.BatchNorm1d(8)
        self.bn3 = nk.BatchNorm3d(8, momentum=None)
        self.in1 = nk.InstanceNorm1d(8)
        self.ln = nk.LayerNorm(8)
        self.rms = nk.RMSNorm(8)

    def forward(self, x):
        h = self.inorm(self.gn(self.sync(self.renorm(self.bn(self.conv(x)).relu()))))
        h = self.bn3(h.unsqueeze(2)).squeeze(2)
        h = self.in1(self.bn1(h.flatten(2)))
        return self.rms(self.ln(h.transpose(1, 2)))


def _norms(model):
    return {name for name, m in model.named_modules() if type(m).__module__.startswith("normkit.")}


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_symbolic_trace_keeps_each_layer_one_call(train):
    torch.manual_seed(0)
    model = _Net().train(train)
    eager = copy.deepcopy(model)
    traced = fx.symbolic_trace(model)
    calls = [n.target for n in traced.graph.nodes if n.op == "call_module"]
    assert sorted(c for c in calls if c != "conv") == sorted(_norms(model))
    assert not [n for n in traced.graph.nodes if n.op == "call_function"
                and "norm" in str(n.target)]
    for step in range(3):                                   # running statistics move alike
        x = torch.randn(4, 3, 6, 6, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        y, want = traced(x), eager(x2)
        torch.testing.assert_close(y, want, rtol=0, atol=0)
        y.square().sum().backward()
        want.square().sum().backward()
        torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
    expected = eager.state_dict()
    assert traced.state_dict().keys() == expected.keys()
    for name, got in traced.state_dict().items():
        torch.testing.assert_close(got, expected[name], rtol=0, atol=0, msg=name)


def test_tracing_a_layer_as_the_root_says_what_to_do():
    with pytest.raises(TypeError, match=r"as the root module.*nn\.Sequential\(layer\)"):
        fx.symbolic_trace(nk.LayerNorm(8))
    traced = fx.symbolic_trace(nn.Sequential(nk.LayerNorm(8)))
    x = torch.randn(3, 8)
    torch.testing.assert_close(traced(x), nk.LayerNorm(8)(x), rtol=0, atol=0)
