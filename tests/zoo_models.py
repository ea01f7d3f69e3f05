"""Small transformers vision models built from configs (no download), for the convert tests."""

import torch

IMAGE = 32

# name -> (config class, model class, config kwargs)
VISION = {
    "convnext": ("ConvNextConfig", "ConvNextModel",
                 dict(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, image_size=IMAGE)),
    "convnextv2": ("ConvNextV2Config", "ConvNextV2Model",
                   dict(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, image_size=IMAGE)),
    "bit": ("BitConfig", "BitModel",
            dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_groups=4,
                 layer_type="preactivation", out_features=None)),
    "poolformer": ("PoolFormerConfig", "PoolFormerModel",
                   dict(hidden_sizes=[8, 16], depths=[1, 1], num_encoder_blocks=2,
                        patch_sizes=[7, 3], strides=[4, 2], padding=[2, 1])),
    "resnet": ("ResNetConfig", "ResNetModel",
               dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")),
    "vit": ("ViTConfig", "ViTModel",
            dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, image_size=IMAGE, patch_size=8)),
    "swin": ("SwinConfig", "SwinModel",
             dict(image_size=IMAGE, patch_size=4, embed_dim=16, depths=[1, 1],
                  num_heads=[2, 4], window_size=4)),
    "dinov2": ("Dinov2Config", "Dinov2Model",
               dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, image_size=IMAGE, patch_size=8)),
    "mobilenet_v2": ("MobileNetV2Config", "MobileNetV2Model",
                     dict(image_size=IMAGE, depth_multiplier=0.25)),
    "regnet": ("RegNetConfig", "RegNetModel",
               dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=8)),
    "levit": ("LevitConfig", "LevitModel",
              dict(image_size=IMAGE, hidden_sizes=[16, 32, 48], num_attention_heads=[1, 2, 3],
                   depths=[1, 1, 1], key_dim=[8, 8, 8], patch_size=16)),
    "segformer": ("SegformerConfig", "SegformerModel",
                  dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                       hidden_sizes=[8, 16], num_attention_heads=[1, 2], patch_sizes=[7, 3],
                       strides=[4, 2], mlp_ratios=[2, 2])),
    "efficientnet": ("EfficientNetConfig", "EfficientNetModel",
                     dict(image_size=IMAGE, width_coefficient=0.25, depth_coefficient=0.25,
                          hidden_dim=320)),
}


def build(name, seed=0):
    import transformers

    config_name, model_name, kwargs = VISION[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**kwargs)
    return getattr(transformers, model_name)(config)


def pixels(batch=2, seed=0, dtype=torch.float32):
    return torch.randn(batch, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(seed),
                       dtype=dtype)


_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                max_position_embeddings=64)

# name -> (config class, model class, config kwargs): causal language models
LANGUAGE = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _DECODER),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _DECODER),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_DECODER, head_dim=8)),
    "mistral": ("MistralConfig", "MistralForCausalLM", _DECODER),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(_DECODER, num_local_experts=2, num_experts_per_tok=1)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_DECODER, head_dim=8)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_DECODER, head_dim=8)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_DECODER, pad_token_id=0)),
    "t5": ("T5Config", "T5ForConditionalGeneration",
           dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=128,
                dropout_rate=0.0)),
}


def build_language(name, seed=0, dtype=torch.float32):
    import transformers

    config_name, model_name, kwargs = LANGUAGE[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**kwargs)
    return getattr(transformers, model_name)(config).to(dtype)


def tokens(batch=2, length=12, seed=0):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))
