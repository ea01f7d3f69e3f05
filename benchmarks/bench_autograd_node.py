"""What recording a C++ op for autograd costs, per call: a ``torch::autograd::Function``
against a node written as torch's generated nodes are (how ``backends/cpu/native.cpp``
records its calls), against torch's own ``mul``.

`python benchmarks/bench_autograd_node.py` compiles ``benchmarks/cpp_node/autograd_node.cpp``
(torch's C++ extension loader: a C++ compiler and ninja, about 20 s the first time), checks
both against torch, then times on one thread (CPU time, best of 9 rounds of 2000 calls,
three interleaved rounds) y = x * w on (4, 64): the forward with a gradient recorded, and
the forward with ``torch.autograd.grad`` of x. For scale, the same for LayerNorm (4, 64),
normkit's layer against torch.nn's. The figures are in docs/performance.md ("Small calls").
Not part of the library or the tests.
"""

from __future__ import annotations

import os

import torch
from torch.utils.cpp_extension import load

import normkit.nn as nknn
from normkit.bench.models import per_call_us

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ext = load("normkit_bench_autograd_node", [os.path.join(HERE, "cpp_node",
                                                            "autograd_node.cpp")],
               extra_cflags=["-O2"], verbose=False)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=gen).requires_grad_()
    w, g = torch.randn(4, 64, generator=gen), torch.randn(4, 64, generator=gen)
    for name in ("as_function", "as_node"):
        got = torch.autograd.grad(getattr(ext, name)(x, w), [x], g)[0]
        assert torch.equal(got, g * w), name
    ours, theirs = nknn.LayerNorm(64), torch.nn.LayerNorm(64)
    cases = {
        "mul, torch's node": torch.mul,
        "mul, a torch::autograd::Function": ext.as_function,
        "mul, a hand-written node": ext.as_node,
    }
    print(f"{'per call, us, one thread':40s} {'forward':>8s} {'fwd + grad':>11s}")
    for round_ in range(3):
        for name, op in cases.items():
            fwd = per_call_us(lambda op=op: op(x, w), 2000, 9)
            both = per_call_us(lambda op=op: torch.autograd.grad(op(x, w), [x], g), 2000, 9)
            print(f"{name:40s} {fwd:8.2f} {both:11.2f}")
        for name, layer in (("LayerNorm (4, 64), torch.nn", theirs),
                            ("LayerNorm (4, 64), normkit", ours)):
            fwd = per_call_us(lambda layer=layer: layer(x), 2000, 9)
            both = per_call_us(lambda layer=layer: layer(x).sum().backward(), 2000, 9)
            print(f"{name:40s} {fwd:8.2f} {both:11.2f}")
        print()


if __name__ == "__main__":
    main()
