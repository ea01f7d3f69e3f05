"""Whole models, converted against untouched, and the per-call cost of small norms.

``normkit bench --models``. Two tables:

* **models**: each model is built twice with the same weights (from a config: nothing is
  downloaded), one left as it is and one passed through ``normkit.convert``. A *train*
  step is forward, loss (sum of the output's squares, or the LM loss), backward and an SGD
  update; an *infer* step is a no-grad forward in eval mode. The two models alternate
  step by step after a warm-up each (numba compiles on first use); a *decode* step is a
  language model's greedy generation of ``DECODE_TOKENS`` tokens after a prompt, batch 1,
  with its key/value cache: the small calls of serving. Each repeat times
  ``steps`` steps of each, and the best repeat of each is kept (wall time: the models use
  every thread). The ratio is converted / untouched: below 1 normkit is faster. With
  ``--control`` an untouched copy runs alongside: its ratio shows the spread of the
  measurement itself on the machine (two equal models).
  Each train row also counts the bytes autograd keeps for backward in one training step
  (``saved_bytes``: the unique storages the graph saves, seen through
  ``torch.autograd.graph.saved_tensors_hooks``, each counted once, the model's own
  parameters and buffers left out), for both models, and their ratio.
* **calls**: one small norm call, normkit's layer against torch.nn's, forward without
  grad and forward + backward (``layer(x).sum().backward()``), on one thread; the best of
  ``repeats`` rounds of the calling thread's CPU time per call, in microseconds.

The transformers models need the ``dev`` extra; rows whose library is missing are
reported as skipped, not dropped silently.
"""

from __future__ import annotations

import copy
import itertools
import time

import torch

__all__ = ["MODELS", "CALLS", "llm", "study_cnn", "images", "train_step", "infer_step",
           "decode_step", "saved_bytes", "run_models", "run_calls", "format_models", "format_calls"]


# ---------------------------------------------------------------------------- models

def _siglip(layers=4):
    import transformers

    config = transformers.SiglipVisionConfig(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=layers,
        num_attention_heads=12, image_size=224, patch_size=16)
    return transformers.SiglipVisionModel(config)


def _resnet18():
    import transformers

    config = transformers.ResNetConfig(embedding_size=64, hidden_sizes=[64, 128, 256, 512],
                                       depths=[2, 2, 2, 2], layer_type="basic")
    return transformers.ResNetModel(config)


def _convnext():
    import transformers

    config = transformers.ConvNextConfig(hidden_sizes=[96, 192, 384, 768], depths=[1, 1, 3, 1])
    return transformers.ConvNextModel(config)


def _bit():
    import transformers

    return transformers.BitModel(transformers.BitConfig())          # BiT-R50x1


def _resnet50():
    import transformers

    return transformers.ResNetModel(transformers.ResNetConfig())    # ResNet-50: the defaults


def _mobilenet_v2():
    import transformers

    return transformers.MobileNetV2Model(transformers.MobileNetV2Config())    # 1.0, 224


def _efficientnet_b0():
    import transformers

    config = transformers.EfficientNetConfig(width_coefficient=1.0, depth_coefficient=1.0,
                                             image_size=224, hidden_dim=1280, dropout_rate=0.2)
    return transformers.EfficientNetModel(config)                   # (the defaults are B7's)


def study_cnn():
    """The study's digits CNN with torch.nn BatchNorm2d layers (the untouched model)."""
    from normkit import revert
    from normkit.study.model import SmallCNN

    model = SmallCNN("batch")
    revert(model)                                   # the torch.nn original
    return model


def llm(family, hidden=1024, layers=2, kv_heads=None, dtype=torch.float32):
    """A Llama- or Gemma-style causal LM from a config (``benchmarks/bench_llm_train.py``
    and the ``llama``/``gemma`` rows): 64-wide heads, MLP about 8/3 of hidden, vocabulary
    8192; ``kv_heads`` key/value heads (default: as many as query heads), in ``dtype``."""
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "gemma": transformers.GemmaConfig}[family]
    model_cls = {"llama": transformers.LlamaForCausalLM,
                 "gemma": transformers.GemmaForCausalLM}[family]
    heads = hidden // 64
    config = config_cls(hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                        num_hidden_layers=layers, num_attention_heads=heads,
                        num_key_value_heads=kv_heads or heads, head_dim=64, vocab_size=8192,
                        max_position_embeddings=4096)
    return model_cls(config).to(dtype)


def mlp():
    """A tabular MLP with BatchNorm1d: 64 features, two hidden layers of 512, 10 outputs."""
    nn = torch.nn
    return nn.Sequential(nn.Linear(64, 512), nn.BatchNorm1d(512), nn.ReLU(),
                         nn.Linear(512, 512), nn.BatchNorm1d(512), nn.ReLU(),
                         nn.Linear(512, 10))


