"""Language models: RMSNorm casting rules of normkit.functional.rms_norm against the
models' own classes, and convert/revert on tiny transformers LLMs."""

import pickle

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from torch import nn  # noqa: E402

import normkit  # noqa: E402
import normkit.functional as nF  # noqa: E402
import normkit.nn as nknn  # noqa: E402
from zoo_models import LANGUAGE, build_language, tokens  # noqa: E402


def _classes():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    return {"llama": (LlamaRMSNorm, "llama", 0.0), "qwen3": (Qwen3RMSNorm, "llama", 0.0),
            "gemma": (GemmaRMSNorm, "gemma", 1.0), "gemma2": (Gemma2RMSNorm, "gemma", 1.0),
            "t5": (T5LayerNorm, "t5", 0.0)}


HALF = (torch.bfloat16, torch.float16)


def _module_and_input(cls, dtype, hidden=1000, rows=64):
    gen = torch.Generator().manual_seed(0)
    module = cls(hidden, eps=1e-6)
    with torch.no_grad():
        module.weight.copy_(torch.randn(hidden, generator=gen) * 0.5 + 0.2)
    module.to(dtype)
    x = (torch.randn(rows, 3, hidden, generator=gen) * 3 + 0.5).to(dtype)
    return module, x


def _eps(module):
    return getattr(module, "variance_epsilon", getattr(module, "eps", None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma", "gemma2", "t5"])
def test_rms_norm_casting_equals_the_model_class(family, dtype):
    cls, casting, offset = _classes()[family]
    module, x = _module_and_input(cls, dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    weight = module.weight.detach().clone().requires_grad_()
    want = module(xa)
    got = nF.rms_norm(xb, [x.shape[-1]], weight, _eps(module), offset=offset, casting=casting)
    assert got.dtype == want.dtype
    if dtype in HALF:
        # the mean of squares is summed in another order: rstd may differ in its last fp32
        # bit, which flips the rounding of a few elements (<= 0.1 %) by one unit
        diff = got != want
        assert diff.float().mean() <= 1e-3, int(diff.sum())
        rel = ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)).max()
        assert rel <= 2 * torch.finfo(dtype).eps
    else:
        torch.testing.assert_close(got, want, rtol=3e-7, atol=3e-7)
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(1)).to(want.dtype)
    want.backward(g)
    got.backward(g)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype in HALF else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xb.grad, xa.grad, **tol)
    torch.testing.assert_close(weight.grad.float(), module.weight.grad.float(),
                               **(dict(rtol=2e-2, atol=0.5) if dtype in HALF else tol))


def test_rms_norm_casting_gradients_against_fp64_autograd():
    x = torch.randn(5, 123, dtype=torch.float64, requires_grad=True)
    w = torch.randn(123, dtype=torch.float64, requires_grad=True)

    def gemma(x, w):   # fp64 throughout, so the cast is the identity
        return nF.rms_norm(x, [123], w, 1e-6, offset=1.0, casting="t5")

    assert torch.autograd.gradcheck(gemma, (x, w))


def test_rms_norm_options_are_checked():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="casting must be one of"):
        nF.rms_norm(x, [8], torch.ones(8), casting="mistral")
    with pytest.raises(ValueError, match="weight is None"):
        nF.rms_norm(x, [8], None, offset=1.0, casting="gemma")
    layer = nknn.RMSNorm(8, eps=1e-6, offset=1.0, casting="gemma")
    assert torch.equal(layer.weight, torch.zeros(8))      # offset + weight = 1 at init
    torch.testing.assert_close(layer(x), nF.rms_norm(x, [8], torch.ones(8), 1e-6))
    assert "offset=1.0, casting='gemma'" in repr(layer)


def _loss(model, name, ids):
    kwargs = dict(input_ids=ids, labels=ids)
    if name == "t5":
        kwargs["decoder_input_ids"] = ids
    return model(**kwargs).loss


def _rms_names(model):
    return {n for n, m in model.named_modules() if "RMSNorm" in type(m).__name__ or
            type(m).__name__ == "T5LayerNorm"}


