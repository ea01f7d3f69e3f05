"""Prototype: what a C++ autograd node would save, per call and in a whole model.

`python benchmarks/bench_cpp_node.py` compiles ``benchmarks/cpp_node/prototypes.cpp``
(torch's C++ extension loader: needs a C++ compiler and ninja, about 40 s the first time,
cached after) and hands it the addresses of normkit's numba kernels compiled as
``cfunc``s. Then, each checked against torch.nn first:

1. LayerNorm (4, 64) per call on one thread (CPU time, best of 11 rounds of 3000 calls,
   three interleaved rounds), forward + backward and forward without grad: the prototype,
   torch and normkit's functional;
2. the study's digits CNN (``normkit bench --models``' study-cnn rows) with its BatchNorm2d
   layers as the prototype (training: batch statistics and the running update in C++; eval:
   one kernel call), against torch.nn and against ``normkit.convert``: best step time of 7
   rounds of 200, three interleaved rounds, 2 threads.

Not part of the library or the tests; the figures are in docs/performance.md ("A C++
autograd node, measured").
"""

from __future__ import annotations

import copy
import os
import time

import numpy as np
import torch
from numba import cfunc, types
from torch.utils.cpp_extension import load

import normkit
from normkit.backends.cpu import entries, rows
from normkit.backends.cpu.address import at
from normkit.bench import models
from normkit.bench.models import per_call_us

F32 = np.empty(0, np.float32)   # the storage dtype, a compile-time constant of the cfuncs


@cfunc(types.void(types.CPointer(types.int64), types.float64))
def ln_forward_kernel(a, eps):
    """a = (M, K, x, y, w, b, mean, rstd): rows.rows_forward over all M rows."""
    m, k = a[0], a[1]
    x, y = at(a[2], F32, (m, k)), at(a[3], F32, (m, k))
    w, b = at(a[4], F32, (k,)), at(a[5], F32, (k,))
    stats = (at(a[6], F32, (m,)), at(a[7], F32, (m,)), np.empty(m, np.float32))
    rows.rows_forward(x, y, w, b, eps, True, stats, (False, 1), 0, m)


@cfunc(types.void(types.CPointer(types.int64)))
def ln_backward_kernel(a):
    """a = (M, K, g, x, dx, w, mean, rstd, dw, db): rows.rows_backward in one chunk."""
    m, k = a[0], a[1]
    g, x, dx = at(a[2], F32, (m, k)), at(a[3], F32, (m, k)), at(a[4], F32, (m, k))
    w, stats = at(a[5], F32, (k,)), (at(a[6], F32, (m,)), at(a[7], F32, (m,)))
    partials = (at(a[8], F32, (1, k)), at(a[9], F32, (1, k)))
    rows.rows_backward(g, x, w, stats, True, dx, partials, (False, 1), 0, 1)


@cfunc(types.void(types.CPointer(types.int64), types.float64))
def bn_forward_kernel(a, eps):
    """a = (N, C, S, x, y, w, b, mean, rstd, var, fixed, from_var): entries.channels_small
    over every channel (fixed: eval, the running mean and variance at mean and rstd)."""
    n, c, s = a[0], a[1], a[2]
    addresses = (a[3], a[4], a[5], a[6], a[7], a[8], a[9])
    entries.channels_small(addresses, (n, c, s), F32, F32, eps, a[10] != 0, a[11] != 0, 0, c)


@cfunc(types.void(types.CPointer(types.int64)))
def bn_backward_kernel(a):
    """a = (N, C, S, g, x, dx, w, mean, rstd, db, dw): entries.channels_small_backward over
    every channel, dbias and dweight summed in the same call."""
    n, c, s = a[0], a[1], a[2]
    addresses = (a[3], a[4], a[5], a[6], a[7], a[8], 0, a[9], a[10])
    entries.channels_small_backward(addresses, (n, c, s), F32, F32, True, False, 0, c)


def layer_norm_calls(ext):
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


def _prototype_batch_norm(ext):
    class PrototypeBatchNorm2d(torch.nn.BatchNorm2d):
        def forward(self, x):
            if self.training:
                self.num_batches_tracked.add_(1)
                return ext.batch_norm_train(x, self.weight, self.bias, self.running_mean,
                                            self.running_var, self.momentum, self.eps)
            return ext.batch_norm_eval(x, self.weight, self.bias, self.running_mean,
                                       self.running_var, self.eps)
    return PrototypeBatchNorm2d


def _swap(model, cls):
    for name, child in model.named_children():
        if isinstance(child, torch.nn.BatchNorm2d):
            layer = cls(child.num_features)
            layer.load_state_dict(child.state_dict())
            setattr(model, name, layer)
        else:
            _swap(child, cls)
    return model


def _check_batch_norm(cls):
    torch.manual_seed(0)
    x, g = torch.randn(2, 16, 8, 8, requires_grad=True), torch.randn(2, 16, 8, 8)
    ref = torch.nn.BatchNorm2d(16)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-1, 1)
    proto = cls(16)
    proto.load_state_dict(ref.state_dict())
    results = []
    for layer in (ref, proto):
        x.grad = None
        y = layer(x)
        y.backward(g)
        results.append((y.detach(), x.grad.clone(), layer.weight.grad, layer.bias.grad,
                        layer.running_mean.clone(), layer.running_var.clone()))
    names = ("y", "dx", "dweight", "dbias", "running_mean", "running_var")
    for name, p, q in zip(names, *results):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=f"{name} differs from torch")
    with torch.no_grad():
        torch.testing.assert_close(proto.eval()(x), ref.eval()(x), rtol=1e-5, atol=1e-5)


def _best_step_ms(step, model, x, steps=200, rounds=7):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(50):
        step(model, opt, x)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            step(model, opt, x)
        best = min(best, (time.perf_counter() - start) / steps)
    return best * 1e3


def study_cnn_steps(ext):
    cls = _prototype_batch_norm(ext)
    _check_batch_norm(cls)
    torch.set_num_threads(2)
    print("study CNN step, ms (ratio to torch.nn), 2 threads")
    for batch in (2, 32):
        torch.manual_seed(0)
        plain = models.study_cnn()
        variants = {"torch.nn": plain, "prototype": _swap(copy.deepcopy(plain), cls),
                    "normkit.convert": normkit.convert(copy.deepcopy(plain)).model}
        x = models.images(batch, 8, 1)
        for mode, step in (("train", models.train_step), ("infer", models.infer_step)):
            times = {k: float("inf") for k in variants}
            for _ in range(3):                                     # interleaved rounds
                for k, m in variants.items():
                    times[k] = min(times[k], _best_step_ms(step, m, x))
            base = times["torch.nn"]
            print(f"  batch {batch:2d} {mode}: " + "   ".join(
                f"{k} {t:.3f} ({t / base:.2f})" for k, t in times.items()))


def main():
    start = time.time()
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpp_node",
                          "prototypes.cpp")
    ext = load(name="normkit_cpp_node_prototypes", sources=[source], extra_cflags=["-O2"])
    print(f"extension ready in {time.time() - start:.0f} s")
    ext.set_kernels(ln_forward_kernel.address, ln_backward_kernel.address,
                    bn_forward_kernel.address, bn_backward_kernel.address)
    layer_norm_calls(ext)
    study_cnn_steps(ext)


if __name__ == "__main__":
    main()
