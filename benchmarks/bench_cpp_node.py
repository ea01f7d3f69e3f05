"""Prototype: what a C++ autograd node would save on a small call.

`python benchmarks/bench_cpp_node.py` compiles ``benchmarks/cpp_node/layer_norm.cpp``
(torch's C++ extension loader: needs a C++ compiler and ninja, about 40 s the first time,
cached after), hands it the addresses of normkit's numba row kernels compiled as ``cfunc``s,
checks the result against ``torch.nn.functional.layer_norm`` and prints, per call on one
thread (CPU time, best of 11 rounds of 3000 calls, three interleaved rounds), LayerNorm (4, 64)
forward + backward and forward without grad: the prototype, torch and normkit's functional.
Not part of the library or the tests; the figures are in docs/performance.md ("A C++
autograd node, measured").
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from numba import cfunc, types
from torch.utils.cpp_extension import load

import normkit
from normkit.backends.cpu import rows
from normkit.backends.cpu.address import at
from normkit.bench.models import per_call_us

F32 = np.empty(0, np.float32)   # the storage dtype, a compile-time constant of the cfuncs


@cfunc(types.void(types.CPointer(types.int64), types.float64))
def forward_kernel(a, eps):
    """a = (M, K, x, y, w, b, mean, rstd): rows.rows_forward over all M rows."""
    m, k = a[0], a[1]
    x, y = at(a[2], F32, (m, k)), at(a[3], F32, (m, k))
    w, b = at(a[4], F32, (k,)), at(a[5], F32, (k,))
    stats = (at(a[6], F32, (m,)), at(a[7], F32, (m,)), np.empty(m, np.float32))
    rows.rows_forward(x, y, w, b, eps, True, stats, (False, 1), 0, m)


@cfunc(types.void(types.CPointer(types.int64)))
def backward_kernel(a):
    """a = (M, K, g, x, dx, w, mean, rstd, dw, db): rows.rows_backward in one chunk."""
    m, k = a[0], a[1]
    g, x, dx = at(a[2], F32, (m, k)), at(a[3], F32, (m, k)), at(a[4], F32, (m, k))
    w, stats = at(a[5], F32, (k,)), (at(a[6], F32, (m,)), at(a[7], F32, (m,)))
    partials = (at(a[8], F32, (1, k)), at(a[9], F32, (1, k)))
    rows.rows_backward(g, x, w, stats, True, dx, partials, (False, 1), 0, 1)


def main():
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpp_node", "layer_norm.cpp")
    start = time.time()
    ext = load(name="normkit_cpp_node_prototype", sources=[source], extra_cflags=["-O2"])
    print(f"extension ready in {time.time() - start:.0f} s")
    ext.set_kernels(forward_kernel.address, backward_kernel.address)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(4, 64, requires_grad=True)
    w, b = torch.randn(64, requires_grad=True), torch.randn(64, requires_grad=True)
    g = torch.randn(4, 64)

    def grads(fn):
        for t in (x, w, b):
            t.grad = None
        y = fn()
        y.backward(g)
        return [y.detach()] + [t.grad.clone() for t in (x, w, b)]

    ours = grads(lambda: ext.layer_norm(x, w, b, 1e-5))
    ref = grads(lambda: torch.nn.functional.layer_norm(x, (64,), w, b))
    for name, p, q in zip(("y", "dx", "dw", "db"), ours, ref):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=f"{name} differs from torch")
    calls = {"prototype (C++ node)": lambda: ext.layer_norm(x, w, b, 1e-5),
             "torch.nn.functional": lambda: torch.nn.functional.layer_norm(x, (64,), w, b),
             "normkit.functional": lambda: normkit.functional.layer_norm(x, (64,), w, b)}
    print("LayerNorm (4, 64) float32, one thread, us per call (three interleaved rounds)")
    for _ in range(3):
        fb = {k: per_call_us(lambda f=f: f().backward(g), 3000, 11) for k, f in calls.items()}
        with torch.no_grad():
            fwd = {k: per_call_us(f, 3000, 11) for k, f in calls.items()}
        print("  " + "   ".join(f"{k}: fwd {fwd[k]:.1f}, fwd+bwd {fb[k]:.1f}" for k in calls))


if __name__ == "__main__":
    main()
