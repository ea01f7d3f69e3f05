"""Lean saved tensors of the models' own norms: a norm with a model's casting rule (Llama's
cast then multiply, Gemma's (1 + w) in fp32, T5's; the recipes' LayerNorms with a bias)
keeps for backward only its input in its own dtype, the fp32 statistics and the weight;
its outputs and gradients are those of the model's order of ops around normkit's plain op
bit for bit, and those of the transformers classes as before (test_llm_conversion.py,
test_convert_recipes.py). Under activation checkpointing, which drops the saved tensors and
runs the forward again, converted models give torch.nn's gradients."""

import copy
import itertools

import pytest

torch = pytest.importorskip("torch")

import normkit  # noqa: E402
import normkit.functional as nF  # noqa: E402
from normkit import grouping as G  # noqa: E402
from normkit import ops  # noqa: E402

HALF = (torch.bfloat16, torch.float16)
MIB = 2 ** 20


def _saved(fn, *args):
    """``fn(*args)`` and the storages its graph saves: {data_ptr: (nbytes, dtype)}."""
    found = {}

    def pack(t):
        s = t.untyped_storage()
        found.setdefault(s.data_ptr(), (s.nbytes(), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, found


def _composed(x, w, b, eps, offset, casting, center):
    """The model's order of ops, written out, around normkit's plain op (no casting rule):
    ``x.float()``, the norm, then the rule's cast, multiply and add."""
    h = x.float()
    shape = [x.shape[-1]]
    x_hat = nF.layer_norm(h, shape, eps=eps) if center else nF.rms_norm(h, shape, None, eps)
    if casting == "llama":
        y = x_hat.to(x.dtype)
        y = y if w is None else (offset + w if offset else w) * y
        return y if b is None else y + b
    if casting == "gemma":
        y = x_hat if w is None else x_hat * (offset + w.float() if offset else w.float())
        return (y if b is None else y + b.float()).to(x.dtype)
    y = x_hat.to(w.dtype) if w is not None and w.dtype in HALF else x_hat       # t5
    y = y if w is None else (offset + w if offset else w) * y
    return y if b is None else y + b


def _lean(x, w, b, eps, offset, casting, center):
    if not center and b is None:
        return nF.rms_norm(x, [x.shape[-1]], w, eps, offset=offset, casting=casting)
    return ops.cast_norm(x, G.layer(tuple(x.shape), 1), w, b, eps, center, casting, offset,
                         torch.float32)


def _case(x_dtype, w_dtype, bias, seed=0, shape=(5, 7, 123)):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3 + 0.5).to(x_dtype)
    w = (torch.randn(shape[-1], generator=gen) * 0.5 + 0.2).to(w_dtype)
    b = (torch.randn(shape[-1], generator=gen) * 0.1).to(w_dtype) if bias else None
    return x, w, b


RULES = [("llama", 0.0, False, False), ("llama", 1.0, False, False), ("gemma", 1.0, False, False),
         ("t5", 0.0, False, False), ("llama", 0.0, True, True), ("gemma", 0.0, True, False),
         ("t5", 0.0, True, True)]            # (casting, offset, center, bias)
DTYPES = list(itertools.product([torch.bfloat16, torch.float16, torch.float32],
                                [None, torch.float32]))       # (x, weight; None: x's)


@pytest.mark.parametrize("native", [True, False], ids=["cpp", "composite"])
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("casting,offset,center,bias", RULES)
def test_cast_rule_is_the_composed_ops_bit_for_bit_and_saves_x_stats_weight(
        casting, offset, center, bias, x_dtype, w_dtype, native):
    cpp = pytest.importorskip("normkit.backends.cpu.native")
    x, w, b = _case(x_dtype, w_dtype or x_dtype, bias)
    results = []
    cpp.switch(native)
    try:
        for fn in (_composed, _lean):
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
            bi = None if b is None else b.clone().requires_grad_()
            y, saved = _saved(fn, xi, wi, bi, 1e-6, offset, casting, center)
            g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype)
            y.backward(g)
            results.append((y, xi.grad, wi.grad, None if bi is None else bi.grad))
    finally:
        cpp.switch(True)
    for want, got, name in zip(*results, ("y", "dx", "dw", "db")):
        if want is None:
            assert got is None
            continue
        assert got.dtype == want.dtype and torch.equal(got, want), name
    # what the lean op keeps: x itself, the weight itself, the fp32 statistics (RMSNorm's
    # mean is 0: not kept), nothing else
    rows = x.numel() // x.shape[-1]
    stats = {p: v for p, v in saved.items()
             if p not in (xi.untyped_storage().data_ptr(), wi.untyped_storage().data_ptr())}
    assert xi.untyped_storage().data_ptr() in saved and wi.untyped_storage().data_ptr() in saved
    assert sorted(stats.values(), key=str) == [(4 * rows, torch.float32)] * (2 if center else 1)


