"""convert on the norm classes transformers' models define themselves (gated, grouped,
weightless, L2, fp32 LayerNorms without bias, per-head q/k norms): routed to normkit and
equal to the untouched class, swapped only where the replacement takes every call; and
whole Mamba2 and Cohere models that run, train and compile like the untouched ones."""

import copy
import pickle

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from torch import nn  # noqa: E402

import normkit  # noqa: E402
import normkit.nn as nknn  # noqa: E402


def _class(path):
    module, name = path.rsplit(".", 1)
    return getattr(__import__(f"transformers.models.{module}", fromlist=[name]), name)


# (class, constructor args, input's trailing shape, gated)
CLASSES = {
    "cohere": ("cohere.modeling_cohere.CohereLayerNorm", dict(hidden_size=24), (24,), False),
    "cohere_qk": ("cohere.modeling_cohere.CohereLayerNorm", dict(hidden_size=(4, 6)), (4, 6),
                  False),
    "cohere2": ("cohere2.modeling_cohere2.Cohere2LayerNorm", dict(hidden_size=24), (24,), False),
    "olmo": ("olmo.modeling_olmo.OlmoLayerNorm", dict(hidden_size=24), (24,), False),
    "deberta": ("deberta.modeling_deberta.DebertaLayerNorm", dict(size=24), (24,), False),
    "imagegpt": ("imagegpt.modeling_imagegpt.ImageGPTLayerNorm", dict(hidden_size=24), (24,),
                 False),
    "falcon_mamba": ("falcon_mamba.modeling_falcon_mamba.FalconMambaWeightlessRMSNorm",
                     dict(hidden_size=24), (24,), False),
    "llama4_qk": ("llama4.modeling_llama4.Llama4TextWeightlessRMSNorm", dict(eps=1e-5), (24,),
                  False),
    "dory_l2": ("dory.modeling_dory.DoryL2Norm", dict(), (24,), False),
    "mamba2": ("mamba2.modeling_mamba2.Mamba2RMSNormGated", dict(hidden_size=24, group_size=8),
               (24,), True),
    "mamba2_one_group": ("mamba2.modeling_mamba2.Mamba2RMSNormGated",
                         dict(hidden_size=24, group_size=24), (24,), True),
    "qwen3_next": ("qwen3_next.modeling_qwen3_next.Qwen3NextRMSNormGated", dict(hidden_size=24),
                   (24,), True),
    "bailing": ("bailing_hybrid.modeling_bailing_hybrid.BailingHybridRMSNormGated",
                dict(hidden_size=24), (24,), True),
    "falcon_h1_after": ("falcon_h1.modeling_falcon_h1.FalconH1RMSNormGated",
                        dict(hidden_size=24, n_groups=2, norm_before_gate=True), (24,), True),
    "falcon_h1_before": ("falcon_h1.modeling_falcon_h1.FalconH1RMSNormGated",
                         dict(hidden_size=24, n_groups=2, norm_before_gate=False), (24,), True),
}
HALF = (torch.bfloat16, torch.float16)


def _pair(name, dtype):
    path, kwargs, shape, gated = CLASSES[name]
    torch.manual_seed(0)
    module = _class(path)(**kwargs)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape) * 0.5 + 0.3)
    module.to(dtype)
    converted = copy.deepcopy(module)
    return module, converted, shape, gated


def _inputs(shape, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn((3, 5) + shape, generator=gen) * 2 + 0.5).to(dtype)
    g = torch.randn((3, 5) + shape, generator=gen).to(dtype)
    return x, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CLASSES))
