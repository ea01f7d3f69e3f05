"""convert/revert over transformers vision models built from configs, and over stand-ins
written the way timm writes its norm layers: every norm-like module swapped or routed,
outputs, gradients and running statistics equal to the untouched model's, revert
restores the classes."""

import copy
import inspect
import pickle

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import normkit  # noqa: E402
import normkit.nn as nknn  # noqa: E402
from zoo_models import VISION, build, pixels  # noqa: E402

NORM_BASES = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
NORMKIT_LAYERS = tuple(getattr(nknn, name) for name in nknn.__all__)

# (swapped, routed) where the table names the model
# (bit: 7 GroupNorm activations, 9 weight-standardized convolutions)
EXPECTED = {"convnext": (1, 4), "convnextv2": (1, 4), "bit": (0, 16), "poolformer": (4, 0)}


def _norm_like(model):
    """Norm modules, and convolutions that standardize their weight with a norm op."""
    return {n for n, m in model.named_modules()
            if isinstance(m, NORM_BASES) or "Norm" in type(m).__name__ or _standardized(m)}


def _standardized(module):
    kind = type(module)
    return (isinstance(module, nn.modules.conv._ConvNd)
            and kind.__module__ != nn.Conv2d.__module__
            and "batch_norm" in inspect.getsource(kind.forward))


def _seeded(model):
    torch.manual_seed(3)             # one dropout / drop-path draw for both models
    return model


def _output(out):
    return out.last_hidden_state


def _assert_close(got, want, what, scale=1.0):
    # fp64 models: a batch of two through dozens of BatchNorms in training amplifies
    # rounding a thousandfold, which fp32 would blur; scale: the size of the quantity
    scale = max(float(want.detach().abs().max()), scale)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9 * scale, msg=what)


def _grad_scale(model):
    return max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("name", sorted(VISION))
def test_vision_model_converts_completely_and_computes_the_same(name):
    original, converted = build(name).double(), build(name).double()
    norms = _norm_like(original)
    report = normkit.convert(converted)
    assert report.left == [], str(report)
    handled = {n for n, _, _ in report.swapped} | {n for n, _, _ in report.routed}
    assert handled == norms
    if name in EXPECTED:
        assert (len(report.swapped), len(report.routed)) == EXPECTED[name], str(report)
    for n, m in converted.named_modules():   # no torch norm computes unrouted
        assert not isinstance(m, NORM_BASES) or "_normkit_routed_from" in vars(type(m)) \
            or isinstance(m, NORMKIT_LAYERS), n          # (normkit's layers subclass torch's)

    for mode in ("train", "eval"):
        original.train(mode == "train"), converted.train(mode == "train")
        x = pixels(seed=1, dtype=torch.float64)
        a, b = (_output(_seeded(m)(pixel_values=x)) for m in (original, converted))
        _assert_close(b, a, f"{name} {mode} output")
        weights = torch.randn(a.shape, generator=torch.Generator().manual_seed(2),
                              dtype=torch.float64)
        (a * weights).sum().backward()
        (b * weights).sum().backward()
        scale = _grad_scale(original)
        for (n, pa), (_, pb) in zip(original.named_parameters(), converted.named_parameters()):
            if pa.grad is not None:
                _assert_close(pb.grad, pa.grad, f"{name} {mode} grad {n}", scale)
        original.zero_grad(), converted.zero_grad()
    for (n, a), (_, b) in zip(original.state_dict().items(), converted.state_dict().items()):
        _assert_close(b.double(), a.double(), f"{name} state {n}")   # running statistics

    back = normkit.revert(converted)
    assert len(back.swapped) + len(back.routed) == len(norms)
    assert [type(m) for m in converted.modules()] == [type(m) for m in original.modules()]
    assert list(converted.state_dict()) == list(original.state_dict())


def test_plain_subclass_keeps_its_attributes_and_reverts():
    from transformers.models.poolformer.modeling_poolformer import PoolFormerGroupNorm

    class Tagged(nn.GroupNorm):
        scale_hint = 3                           # a class attribute the twin lacks

        def describe(self):
            return f"{self.num_groups}x{self.num_channels} {self.tag}"

    model = nn.Sequential(PoolFormerGroupNorm(6), Tagged(2, 6))
    model[1].tag = "mine"
    ref = [m(torch.randn(2, 6, 4, 4, generator=torch.Generator().manual_seed(0)))
           for m in model]
    report = normkit.convert(model)
    assert len(report.swapped) == 2 and report.routed == [] and report.left == []
    assert isinstance(model[0], normkit.nn.GroupNorm) and type(model[0]).__name__ == \
        "PoolFormerGroupNorm"
    assert model[1].tag == "mine" and model[1].scale_hint == 3
    assert model[1].describe() == "2x6 mine"
    x = torch.randn(2, 6, 4, 4, generator=torch.Generator().manual_seed(0))
    for m, want in zip(model, ref):
        torch.testing.assert_close(m(x), want)
    weight = model[1].weight
    assert pickle.loads(pickle.dumps(model))[1].tag == "mine"
    normkit.revert(model)
    assert type(model[0]) is PoolFormerGroupNorm and type(model[1]) is Tagged
    assert model[1].tag == "mine" and model[1].weight is weight