def _channels_last(build):
    """``build``'s model in channels_last memory (what oneDNN's convolutions prefer)."""
    return lambda: build().to(memory_format=torch.channels_last)


def images(batch, size, channels=3, memory_format=torch.contiguous_format):
    """A fixed random batch of images, (batch, channels, size, size)."""
    x = torch.randn(batch, channels, size, size, generator=torch.Generator().manual_seed(0))
    return x.contiguous(memory_format=memory_format)


def _table(batch, features=64):
    return torch.randn(batch, features, generator=torch.Generator().manual_seed(0))


def _tokens(batch, seq):
    return torch.randint(0, 8192, (batch, seq), generator=torch.Generator().manual_seed(0))


#: name -> (description, build, make input, modes); the table of issue #19, the LLMs of
#: #23, and what #19's table left out: channels_last, BatchNorm1d, ConvNeXt, BiT
MODELS = {
    "siglip": ("SiglipVisionModel, ViT-B/16 config, 4 layers, batch 8, 224 px",
               _siglip, lambda: images(8, 224), ("train", "infer")),
    "resnet18": ("ResNetModel, ResNet-18 config, batch 16, 224 px",
                 _resnet18, lambda: images(16, 224), ("train", "infer")),
    "resnet18-fused": ("ResNetModel, ResNet-18 config, batch 16, 224 px, converted with "
                       "fuse_activation=True", _resnet18, lambda: images(16, 224),
                       ("train", "infer")),
    "resnet18-small": ("ResNetModel, ResNet-18 config, batch 2, 64 px",
                       _resnet18, lambda: images(2, 64), ("train", "infer")),
    "study-cnn-b2": ("the study's digits CNN (8x8, 16-64 channels, BatchNorm2d), batch 2",
                     study_cnn, lambda: images(2, 8, 1), ("train", "infer")),
    "study-cnn-b32": ("the study's digits CNN, batch 32",
                      study_cnn, lambda: images(32, 8, 1), ("train", "infer")),
    "resnet18-cl": ("ResNetModel, ResNet-18 config, channels_last, batch 16, 224 px",
                    _channels_last(_resnet18),
                    lambda: images(16, 224, memory_format=torch.channels_last),
                    ("train", "infer")),
    "study-cnn-b32-cl": ("the study's digits CNN, channels_last, batch 32",
                         _channels_last(study_cnn),
                         lambda: images(32, 8, 1, torch.channels_last), ("train", "infer")),
    "convnext": ("ConvNextModel, ConvNeXt-T widths, depths 1-1-3-1, batch 8, 64 px",
                 _convnext, lambda: images(8, 64), ("train", "infer")),
    "bit": ("BitModel, BiT-R50x1 config (GroupNorm, weight-standardized convs), batch 2, "
            "224 px", _bit, lambda: images(2, 224), ("train", "infer")),
    "mlp-bn1d": ("an MLP on 64 features, 2 x (Linear 512, BatchNorm1d, ReLU), batch 256",
                 mlp, lambda: _table(256), ("train", "infer")),
    "llama": ("LlamaForCausalLM, hidden 1024, 2 layers, seq 512, batch 2",
              lambda: llm("llama"), lambda: _tokens(2, 512), ("train",)),
    "gemma": ("GemmaForCausalLM, hidden 1024, 2 layers, seq 512, batch 2",
              lambda: llm("gemma"), lambda: _tokens(2, 512), ("train",)),
    "llama-bf16": ("LlamaForCausalLM in bf16, hidden 512, 4 layers, 8 heads, 2 KV heads, "
                   "seq 256, batch 4", lambda: llm("llama", 512, 4, 2, torch.bfloat16),
                   lambda: _tokens(4, 256), ("train",)),
    "llama-bf16-fused": ("the llama-bf16 model converted with fuse_residual=True",
                         lambda: llm("llama", 512, 4, 2, torch.bfloat16),
                         lambda: _tokens(4, 256), ("train",)),
    "llama-decode": ("LlamaForCausalLM, hidden 512, 4 layers, 8 heads, 2 KV heads: 32 "
                     "tokens generated greedily after 16, batch 1",
                     lambda: llm("llama", 512, 4, 2), lambda: _tokens(1, 16), ("decode",)),
    "resnet50": ("ResNetModel, ResNet-50 config, batch 4, 128 px",
                 _resnet50, lambda: images(4, 128), ("train", "infer")),
    "mobilenetv2": ("MobileNetV2Model, 1.0 config, batch 8, 128 px",
                    _mobilenet_v2, lambda: images(8, 128), ("train", "infer")),
    "efficientnet-b0": ("EfficientNetModel, B0 widths and depths, batch 8, 128 px",
                        _efficientnet_b0, lambda: images(8, 128), ("train", "infer")),
}
QUICK_MODELS = ("study-cnn-b2",)
#: the rows converted with options (``normkit.convert``'s keywords)
CONVERT = {"resnet18-fused": dict(fuse_activation=True),
           "llama-bf16-fused": dict(fuse_residual=True)}