@pytest.mark.parametrize("name", sorted(LANGUAGE))
def test_language_model_rms_norms_swapped(name):
    original, converted = build_language(name), build_language(name)
    norms = _rms_names(original)
    report = normkit.convert(converted)
    assert report.left == [] and report.routed == [], str(report)
    assert {n for n, _, _ in report.swapped} == norms and norms
    for n in norms:
        module = converted.get_submodule(n)
        assert isinstance(module, nknn.RMSNorm)
        source = type(original.get_submodule(n))
        assert type(module).__name__ == source.__name__
        assert module.casting == ("gemma" if "gemma" in name else "t5" if name == "t5" else
                                  "llama")
        assert getattr(module, "variance_epsilon", module.eps) == module.eps
    # state_dicts load both ways
    assert list(converted.state_dict()) == list(original.state_dict())
    converted.load_state_dict(original.state_dict())
    original.load_state_dict(converted.state_dict())

    ids = tokens()
    for dtype in (torch.float32, torch.bfloat16):
        original.to(dtype), converted.to(dtype)
        original.zero_grad(), converted.zero_grad()
        la, lb = _loss(original, name, ids), _loss(converted, name, ids)
        la.backward(), lb.backward()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(lb, la, rtol=tol, atol=tol)
        scale = max(float(p.grad.abs().max()) for p in original.parameters()
                    if p.grad is not None)
        for (n, pa), (_, pb) in zip(original.named_parameters(), converted.named_parameters()):
            if pa.grad is not None:
                torch.testing.assert_close(pb.grad.float(), pa.grad.float(), rtol=tol,
                                           atol=tol * scale, msg=n)

    back = normkit.revert(converted)
    assert len(back.swapped) == len(norms)
    assert [type(m) for m in converted.modules()] == [type(m) for m in original.modules()]
    for n in norms:
        a, b = original.get_submodule(n), converted.get_submodule(n)
        assert vars(a).keys() == vars(b).keys()


class _Count:
    calls = 0

    def __call__(self, *_):
        self.calls += 1


def test_converted_llm_pickles_and_hooks_carry():
    model = build_language("llama")
    hook = _Count()
    model.model.norm.register_forward_hook(hook)
    normkit.convert(model)
    _loss(model, "llama", tokens())
    assert hook.calls == 1
    clone = pickle.loads(pickle.dumps(model))
    torch.testing.assert_close(_loss(clone, "llama", tokens()), _loss(model, "llama", tokens()))


class NotQuiteRMS(nn.Module):           # the structure of an RMSNorm, another computation
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        return self.weight * x / (x.abs().mean(-1, keepdim=True) + self.eps)


class OwnRMSNorm(nn.Module):             # a user's class of the same structure and rule
    def __init__(self, hidden, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def test_structure_is_verified_by_behaviour():
    model = nn.Sequential(OwnRMSNorm(16), NotQuiteRMS(16))
    report = normkit.convert(model)
    assert [n for n, _, _ in report.swapped] == ["0"]
    assert model[0].casting == "llama" and model[0].offset == 0.0
    [(name, kind, why)] = report.left
    assert name == "1" and "computes none of normkit's LayerNorm/RMSNorm recipes" in why
    assert "swapped 1 module(s), routed 0, left 1" in str(report)


def test_converted_llama_compiles_fullgraph():
    model = build_language("llama").eval()
    normkit.convert(model)
    ids = tokens()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits)


def _train(model, name, steps=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = _loss(model, name, tokens(seed=step))
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, [p.grad.double().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_language_model_trains_the_same(name):
    truth_losses, truth_grads = _train(build_language(name, dtype=torch.float64), name)
    plain_losses, plain_grads = _train(build_language(name), name)
    model = build_language(name)
    normkit.convert(model)
    losses, grads = _train(model, name)
    # judged against fp64: the converted run is no further from it than fp32 rounding
    # takes the untouched run (both norm implementations round differently in fp32)
    for got, plain, truth in zip(losses, plain_losses, truth_losses):
        assert abs(got - truth) <= 4 * abs(plain - truth) + 1e-5, (got, plain, truth)
    for got, plain, truth in zip(grads, plain_grads, truth_grads):
        scale = float(truth.abs().max()) + 1e-12
        assert float((got - truth).abs().max()) <= \
            4 * float((plain - truth).abs().max()) + 1e-5 * scale