# Stand-ins written the way timm writes its norm layers (timm itself cannot be installed
# beside this torch: its torchvision dependency pulls another torch build).
class LayerNorm2d(nn.LayerNorm):
    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class BatchNormAct2d(nn.BatchNorm2d):
    def __init__(self, num_features, act_layer=nn.ReLU, **kwargs):
        super().__init__(num_features, **kwargs)
        self.act = act_layer()

    def forward(self, x):
        if self.momentum is None:
            factor = 0.0
        else:
            factor = self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch = self.training or self.running_mean is None
        x = F.batch_norm(x, self.running_mean if not self.training or self.track_running_stats
                         else None, self.running_var if not self.training or
                         self.track_running_stats else None, self.weight, self.bias,
                         use_batch, factor, self.eps)
        return self.act(x)


class GroupNormAct(nn.GroupNorm):
    def __init__(self, num_channels, num_groups=4, **kwargs):
        super().__init__(num_groups, num_channels, **kwargs)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.act(F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps))


class LayerNormAct2d(nn.LayerNorm):
    def __init__(self, num_channels, **kwargs):
        super().__init__(num_channels, **kwargs)
        self.act = nn.GELU()

    def _norm(self, x):
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight,
                            self.bias, self.eps).permute(0, 3, 1, 2)

    def forward(self, x):
        return self.act(self._norm(x))


class GroupNorm1(nn.GroupNorm):
    def __init__(self, num_channels, **kwargs):
        super().__init__(1, num_channels, **kwargs)

    def forward(self, x):
        return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


class Opaque(nn.LayerNorm):
    def forward(self, x):                        # computes through an op normkit cannot see
        return torch.layer_norm(x, self.normalized_shape, self.weight, self.bias,
                                self.eps).relu()


def _timm_like():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), BatchNormAct2d(8), LayerNorm2d(8),
                         GroupNormAct(8), LayerNormAct2d(8), GroupNorm1(8),
                         nn.Conv2d(8, 8, 1), BatchNormAct2d(8, momentum=None)).double()


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_timm_style_layers_are_routed(mode):
    original, converted = _timm_like(), _timm_like()
    report = normkit.convert(converted)
    assert report.left == [] and report.swapped == []
    assert [n for n, _, _ in report.routed] == ["1", "2", "3", "4", "5", "7"]
    assert "channels_first" in report.routed[1][2]
    for model in (original, converted):
        model.train(mode == "train")
    for step in range(2):
        x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(step),
                        dtype=torch.float64)
        xa, xb = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
        a, b = original(xa), converted(xb)
        _assert_close(b, a, f"{mode} output {step}")
        a.square().sum().backward(), b.square().sum().backward()
        _assert_close(xb.grad, xa.grad, "input grad")
    scale = _grad_scale(original)
    for (n, pa), (_, pb) in zip(original.named_parameters(), converted.named_parameters()):
        _assert_close(pb.grad, pa.grad, f"grad {n}", scale)
    for (n, a), (_, b) in zip(original.state_dict().items(), converted.state_dict().items()):
        _assert_close(b.double(), a.double(), f"state {n}")
    normkit.revert(converted)
    assert [type(m) for m in converted] == [type(m) for m in original]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_channels_first_layer_norm_runs_the_rows_kernel(dtype):
    # a routed channels-first LayerNorm: the layer norm of the channels-last rows (a copy
    # in, as the model's own permute does, then the C++ node), not a strided reduction
    torch.manual_seed(0)
    original = LayerNorm2d(8).to(dtype)
    with torch.no_grad():
        original.weight.uniform_(0.5, 1.5), original.bias.uniform_(-1, 1)
    converted = normkit.convert(nn.Sequential(copy.deepcopy(original))).model[0]
    x = torch.randn(3, 8, 5, 7, dtype=dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = original(xa), converted(xb)
    assert "NormNode" in b.grad_fn.next_functions[0][0].name()      # (under the movedim)
    torch.testing.assert_close(b, a)                  # (torch's defaults for the dtype)
    a.square().sum().backward(), b.square().sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad)
    torch.testing.assert_close(converted.weight.grad, original.weight.grad)


