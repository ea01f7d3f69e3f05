"""transformers' base models made small, and inputs for them: what ``normkit.conversion.sweep``
runs.

Every model type of ``transformers.models.auto.modeling_auto.MODEL_MAPPING_NAMES`` (the base
models: ``LlamaModel``, ``CLIPModel``, ``Mamba2Model``, ...) is built from its *default*
config with the sizes cut down (``small_config``), never from downloaded weights:

* layers: every ``num_*layers``-like count to at most 2, stage ``depths`` to 1 each, and
  per-layer lists (``layer_types``) to the new count;
* widths: ``hidden_size``, ``d_model``, ``intermediate_size`` and their kin divided by a
  power of two to at most 64 (128 for feed-forward widths), which keeps the divisibility
  the model asks of them; heads to at most 4, experts to at most 4;
* images to 64 x 64 pixels;
* dropout-like probabilities to 0, so a training step is deterministic.

Where that config does not build or run (a rotary or per-head size cut below what the
model asks), level 2 cuts differently: at most 2 heads *of the original head size* (the
hidden size cut to match), one key/value head, feed-forward widths to at most 256, the
vocabulary to 8192 (special token ids moved below it), layers and experts as above.

A model whose small config cannot be built, or whose untouched forward fails on the
inputs ``inputs`` makes, is counted as not tested, never as broken.
"""

from __future__ import annotations

import inspect
import math

import torch

__all__ = ["base_models", "small_config", "build", "inputs", "MAX_PARAMETERS", "LEVELS"]

MAX_PARAMETERS = 40_000_000
LEVELS = (1, 2)
_LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers",
           "decoder_layers", "num_encoder_layers", "num_decoder_layers", "depth",
           "num_text_layers", "num_vision_layers", "num_cross_layers", "text_layers",
           "vision_layers", "num_blocks")
_WIDTHS = ("hidden_size", "d_model", "n_embd", "embed_dim", "embedding_size", "dim",
           "hidden_dim", "d_embed", "word_embed_proj_dim", "projection_dim", "text_embed_dim",
           "vision_embed_dim", "n_embed", "hidden_sizes", "embed_dims", "embedding_dim",
           "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
           "v_head_dim", "time_step_rank")
_FFN = ("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff",
        "n_inner", "ffn_hidden_size", "moe_intermediate_size", "mlp_dim",
        "shared_expert_intermediate_size", "intermediate_size_mlp", "d_inner")
_HEADS = ("num_attention_heads", "num_heads", "n_head", "n_heads", "encoder_attention_heads",
          "decoder_attention_heads", "attention_heads")
_KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts")


def base_models() -> list:
    """``(model_type, class name)`` of every base model transformers maps, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    return sorted((t, n if isinstance(n, str) else n[0]) for t, n in MODEL_MAPPING_NAMES.items())


def _halved(value, limit):
    """``value`` divided by the smallest power of two that brings it to ``limit`` or less
    while dividing it exactly (``value`` itself when none does)."""
    f = 1
    while value // f > limit and value % (2 * f) == 0:
        f *= 2
    return value // f if value // f <= limit else min(value, limit)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _shrink_value(name, v):
    if name in _LAYERS and _int(v):
        return min(v, 2)
    if name in ("depths", "num_layers") and isinstance(v, (list, tuple)):
        return type(v)(min(d, 1) for d in v)
    if name in _WIDTHS or name in _FFN:
        limit = 128 if name in _FFN else 64
        if _int(v) and v > limit:
            return _halved(v, limit)
        if isinstance(v, (list, tuple)) and v and all(_int(x) for x in v):
            f = max(1, max(v) // limit)
            return type(v)(max(x // f, 4) for x in v)
    if name == "image_size" and _int(v) and v > 64:
        return 64
    if name in _HEADS and _int(v):
        return min(v, 4)
    if name in _HEADS and isinstance(v, (list, tuple)) and all(_int(x) for x in v):
        return type(v)(min(x, 4) for x in v)
    if name in _EXPERTS and _int(v):
        return min(v, 4)
    if name in _TOP_K and _int(v):
        return min(v, 2)
    if isinstance(v, float) and ("dropout" in name or "drop_path" in name or
                                 name.endswith("drop_rate") or name.endswith("_prob") or
                                 "layerdrop" in name):
        return 0.0
    return v


def _get(config, name):
    """``config.name``, None where it is missing or refuses to answer (a per-layer
    attribute of a heterogeneous config)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 -- transformers' AmbiguousGlobalPerLayerAttributeError
        return None


