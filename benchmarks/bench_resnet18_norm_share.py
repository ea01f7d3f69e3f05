"""How much of ResNet-18's training step (batch 16, 224 px, 2 threads) its BatchNorm
layers take, torch.nn's and normkit's, against four copies of the same tensor; and the
step of the converted model with every ReLU removed, the bound of a BatchNorm+ReLU fusion
(docs/performance.md, "ResNet-18's training step 10 % faster is more than its norms
cost").

    python benchmarks/bench_resnet18_norm_share.py
"""

from __future__ import annotations

import copy
import time

import torch

import normkit.nn as nknn
from normkit.bench.models import MODELS, _pair, train_step

# ResNet-18's BatchNorm2d inputs at batch 16, 224 px, and how many layers have each
SHAPES = [((16, 64, 112, 112), 1), ((16, 64, 56, 56), 4), ((16, 128, 28, 28), 5),
          ((16, 256, 14, 14), 5), ((16, 512, 7, 7), 5)]


def _best_ms(fn, repeats):
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def norm_share():
    """ms per step of the BatchNorm layers, forward and backward, one layer at a time."""
    total = {"normkit": 0.0, "torch": 0.0, "4 copies": 0.0}
    for shape, count in SHAPES:
        x = torch.randn(shape).requires_grad_()
        g, buf = torch.randn(shape), torch.empty(shape)
        repeats = 5 if shape[2] > 56 else 15
        row = {}
        for name, layer in (("normkit", nknn.BatchNorm2d(shape[1])),
                            ("torch", torch.nn.BatchNorm2d(shape[1]))):
            row[name] = _best_ms(lambda layer=layer: layer(x).backward(g), repeats)
        row["4 copies"] = 4 * _best_ms(lambda: buf.copy_(g), repeats)
        for key in total:
            total[key] += count * row[key]
        print(f"{str(shape):20s} x{count}  " + "  ".join(f"{k} {v:6.2f}" for k, v in row.items()))
    print("per step, ms:", "  ".join(f"{k} {v:.1f}" for k, v in total.items()))


def without_relu():
    """Step times of torch.nn's model, the converted one, and the converted one with its
    ReLUs replaced by Identity (best of 4 rounds of 2 steps, the models taking turns)."""
    plain, converted, _ = _pair(MODELS["resnet18"][1])
    bare = copy.deepcopy(converted)
    for module in list(bare.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.ReLU):
                setattr(module, name, torch.nn.Identity())
    x = MODELS["resnet18"][2]()
    models = {"torch.nn": plain, "converted": converted, "converted, no ReLU": bare}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in models.items()}
    for key, model in models.items():
        model.train()
        train_step(model, opts[key], x)
    best = {key: float("inf") for key in models}
    for r in range(4):
        for key in (list(models) if r % 2 == 0 else list(models)[::-1]):
            start = time.perf_counter()
            train_step(models[key], opts[key], x)
            best[key] = min(best[key], (time.perf_counter() - start) * 1e3)
    print("step, ms (ratio to torch.nn):", "  ".join(
        f"{k} {v:.0f} ({v / best['torch.nn']:.3f})" for k, v in best.items()))


if __name__ == "__main__":
    torch.set_num_threads(2)
    norm_share()
    without_relu()
