"""convert/revert over diffusers' models built from small configs (nothing downloaded): the
U-Nets and the VAE, whose GroupNorms are most of normkit's GroupNorm use, and the diffusion
transformers (DiT, PixArt, SD3, Flux, Mochi) with their LayerNorms and RMSNorms. Every norm module
swapped or routed; outputs and gradients equal to the untouched model's in float64;
revert restores the classes; diffusers' RMSNorm keeps its casting in bf16 (every norm class
alone: tests/test_norm_classes.py)."""

import copy

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
from torch import nn  # noqa: E402

import normkit  # noqa: E402

NORM_BASES = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
F64 = dict(dtype=torch.float64)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), **F64)


def _unet():
    return diffusers.UNet2DModel(
        sample_size=16, in_channels=3, out_channels=3, layers_per_block=1, norm_num_groups=8,
        block_out_channels=(8, 16), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"))


def _sd_unet():
    return diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, norm_num_groups=8,
        block_out_channels=(8, 16), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=8,
        attention_head_dim=4)


def _vae():
    return diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(8, 16), latent_channels=4,
        norm_num_groups=8, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2)


def _dit():
    return diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=2, sample_size=8,
        patch_size=2, num_embeds_ada_norm=10)


def _pixart():
    return diffusers.PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
        sample_size=8, patch_size=2, cross_attention_dim=16, caption_channels=16)


def _sd3():
    return diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
        pooled_projection_dim=8, out_channels=4, qk_norm="rms_norm")


def _flux():
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
        axes_dims_rope=(4, 6, 6))


def _mochi():
    return diffusers.MochiTransformer3DModel(
        patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2, in_channels=4,
        pooled_projection_dim=16, text_embed_dim=16, time_embed_dim=4, max_sequence_length=8)


def _steps():
    return torch.tensor([1.0, 7.0], **F64)


# name -> (builder, call(model) -> output)
MODELS = {
    "unet": (_unet, lambda m: m(_randn(2, 3, 16, 16, seed=1), _steps()).sample),
    "sd_unet": (_sd_unet, lambda m: m(_randn(2, 4, 8, 8, seed=1), _steps(),
                                      encoder_hidden_states=_randn(2, 5, 8, seed=2)).sample),
    "vae": (_vae, lambda m: m(_randn(2, 3, 16, 16, seed=1)).sample),
    "dit": (_dit, lambda m: m(_randn(2, 4, 8, 8, seed=1), timestep=torch.tensor([1, 7]),
                              class_labels=torch.tensor([1, 3])).sample),
    "pixart": (_pixart, lambda m: m(_randn(2, 4, 8, 8, seed=1), timestep=torch.tensor([1, 7]),
                                    encoder_hidden_states=_randn(2, 5, 16, seed=2),
                                    added_cond_kwargs={"resolution": None,
                                                       "aspect_ratio": None}).sample),
    "sd3": (_sd3, lambda m: m(_randn(2, 4, 8, 8, seed=1), timestep=torch.tensor([1, 7]),
                              encoder_hidden_states=_randn(2, 5, 16, seed=2),
                              pooled_projections=_randn(2, 8, seed=3)).sample),
    "flux": (_flux, lambda m: m(_randn(2, 16, 16, seed=1), timestep=_steps(),
                                encoder_hidden_states=_randn(2, 5, 32, seed=2),
                                pooled_projections=_randn(2, 16, seed=3),
                                img_ids=torch.zeros(16, 3, **F64),
                                txt_ids=torch.zeros(5, 3, **F64)).sample),
    # (its modulated norms hold a weightless RMSNorm of width 0, which the probe must not
    # take for the width it normalizes)
    "mochi": (_mochi, lambda m: m(_randn(2, 4, 2, 8, 8, seed=1), timestep=torch.tensor([1, 7]),
                                  encoder_hidden_states=_randn(2, 5, 16, seed=2),
                                  encoder_attention_mask=torch.ones(2, 5, dtype=torch.bool))
                      .sample),
}


def _tolerance(model):
    """Relative to the output's (or the gradients') size: diffusers' own RMSNorm takes a
    float64 input's mean square in float32 (normkit in float64), and Mochi casts to float32
    around its norms, so a model holding it differs by float32's rounding there (SD3's
    output 3e-9, Mochi's 6e-8 and its gradients 2e-7)."""
    own = any(type(m).__name__ == "RMSNorm" and type(m).__module__.startswith("diffusers.")
              for m in model.modules())
    return 1e-6 if own else 1e-9


