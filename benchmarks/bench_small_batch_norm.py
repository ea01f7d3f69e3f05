"""Per-call cost of small BatchNorm calls on rows of channels (BatchNorm1d on (N, C), and
BatchNorm2d on channels_last), normkit against torch.nn, one thread.

Prints, per input and dtype, the best of ``--repeats`` rounds of ``--calls`` calls of the
calling thread's CPU time (``time.thread_time``) in microseconds: forward without grad,
and forward + backward in training. The figures of docs/performance.md ("Tried and left:
BatchNorm on rows of channels in the per-(n, c) family") come from it, run once per
checkout with ``PYTHONPATH=<checkout>/src``, the checkouts taking turns.

    PYTHONPATH=src python benchmarks/bench_small_batch_norm.py [--calls 300] [--repeats 9]
"""

from __future__ import annotations

import argparse

import torch

import normkit.nn as nknn
from normkit.bench.models import per_call_us    # best round of the thread's CPU time

CASES = [((64, 128), False), ((256, 512), False), ((8, 64, 8, 8), True)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("input,dtype,library,forward_us,forward_backward_us")
    for shape, channels_last in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(shape, dtype=dtype)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            xg, dy = x.clone().requires_grad_(True), torch.randn_like(x)
            for name, lib in (("normkit", nknn), ("torch", torch.nn)):
                layer = (lib.BatchNorm2d if len(shape) == 4 else lib.BatchNorm1d)(shape[1])
                layer = layer.to(dtype)
                with torch.no_grad():
                    fwd = per_call_us(lambda: layer(x), args.calls, args.repeats)
                both = per_call_us(lambda: layer(xg).backward(dy), args.calls, args.repeats)
                label = "x".join(map(str, shape)) + (" channels_last" if channels_last else "")
                print(f"{label},{str(dtype)[6:]},{name},{fwd:.1f},{both:.1f}")


if __name__ == "__main__":
    main()
