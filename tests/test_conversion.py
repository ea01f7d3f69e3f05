"""convert/revert on toy and real models (transformers' SigLIP vision tower and ResNet)."""

import copy
import gc

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import normkit  # noqa: E402
import normkit.nn as nknn  # noqa: E402

transformers = pytest.importorskip("transformers")


def _toy():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.GroupNorm(2, 8),
                         nn.InstanceNorm2d(8, affine=True), nn.Flatten(), nn.LazyBatchNorm1d(),
                         nn.Linear(8 * 36, 16), nn.LayerNorm(16), nn.RMSNorm(16))


def test_convert_swaps_exact_types_and_keeps_tensors():
    model = _toy()
    params_before = {n: p for n, p in model.named_parameters()}
    model[1].weight.requires_grad_(False)
    model.eval()
    report = normkit.convert(model)
    assert report.model is model
    kinds = [type(m) for m in model]
    assert kinds[1] is nknn.BatchNorm2d and kinds[3] is nknn.GroupNorm
    assert kinds[4] is nknn.InstanceNorm2d and kinds[8] is nknn.LayerNorm
    assert kinds[9] is nknn.RMSNorm
    assert kinds[6] is nn.LazyBatchNorm1d  # a subclass: left in place and reported
    assert [s[0] for s in report.skipped] == ["6"]
    assert len(report.swapped) == 5
    # the very same Parameter objects (an optimizer built before stays valid)
    for n, p in model.named_parameters():
        if n in params_before:
            assert p is params_before[n]
    assert not model[1].weight.requires_grad
    assert not any(m.training for m in model)
    assert "swapped 5 module(s), routed 0, left 1" in str(report)


def test_report_used_as_the_model_says_what_convert_returns():
    """``model = normkit.convert(model)`` (as torch's convert_sync_batchnorm is used) gets
    the report: its errors name report.model; the report's own fields and copies work."""
    report = normkit.convert(_toy())
    with pytest.raises(AttributeError, match=r"no 'parameters'.*report\.model\.parameters"):
        report.parameters()
    with pytest.raises(TypeError, match=r"not a model.*report\.model\(\.\.\.\)"):
        report(torch.randn(2, 3, 8, 8))
    with pytest.raises(AttributeError, match="has no attribute 'no_such_field'"):
        report.no_such_field
    plain = normkit.convert(nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8)))
    assert copy.deepcopy(plain).swapped == plain.swapped


def test_revert_restores_torch_layers():
    model = _toy()
    model(torch.randn(2, 3, 8, 8))  # materializes the lazy layer into a plain BatchNorm1d
    ref = copy.deepcopy(model)
    assert len(normkit.convert(model).swapped) == 6
    report = normkit.revert(model)
    assert [type(m) for m in model] == [type(m) for m in ref]
    assert len(report.swapped) == 6
    for (n, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), n


class _Shared(nn.Module):
    """One LayerNorm and one BatchNorm registered under several names (two attributes, a
    ModuleList), each called once per name."""

    def __init__(self):
        super().__init__()
        self.norm = self.alias = nn.LayerNorm(8)
        self.bn = nn.BatchNorm1d(8)
        self.stack = nn.ModuleList([self.norm, self.bn, self.bn])

    def forward(self, x):
        return self.stack[2](self.stack[1](self.alias(self.norm(self.stack[0](x)))))


def test_a_module_under_several_names_becomes_one_twin_at_each():
    # the walk took each parent's children once (named_children), so `self.alias` stayed a
    # torch LayerNorm, unreported, and the ModuleList got twins of their own: three objects
    # where there was one
    torch.manual_seed(0)
    model = _Shared()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 8)
    report = normkit.convert(model)
    assert type(model.norm) is nknn.LayerNorm and type(model.bn) is nknn.BatchNorm1d
    assert model.norm is model.alias is model.stack[0]
    assert model.bn is model.stack[1] is model.stack[2]
    assert sorted(name for name, _, _ in report.swapped) == ["bn", "norm"], report.swapped
    y, r = model(x), ref(x)
    torch.testing.assert_close(y, r)
    torch.testing.assert_close(model.bn.running_var, ref.bn.running_var)
    assert int(model.bn.num_batches_tracked) == int(ref.bn.num_batches_tracked) == 2
    normkit.revert(model)
    assert type(model.norm) is nn.LayerNorm and model.norm is model.alias is model.stack[0]
    assert type(model.bn) is nn.BatchNorm1d and model.bn is model.stack[1] is model.stack[2]


def _hooked(calls):
    """A LayerNorm with a hook of every kind, each noting its name in ``calls``; their
    handles."""
    norm = nn.LayerNorm(8)
    note = calls.append
    return norm, [
        norm.register_forward_pre_hook(lambda m, a: note("pre")),
        norm.register_forward_pre_hook(lambda m, a, k: note("pre-kw"), with_kwargs=True),
        norm.register_forward_hook(lambda m, a, k, out: note("kw"), with_kwargs=True),
        norm.register_forward_hook(lambda m, a, out: note("always"), always_call=True),
        norm.register_full_backward_pre_hook(lambda m, go: note("bwd-pre")),
        norm.register_full_backward_hook(lambda m, gi, go: note("bwd")),
        norm.register_state_dict_pre_hook(lambda m, prefix, keep: note("sd-pre")),
        norm.register_state_dict_post_hook(lambda m, sd, prefix, local: note("sd")),
        norm.register_load_state_dict_pre_hook(lambda m, *a: note(("load-pre", type(m)))),
        norm.register_load_state_dict_post_hook(lambda m, keys: note("load")),
    ]


