"""LayerNorm over short rows (K = 8 ... 256 elements): normkit's layer against torch.nn's,
in cache (2^18 elements, one thread) and from memory (2^25 elements, 2 threads, the
no-mmap allocator's conditions are the caller's), forward without grad and backward
alone, best of 7 rounds, ratio normkit / torch (docs/performance.md, "Short rows";
``tuning.SMALL_ROW``).

    python benchmarks/bench_short_rows.py [--ks 8 16 32 64 128 256]
"""

from __future__ import annotations

import argparse
import time

import torch

import normkit.nn as nknn
from normkit.bench.models import per_call_us


def _ms(fn, calls):
    return per_call_us(fn, calls, 7, clock=time.perf_counter) / 1e3     # best of 7 rounds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ks", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    opts = ap.parse_args(argv)
    print("K,where,fwd normkit/torch (ms),bwd normkit/torch (ms)")
    for where, numel, threads, calls in (("cache", 1 << 18, 1, 20), ("memory", 1 << 25, 2, 3)):
        torch.set_num_threads(threads)
        for k in opts.ks:
            x = torch.randn(numel // k, k, requires_grad=True)
            gy = torch.randn(numel // k, k)
            fwd, bwd = [], []
            for layer in (nknn.LayerNorm(k), torch.nn.LayerNorm(k)):
                with torch.no_grad():
                    fwd.append(_ms(lambda: layer(x), calls))
                y = layer(x)
                bwd.append(_ms(lambda: y.backward(gy, retain_graph=True), calls))
            print(f"{k},{where},{fwd[0] / fwd[1]:.2f} ({fwd[0]:.2f}/{fwd[1]:.2f}),"
                  f"{bwd[0] / bwd[1]:.2f} ({bwd[0]:.2f}/{bwd[1]:.2f})", flush=True)


if __name__ == "__main__":
    main()