def _norms(model):
    """The norm modules: torch's, and the leaf modules named like one (diffusers' own)."""
    return {n for n, m in model.named_modules() if isinstance(m, NORM_BASES)
            or ("Norm" in type(m).__name__ and next(m.children(), None) is None)}


def _close(got, want, what, tol, scale=None):
    scale = max(float(want.detach().abs().max()), scale or 0.0, 1e-30)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale, msg=what)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_diffusers_model_converts_completely_and_computes_the_same(name):
    build, call = MODELS[name]
    torch.manual_seed(0)
    original = build().double()
    torch.manual_seed(0)
    converted = build().double()
    norms, tol = _norms(original), _tolerance(original)
    assert norms, f"{name}: no norm module to convert"
    report = normkit.convert(converted)
    assert report.left == [], str(report)
    assert {n for n, _, _ in report.swapped} | {n for n, _, _ in report.routed} == norms

    for mode in ("train", "eval"):
        original.train(mode == "train"), converted.train(mode == "train")
        a, b = call(original), call(converted)
        _close(b, a, f"{name} {mode} output", tol)
        weights = _randn(*a.shape, seed=4)
        (a * weights).sum().backward()
        (b * weights).sum().backward()
        scale = max(float(p.grad.abs().max()) for p in original.parameters() if p.grad is not None)
        for (n, pa), (_, pb) in zip(original.named_parameters(), converted.named_parameters()):
            if pa.grad is not None:
                _close(pb.grad, pa.grad, f"{name} {mode} grad {n}", tol, scale)
        original.zero_grad(), converted.zero_grad()

    back = normkit.revert(converted)
    assert len(back.swapped) + len(back.routed) == len(norms)
    assert [type(m) for m in converted.modules()] == [type(m) for m in original.modules()]
    assert list(converted.state_dict()) == list(original.state_dict())


@pytest.mark.parametrize("bias", [False, True])
def test_diffusers_rms_norm_keeps_its_casting_on_bf16_inputs(bias):
    # diffusers' RMSNorm casts the normalized input to the weight's dtype only where that is
    # fp16/bf16 (T5's rule): with fp32 parameters a bf16 input gives an fp32 output never
    # rounded to bf16 (Llama's rule would round it)
    from diffusers.models.normalization import RMSNorm

    for p_dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        module = RMSNorm(16, eps=1e-6, bias=bias)
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape))
        module.to(p_dtype)
        converted = nn.Sequential(copy.deepcopy(module))
        report = normkit.convert(converted)
        assert report.left == [], str(report)
        x = (_randn(3, 5, 16, seed=1) * 3 + 1).to(torch.bfloat16)
        want, got = module(x), converted(x)
        assert got.dtype == want.dtype
        if p_dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:
            _close(got, want, f"bias={bias}, fp32 parameters", 1e-6)


def test_a_block_named_like_a_norm_runs_its_own_norm_calls_on_normkit():
    # AdaGroupNorm (diffusers' K-upscaler U-Nets): F.group_norm in its own forward, the
    # scale and shift from a Linear child; AdaLayerNorm calls its nn.LayerNorm child
    from diffusers.models.normalization import AdaGroupNorm, AdaLayerNorm

    torch.manual_seed(0)
    original = nn.ModuleDict({"group": AdaGroupNorm(8, 16, num_groups=4),
                              "layer": AdaLayerNorm(16, num_embeddings=10)}).double()
    converted = copy.deepcopy(original)
    report = normkit.convert(converted)
    assert [n for n, _, _ in report.routed] == ["group"] and report.left == [], str(report)
    assert [n for n, _, _ in report.swapped] == ["layer.norm"], str(report)
    x, emb = _randn(2, 16, 4, 4, seed=1).requires_grad_(), _randn(2, 8, seed=2)
    h, step = _randn(2, 3, 16, seed=3), torch.tensor(3)
    for a, b in ((original["group"](x, emb), converted["group"](x, emb)),
                 (original["layer"](h, step), converted["layer"](h, step))):
        _close(b, a, "output", 1e-12)
    got = torch.autograd.grad(converted["group"](x, emb).square().sum(), x)[0]
    want = torch.autograd.grad(original["group"](x, emb).square().sum(), x)[0]
    _close(got, want, "input gradient", 1e-12)
    normkit.revert(converted)
    assert [type(m) for m in converted.modules()] == [type(m) for m in original.modules()]