def test_lean_op_keeps_less_than_the_composed_ops():
    x, w, _ = _case(torch.bfloat16, torch.bfloat16, False, shape=(4, 256, 512))
    x.requires_grad_(), w.requires_grad_()
    composed = _saved(_composed, x, w, None, 1e-6, 0.0, "llama", False)[1]
    lean = _saved(_lean, x, w, None, 1e-6, 0.0, "llama", False)[1]
    mib = lambda found: sum(n for n, _ in found.values()) / MIB  # noqa: E731
    # x in fp32 (2 MiB) and x_hat cast to bf16 (1 MiB), against x in bf16 (1 MiB); both
    # keep the weight (1 KiB) and rstd (4 KiB), the plain op's node its mean (4 KiB) too
    assert mib(composed) == pytest.approx(3.0 + 9 / 1024)
    assert mib(lean) == pytest.approx(1.0 + 5 / 1024)


def _classes():
    pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    return {"llama": LlamaRMSNorm, "gemma": GemmaRMSNorm, "t5": T5LayerNorm}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("family", ["llama", "gemma", "t5"])
def test_converted_model_norm_keeps_its_input_and_equals_the_class(family, dtype):
    cls = _classes()[family]
    gen = torch.Generator().manual_seed(0)
    module = cls(512, eps=1e-6)
    with torch.no_grad():
        module.weight.copy_(torch.randn(512, generator=gen) * 0.5 + 0.2)
    module.to(dtype)
    model = torch.nn.Sequential(copy.deepcopy(module))
    report = normkit.convert(model)
    assert len(report.swapped) == 1
    x = (torch.randn(4, 256, 512, generator=gen) * 3 + 0.5).to(dtype)
    g = torch.randn(4, 256, 512, generator=gen).to(dtype)
    runs = []
    for m in (module, model):
        xi = x.clone().requires_grad_()
        y, saved = _saved(m, xi)
        y.backward(g)
        params = {p.untyped_storage().data_ptr() for p in m.parameters()}
        kept = sum(n for p, (n, _) in saved.items() if p not in params)
        runs.append((y, xi.grad, m.parameters().__next__().grad, kept))
    (want, dxa, dwa, kept_a), (got, dxb, dwb, kept_b) = runs
    size = x.numel() * x.element_size()
    assert kept_b == size + 4 * 1024                    # x in its own dtype, and fp32 rstd
    if dtype in HALF:    # the class keeps x.float(), x_hat (cast for Llama/T5) and rsqrt;
        # Gemma its 1 + w.float() too, T5 x itself too: 3.0, 4.0 and 4.0 MiB
        want_kept = {"llama": 3 * MIB, "t5": 4 * MIB, "gemma": 4 * MIB + 512 * 4}[family]
        assert kept_a == want_kept + 4 * 1024
    assert got.dtype == want.dtype
    # as test_llm_conversion: the mean of squares is summed in another order, so rstd may
    # differ in its last fp32 bit (a few elements one unit apart in half precision)
    if dtype in HALF:
        assert float((got != want).float().mean()) <= 1e-3
    else:
        torch.testing.assert_close(got, want, rtol=3e-7, atol=3e-7)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype in HALF else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dxb, dxa, **tol)
    torch.testing.assert_close(dwb.float(), dwa.float(),
                               **(dict(rtol=2e-2, atol=0.5) if dtype in HALF else
                                  dict(rtol=1e-4, atol=1e-3)))


@pytest.mark.parametrize("path", ["cohere.modeling_cohere.CohereLayerNorm",
                                  "deberta.modeling_deberta.DebertaLayerNorm"])
