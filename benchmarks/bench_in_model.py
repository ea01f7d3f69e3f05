"""What one small BatchNorm call costs between convolutions, against alone, at each level of
normkit's path and of torch's (docs/performance.md, "Between convolutions").

A (2, 16, 8, 8) eval BatchNorm, one thread: each variant timed alone in a loop, and inside
``relu(variant(conv(x)))`` minus ``relu(conv(x))``; best of 7 rounds of 3000 calls, the
calling thread's CPU time.

    python benchmarks/bench_in_model.py
"""

from __future__ import annotations

import torch

import normkit.functional as NF
import normkit.nn as nknn
from normkit import backends, ops
from normkit import grouping as G
from normkit.bench.models import per_call_us as _per_call_us


def per_call_us(f):
    return _per_call_us(f, calls=3000, repeats=7)      # the calling thread's CPU time


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(2, 16, 8, 8)
    conv, relu = torch.nn.Conv2d(16, 16, 3, padding=1).eval(), torch.nn.ReLU()
    tbn, nbn = torch.nn.BatchNorm2d(16).eval(), nknn.BatchNorm2d(16).eval()
    rm, rv, w, b = nbn.running_mean, nbn.running_var, nbn.weight, nbn.bias
    g = G.batch(x.shape)
    node = backends.plan(x, g, True, True)
    variants = {
        "torch.nn.BatchNorm2d": tbn,
        "torch F.batch_norm": lambda y: torch.nn.functional.batch_norm(y, rm, rv, w, b, False,
                                                                       0.1, 1e-5),
        "torch.batch_norm (C++)": lambda y: torch.batch_norm(y, w, b, rm, rv, False, 0.1, 1e-5,
                                                             False),
        "normkit.nn.BatchNorm2d": nbn,
        "normkit F.batch_norm": lambda y: NF.batch_norm(y, rm, rv, w, b, False, 0.1, 1e-5),
        "ops.norm_forward": lambda y: ops.norm_forward(y, g, w, b, 1e-5, True, rm, None, False,
                                                       rv)[0],
        "C++ node forward": None if node is None else
        (lambda y: node.forward(y, w, b, 1e-5, rm, None, False, rv)[0]),
        "empty_like + copy_": lambda y: torch.empty_like(y).copy_(y),
    }
    y0 = conv(x)
    with torch.no_grad():
        base = per_call_us(lambda: relu(conv(x)))
        print(f"relu(conv(x)): {base:.2f} us")
        for name, f in variants.items():
            if f is None:
                print(f"{name:24s} (no C++ node on this machine)")
                continue
            alone = per_call_us(lambda: f(y0))
            between = per_call_us(lambda: relu(f(conv(x)))) - base
            print(f"{name:24s} alone {alone:6.2f} us   between convolutions {between:6.2f} us")


if __name__ == "__main__":
    main()