def _fix(config):
    """Restore relations between the cut sizes that the models check."""
    get = lambda n: _get(config, n)  # noqa: E731
    heads = next((get(n) for n in _HEADS if _int(get(n))), None)
    hidden = next((get(n) for n in ("hidden_size", "d_model", "n_embd") if _int(get(n))), None)
    for name in _KV_HEADS:
        if _int(get(name)) and heads:
            setattr(config, name, max(1, min(get(name), heads // 2 or 1)))
    if _int(get("head_dim")) and heads and hidden:
        setattr(config, "head_dim", max(hidden // heads, 8))
    if _int(get("expand")) and _int(get("num_heads")) and _int(get("head_dim")) and hidden:
        config.head_dim = get("expand") * hidden // get("num_heads")        # Mamba2
    if _int(get("n_groups")) and _int(get("num_heads")):
        config.n_groups = math.gcd(get("n_groups"), get("num_heads"))     # Mamba2's SSM groups
    for name in ("n_group", "topk_group"):
        if _int(get(name)):
            setattr(config, name, 1)
    layers = next((get(n) for n in _LAYERS if _int(get(n))), None)
    for name in ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern"):
        value = get(name)
        if layers and isinstance(value, (list, tuple)) and len(value) > layers:
            setattr(config, name, type(value)(value[:layers]))
        elif layers and isinstance(value, str) and len(value) > layers:
            setattr(config, name, value[:layers])


def _keep_heads_value(name, v, config):
    """Level 2: fewer heads of the same size (rotary and per-head sizes stay valid)."""
    get = lambda n: _get(config, n)  # noqa: E731
    if name in _LAYERS and _int(v):
        return min(v, 2)
    if name in ("depths",) and isinstance(v, (list, tuple)):
        return type(v)(min(d, 1) for d in v)
    if name in _EXPERTS and _int(v):
        return min(v, 4)
    if name in _TOP_K and _int(v):
        return min(v, 2)
    if name in _FFN and _int(v) and v > 256:
        return _halved(v, 256)
    if name in ("hidden_size", "d_model", "n_embd", "embed_dim") and _int(v):
        heads = next((get(n) for n in _HEADS if _int(get(n))), None)
        if heads and v % heads == 0 and heads > 2:
            return 2 * (v // heads)
        return v
    if name in _HEADS and _int(v):
        return min(v, 2)
    if name in _KV_HEADS and _int(v):
        return 1
    if name == "vocab_size" and _int(v) and v > 8192:
        return 8192
    if (name.endswith("_token_id") or name.endswith("_token_index")) and _int(v) and v >= 8192:
        return 8191 - sum(map(ord, name)) % 64
    return _shrink_value(name, v) if isinstance(v, float) else v


def _shrink(config, seen, level=1):
    if id(config) in seen:
        return
    seen.add(id(config))
    for name, value in list(vars(config).items()):
        if name.startswith("_"):
            continue
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            _shrink(value, seen, level)
            continue
        new = (_shrink_value(name, value) if level == 1 else
               _keep_heads_value(name, value, config))
        if new is not value:
            try:
                setattr(config, name, new)
            except Exception:  # noqa: BLE001 -- a checked field: keep its default
                pass
    if level == 1:
        try:
            _fix(config)
        except Exception:  # noqa: BLE001 -- a relation it cannot restore: the model says
            pass


def small_config(model_type, level=1):
    """The default config of ``model_type`` with its sizes cut down (module docstring)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    _shrink(config, set(), level)
    config.use_cache = False
    return config


def build(model_type, class_name, seed=0, level=1):
    """The fp32 base model ``class_name`` of ``model_type`` from ``small_config``, its
    weights drawn from ``seed``; raises ValueError when it holds more than
    ``MAX_PARAMETERS`` (the cut-down config still too large to sweep)."""
    import transformers

    config = small_config(model_type, level)
    cls = getattr(transformers, class_name)
    with torch.device("meta"):
        count = sum(p.numel() for p in cls(config).parameters())
    if count > MAX_PARAMETERS:
        raise ValueError(f"{count} parameters after cutting the config down "
                         f"(limit {MAX_PARAMETERS})")
    torch.manual_seed(seed)
    model = cls(config).float()
    model.eval()
    return model


def _config_int(config, names, default):
    for cfg in (config, *(_get(config, n) for n in ("vision_config",
                                                             "text_config", "audio_config"))):
        for n in names:
            v = _get(cfg, n) if cfg is not None else None
            if _int(v):
                return v
            if isinstance(v, (list, tuple)) and v and _int(v[0]):
                return v[0]
    return default


def inputs(model, seed=0, batch=2, length=8, text_only=False):
    """Keyword inputs for ``model``'s forward, from its main input name and signature:
    token ids, pixels, audio samples or features, and decoder ids for an
    encoder-decoder; ``text_only``: no pixels beside token ids (a vision-language model
    whose text needs image tokens to take pixels)."""
    config = model.config
    gen = torch.Generator().manual_seed(seed)
    params = inspect.signature(model.forward).parameters
    vocab = _config_int(config, ("vocab_size",), 100)
    out = {}

    def ids():
        return torch.randint(3, max(4, min(vocab, 100)), (batch, length), generator=gen)

    name = model.main_input_name
    if name == "input_ids" or "input_ids" in params and name not in params:
        out["input_ids"] = ids()
    if name == "pixel_values" or ("pixel_values" in params and "input_ids" in out
                                  and "vision_config" in vars(config) and not text_only):
        size = _config_int(config, ("image_size",), 224)
        channels = _config_int(config, ("num_channels",), 3)
        out["pixel_values"] = torch.randn(batch, channels, size, size, generator=gen)
    if name == "input_values":
        out["input_values"] = torch.randn(batch, 4000, generator=gen)
    if name == "input_features":
        bins = _config_int(config, ("num_mel_bins", "feature_size", "input_feat_per_channel"),
                           80)
        frames = 2 * _config_int(config, ("max_source_positions",), 50)
        out["input_features"] = torch.randn(batch, bins, min(frames, 3000), generator=gen)
    if name not in out and name in params and name.endswith("_values"):
        out[name] = torch.randn(batch, 3, 32, 32, generator=gen)
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        out["decoder_input_ids"] = ids()
    return out