def test_routed_layer_norm_recipe_keeps_its_input(path):
    pytest.importorskip("transformers")
    module_path, name = path.rsplit(".", 1)
    cls = getattr(__import__(f"transformers.models.{module_path}", fromlist=[name]), name)
    torch.manual_seed(0)
    module = cls(24)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape) * 0.5 + 0.3)
    module.to(torch.bfloat16)
    model = torch.nn.Sequential(copy.deepcopy(module))
    assert len(normkit.convert(model).routed) == 1
    x = (torch.randn(6, 24) * 2 + 0.5).to(torch.bfloat16).requires_grad_()
    y, saved = _saved(model, x)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = sorted((n, dt) for p, (n, dt) in saved.items() if p not in params)
    assert kept == [(4 * 6, torch.float32)] * 2 + [(x.numel() * 2, torch.bfloat16)]
    torch.testing.assert_close(y, module(x), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("casting,center", [("llama", False), ("llama", True), ("t5", False),
                                            ("t5", True)])
def test_cast_norm_gradcheck_and_gradgradcheck(casting, center):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, generator=gen, requires_grad=True)

    def fn(x, w, b):       # in fp64 throughout: the casts are the identity
        return ops.cast_norm(x, G.layer((3, 4, 5), 1), w, b, 1e-5, center, casting, 1.0,
                             torch.float64)

    assert torch.autograd.gradcheck(fn, (x, w, b))
    assert torch.autograd.gradgradcheck(fn, (x, w, b))


def test_converted_llama_trains_under_compile_as_in_eager():
    pytest.importorskip("transformers")
    from zoo_models import build_language, tokens

    model = build_language("llama").to(torch.bfloat16)
    normkit.convert(model)
    ids = tokens()
    grads = []
    for run in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        model.zero_grad()
        run(input_ids=ids, labels=ids).loss.backward()
        grads.append([p.grad.float() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2 * float(a.abs().max()) + 1e-6)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape", [(5, 17), (7, 123), (64, 1000), (1024, 512), (33, 4096)])
def test_half_kernel_is_the_fp32_kernel_then_the_cast(shape, dtype):
    # what rms_casting.kernel_dtype relies on: the kernel loads a half input into fp32 and
    # rounds once, so its output and its backward are the fp32 kernel's, then cast
    from normkit import backends

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3 + 0.5).to(dtype)
    g = torch.randn(shape, generator=gen).to(dtype)
    grouping = G.layer(shape, 1)
    half, full = (backends.plan(t, grouping, False, False) for t in (x, x.float()))
    y, mean, rstd, _ = half.forward(x, None, None, 1e-6)
    y32, mean32, rstd32, _ = full.forward(x.float(), None, None, 1e-6)
    assert torch.equal(rstd, rstd32) and torch.equal(y, y32.to(dtype))
    dx = half.backward(g, x, mean, rstd, None, (True, False, False))[0]
    dx32 = full.backward(g.float(), x.float(), mean32, rstd32, None, (True, False, False))[0]
    assert torch.equal(dx, dx32.to(dtype))


@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_with_a_casting_rule_keeps_h_stats_weight(dtype, one_pass, monkeypatch):
    """``add_rms_norm(casting="llama")`` (``convert(fuse_residual=True)`` of a Llama) keeps
    ``h`` in its own dtype, the fp32 statistics and the weight -- what the unfused add then
    the lean norm keep -- not ``x_hat`` besides; outputs and gradients the unfused bits."""
    from normkit.backends.cpu import tuning

    if one_pass:
        monkeypatch.setattr(tuning, "ONE_PASS_ADD", 0)
    gen = torch.Generator().manual_seed(7)
    x, r = (torch.randn(4, 32, 256, generator=gen).to(dtype).requires_grad_() for _ in "xr")
    w = (torch.randn(256, generator=gen) * 0.5 + 1).to(dtype).requires_grad_()
    gy, gh = (torch.randn(4, 32, 256, generator=gen).to(dtype) for _ in "yh")
    runs = []
    for fused in (True, False):
        def fn(x, r, w, fused=fused):
            if fused:
                return nF.add_rms_norm(x, r, (256,), w, 1e-6, casting="llama")
            h = x + r
            return nF.rms_norm(h, (256,), w, 1e-6, casting="llama"), h
        (y, h), saved = _saved(fn, x, r, w)
        grads = torch.autograd.grad([y, h], [x, r, w], [gy, gh])
        runs.append((saved, [y, h, *grads]))
    (fused_saved, fused_out), (plain_saved, plain_out) = runs
    for a, b in zip(fused_out, plain_out):
        assert torch.equal(a, b)
    h_bytes = x.numel() * x.element_size()
    assert sum(n for n, _ in fused_saved.values()) <= sum(n for n, _ in plain_saved.values())
    assert sum(n for n, dt in fused_saved.values() if n >= h_bytes) == h_bytes   # h alone


