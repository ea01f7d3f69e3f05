"""Eval BatchNorm on ResNet-18's layer shapes (batch 16), 2 threads: normkit's layer
against torch.nn's, alone in a loop and between a convolution and a ReLU (docs/
performance.md, "Threads from C++" and "Eval BatchNorm in memory order").

For each shape: microseconds per call alone (the same input again and again) and, in
``relu(bn(conv(x)))``, the BatchNorm's and then the ReLU's wall time, best of 30
interleaved rounds.

    python benchmarks/bench_eval_bn_threads.py
"""

from __future__ import annotations

import copy
import time

import torch

import normkit
from normkit.bench.models import per_call_us

SHAPES = [(16, 64, 56, 56), (16, 128, 28, 28), (16, 256, 14, 14), (16, 512, 7, 7)]


def _alone_us(fn):
    return per_call_us(fn, 50, 7, clock=time.perf_counter)


def _between_us(bn, x, weight):
    """(bn, relu) wall microseconds of one ``relu(bn(conv(x)))``."""
    h = torch.nn.functional.conv2d(x, weight, padding=1)
    start = time.perf_counter()
    h = bn(h)
    middle = time.perf_counter()
    torch.relu(h)
    return (middle - start) * 1e6, (time.perf_counter() - middle) * 1e6


def main():
    torch.set_num_threads(2)
    torch.manual_seed(0)
    print("eval BatchNorm, 2 threads, us: alone | in conv -> bn -> relu: bn / relu")
    for shape in SHAPES:
        c = shape[1]
        theirs = torch.nn.BatchNorm2d(c).eval()
        theirs.running_var.uniform_(0.5, 2)
        ours = normkit.convert(torch.nn.Sequential(copy.deepcopy(theirs))).model[0].eval()
        x, weight = torch.randn(shape), torch.randn(c, c, 3, 3) * 0.05
        with torch.no_grad():
            alone = {"torch": _alone_us(lambda: theirs(x)), "normkit": _alone_us(lambda: ours(x))}
            between = {"torch": [float("inf")] * 2, "normkit": [float("inf")] * 2}
            for _ in range(30):
                for name, bn in (("torch", theirs), ("normkit", ours)):
                    got = _between_us(bn, x, weight)
                    between[name] = [min(a, b) for a, b in zip(between[name], got)]
        cells = "  ".join(f"{name} {alone[name]:7.1f} | {between[name][0]:7.1f} / "
                          f"{between[name][1]:6.1f}" for name in ("torch", "normkit"))
        print(f"{str(shape):18s} {cells}")


if __name__ == "__main__":
    main()
