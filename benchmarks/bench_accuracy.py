"""Forward accuracy of normkit's and torch's fp32 norms against a float64 run of the same
inputs, on the CPU.

For each op, layout and kind of data it prints the largest and the root-mean-square error
in fp32 rounding units of the result's size (``|y - exact| / (eps * max(|exact|, 1))``):
centred data (N(0, 3)), data at an offset of 1000 (N(1000, 1)), and an outlier first
element per unit (300 among N(0, 1); the element the kernels once shifted by). Training
mode (batch statistics), and BatchNorm in eval with running statistics at the data's
offset. docs/architecture.md ("Autograd and precision") quotes it.

``--long``: forward and backward over long rows, planes and channels instead (millions of
elements per statistic, one sample on channels_last), the largest error of y, dx and
dweight relative to the largest exact value. ``--gpu-interpreter SMS``: normkit's column
runs the GPU backend's Triton kernels in Triton's interpreter on the CPU, launched as on
a device of SMS multiprocessors (the split of long sums into programs follows it: 132 for
an H100); the interpreter reduces inside a block as NumPy does, so it shows how the sums
across blocks and programs accumulate, not the device's bits (minutes per case).

    PYTHONPATH=src python benchmarks/bench_accuracy.py [--threads 2] [--long]
        [--gpu-interpreter SMS] [--cases N ...]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

import normkit.functional as NF

EPS32 = torch.finfo(torch.float32).eps
C = 32


def _units(y, exact):
    u = (y.double() - exact).abs() / (EPS32 * exact.abs().clamp_min(1.0))
    return u.max().item(), u.pow(2).mean().sqrt().item()


def _data(shape, kind, gen, unit_first):
    if kind == "centred":
        x = torch.randn(shape, generator=gen) * 3
    elif kind == "offset 1000":
        x = torch.randn(shape, generator=gen) + 1000
    else:
        x = torch.randn(shape, generator=gen)
        unit_first(x)
    return x


def _ops(gen):
    w, b = torch.randn(C, generator=gen), torch.randn(C, generator=gen)
    w2, b2 = torch.randn(512, generator=gen), torch.randn(512, generator=gen)

    def first_of_channels(x):
        x[0, :, 0, 0] = 300.0

    def first_of_groups(x):
        x[:, ::4, 0, 0] = 300.0

    def first_of_planes(x):
        x[:, :, 0, 0] = 300.0

    def first_of_rows(x):
        x[:, 0] = 300.0

    def bn(f, x, p, q):
        return f.batch_norm(x, None, None, p, q, training=True)

    def bn_eval(f, x, p, q):
        # running statistics of the data, the same fp32 values for both runs
        c, d = x.shape[1], x.double()
        mean = torch.full((c,), float(d.mean()), dtype=torch.float32).to(x.dtype)
        var = torch.full((c,), float(d.var()), dtype=torch.float32).to(x.dtype)
        return f.batch_norm(x, mean, var, p, q, training=False)

    def gn(f, x, p, q):
        return f.group_norm(x, 8, p, q)

    def inorm(f, x, p, q):
        return f.instance_norm(x, weight=p, bias=q)

    def ln(f, x, p, q):
        return f.layer_norm(x, (512,), p, q)

    nchw = (16, C, 16, 16)
    return [("batch_norm", nchw, bn, (w, b), first_of_channels),
            ("batch_norm eval", nchw, bn_eval, (w, b), first_of_channels),
            ("group_norm", nchw, gn, (w, b), first_of_groups),
            ("instance_norm", nchw, inorm, (w, b), first_of_planes),
            ("layer_norm", (256, 512), ln, (w2, b2), first_of_rows),
            ("batch_norm (N, C)", (256, C), bn, (w, b), first_of_rows)]


def _long_cases():
    def bn(f, x, w):
        return f.batch_norm(x, None, None, w, training=True)

    return [("instance_norm", (1, 8, 2048, 2048), False,
             lambda f, x, w: f.instance_norm(x, weight=w)),
            ("group_norm(32)", (1, 128, 1024, 1024), False,
             lambda f, x, w: f.group_norm(x, 32, w)),
            ("batch_norm", (2, 4, 2048, 2048), False, bn),
            ("layer_norm", (4, 1 << 20), False, lambda f, x, w: f.layer_norm(x, (1 << 20,), w)),
            ("batch_norm (N, C)", (1 << 22, 8), False, bn),
            ("batch_norm", (8, 16, 1024, 1024), True, bn),
            ("group_norm(4)", (1, 16, 1024, 1024), True, lambda f, x, w: f.group_norm(x, 4, w)),
            ("instance_norm", (1, 16, 64, 64), True,
             lambda f, x, w: f.instance_norm(x, weight=w))]


def _on_interpreted_gpu(sms):
    """Route normkit's ops on CPU tensors to the GPU backend (TRITON_INTERPRET=1 is set), as
    the interpreter tests do (``tests/_triton_interp_check.py``, whose routing this uses),
    launched as on ``sms`` multiprocessors."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from _triton_interp_check import _via_dispatch

    from normkit.backends import gpu

    _via_dispatch()
    gpu.INTERPRETER_SMS = sms


