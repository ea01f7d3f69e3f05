"""normkit.fold: folded models compute what the unfolded ones do; the report says what was
left and why."""

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import normkit  # noqa: E402
import normkit.nn as nknn  # noqa: E402

BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
            nknn.BatchNorm1d, nknn.BatchNorm2d, nknn.BatchNorm3d)


def _randomize(model, seed=0):
    """Non-trivial running statistics and affine parameters, so that a wrong fold shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, BN_TYPES) and m.running_mean is not None:
                n = m.num_features
                m.running_mean.copy_(torch.randn(n, generator=gen) * 0.5)
                m.running_var.copy_(torch.rand(n, generator=gen) * 2 + 0.1)
                if m.weight is not None:
                    m.weight.copy_(torch.rand(n, generator=gen) + 0.5)
                if m.bias is not None:
                    m.bias.copy_(torch.randn(n, generator=gen) * 0.3)
    return model


def _close(actual, expected, rel):
    """max |actual - expected| <= rel * max |expected| (relative to the output's scale)."""
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} > {rel:g} x {scale:.3g}"


def _count_bn(model):
    return sum(isinstance(m, BN_TYPES) for m in model.modules())


class Branches(nn.Module):
    """Every foldable producer kind, declared in an order unlike the call order."""

    def __init__(self):
        super().__init__()
        self.bn_lin = nn.BatchNorm1d(6)
        self.bn_t = nn.BatchNorm2d(6)
        self.bn_g = nn.BatchNorm2d(8, affine=False)
        self.bn3 = nn.BatchNorm3d(4)
        self.bn1 = nn.BatchNorm1d(6)
        self.conv_g = nn.Conv2d(3, 8, 3, groups=1, bias=False, padding=1)
        self.conv_dw = nn.Conv2d(8, 8, 3, groups=4, dilation=2, padding=2)
        self.bn_dw = nn.BatchNorm2d(8)
        self.convt = nn.ConvTranspose2d(8, 6, 3, stride=2, groups=2)
        self.conv3 = nn.Conv3d(3, 4, (1, 3, 3), bias=False)
        self.conv1 = nn.Conv1d(3, 6, 5, padding=2, padding_mode="circular")
        self.lin = nn.Linear(12, 6, bias=False)

    def forward(self, x, seq, vec, vol):
        a = torch.relu(self.bn_g(self.conv_g(x)))
        a = self.bn_dw(self.conv_dw(a))
        t = self.bn_t(self.convt(a))
        v = self.bn3(self.conv3(vol))
        s = self.bn1(self.conv1(seq))
        w = self.bn_lin(self.lin(vec))
        return t.mean((2, 3)) + v.mean((2, 3, 4)).sum(1, keepdim=True) + s.mean(2) + w


def _branch_inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(4, 3, 9, 11, generator=gen, dtype=dtype),
            torch.randn(4, 3, 13, generator=gen, dtype=dtype),
            torch.randn(4, 12, generator=gen, dtype=dtype),
            torch.randn(4, 3, 2, 7, 6, generator=gen, dtype=dtype))


@pytest.mark.parametrize("layers", ["torch", "normkit"])
def test_every_producer_kind_folds_and_outputs_match(layers):
    model = _randomize(Branches()).eval()
    if layers == "normkit":
        normkit.convert(model)
        assert all(type(m).__module__.startswith("normkit.") for m in model.modules()
                   if isinstance(m, nn.BatchNorm2d))
    inputs = _branch_inputs()
    with torch.no_grad():
        expected = model(*inputs)
    report = normkit.fold(model)
    assert {b for b, _, _ in report.folded} == {
        "bn_g", "bn_dw", "bn_t", "bn3", "bn1", "bn_lin"}, str(report)
    assert dict((b, p) for b, p, _ in report.folded)["bn_t"] == "convt"
    assert report.left == [] and _count_bn(report.model) == 0
    assert report.model.conv_g.bias is not None and report.model.lin.bias is not None
    with torch.no_grad():
        _close(report.model(*inputs), expected, 1e-5)
    # the input model is untouched: fold works on a copy unless inplace=True
    assert report.model is not model and _count_bn(model) == 6 and model.conv_g.bias is None