def _output(model, x):
    if x.dtype == torch.long:
        return model(input_ids=x, labels=x).loss
    out = model(x)
    out = getattr(out, "last_hidden_state", out)
    return out.float().square().mean()


def train_step(model, opt, x):
    """Forward, loss (``_output``), backward and one ``opt`` step."""
    opt.zero_grad(set_to_none=True)
    _output(model, x).backward()
    opt.step()


def infer_step(model, opt, x):
    """A no-grad forward (``opt`` unused: the same signature as ``train_step``)."""
    with torch.no_grad():
        _output(model, x)


DECODE_TOKENS = 32


def decode_step(model, opt, x):
    """``DECODE_TOKENS`` tokens generated greedily after the prompt ``x`` (no grad; ``opt``
    unused); returns the tokens."""
    with torch.no_grad():
        return model.generate(x, max_new_tokens=DECODE_TOKENS, min_new_tokens=DECODE_TOKENS,
                              do_sample=False, pad_token_id=0)


def saved_bytes(model, x):
    """Bytes autograd keeps for the backward of one training step of ``model`` on ``x``
    (``_output``'s loss): every storage a node of the graph saves, counted once at its
    full size however many tensors view it (``saved_tensors_hooks`` sees each saved
    tensor), the model's own parameters and buffers left out (they are kept anyway).
    The graph is then run backward and the gradients dropped."""
    own = {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(),
                                                                   model.buffers())}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _output(model, x)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def _pair(build, **options):
    """(untouched, converted, swapped count) with equal weights; ``options`` for
    ``normkit.convert``."""
    import normkit

    torch.manual_seed(0)
    plain = build()
    converted = copy.deepcopy(plain)
    report = normkit.convert(converted, **options)
    return plain, report.model, len(report.swapped) + len(report.routed)


def _spread(best, key):
    """The ``key`` model's time over the untouched one's (None without that model)."""
    return best[key] / best["untouched"] if key in best else None


def _time_steps(fn, model, opt, x, steps):
    cuda = x.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn(model, opt, x)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def _round_order(keys, r):
    """The order of the models in round ``r``: ``keys``, reversed in odd rounds."""
    return keys[::-1] if r % 2 else keys


def measure_model(name, mode, repeats=5, min_seconds=0.3, device="cpu", control=False):
    """One row: best step time of each model and the ratio converted / untouched (on
    ``device``: a CUDA step is timed from synchronize to synchronize). ``control``: a
    third model, an untouched copy, timed the same way in the same rounds; its ratio to
    the untouched one (``control``) is the measurement's own spread, what a ratio of two
    equal models reads on this machine. The models take turns in each round, in the
    reverse order every other round, so that none is always timed first or last."""
    desc, build, make_input, _ = MODELS[name]
    plain, converted, count = _pair(build, **CONVERT.get(name, {}))
    plain, converted = plain.to(device), converted.to(device)
    x = make_input().to(device)
    fn = {"train": train_step, "infer": infer_step, "decode": decode_step}[mode]
    pair = {"untouched": plain, "converted": converted}
    if control:
        pair["control"] = copy.deepcopy(plain)
    opts = {}
    for key, model in pair.items():
        model.train(mode == "train")
        opts[key] = torch.optim.SGD(model.parameters(), lr=1e-4)
        fn(model, opts[key], x)                                    # warm-up (numba compiles)
    saved = {}
    if mode == "train":        # (before the timing: what one step keeps for its backward)
        saved = {key: saved_bytes(pair[key], x) for key in ("untouched", "converted")}
    once = _time_steps(fn, plain, opts["untouched"], x, 1)
    steps = max(1, min(200, round(min_seconds / max(once, 1e-6))))
    best = {key: float("inf") for key in pair}
    for r in range(repeats):
        for key in _round_order(list(pair), r):
            best[key] = min(best[key], _time_steps(fn, pair[key], opts[key], x, steps))
    return dict(model=name, description=desc, mode=mode, device=str(device),
                norms_converted=count,
                steps_per_repeat=steps, untouched_ms=best["untouched"] * 1e3,
                converted_ms=best["converted"] * 1e3,
                ratio=best["converted"] / best["untouched"], control=_spread(best, "control"),
                untouched_saved_bytes=saved.get("untouched"),
                converted_saved_bytes=saved.get("converted"),
                saved_ratio=(saved["converted"] / saved["untouched"] if saved.get("untouched")
                             else None))


