"""convert(model, fuse_residual=True): the residual add before a norm runs as add_rms_norm /
add_layer_norm, with the unfused converted model's outputs and gradients bit for bit (fp32
and bf16 on CPU, where add_* is the add followed by the same norm op), and the untouched
model's within the tolerances of test_llm_conversion (fp32 1e-5, bf16 2e-2)."""

import copy
import pickle

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from torch import nn  # noqa: E402

import normkit  # noqa: E402
import normkit.functional as nF  # noqa: E402
from normkit.conversion import fuse  # noqa: E402
from zoo_models import build, build_language, pixels, tokens  # noqa: E402

# the (first) residual add of each decoder layer and the norm it is fused into
_LLAMA = "residual + hidden_states, then post_attention_layernorm"
FUSED = {"llama": _LLAMA, "qwen2": _LLAMA, "gemma": _LLAMA,
         "gemma2": "residual + hidden_states, then pre_feedforward_layernorm",
         "phi3": "residual + self.resid_attn_dropout(hidden_states), then "
                 "post_attention_layernorm"}


def _run(model, ids):
    """Logits, the residual stream after every layer, and every parameter's gradient."""
    model.zero_grad()
    out = model(input_ids=ids, labels=ids, output_hidden_states=True)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), [h.detach() for h in out.hidden_states], grads


class _Counted:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_equals_unfused_and_the_original(name, monkeypatch):
    original, unfused, fused = (build_language(name) for _ in range(3))
    normkit.convert(unfused)
    report = normkit.convert(fused, fuse_residual=True)
    layers = fused.config.num_hidden_layers
    assert [(n, how) for n, _, how in report.fused] == [
        (f"model.layers.{i}", f"{FUSED[name]} -> add_rms_norm") for i in range(layers)]
    assert f"fused {layers} residual add(s)" in str(report).splitlines()[0]
    counted = _Counted(nF.add_rms_norm)
    monkeypatch.setattr(nF, "add_rms_norm", counted)

    ids = tokens()
    for dtype in (torch.float32, torch.bfloat16):
        for model in (original, unfused, fused):
            model.to(dtype)
        counted.calls = 0
        want, plain, got = _run(original, ids), _run(unfused, ids), _run(fused, ids)
        assert counted.calls == layers     # (each deciding on its one pass: below)
        assert torch.equal(got[0], plain[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], plain[1]))   # residual stream
        assert got[2].keys() == plain[2].keys()
        assert all(torch.equal(got[2][n], plain[2][n]) for n in plain[2]), name
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
        scale = max(float(g.abs().max()) for g in want[2].values())
        for n, g in want[2].items():
            torch.testing.assert_close(got[2][n].float(), g.float(), rtol=tol,
                                       atol=tol * scale, msg=n)


def test_revert_and_state_dict_round_trip():
    original, fused = build_language("llama"), build_language("llama")
    normkit.convert(fused, fuse_residual=True)
    assert type(fused.model.layers[0]).__name__ == "LlamaDecoderLayer"
    assert fuse.is_fused(fused.model.layers[0])
    assert list(fused.state_dict()) == list(original.state_dict())
    fused.load_state_dict(original.state_dict())
    original.load_state_dict(fused.state_dict())

    back = normkit.revert(fused)
    assert [n for n, _, _ in back.fused] == ["model.layers.0", "model.layers.1"]
    assert [type(m) for m in fused.modules()] == [type(m) for m in original.modules()]
    layer = fused.model.layers[0]
    assert "forward" not in vars(layer) and type(layer).forward is \
        type(original.model.layers[0]).forward
    ids = tokens()
    assert torch.equal(fused(input_ids=ids).logits, original(input_ids=ids).logits)


def test_convert_twice_fuses_once_and_the_model_pickles():
    model = build_language("llama")
    normkit.convert(model, fuse_residual=True)
    again = normkit.convert(model, fuse_residual=True)
    assert again.swapped == [] and again.fused == []
    ids = tokens()
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert fuse.is_fused(clone.model.layers[1])
        assert torch.equal(clone(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_layer_outside_the_pattern_is_left_unfused_with_the_reason():
    import transformers

    # GPT-2's block: an optional cross-attention sits between the add and ln_2
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64))
    report = normkit.convert(model, fuse_residual=True)
    assert report.fused == [] and len(report.swapped) == 5
    reasons = dict((n, why) for n, _, why in report.unfused)
    assert reasons["transformer.h.0"].startswith("no residual add directly before a norm call")
    assert not any(fuse.is_fused(m) for m in model.modules())

    class AddsAConstant(nn.Module):                  # never a tensor: nothing to fuse
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(4)

        def forward(self, h):
            h = h + 1.0
            h = self.norm(h)
            return h

    report = normkit.convert(AddsAConstant(), fuse_residual=True)
    assert report.fused == []
    assert report.unfused[0][2] == "before norm, `h = h + 1.0` adds a constant"