def test_fold_in_float64_is_exact_to_rounding():
    model = _randomize(Branches()).double().eval()
    inputs = _branch_inputs(torch.float64)
    with torch.no_grad():
        expected = model(*inputs)
        report = normkit.fold(model, inplace=True)
        assert report.model is model and _count_bn(model) == 0
        _close(model(*inputs), expected, 1e-13)
        assert model.conv1.weight.dtype == torch.float64


def test_folded_weights_follow_the_formula():
    conv = nn.Conv2d(2, 3, 1, bias=True)
    bn = _randomize(nknn.BatchNorm2d(3, eps=1e-3, bias=False))
    model = nn.Sequential(conv, bn).eval()
    report = normkit.fold(model)
    s = bn.weight.double() / torch.sqrt(bn.running_var.double() + 1e-3)
    w = conv.weight.double() * s.view(3, 1, 1, 1)
    b = (conv.bias.double() - bn.running_mean.double()) * s  # no beta: bias=False
    folded = report.model[0]
    torch.testing.assert_close(folded.weight, w.float(), rtol=0, atol=0)
    torch.testing.assert_close(folded.bias, b.float(), rtol=0, atol=0)
    assert isinstance(report.model[1], normkit.folding.FoldedBatchNorm)


@pytest.mark.parametrize("make, good, bad, torch_refuses", [
    # a Linear's 3-D output (N, C, L), L == C: BatchNorm1d normalized dim 1, the fold
    # scaled the Linear's features (the last dim)
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), (5, 4), (2, 4, 4), False),
    # an unbatched (C, L) input to a Conv1d: its BatchNorm1d took the output as (N, C)
    (lambda: nn.Sequential(nn.Conv1d(3, 5, 1), nn.BatchNorm1d(5)), (2, 3, 5), (3, 5), False),
    # an unbatched (C, H, W) input to a Conv2d, which BatchNorm2d refused
    (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), (2, 3, 8, 8), (3, 8, 8),
     True)])
def test_an_input_of_another_layout_than_the_fold_assumed_raises(make, good, bad,
                                                                 torch_refuses):
    model = _randomize(make()).eval()
    folded = normkit.fold(model).model
    x = torch.randn(good)
    _close(folded(x), model(x), 1e-6)
    x = torch.randn(bad)
    if torch_refuses:
        with pytest.raises(ValueError):
            model(x)
    else:                                   # what the fold would have computed: not that
        assert not torch.allclose(folded[0](x), model(x), atol=1e-3)
    with pytest.raises(ValueError, match=r"folded into .* for \d-D input .*, got a "
                                         r"\d-D input of shape"):
        folded(x)


def test_a_folded_model_scripts_exports_and_keeps_the_activation():
    model = _randomize(nn.Sequential(nn.Conv2d(3, 4, 3),
                                     nknn.BatchNorm2d(4, activation="relu6"))).eval()
    folded = normkit.fold(model).model
    assert isinstance(folded[1].act, nn.ReLU6)
    x = torch.randn(2, 3, 8, 8) * 4
    _close(folded(x), model(x), 1e-6)
    _close(torch.jit.script(folded)(x), model(x), 1e-6)
    _close(torch.export.export(folded, (x,)).module()(x), model(x), 1e-6)