def test_add_rms_norm_with_a_casting_rule_in_one_pass_gradgradcheck(monkeypatch):
    """t5's rule in fp64 normalizes in fp64: the one rule gradcheck can see in one pass
    (llama's normalizes an fp64 input in fp32)."""
    from normkit.backends.cpu import tuning

    casting = "t5"
    monkeypatch.setattr(tuning, "ONE_PASS_ADD", 0)
    gen = torch.Generator().manual_seed(5)
    x, r = (torch.randn(3, 4, 5, dtype=torch.float64, generator=gen, requires_grad=True)
            for _ in "xr")
    w = torch.randn(5, dtype=torch.float64, generator=gen, requires_grad=True)

    def fn(x, r, w):
        return nF.add_rms_norm(x, r, (5,), w, 1e-5, offset=1.0, casting=casting)

    assert "AddNorm" in type(fn(x, r, w)[0].grad_fn.next_functions[0][0]).__name__
    assert torch.autograd.gradcheck(fn, (x, r, w))
    assert torch.autograd.gradgradcheck(fn, (x, r, w))


def test_add_rms_norm_casting_refuses_memory_saving():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="memory_saving=True recomputes x_hat"):
        nF.add_rms_norm(x, x, (8,), torch.ones(8), casting="llama", memory_saving=True)


class _Blocks(torch.nn.Module):
    """Three blocks (BatchNorm + ReLU, GroupNorm + SiLU, LayerNorm), each run under
    ``torch.utils.checkpoint`` (its saved tensors dropped, its forward run again in
    backward)."""

    def __init__(self, reentrant):
        super().__init__()
        nn = torch.nn
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU()),
            nn.LayerNorm([8, 6, 6])])
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused_activation"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["saved_hooks", "reentrant"])
def test_activation_checkpointing_gives_torch_nn_gradients(reentrant, fuse):
    # the recomputed forward updates BatchNorm's running statistics a second time, as
    # torch.nn's does
    torch.manual_seed(0)
    theirs = _Blocks(reentrant)
    mine = copy.deepcopy(theirs)
    normkit.convert(mine, fuse_activation=fuse)
    x = torch.randn(4, 3, 6, 6, requires_grad=True)
    xm = x.detach().clone().requires_grad_()
    (theirs(x) ** 2).mean().backward()
    (mine(xm) ** 2).mean().backward()
    torch.testing.assert_close(xm.grad, x.grad, rtol=1e-5, atol=1e-7)
    for (name, p), q in zip(theirs.named_parameters(), mine.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    for (name, b), c in zip(theirs.named_buffers(), mine.buffers()):
        torch.testing.assert_close(c, b, rtol=1e-5, atol=1e-6, msg=name)
    assert int(mine.blocks[0][1].num_batches_tracked) == 2


def test_a_language_model_with_gradient_checkpointing_gives_its_gradients():
    pytest.importorskip("transformers")
    from zoo_models import build_language, tokens

    theirs = build_language("llama")
    mine = copy.deepcopy(theirs)
    normkit.convert(mine, fuse_residual=True)
    ids = tokens()
    for model in (theirs, mine):
        enable = getattr(model, "activation_checkpointing_enable", None)  # (transformers 5.x;
        enable = enable or model.gradient_checkpointing_enable             # before: this name)
        enable({"use_reentrant": False})
        model(ids, labels=ids).loss.backward()
    for (name, p), q in zip(theirs.named_parameters(), mine.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