def _use(model, x):
    model(x).sum().backward()
    model.load_state_dict(model.state_dict())


def test_every_kind_of_hook_carries_over_and_its_handle_removes_it():
    # the backward hooks (their kind flag was not carried, so torch called none) and the
    # state_dict pre and load_state_dict post hooks were lost; the handles removed the
    # hooks from the torch layer's dicts, not the twin's
    # (and torch's load_state_dict pre hook, bound to the torch layer by a weak reference,
    # raised "dead Module" once that layer was gone)
    x = torch.randn(2, 8, requires_grad=True)
    want, got = [], []
    _use(nn.Sequential(_hooked(want)[0]), x)
    assert len(set(want)) == 10, want
    norm, handles = _hooked(got)
    model = nn.Sequential(norm)
    del norm                       # (the model holds the torch layer alone, as models do)
    normkit.convert(model)
    gc.collect()
    assert type(model[0]) is nknn.LayerNorm
    _use(model, x)
    assert got == [(c[0], nknn.LayerNorm) if isinstance(c, tuple) else c for c in want]
    normkit.revert(model)
    gc.collect()
    got.clear()
    _use(model, x)
    assert got == want
    normkit.convert(model)
    for handle in handles:
        handle.remove()
    got.clear()
    _use(model, x)
    assert got == []


def test_siglip_vision_model_outputs_and_gradients_identical():
    from transformers import SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(0)
    cfg = SiglipVisionConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, image_size=32, patch_size=8)
    original = SiglipVisionModel(cfg).double()
    converted = copy.deepcopy(original)
    report = normkit.convert(converted)
    names = {n for n, _, _ in report.swapped}
    assert any(n.endswith("post_layernorm") for n in names)
    assert all(isinstance(m, nknn.LayerNorm) for m in converted.modules()
               if isinstance(m, nn.LayerNorm))                 # (normkit's are torch's too)
    pixels = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    out_a = original(pixel_values=pixels)
    out_b = converted(pixel_values=pixels)
    torch.testing.assert_close(out_b.last_hidden_state, out_a.last_hidden_state,
                               atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(out_b.pooler_output, out_a.pooler_output, atol=1e-12, rtol=1e-12)
    (out_a.last_hidden_state.square().mean() + out_a.pooler_output.sum()).backward()
    (out_b.last_hidden_state.square().mean() + out_b.pooler_output.sum()).backward()
    for (n, pa), (_, pb) in zip(original.named_parameters(), converted.named_parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, atol=1e-11, rtol=1e-10, msg=n)


def test_resnet_training_steps_then_eval_identical():
    from transformers import ResNetConfig, ResNetModel

    torch.manual_seed(0)
    cfg = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
    original = ResNetModel(cfg).double()
    converted = copy.deepcopy(original)
    report = normkit.convert(converted)
    assert len(report.swapped) == sum(isinstance(m, nn.BatchNorm2d) for m in original.modules())
    opt_a = torch.optim.SGD(original.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(converted.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        x = torch.randn(4, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        for model, opt in ((original, opt_a), (converted, opt_b)):
            opt.zero_grad()
            model(pixel_values=x).pooler_output.square().sum().backward()
            opt.step()
    for (n, a), (_, b) in zip(original.state_dict().items(), converted.state_dict().items()):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-10, msg=n)
    original.eval(), converted.eval()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    torch.testing.assert_close(converted(pixel_values=x).last_hidden_state,
                               original(pixel_values=x).last_hidden_state, atol=1e-10, rtol=1e-10)


def test_revert_passes_bias_only_where_it_matters(monkeypatch):
    """torch before 2.13 has no ``bias`` argument in BatchNorm, InstanceNorm, GroupNorm:
    revert must not pass it for layers that have their bias (or no affine at all)."""
    import inspect

    def strict(cls):  # the torch 2.11 signature: no bias keyword
        class Old(cls):
            def __init__(self, *args, **kwargs):
                if "bias" in kwargs:
                    raise TypeError(f"{cls.__name__}.__init__() got an unexpected keyword "
                                    f"argument 'bias'")
                super().__init__(*args, **kwargs)
        return Old

    from normkit.conversion import swap

    model = nn.Sequential(nn.BatchNorm2d(4), nn.GroupNorm(2, 4), nn.InstanceNorm2d(4))
    normkit.convert(model)
    monkeypatch.setattr(swap, "PAIRS", [(strict(src), dst, args) if src is not nn.LayerNorm
                                        else (src, dst, args) for src, dst, args in swap.PAIRS])
    normkit.revert(model)
    assert [type(m).__name__ for m in model] == ["Old", "Old", "Old"]
    assert "bias" in inspect.signature(nknn.BatchNorm2d.__init__).parameters
    no_bias = nknn.BatchNorm2d(4, bias=False)
    assert swap._bn_args(no_bias)["bias"] is False        # kept where it changes the layer


class _LooksCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA (this machine has no GPU)."""

    @property
    def is_cuda(self):
        return True


def test_convert_warns_that_cuda_models_run_slower():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    model.register_buffer("marker", torch.zeros(1).as_subclass(_LooksCuda))
    with pytest.warns(UserWarning, match="slower than with torch.nn"):
        normkit.convert(model)


def test_convert_of_a_cpu_model_does_not_warn():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        normkit.convert(nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8)))
        normkit.convert(nn.Sequential(nn.Linear(4, 8)))          # nothing to swap


def test_torchscript_modules_are_refused_with_what_to_do():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
        for script in (torch.jit.script(model), torch.jit.trace(model, torch.randn(2, 8))):
            with pytest.raises(TypeError, match="convert the model first"):
                normkit.convert(script)
