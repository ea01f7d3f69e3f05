"""Where a threaded call starts to pay: ``tuning.SERIAL_BELOW``, measured.

``python benchmarks/bench_serial_threshold.py [--threads 2] [--repeats 7]`` (about two
minutes). For inputs of 2^14 .. 2^20 float32 elements, each call on one thread (the
threshold above the size) and split over torch's threads (the threshold at 0), in
microseconds per call, the best of interleaved repeats (the C++ node's threads where it
builds, else the Python launch's, ``tuning.SERIAL_BELOW``): BatchNorm2d / GroupNorm(8) on
(N, 64, 8, 8), LayerNorm / RMSNorm on (M, 256); ``fb``: forward and backward.
The figures are in docs/performance.md ("Threads").
"""

from __future__ import annotations

import argparse
import time

import torch

import normkit.functional as F
from normkit import backends
from normkit.backends.cpu import tuning


def _calls(elements):
    n = elements // (64 * 64)
    m = elements // 256
    x4 = torch.randn(n, 64, 8, 8)
    x2 = torch.randn(m, 256)
    w64, b64, w256, b256 = (torch.rand(64), torch.randn(64), torch.rand(256), torch.randn(256))
    rm, rv = torch.zeros(64), torch.ones(64)
    g4, g2 = torch.randn_like(x4), torch.randn_like(x2)

    def fb(fn, x, g, *params):
        xr = x.detach().requires_grad_(True)
        ps = [p.detach().requires_grad_(True) for p in params]
        fn(xr, *ps).backward(g)

    return {
        "BN eval fwd": lambda: F.batch_norm(x4, rm, rv, w64, b64, False),
        "BN train fwd": lambda: F.batch_norm(x4, None, None, w64, b64, True),
        "BN train fb": lambda: fb(lambda x, w, b: F.batch_norm(x, None, None, w, b, True),
                                  x4, g4, w64, b64),
        "GN fwd": lambda: F.group_norm(x4, 8, w64, b64),
        "GN fb": lambda: fb(lambda x, w, b: F.group_norm(x, 8, w, b), x4, g4, w64, b64),
        "LN fwd": lambda: F.layer_norm(x2, (256,), w256, b256),
        "LN fb": lambda: fb(lambda x, w, b: F.layer_norm(x, (256,), w, b), x2, g2, w256, b256),
        "RMS fb": lambda: fb(lambda x, w: F.rms_norm(x, (256,), w), x2, g2, w256),
    }


def _per_call(fn, seconds=0.02):
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e6


def measure(sizes, repeats):
    """{(elements, call): (serial us, threaded us)}, the best of ``repeats`` each."""
    best = {}
    for elements in sizes:
        calls = _calls(elements)
        for _ in range(repeats):
            for below, side in ((elements + 1, 0), (0, 1)):
                tuning.SERIAL_BELOW = below
                backends.clear_plans()
                with torch.no_grad():
                    for name in ("BN eval fwd", "BN train fwd", "GN fwd", "LN fwd"):
                        us = _per_call(calls[name])
                        key = (elements, name)
                        pair = best.setdefault(key, [float("inf")] * 2)
                        pair[side] = min(pair[side], us)
                for name in ("BN train fb", "GN fb", "LN fb", "RMS fb"):
                    us = _per_call(calls[name])
                    pair = best.setdefault((elements, name), [float("inf")] * 2)
                    pair[side] = min(pair[side], us)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    saved = tuning.SERIAL_BELOW
    sizes = [1 << p for p in range(14, 21)]
    try:
        best = measure(sizes, args.repeats)
    finally:
        tuning.SERIAL_BELOW = saved
        backends.clear_plans()
    names = list(_calls(1 << 14))
    print(f"us per call, fp32, {args.threads} threads, best of {args.repeats}: "
          "serial / threaded")
    print("| elements | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for elements in sizes:
        cells = [f"{best[(elements, n)][0]:.0f} / {best[(elements, n)][1]:.0f}" for n in names]
        print(f"| 2^{elements.bit_length() - 1} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
