"""Per-sample gradients (``torch.func.vmap(grad(loss))``, as DP-SGD computes them) of a
model with torch.nn's norms and of its ``normkit.convert`` copy. Under a ``torch.func``
transform normkit's norms run the composite torch ops (docs/pytorch2.md), so this is
their cost against torch's own ops with batching rules: a small CNN with GroupNorm (64
samples of 3x32x32) and an MLP with LayerNorm (256 samples of 64 features), alternated,
best of the rounds, 2 threads. docs/pytorch2.md quotes it.

    PYTHONPATH=src python benchmarks/bench_func_transforms.py
"""

from __future__ import annotations

import copy
import time

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import normkit


def cnn():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def mlp():
    return nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 256),
                         nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 10))


def per_sample_grads(model):
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x, y):
        return nn.functional.cross_entropy(functional_call(model, p, (x,)), y)
    step = vmap(grad(loss), in_dims=(None, 0, 0))
    return lambda x, y: step(params, x, y)


def main(rounds=3, calls=5):
    torch.manual_seed(0)
    torch.set_num_threads(2)
    cases = [("CNN + GroupNorm", cnn, (64, 1, 3, 32, 32)), ("MLP + LayerNorm", mlp, (256, 1, 64))]
    print("| model | torch.nn (ms) | normkit (ms) | ratio |")
    print("|---|---:|---:|---:|")
    for name, make, shape in cases:
        base = make()
        converted = copy.deepcopy(base)
        normkit.convert(converted)
        x, y = torch.randn(shape), torch.randint(0, 10, (shape[0], 1))
        steps = {"torch": per_sample_grads(base), "normkit": per_sample_grads(converted)}
        best = {}
        for _ in range(rounds):
            for tag, step in steps.items():
                step(x, y)                                        # warm
                start = time.perf_counter()
                for _ in range(calls):
                    step(x, y)
                took = (time.perf_counter() - start) / calls * 1e3
                best[tag] = min(best.get(tag, took), took)
        print(f"| {name} | {best['torch']:.1f} | {best['normkit']:.1f} | "
              f"{best['normkit'] / best['torch']:.2f} |")


if __name__ == "__main__":
    main()
