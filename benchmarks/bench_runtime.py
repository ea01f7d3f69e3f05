"""The runtime measurements behind docs/performance.md, outside the kernels themselves:
`python benchmarks/bench_runtime.py` (2 threads; about a minute).

1. launcher: LayerNorm forward 8192x4096 fp32 right after a torch ``copy_``, its ranges on
   torch's OpenMP team and on normkit's fallback thread pool; and the launch cost of a
   small threaded call.
2. huge pages: the same LayerNorm forward with a fresh output (default allocator), with
   and without the MADV_HUGEPAGE advice, and torch's.
3. the floor: ``y = x * w + b`` as a numba row loop and as torch's ``addcmul``, against
   ``copy_``; and two forward kernels with their output written by plain stores and
   streamed (non-temporal stores, what ``cpu.tuning.stream_out`` picks for large fp32 outputs).
4. accuracy: GroupNorm / BatchNorm of fp32 data with mean 1e3 and 1e4 and unit spread,
   torch and normkit, max |error| against float64.
5. first call: a new process with an empty numba cache, then with the cache filled.

Medians of interleaved repeats; the VM's memory timings move 10-40 % between runs.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit

import normkit.functional as NF
from normkit.backends import _memory, _parallel
from normkit.backends.cpu import planes, rows, tuning


def _median_ms(fns, repeats=15, before=None):
    """Median ms of each callable, interleaved; ``before`` runs untimed before each."""
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            if before is not None:
                before()
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def _with_pool(fn):
    """``fn`` run with the launcher's OpenMP path switched off (the fallback pool)."""
    def run():
        omp, _parallel._OMP = _parallel._OMP, None
        try:
            fn()
        finally:
            _parallel._OMP = omp
    return run


def launcher():
    x, w = torch.randn(8192, 4096), torch.randn(4096)
    dst = torch.empty_like(x)
    y, stats = torch.empty_like(x), [torch.empty(8192) for _ in range(3)]
    args = [a.numpy() for a in (x, y, w, w)] + [1e-5, True, tuple(s.numpy() for s in stats),
                                               (tuning.stream_out(y), tuning.rows_ahead(4096, 4))]

    def kernel():
        _parallel.launch(rows.rows_forward, 8192, 2, *args)
    ms = _median_ms({"team": kernel, "pool": _with_pool(kernel)}, before=lambda: dst.copy_(x))
    print(f"1. LayerNorm fwd 8192x4096 right after a torch copy_: torch's OpenMP team "
          f"{ms['team']:.1f} ms, normkit's pool {ms['pool']:.1f} ms "
          f"(launcher: {_parallel.backend()})")
    xs = torch.randn(64, 1024)
    ys, small = torch.empty_like(xs), [torch.empty(64) for _ in range(3)]
    sargs = [a.numpy() for a in (xs, ys, w[:1024], w[:1024])] + [
        1e-5, True, tuple(s.numpy() for s in small),
        (tuning.stream_out(ys), tuning.rows_ahead(1024, 4))]

    def small_call():
        _parallel.launch(rows.rows_forward, 64, 2, *sargs)
    us = _median_ms({"team": small_call, "pool": _with_pool(small_call)}, repeats=200)
    print(f"   launch of a small threaded call (64x1024): team {us['team'] * 1e3:.0f} us, "
          f"pool {us['pool'] * 1e3:.0f} us")


def huge_pages():
    x, w = torch.randn(8192, 4096), torch.randn(4096)

    def no_advice():
        advise, _memory._MADVISE = _memory._MADVISE, None
        try:
            NF.layer_norm(x, (4096,), w, w)
        finally:
            _memory._MADVISE = advise
    ms = _median_ms({"advised": lambda: NF.layer_norm(x, (4096,), w, w),
                     "not advised": no_advice,
                     "torch": lambda: F.layer_norm(x, (4096,), w, w)})
    print(f"2. LayerNorm fwd 8192x4096, fresh output, {os.environ.get('MALLOC_MMAP_MAX_') and 'MALLOC_MMAP_MAX_ set' or 'default allocator'}"
          f" (huge pages advised here: {_memory.huge_pages_advised()}): "
          + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()))


@njit(nogil=True)
def _axpy_rows(x, y, w, b, lo, hi):
    for r in range(lo, hi):
        xr, yr = x[r], y[r]
        for i in range(xr.shape[0]):
            yr[i] = xr[i] * w[i] + b[i]