class Unfoldable(nn.Module):
    """One BatchNorm for each reason a fold is refused; the last pair does fold."""

    def __init__(self):
        super().__init__()
        self.shared_out = nn.Conv2d(3, 4, 3, padding=1)
        self.bn_shared_out = nn.BatchNorm2d(4)
        self.pre = nn.Conv2d(3, 4, 3, padding=1)
        self.bn_after_relu = nn.BatchNorm2d(4)
        self.train_conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn_train = nn.BatchNorm2d(4)
        self.nostat_conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn_no_stats = nn.BatchNorm2d(4, track_running_stats=False)
        self.bn_input = nn.BatchNorm2d(3)
        self.twice = nn.Conv2d(3, 4, 3, padding=1)
        self.bn_twice_producer = nn.BatchNorm2d(4)
        self.read_conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn_read = nn.BatchNorm2d(4)
        self.ok_conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn_ok = nn.BatchNorm2d(4)

    def forward(self, x):
        c = self.shared_out(x)
        out = self.bn_shared_out(c) + c                                   # output used twice
        out = out + self.bn_after_relu(torch.relu(self.pre(x)))           # activation between
        out = out + self.bn_train(self.train_conv(x))                     # BN in training mode
        out = out + self.bn_no_stats(self.nostat_conv(x))                 # no running stats
        out = out + self.bn_input(x).sum(1, keepdim=True)                 # no producer
        out = out + self.bn_twice_producer(self.twice(x)) + self.twice(x)  # producer called twice
        w = self.read_conv.weight                                         # weight read directly
        out = out + self.bn_read(self.read_conv(x)) + w.sum()
        return out + self.bn_ok(self.ok_conv(x))


@pytest.mark.parametrize("layers", ["torch", "normkit"])
def test_unfoldable_batch_norms_are_left_with_the_reason(layers):
    model = _randomize(Unfoldable()).eval()
    if layers == "normkit":
        normkit.convert(model)
    model.bn_train.train()
    x = torch.randn(2, 3, 6, 5, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(x)
    report = normkit.fold(model)
    assert [b for b, _, _ in report.folded] == ["bn_ok"]
    why = {name: reason for name, _, reason in report.left}
    assert set(why) == {"bn_shared_out", "bn_after_relu", "bn_train", "bn_no_stats", "bn_input",
                        "bn_twice_producer", "bn_read"}
    assert "also used by" in why["bn_shared_out"] and "'add'" in why["bn_shared_out"]
    assert "relu" in why["bn_after_relu"] and "not straight from" in why["bn_after_relu"]
    assert "training mode" in why["bn_train"]
    assert "track_running_stats=False" in why["bn_no_stats"]
    assert why["bn_input"].startswith("no producer")
    assert "called 2 times" in why["bn_twice_producer"]
    assert "read elsewhere" in why["bn_read"]
    kinds = {type(m) for m in report.model.modules()}
    assert (nknn.BatchNorm2d if layers == "normkit" else nn.BatchNorm2d) in kinds
    with torch.no_grad():
        _close(report.model(x), expected, 1e-5)  # bn_train's batch statistics: same batch


def test_shared_layers_subclass_hooks_tied_weights_and_unused_are_left():
    class MyBN(nn.BatchNorm2d):
        pass

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(2, 3, 1), nn.Conv2d(2, 3, 1)
            self.bn = nn.BatchNorm2d(3)  # one BatchNorm after two convolutions
            self.c, self.sub = nn.Conv2d(2, 3, 1), MyBN(3)
            self.d, self.hooked = nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3)
            self.lin, self.bn1 = nn.Linear(2, 3), nn.BatchNorm1d(3)
            self.e, self.f = nn.Conv2d(2, 3, 1), nn.Conv2d(2, 3, 1)
            self.f.weight = self.e.weight  # tied weights
            self.bn_e, self.bn_f = nn.BatchNorm2d(3), nn.BatchNorm2d(3)
            self.unused = nn.BatchNorm2d(3)

        def forward(self, x):
            y = self.bn(self.a(x)) + self.bn(self.b(x)) + self.sub(self.c(x))
            y = y + self.bn_e(self.e(x)) + self.bn_f(self.f(x))
            return y + self.hooked(self.d(x)), self.bn1(self.lin(x.mean((2, 3))))

    model = _randomize(Net()).eval()
    model.hooked.register_forward_hook(lambda mod, args, out: None)
    report = normkit.fold(model)
    why = {name: reason for name, _, reason in report.left}
    assert "called 2 times" in why["bn"]
    assert "not a BatchNorm1d/2d/3d" in why["sub"]
    assert "forward hooks" in why["hooked"]
    assert "read elsewhere" in why["bn_e"] and "read elsewhere" in why["bn_f"]
    assert "never calls it" in why["unused"]
    assert [b for b, _, _ in report.folded] == ["bn1"]