def run_models(names=None, repeats=5, progress=None, device="cpu", control=False):
    """Every (model, mode) row of ``names`` (default: all); a row whose library is missing
    becomes ``{"model", "mode", "skipped": reason}``."""
    rows = []
    for name in names or MODELS:
        for mode in MODELS[name][3]:
            try:
                rows.append(measure_model(name, mode, repeats, device=device,
                                          control=control))
            except ImportError as exc:
                rows.append(dict(model=name, mode=mode, description=MODELS[name][0],
                                 skipped=f"needs {exc.name or exc}"))
            if progress:
                progress(rows[-1])
    return rows


# ---------------------------------------------------------------------------- calls

def _calls():
    x4 = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    x8 = torch.randn(8, 64, 8, 8, generator=torch.Generator().manual_seed(0))
    x8_cl = x8.contiguous(memory_format=torch.channels_last)
    x256 = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    return {
        "LayerNorm (4, 64)": (lambda m: m.LayerNorm(64), x4, True),
        "RMSNorm (4, 64)": (lambda m: m.RMSNorm(64), x4, True),
        "BatchNorm2d (8, 64, 8, 8) train": (lambda m: m.BatchNorm2d(64), x8, True),
        "BatchNorm2d (8, 64, 8, 8) eval": (lambda m: m.BatchNorm2d(64), x8, False),
        "GroupNorm 8 groups (8, 64, 8, 8)": (lambda m: m.GroupNorm(8, 64), x8, True),
        "BatchNorm2d (8,64,8,8) CL train": (lambda m: m.BatchNorm2d(64), x8_cl, True),
        "BatchNorm1d (256, 512) train": (lambda m: m.BatchNorm1d(512), x256, True),
    }


CALLS = tuple(_calls())


def per_call_us(fn, calls, repeats, clock=time.thread_time):
    """Microseconds per ``fn()``, best of ``repeats`` rounds of ``calls`` calls, after a
    warm-up: CPU time of the calling thread, or wall time with ``clock=time.perf_counter``
    (calls that use several threads; the scripts in ``benchmarks/``)."""
    for _ in range(calls // 10 + 10):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        for _ in range(calls):
            fn()
        best = min(best, (clock() - start) / calls * 1e6)
    return best


def run_calls(calls=300, repeats=15):
    """Per-call microseconds of normkit's and torch.nn's layer, one thread."""
    import normkit.nn as nknn

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for case, (make, x, train) in _calls().items():
            layers = {"normkit": make(nknn).train(train), "torch": make(torch.nn).train(train)}
            xg = x.clone().requires_grad_()
            for kind in ("forward", "forward+backward"):
                us = {}
                for lib, layer in layers.items():
                    if kind == "forward":
                        def fn(layer=layer):
                            with torch.no_grad():
                                layer(x)
                    else:
                        def fn(layer=layer):
                            layer(xg).sum().backward()
                    us[lib] = per_call_us(fn, calls, repeats)
                rows.append(dict(case=case, pass_=kind, normkit_us=us["normkit"],
                                 torch_us=us["torch"], ratio=us["normkit"] / us["torch"]))
    finally:
        torch.set_num_threads(threads)
    return rows


# ---------------------------------------------------------------------------- printing

def _saved_columns(r):
    """``saved MiB untouched / converted, ratio`` of a train row; blank for the others."""
    if r.get("saved_ratio") is None:
        return f"{'':>24s}"
    mib = 2 ** 20
    return (f"{r['untouched_saved_bytes'] / mib:8.1f} {r['converted_saved_bytes'] / mib:8.1f} "
            f"{r['saved_ratio']:6.3f}")


def format_models(rows):
    control = any(r.get("control") is not None for r in rows)
    lines = [f"{'model':16s} {'mode':6s} {'norms':>5s} {'untouched ms':>13s} "
             f"{'converted ms':>13s} {'ratio':>6s}  {'saved MiB':>8s} {'(conv.)':>8s} "
             f"{'ratio':>6s}" + ("  control" if control else "")]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['model']:16s} {r['mode']:6s} skipped: {r['skipped']}")
            continue
        lines.append(f"{r['model']:16s} {r['mode']:6s} {r['norms_converted']:5d} "
                     f"{r['untouched_ms']:13.2f} {r['converted_ms']:13.2f} {r['ratio']:6.3f}  "
                     f"{_saved_columns(r)}"
                     + (f"  {r['control']:7.3f}" if r.get("control") is not None else ""))
    return "\n".join(lines)


def format_calls(rows):
    lines = [f"{'call (one thread)':34s} {'pass':17s} {'normkit us':>10s} {'torch us':>9s} "
             f"{'ratio':>6s}"]
    for r in rows:
        lines.append(f"{r['case']:34s} {r['pass_']:17s} {r['normkit_us']:10.1f} "
                     f"{r['torch_us']:9.1f} {r['ratio']:6.2f}")
    return "\n".join(lines)