def floor():
    for shape in ((8192, 4096), (32768, 768)):
        x, w, b = torch.randn(shape), torch.randn(shape[1]), torch.randn(shape[1])
        y = torch.empty_like(x)
        a = (x.numpy(), y.numpy(), w.numpy(), b.numpy())
        ms = _median_ms({"copy": lambda: y.copy_(x),
                         "numba": lambda: _parallel.launch(_axpy_rows, shape[0], 2, *a),
                         "addcmul": lambda: torch.addcmul(b, x, w, out=y)})
        print(f"3. y = x * w + b, {shape[0]}x{shape[1]} fp32: numba {ms['numba'] / ms['copy']:.2f}"
              f" x copy, torch addcmul {ms['addcmul'] / ms['copy']:.2f} x copy")


def streaming():
    x = torch.randn(8192, 4096)
    y, stats = torch.empty_like(x), tuple(torch.empty(8192).numpy() for _ in range(3))
    w = torch.ones(4096).numpy()
    x4 = torch.randn(32, 256, 56, 56)
    y4, gs = torch.empty_like(x4), tuple(torch.empty(32 * 32).numpy() for _ in range(3))
    w4 = torch.ones(256).numpy()
    kernels = {   # name: (run(stream), the output, the input)
        "LayerNorm fwd 8192x4096": (lambda stream: _parallel.launch(
            rows.rows_forward, 8192, 2, x.numpy(), y.numpy(), w, w, 1e-5, True, stats,
            (stream, tuning.rows_ahead(4096, 4))), y, x),
        "GroupNorm fwd 32x256x56x56": (lambda stream: _parallel.launch(
            planes.planes_forward, 32 * 32, 2, x4.view(32, 256, -1).numpy(),
            y4.view(32, 256, -1).numpy(), w4, w4, 1e-5, 32, False, gs,
            (stream, tuning.rows_ahead(56 * 56, 4))), y4, x4),
    }
    for name, (run, out, inp) in kernels.items():
        ms = _median_ms({"copy": lambda: out.copy_(inp), "plain": lambda: run(False),
                         "streamed": lambda: run(True)})
        print(f"   {name} fp32: plain stores {ms['plain'] / ms['copy']:.2f} x copy, "
              f"streamed {ms['streamed'] / ms['copy']:.2f} x copy ({ms['plain']:.1f} -> "
              f"{ms['streamed']:.1f} ms)")


def accuracy():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(4, 64, 28, 28, generator=gen, dtype=torch.float64)
    for offset in (1e3, 1e4):
        for layout in (torch.contiguous_format, torch.channels_last):
            x = (base + offset).float().contiguous(memory_format=layout)
            x64 = x.double()
            cases = {"GroupNorm": (lambda m, t: m.group_norm(t, 8)),
                     "BatchNorm": (lambda m, t: m.batch_norm(t, None, None, training=True))}
            parts = []
            for name, op in cases.items():
                want = op(F, x64)
                errs = [(op(m, x).double() - want).abs().max().item() for m in (F, NF)]
                parts.append(f"{name} torch {errs[0]:.1e} normkit {errs[1]:.1e}")
            lay = "channels_last" if layout is torch.channels_last else "contiguous"
            print(f"4. mean {offset:g}, {lay}: " + "; ".join(parts))


def first_call():
    script = textwrap.dedent("""
        import time
        t0 = time.perf_counter()
        import torch, normkit.functional as NF
        t1 = time.perf_counter()
        NF.layer_norm(torch.randn(64, 256, requires_grad=True), (256,)).sum().backward()
        t2 = time.perf_counter()
        xb = torch.randn(4, 8, 5, 5, requires_grad=True)
        NF.batch_norm(xb, None, None, training=True).sum().backward()
        t3 = time.perf_counter()
        NF.layer_norm(torch.randn(64, 256).bfloat16(), (256,))
        t4 = time.perf_counter()
        print(f"import {t1 - t0:.2f} s, layer_norm fwd+bwd fp32 {t2 - t1:.2f} s, "
              f"then batch_norm fwd+bwd fp32 {t3 - t2:.2f} s, then layer_norm fwd bf16 "
              f"{t4 - t3:.2f} s")
    """)
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        for label in ("empty cache", "cache filled"):
            out = subprocess.run([sys.executable, "-c", script], env=env, check=True,
                                 capture_output=True, text=True).stdout.strip()
            print(f"5. first calls, {label}: {out}")


if __name__ == "__main__":
    torch.set_num_threads(2)
    np.random.seed(0)
    launcher()
    huge_pages()
    floor()
    streaming()
    accuracy()
    first_call()