def test_a_producer_subclass_folds_where_it_keeps_torchs_forward():
    """A Conv2d subclass that only sets arguments (transformers' EfficientNet depthwise
    convolution) computes Conv2d: it folds. One with its own forward (here: weight
    standardization) may compute anything else: its BatchNorm is left."""
    class Depthwise(nn.Conv2d):
        def __init__(self, channels):
            super().__init__(channels, channels, 3, padding=1, groups=channels)

    class Standardized(nn.Conv2d):
        def forward(self, x):
            w = (self.weight - self.weight.mean((1, 2, 3), keepdim=True))
            return self._conv_forward(x, w, self.bias)

    class OwnConv(nn.Conv2d):             # torch's forward, its own _conv_forward
        def _conv_forward(self, x, weight, bias):
            return super()._conv_forward(x, weight * 2, bias)

    model = _randomize(nn.Sequential(Depthwise(3), nn.BatchNorm2d(3), Standardized(3, 3, 1),
                                     nn.BatchNorm2d(3), OwnConv(3, 3, 1),
                                     nn.BatchNorm2d(3))).eval()
    x = torch.randn(2, 3, 6, 6)
    report = normkit.fold(model)
    assert report.folded == [("1", "0", "Depthwise")]
    why = {name: reason for name, _, reason in report.left}
    assert why.keys() == {"3", "5"} and "not straight from a Conv" in why["3"]
    with torch.no_grad():
        _close(report.model(x), model(x), 1e-5)


def test_a_parametrized_producer_is_left_until_its_parametrization_is_removed():
    """weight_norm's Conv2d is a torch subclass with torch's forward, but its weight is
    computed at each call: a fold that wrote it would change nothing (0.08 off)."""
    from torch.nn.utils import parametrizations, parametrize

    model = _randomize(nn.Sequential(parametrizations.weight_norm(nn.Conv2d(3, 4, 3)),
                                     nn.BatchNorm2d(4), nn.Flatten(),
                                     parametrizations.weight_norm(nn.Linear(4, 5)),
                                     nn.BatchNorm1d(5))).eval()
    x = torch.randn(2, 3, 3, 3)
    report = normkit.fold(model)
    assert report.folded == [] and len(report.left) == 2
    assert all("parametrized tensors" in why for _, _, why in report.left), str(report)

    class Computed(nn.Conv2d):          # torch's forward, a weight computed by a property
        def __init__(self):
            super().__init__(3, 4, 3)
            self.raw = nn.Parameter(self._parameters.pop("weight").detach())

        @property
        def weight(self):
            return self.raw * 2

    computed = _randomize(nn.Sequential(Computed(), nn.BatchNorm2d(4))).eval()
    report = normkit.fold(computed)
    assert report.folded == [] and "computes its weight or bias" in report.left[0][2]

    for i in (0, 3):
        parametrize.remove_parametrizations(model[i], "weight")
    report = normkit.fold(model)
    assert [b for b, _, _ in report.folded] == ["1", "4"]
    with torch.no_grad():
        _close(report.model(x), model(x), 1e-5)


def _zoo_folded(name):
    """The zoo model ``name`` with random statistics, folded: (report, its output, the
    unfolded model's output)."""
    from zoo_models import build, pixels

    model = _randomize(build(name)).eval()
    with torch.no_grad():
        expected = model(pixel_values=pixels()).last_hidden_state
        report = normkit.fold(model)
        return report, report.model(pixel_values=pixels()).last_hidden_state, expected