def test_model_norm_class_runs_on_normkit_and_equals_the_untouched(name, dtype):
    module, converted, shape, gated = _pair(name, dtype)
    report = normkit.convert(nn.Sequential(converted))
    assert report.left == [] and report.swapped == [], str(report)
    assert "_normkit_routed_from" in vars(type(converted))      # its forward is normkit's
    x, g = _inputs(shape, dtype)
    calls = [((x, g), {}), ((x,), {"gate": g})] if gated else [((x,), {})]
    if name.startswith(("mamba2", "falcon_h1")):
        calls.append(((x,), {}))                                  # the gate is optional
    for args, kwargs in calls:
        xa = args[0].clone().requires_grad_()
        xb = args[0].clone().requires_grad_()
        want = module(xa, *args[1:], **kwargs)
        got = converted(xb, *args[1:], **kwargs)
        assert got.dtype == want.dtype and got.shape == want.shape
        if dtype in HALF:
            # judged against the class itself in float64: no less accurate than the class
            # in bf16 (ImageGPT's computes in bf16 what normkit does with fp32 statistics)
            exact = copy.deepcopy(module).double()
            truth = exact(args[0].double(), *(a.double() for a in args[1:]),
                          **{k: v.double() for k, v in kwargs.items()}).detach()
            err = lambda y: float((y.detach().double() - truth).abs().max())  # noqa: E731
            assert err(got) <= 2 * err(want) + 1e-6, (err(got), err(want))
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        seed = torch.Generator().manual_seed(2)
        dy = torch.randn(want.shape, generator=seed).to(want.dtype)
        want.backward(dy)
        got.backward(dy)
        tol = dict(rtol=3e-2, atol=3e-2) if dtype in HALF else dict(rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(xb.grad.float(), xa.grad.float(), **tol)
    for (n, a), (_, b) in zip(module.named_parameters(), converted.named_parameters()):
        tol = dict(rtol=5e-2, atol=0.5) if dtype in HALF else dict(rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b.grad.float(), a.grad.float(), **tol, msg=n)


def test_gated_norm_is_routed_not_swapped_and_reverts():
    # one group: the gated norm computes LlamaRMSNorm's rule when called without a gate,
    # which used to swap it for an RMSNorm whose forward takes one argument
    module, converted, shape, _ = _pair("mamba2_one_group", torch.float32)
    model = nn.Sequential(converted)
    keys = list(model.state_dict())
    report = normkit.convert(model)
    assert [n for n, _, _ in report.routed] == ["0"] and not report.swapped
    assert "gate before (silu)" in report.routed[0][2]
    assert not isinstance(model[0], nknn.RMSNorm)
    x, g = _inputs(shape, torch.float32)
    torch.testing.assert_close(model[0](hidden_states=x, gate=g), module(x, g))
    assert list(model.state_dict()) == keys
    clone = pickle.loads(pickle.dumps(model))
    torch.testing.assert_close(clone[0](x, g), module(x, g))
    normkit.revert(model)
    assert type(model[0]) is type(module) and "_normkit_recipe" not in vars(model[0])


class TwoInputs(nn.Module):            # RMSNorm-shaped, but called with a mask as well
    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = 1e-6

    def forward(self, x, mask=None, scale=1.0):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x * scale if mask is None else self.weight * x * mask


class MeanAbsNorm(nn.Module):          # the structure of one, not the math
    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = 1e-6

    def forward(self, x):
        return self.weight * x / (x.abs().mean(-1, keepdim=True) + self.eps)


def test_report_names_every_module_left_and_why():
    model = nn.Sequential(TwoInputs(8), MeanAbsNorm(8), nn.Linear(8, 8))
    reference = copy.deepcopy(model)
    report = normkit.convert(model)
    assert report.swapped == [] and report.routed == []
    why = dict((n, reason) for n, _, reason in report.left)
    assert set(why) == {"0", "1"}
    assert "more than an input and a gate" in why["0"] and "mask" in why["0"]
    assert "computes none of normkit's LayerNorm/RMSNorm recipes" in why["1"]
    x = torch.randn(2, 8)
    torch.testing.assert_close(model[0](x, None, 2.0), reference[0](x, None, 2.0))


# --- whole models: Mamba2 (gated, grouped RMSNorm) and Cohere (fp32 LayerNorm, q/k norms)

def _mamba2(n_groups):
    from transformers import Mamba2Config, Mamba2Model

    config = Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=4,
                          head_dim=16, expand=2, n_groups=n_groups, state_size=8,
                          chunk_size=8, use_cache=False)
    torch.manual_seed(0)
    return Mamba2Model(config)


def _cohere(_):
    from transformers import CohereConfig, CohereModel

    config = CohereConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          use_qk_norm=True, use_cache=False)
    torch.manual_seed(0)
    return CohereModel(config)