def _long(gen, which=None, label="normkit"):
    print(f"{'op':18s} {'shape':20s} {'layout':14s} {label + ' y / dx / dweight':>26s} "
          f"{'torch y / dx / dweight':>26s}")
    for i, (name, shape, channels_last, fn) in enumerate(_long_cases()):
        x = torch.randn(shape, generator=gen) + 0.5
        dy = torch.randn(shape, generator=gen)
        if channels_last:
            x, dy = (t.to(memory_format=torch.channels_last) for t in (x, dy))
        w = torch.rand(shape[-1] if name == "layer_norm" else shape[1], generator=gen) + 0.5
        if which and i not in which:      # (drawn all the same: the next cases' data)
            continue
        runs = []
        for f, dtype in ((F, torch.float64), (NF, torch.float32), (F, torch.float32)):
            # the exact run in NCHW: torch 2.13's float64 instance_norm backward of one
            # channels_last sample is wrong (tests/test_cpu_channels_last.py)
            exact = dtype == torch.float64
            xi = (x.double().contiguous() if exact else x).detach().requires_grad_()
            wi = w.to(dtype).detach().requires_grad_()
            y = fn(f, xi, wi)
            y.backward(dy.double().contiguous() if exact else dy)
            runs.append([t.detach().double() for t in (y, xi.grad, wi.grad)])
            del y, xi, wi
        exact = runs[0]
        cells = [" / ".join(f"{((g - e).abs().max() / e.abs().max()).item():.1e}"
                            for g, e in zip(run, exact)) for run in runs[1:]]
        layout = "channels_last" if channels_last else "contiguous"
        print(f"{name:18s} {str(shape):20s} {layout:14s} {cells[0]:>26s} {cells[1]:>26s}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--long", action="store_true", help="long rows, planes and channels")
    parser.add_argument("--gpu-interpreter", type=int, metavar="SMS",
                        help="with --long: the GPU kernels in Triton's interpreter")
    parser.add_argument("--cases", type=int, nargs="+", help="with --long: these cases "
                        "only (0-based)")
    opts = parser.parse_args(argv)
    if opts.gpu_interpreter and os.environ.get("TRITON_INTERPRET") != "1":
        # (read when triton is first imported: a process of its own)
        os.execve(sys.executable, [sys.executable] + sys.argv,
                  dict(os.environ, TRITON_INTERPRET="1"))
    torch.set_num_threads(opts.threads)
    gen = torch.Generator().manual_seed(0)
    if opts.long:
        label = "normkit"
        if opts.gpu_interpreter:
            _on_interpreted_gpu(opts.gpu_interpreter)
            label = f"GPU kernels ({opts.gpu_interpreter} SMs)"
        _long(gen, opts.cases, label)
        return
    print(f"{'op':18s} {'layout':14s} {'data':12s} {'normkit max/rms':>16s} "
          f"{'torch max/rms':>16s}")
    for name, shape, fn, (w, b), unit_first in _ops(gen):
        layouts = ("contiguous", "channels_last") if len(shape) == 4 else ("contiguous",)
        for layout in layouts:
            for kind in ("centred", "offset 1000", "outlier first"):
                x = _data(shape, kind, gen, unit_first)
                if layout == "channels_last":
                    x = x.to(memory_format=torch.channels_last)
                exact = fn(F, x.double(), w.double(), b.double())
                cells = [_units(fn(f, x, w, b), exact) for f in (NF, F)]
                print(f"{name:18s} {layout:14s} {kind:12s} "
                      + " ".join(f"{m:8.1f}/{r:7.2f}" for m, r in cells))


if __name__ == "__main__":
    main()