def test_transformers_efficientnet_depthwise_batch_norms_fold():
    report, got, expected = _zoo_folded("efficientnet")
    depthwise = [b for b, _, kind in report.folded if kind == "EfficientNetDepthwiseConv2d"]
    assert len(depthwise) == 7 and len(report.folded) == 21, str(report)
    _close(got, expected, 1e-5)


class _LinearNorm(nn.Module):     # LeViT's: BatchNorm1d over the rows of a Linear's output
    def __init__(self, flat=(0, 1), reuse=False):
        super().__init__()
        self.linear, self.bn = nn.Linear(4, 6), nn.BatchNorm1d(6)
        self.flat, self.reuse = flat, reuse

    def forward(self, x):
        h = self.linear(x)
        y = self.bn(h.flatten(*self.flat)).reshape_as(h)
        return y + h if self.reuse else y


@pytest.mark.parametrize("flat", [(0, 1), (0, -2)])
def test_a_linear_folds_through_a_flatten_of_its_leading_dims(flat):
    model = _randomize(_LinearNorm(flat)).eval()
    x = torch.randn(2, 5, 4)
    report = normkit.fold(model)
    assert report.folded == [("bn", "linear", "Linear")], str(report)
    with torch.no_grad():
        _close(report.model(x), model(x), 1e-5)
    x4 = torch.randn(2, 5, 3, 4)
    if flat == (0, -2):                        # (N, L, K, C) -> rows of C: still the fold
        with torch.no_grad():
            _close(report.model(x4), model(x4), 1e-5)
    else:                                      # (N * L, K, C): not rows of C
        with pytest.raises(ValueError, match="BatchNorm1d"):
            report.model(x4)


def test_a_flatten_that_is_not_of_the_leading_dims_or_a_reused_output_is_left():
    for model, reason in ((_LinearNorm((1, 2)), "not straight from"),
                          (_LinearNorm(reuse=True), "also used by")):
        report = normkit.fold(_randomize(model).eval())
        assert report.folded == [] and reason in report.left[0][2], str(report)


def test_transformers_levit_every_batch_norm_folds():
    report, got, expected = _zoo_folded("levit")
    assert len(report.folded) == 26 and report.left == [], str(report)
    _close(got, expected, 1e-5)


def test_producer_of_another_dimensionality_is_refused():
    # Conv1d (N, 4, L) feeding a BatchNorm1d(4) folds; a Conv2d feeding a BatchNorm1d does not
    model = nn.Sequential(nn.Conv1d(2, 4, 3), nn.BatchNorm1d(4)).eval()
    assert len(normkit.fold(model).folded) == 1
    odd = nn.Sequential(nn.Conv2d(2, 4, 1), nn.BatchNorm1d(4)).eval()
    report = normkit.fold(odd)
    assert "does not feed a BatchNorm1d" in report.left[0][2]


def test_training_model_and_model_without_batch_norm_come_back_unchanged():
    model = _randomize(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
    state = copy.deepcopy(model.state_dict())
    for inplace in (False, True):
        report = normkit.fold(model, inplace=inplace)
        assert report.folded == [] and [n for n, _, _ in report.left] == ["1"]
        assert "training mode" in report.notes[0] and "model.eval()" in report.notes[0]
        assert isinstance(report.model[1], nn.BatchNorm2d)
        for key, value in report.model.state_dict().items():
            assert torch.equal(value, state[key]), key
    plain = nn.Sequential(nn.Linear(3, 4), nn.ReLU()).eval()
    report = normkit.fold(plain, inplace=True)
    assert report.model is plain and report.folded == report.left == []
    assert "no BatchNorm" in str(report)


def test_module_with_untraceable_forward_is_traced_child_by_child():
    class Checked(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())

        def forward(self, x):
            if x.shape[1] != 3:  # control flow on a traced value: fx cannot record it
                raise ValueError("3 channels expected")
            return self.block(x)

    model = _randomize(nn.Sequential(Checked(), nn.Conv2d(4, 2, 1), nn.BatchNorm2d(2))).eval()
    x = torch.randn(2, 3, 7, 7)
    with torch.no_grad():
        expected = model(x)
    report = normkit.fold(model)
    assert sorted(b for b, _, _ in report.folded) == ["0.block.1", "2"]
    assert any(note.startswith("0 could not be traced as a whole") for note in report.notes)
    with torch.no_grad():
        _close(report.model(x), expected, 1e-5)


def test_report_reads_well():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.BatchNorm2d(8)).eval()
    text = str(normkit.fold(model))
    assert text.splitlines()[0] == "folded 0 BatchNorm layer(s), left 1"
    assert text.splitlines()[1].startswith("  left 2 (torch.nn.BatchNorm2d): its input comes "
                                           "from '1' (ReLU)")
    text = str(normkit.fold(nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8)).eval()))
    assert text == "folded 1 BatchNorm layer(s), left 0\n  folded 1 into 0 (Linear)"


