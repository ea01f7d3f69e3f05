"""Inference speed-up of ``normkit.fold`` on a ResNet-18: `python benchmarks/bench_fold.py`.

transformers' ``ResNetModel`` built from a ResNet-18 config (random weights, non-trivial
running statistics), eval mode, fp32, ``torch.no_grad()`` forward of a batch of 16
images of 224 x 224 px. Four models, timed in one interleaved loop so that load from
other processes hits them alike:

* ``torch``            -- torch.nn BatchNorm2d layers, as built;
* ``torch folded``     -- ``normkit.fold`` of it (every BatchNorm merged into its Conv2d);
* ``normkit``          -- the same model after ``normkit.convert`` (normkit's BatchNorm2d);
* ``normkit folded``   -- ``normkit.fold`` of the converted model.

Before timing, each folded model's output is checked against its unfolded twin (max
error <= 1e-5 x max |output|). Prints best and median ms per forward and two speed-ups,
unfolded / folded: of the best times, and the median over repeats of the ratio of the
two forwards that ran back to back in one repeat (the steadier one when other processes
load the machine).

Options: ``--batch 16 --size 224 --repeats 7 --threads N`` (default: torch's setting).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import ResNetConfig, ResNetModel

import normkit

RESNET18 = dict(layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512])


def build():
    torch.manual_seed(0)
    model = ResNetModel(ResNetConfig(**RESNET18)).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.2)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.2)
    converted = copy.deepcopy(model)
    normkit.convert(converted)
    return {"torch": model, "torch folded": normkit.fold(model).model,
            "normkit": converted, "normkit folded": normkit.fold(converted).model}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    models = build()
    pixels = torch.randn(args.batch, 3, args.size, args.size,
                         generator=torch.Generator().manual_seed(1))
    times = {name: [] for name in models}
    with torch.no_grad():
        outs = {name: m(pixel_values=pixels).last_hidden_state for name, m in models.items()}
        for name in ("torch", "normkit"):
            ref, got = outs[name], outs[f"{name} folded"]
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            if err > 1e-5:
                raise SystemExit(f"{name} folded differs from {name}: relative error {err:.2g}")
        del outs
        for _ in range(args.repeats):
            for name, m in models.items():
                t0 = time.perf_counter()
                m(pixel_values=pixels)
                times[name].append(time.perf_counter() - t0)
    best = {name: min(t) * 1e3 for name, t in times.items()}
    print(f"ResNet-18 (transformers ResNetModel), batch {args.batch}, {args.size} px, fp32, "
          f"no_grad, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"best and median of {args.repeats} interleaved repeats")
    print(f"{'model':<16} {'best ms':>9} {'median ms':>10}  {'speed-up: best':>14}  paired")
    for name, t in times.items():
        base = name.replace(" folded", "")
        ratio = paired = ""
        if name != base:
            ratio = f"{best[base] / best[name]:.2f}x"
            paired = f"{statistics.median(u / f for u, f in zip(times[base], t)):.2f}x"
        print(f"{name:<16} {best[name]:9.1f} {statistics.median(t) * 1e3:10.1f}  {ratio:>14}  "
              f"{paired}")


if __name__ == "__main__":
    main()