class StdConv2d(nn.Conv2d):
    """timm's weight-standardized convolution, as timm writes it."""

    def __init__(self, *args, eps=1e-6, **kwargs):
        super().__init__(*args, **kwargs)
        self.eps = eps

    def forward(self, x):
        weight = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None,
                              training=True, momentum=0.0, eps=self.eps).reshape_as(self.weight)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation,
                        self.groups)


def _graph_names(y):
    """The names of every autograd node behind ``y``, joined."""
    names, todo, seen = [], [y.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.append(fn.name())
        todo.extend(f for f, _ in fn.next_functions)
    return " ".join(names)


def test_weight_standardized_convolution_is_routed():
    torch.manual_seed(0)
    original = nn.Sequential(StdConv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 1)).double()
    converted = copy.deepcopy(original)
    report = normkit.convert(converted)
    assert [n for n, _, _ in report.routed] == ["0"] and report.left == []  # plain conv kept
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    a, b = original(x), converted(x)
    _assert_close(b, a, "output")
    assert "NormNode" in _graph_names(b) and "NormNode" not in _graph_names(a)
    a.square().sum().backward(), b.square().sum().backward()
    for (n, pa), (_, pb) in zip(original.named_parameters(), converted.named_parameters()):
        _assert_close(pb.grad, pa.grad, f"grad {n}", _grad_scale(original))
    normkit.revert(converted)
    assert type(converted[0]) is StdConv2d


def test_routing_is_per_module_and_leaves_torch_functions_alone():
    routed, plain = GroupNormAct(8), GroupNormAct(8)
    normkit.convert(routed)
    assert F.group_norm is torch.nn.functional.group_norm     # nothing global patched
    assert type(plain) is GroupNormAct and type(routed) is not GroupNormAct
    assert isinstance(routed, GroupNormAct)


def test_opaque_subclass_is_left_with_the_reason():
    model = nn.Sequential(Opaque(8))
    report = normkit.convert(model)
    assert report.swapped == [] and report.routed == []
    [(name, kind, why)] = report.left
    assert name == "0" and kind.endswith("Opaque") and "overrides forward" in why
    assert "left 1" in str(report)


def test_routed_model_compiles_fullgraph():
    model = _timm_like().eval()
    normkit.convert(model)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), model(x))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_converted_zoo_model_compiles_fullgraph_without_breaks(name):
    """The issue's four families, converted (swapped and routed), under torch.compile."""
    model = build(name).float().eval()
    normkit.convert(model)
    x = pixels(batch=2)
    torch._dynamo.reset()
    assert torch._dynamo.explain(model)(x).graph_break_count == 0
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch.testing.assert_close(_output(compiled(x)), _output(model(x)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, kind, options", [
    ("resnet", "vision", {"fuse_activation": True}), ("convnext", "vision", {}),
    ("bit", "vision", {}), ("llama", "language", {"fuse_residual": True}),
    ("gemma", "language", {}), ("t5", "language", {})])
def test_a_model_built_on_the_meta_device_converts_as_on_the_cpu(name, kind, options):
    # the way large models are made: built on the meta device, converted, then given
    # memory and their weights (to_empty, load_state_dict); convert decides as on the CPU
    from zoo_models import build_language, tokens

    make = build if kind == "vision" else build_language
    with torch.device("meta"):
        on_meta = make(name)
    meta_report = str(normkit.convert(on_meta, **options))
    model = make(name)
    report = normkit.convert(model, **options)
    assert meta_report == str(report)
    on_meta.to_empty(device="cpu")
    on_meta.load_state_dict(model.state_dict())
    buffers = dict(model.named_buffers())       # (non-persistent ones: rotary frequencies)
    for n, b in on_meta.named_buffers():
        b.copy_(buffers[n])
    model.eval(), on_meta.eval()
    x = pixels() if kind == "vision" else tokens()
    args = {} if kind == "vision" else {"decoder_input_ids": x} if name == "t5" else {}
    want, got = model(x, **args), on_meta(x, **args)
    key = "last_hidden_state" if kind == "vision" else "logits"
    torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
    assert {type(m) for m in on_meta.modules()} == {type(m) for m in model.modules()}