@pytest.mark.parametrize("bad", [{"w": 1}, [nn.Conv2d(1, 1, 1)], None])
def test_non_module_input_is_a_type_error(bad):
    with pytest.raises(TypeError, match="fold expects a torch.nn.Module"):
        normkit.fold(bad)


def test_inplace_must_be_a_bool():
    with pytest.raises(TypeError, match="inplace must be True or False"):
        normkit.fold(nn.Sequential(), inplace="yes")


transformers = pytest.importorskip("transformers")

RESNET18 = dict(layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512])


@pytest.mark.parametrize("layers", ["torch", "normkit", "normkit, fuse_activation"])
def test_transformers_resnet18_every_batch_norm_folds(layers):
    # (fuse_activation: the conv layers' classes, derived by convert with the activation
    # call dropped, are traced through like transformers' own, not kept as leaves)
    from transformers import ResNetConfig, ResNetModel

    torch.manual_seed(0)
    model = _randomize(ResNetModel(ResNetConfig(**RESNET18))).eval()
    if layers != "torch":
        normkit.convert(model, fuse_activation=layers.endswith("fuse_activation"))
    n_bn = _count_bn(model)
    assert n_bn == 20
    pixels = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(pixel_values=pixels)
    report = normkit.fold(model)
    assert len(report.folded) == n_bn and report.left == [], str(report)
    assert _count_bn(report.model) == 0
    with torch.no_grad():
        got = report.model(pixel_values=pixels)
    _close(got.last_hidden_state, expected.last_hidden_state, 1e-5)
    _close(got.pooler_output, expected.pooler_output, 1e-5)


def test_transformers_resnet50_defaults_every_batch_norm_folds():
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    model = _randomize(ResNetForImageClassification(ResNetConfig())).eval()
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(pixel_values=pixels).logits
        report = normkit.fold(model)
        assert len(report.folded) == 53 and report.left == []
        _close(report.model(pixel_values=pixels).logits, expected, 1e-5)


def test_tracer_rollback_leaves_a_valid_graph():
    from normkit.folding import _PiecewiseTracer

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            if self.lin.weight.sum() > 0:  # reads a parameter, then fails to trace
                return self.lin(x)
            return x

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.lin, self.bn = Gate(), nn.Linear(4, 4), nn.BatchNorm1d(4)

        def forward(self, x):
            y = self.gate(x) * self.gate.lin.weight.sum()  # the same parameter, read again
            return self.bn(self.lin(y))

    tracer = _PiecewiseTracer()
    graph = tracer.trace(Net())
    graph.lint()  # no node refers to one erased by the rollback
    assert [name for name, _, _ in tracer.opaque] == ["gate"]
    assert [n.target for n in graph.find_nodes(op="get_attr")] == ["gate.lin.weight"]
    model = _randomize(Net()).eval()
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = model(x)
        report = normkit.fold(model)
        assert [b for b, _, _ in report.folded] == ["bn"]
        _close(report.model(x), expected, 1e-5)