@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("casting,offset", [("torch", 0.0), ("torch", 1.0), ("llama", 0.0),
                                            ("gemma", 1.0), ("t5", 0.0)])
def test_add_norm_is_the_unfused_code_bit_for_bit(casting, offset, dtype, one_pass,
                                                  monkeypatch):
    from normkit.autograd import AddNormFunction
    from normkit.backends.cpu import tuning

    counted = _Counted(AddNormFunction.apply)
    monkeypatch.setattr(AddNormFunction, "apply", counted)
    if one_pass:
        monkeypatch.setattr(tuning, "ONE_PASS_ADD", 0)            # every size in one pass
    # one pass where the kernels' one cast of x_hat is the rule's
    serves = {"torch": True, "llama": dtype != torch.float64, "gemma": dtype == torch.float32,
              "t5": dtype in (torch.float32, torch.float64)}[casting] and one_pass
    gen = torch.Generator().manual_seed(0)
    norm = normkit.nn.RMSNorm(123, eps=1e-6, offset=offset, casting=casting)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(123, generator=gen) * 0.5 + 0.2)
    norm.to(dtype)
    a, b, gy, gh = (torch.randn(5, 3, 123, generator=gen).to(dtype) for _ in range(4))
    results = []
    for fused in (False, True):
        norm.zero_grad()
        ai, bi = a.clone().requires_grad_(), b.clone().requires_grad_()
        if fused:
            y, h = fuse.add_norm(norm, ai, bi)
        else:
            h = ai + bi
            y = norm(h)
        torch.autograd.backward([y, h], [gy, gh])
        results.append((y, h, ai.grad, bi.grad, norm.weight.grad))
    assert counted.calls == int(serves)
    for want, got in zip(*results):
        assert want.dtype == got.dtype and torch.equal(want, got)


class PreNormBlock(nn.Module):           # a GPT-style block with torch.nn.LayerNorm
    def __init__(self, width=24):
        super().__init__()
        self.attn, self.mlp = nn.Linear(width, width), nn.Linear(width, width)
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)

    def forward(self, hidden):
        residual = hidden
        hidden = self.attn(self.ln_1(hidden))
        if hidden.dim() > 0:                            # the pattern inside a block
            hidden = hidden + residual
            residual = hidden
            hidden = self.ln_2(hidden)
        return self.mlp(hidden) + residual


def _block_pair():
    torch.manual_seed(0)
    plain = PreNormBlock()
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_()
    fused = copy.deepcopy(plain)
    normkit.convert(plain)
    return plain, fused, normkit.convert(fused, fuse_residual=True)


def test_layer_norm_blocks_fuse_into_add_layer_norm():
    plain, fused, report = _block_pair()
    assert [how for _, _, how in report.fused] == ["hidden + residual, then ln_2 -> add_layer_norm"]
    x = torch.randn(3, 7, 24)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = plain(xa), fused(xb)
    assert torch.equal(ya, yb)
    g = torch.randn(ya.shape)
    ya.backward(g), yb.backward(g)
    assert torch.equal(xa.grad, xb.grad)
    for (n, pa), (_, pb) in zip(plain.named_parameters(), fused.named_parameters()):
        assert torch.equal(pa.grad, pb.grad), n


class DropoutBlock(nn.Module):     # operands that are calls, dropouts in training mode
    def __init__(self, width=24):
        super().__init__()
        self.attn, self.drop = nn.Linear(width, width), nn.Dropout(0.3)
        self.ln, self.post = nn.LayerNorm(width), nn.LayerNorm(width)

    def forward(self, x):
        residual = x
        h = residual + self.drop(self.attn(x))                   # Phi-3's pre-norm add
        residual = h
        h = self.ln(h)
        return self.post(self.drop(h) + self.drop(residual))     # two draws, in order