MODELS = {"mamba2": (_mamba2, 1), "mamba2_groups": (_mamba2, 2), "cohere_qk": (_cohere, None)}
_IDS = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))


def _train(model, steps=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        out = model(input_ids=_IDS).last_hidden_state
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
        loss = (out * weights.to(out.dtype)).sum()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, [p.grad.double().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_converts_completely_runs_and_trains_like_the_untouched(name):
    make, arg = MODELS[name]
    norms = {n for n, m in make(arg).named_modules() if "Norm" in type(m).__name__}
    model = make(arg)
    report = normkit.convert(model)
    assert report.left == [], str(report)
    assert {n for n, _, _ in report.swapped + report.routed} == norms
    model.eval()
    untouched = make(arg).eval()
    torch.testing.assert_close(model(input_ids=_IDS).last_hidden_state,
                               untouched(input_ids=_IDS).last_hidden_state,
                               rtol=1e-4, atol=1e-5)
    truth_losses, truth_grads = _train(make(arg).double().train())
    plain_losses, plain_grads = _train(make(arg).train())
    losses, grads = _train(model.train())
    # judged against fp64: no further from it than fp32 rounding takes the untouched run
    for got, plain, truth in zip(losses, plain_losses, truth_losses):
        assert abs(got - truth) <= 4 * abs(plain - truth) + 1e-4 * abs(truth), (got, truth)
    for got, plain, truth in zip(grads, plain_grads, truth_grads):
        scale = float(truth.abs().max()) + 1e-12
        assert float((got - truth).abs().max()) <= \
            4 * float((plain - truth).abs().max()) + 1e-5 * scale


@pytest.mark.parametrize("name", sorted(MODELS))
def test_converted_model_compiles_fullgraph(name):
    make, arg = MODELS[name]
    model = make(arg).eval()
    normkit.convert(model)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    want = make(arg).eval()(input_ids=_IDS).last_hidden_state
    torch.testing.assert_close(compiled(input_ids=_IDS).last_hidden_state, want,
                               rtol=1e-4, atol=1e-5)
    model.train()
    compiled(input_ids=_IDS).last_hidden_state.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("path", ["d_fine.modeling_d_fine.DFineFrozenBatchNorm2d",
                                  "detr.modeling_detr.DetrFrozenBatchNorm2d"])
def test_frozen_batch_norm_runs_on_normkit_and_equals_the_untouched(path):
    module = _class(path)(8)
    with torch.no_grad():
        for b in module.buffers():
            b.copy_(torch.rand(8, generator=torch.Generator().manual_seed(0)) + 0.5)
    converted = copy.deepcopy(module)
    report = normkit.convert(nn.Sequential(converted))
    assert report.left == [] and "batch_norm in eval" in report.routed[0][2], str(report)
    xa = torch.randn(2, 8, 5, 7, generator=torch.Generator().manual_seed(1)).requires_grad_()
    xb = xa.detach().clone().requires_grad_()
    want, got = module(xa), converted(xb)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    want.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-5, atol=1e-6)
    assert list(converted.state_dict()) == list(module.state_dict())


def test_channels_first_layer_norm_of_3d_inputs_is_routed():
    from transformers.models.squeezebert.modeling_squeezebert import SqueezeBertLayerNorm

    torch.manual_seed(0)
    module = SqueezeBertLayerNorm(12)
    with torch.no_grad():
        module.weight.normal_()
        module.bias.normal_()
    converted = copy.deepcopy(module)
    report = normkit.convert(nn.Sequential(converted))
    assert report.routed and "channels_first" in report.routed[0][2], str(report)
    x = torch.randn(2, 12, 7, requires_grad=True)
    torch.testing.assert_close(converted(x), module(x), rtol=1e-5, atol=1e-6)


def test_norm_named_module_that_normalizes_nothing_is_left_with_that_reason():
    from transformers.models.mobilebert.modeling_mobilebert import NoNorm

    model = nn.Sequential(NoNorm(8))
    report = normkit.convert(model)
    [(name, _, why)] = report.left
    assert name == "0" and "computes no normalization" in why and "elementwise" in why