def test_adds_of_expressions_fuse_and_evaluate_them_once_in_order(monkeypatch):
    """The operands are the call's arguments, evaluated once each, left first, as by the
    add: the dropouts draw the same numbers (swapped, the outputs would differ)."""
    torch.manual_seed(0)
    plain = DropoutBlock()
    fused = copy.deepcopy(plain)
    normkit.convert(plain)
    report = normkit.convert(fused, fuse_residual=True)
    assert [how for _, _, how in report.fused] == [
        "residual + self.drop(self.attn(x)), then ln -> add_layer_norm",
        "self.drop(h) + self.drop(residual), then post -> add_layer_norm"]
    counted = _Counted(nF.add_layer_norm)
    monkeypatch.setattr(nF, "add_layer_norm", counted)
    x = torch.randn(3, 7, 24)
    results = []
    for model in (plain, fused):
        torch.manual_seed(1)
        xx = x.clone().requires_grad_()
        y = model(xx)
        y.backward(torch.ones_like(y))
        results.append([y, xx.grad] + [p.grad for p in model.parameters()])
    assert counted.calls == 2
    assert all(torch.equal(a, b) for a, b in zip(*results))


def _bert():
    import transformers

    torch.manual_seed(0)
    return transformers.BertModel(transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        vocab_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


# pre-norm ViT (`h = hidden_states + residual; r = h; h = self.layernorm_after(h)`) and
# post-norm BERT (`self.LayerNorm(hidden_states + input_tensor)`, and its embeddings' sum)
ENCODERS = {
    "vit": (lambda: build("vit"), lambda: dict(pixel_values=pixels()),
            ["hidden_states + residual, then layernorm_after -> add_layer_norm"] * 2),
    "bert": (_bert, lambda: dict(input_ids=tokens()),
             ["embeddings + position_embeddings, then LayerNorm -> add_layer_norm"] +
             ["hidden_states + input_tensor, then LayerNorm -> add_layer_norm"] * 4),
}


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_encoders_fuse_into_add_layer_norm(name):
    make, inputs, hows = ENCODERS[name]
    plain = make()
    fused = copy.deepcopy(plain)
    normkit.convert(plain)
    report = normkit.convert(fused, fuse_residual=True)
    assert [how for _, _, how in report.fused] == hows
    results = []
    for model in (plain, fused):
        out = model(**inputs()).last_hidden_state
        out.square().mean().backward()
        results.append([out] + [p.grad for p in model.parameters() if p.grad is not None])
    assert len(results[0]) == len(results[1]) > 10
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_the_fused_call_falls_back_where_it_could_differ():
    plain, fused, _ = _block_pair()
    seen = []
    fused.ln_2.register_forward_hook(lambda m, i, o: seen.append(o))  # a hook, added later
    x = torch.randn(2, 5, 24)
    assert torch.equal(fused(x), plain(x)) and len(seen) == 1
    plain, fused, _ = _block_pair()
    called = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, i, o: called.append(m) if isinstance(m, nn.Module) else None)
    try:
        fused(x)
    finally:
        handle.remove()
    assert fused.ln_2 in called                                    # a global hook
    # operands that broadcast: the unfused a + b
    assert torch.equal(fuse.add_norm(plain.ln_2, x, x[0])[1], x + x[0])


def test_reasons_for_forwards_that_cannot_be_rewritten():
    namespace = {"nn": nn}
    exec("class NoSource(nn.Module):\n"         # noqa: S102 -- a class without source
         "    def forward(self, h, r):\n"
         "        h = h + r\n        r = h\n        h = self.norm(h)\n        return h + r\n",
         namespace)
    model = nn.Sequential(namespace["NoSource"](), PreNormBlock())
    model[0].norm = nn.LayerNorm(4)
    model[1].forward = model[1].forward                  # a bound method on the instance
    report = normkit.convert(model, fuse_residual=True)
    reasons = {n: why for n, _, why in report.unfused}
    assert reasons["0"].startswith("the source of its forward is not available")
    assert reasons["1"] == "its forward is set on the instance"
    assert report.fused == []
    with pytest.raises(TypeError, match="fuse_residual"):
        normkit.convert(model, fuse_residual=1)


@pytest.mark.parametrize("name", ["llama", "phi3"])   # (phi3: a dropout call as an operand)
def test_fused_llama_compiles_fullgraph_without_graph_breaks(name):
    model = build_language(name).eval()
    normkit.convert(model, fuse_residual=True)
    ids = tokens()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits)
