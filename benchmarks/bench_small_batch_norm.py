"""Per-call cost of small BatchNorm calls (BatchNorm1d on (N, C), BatchNorm2d on
channels_last and on NCHW), normkit against torch.nn, one thread.

Prints, per input and dtype, the best of ``--repeats`` rounds of ``--calls`` calls of the
calling thread's CPU time (``time.thread_time``) in microseconds: forward without grad,
and forward + backward in training. ``--eval``: eval forward on ``--threads`` threads
(wall time: the other threads work too) at the NCHW shapes of a small CNN, the
executor's threaded eval loop. The figures of docs/performance.md ("Tried and left",
"BatchNorm fused with its activation": against 9222a10) come from it, run once per
checkout with ``PYTHONPATH=<checkout>/src``, the checkouts taking turns.

    PYTHONPATH=src python benchmarks/bench_small_batch_norm.py [--calls 300] [--repeats 9]
    PYTHONPATH=src python benchmarks/bench_small_batch_norm.py --eval --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

import normkit.nn as nknn
from normkit.bench.models import per_call_us    # best round of the thread's CPU time

CASES = [((64, 128), False), ((256, 512), False), ((8, 64, 8, 8), True), ((8, 64, 8, 8), False),
         ((8, 64, 32, 32), False)]
EVAL_CASES = [(32, 32, 8, 8), (64, 32, 8, 8), (32, 64, 8, 8)]


def eval_calls(args):
    torch.set_num_threads(args.threads)
    print(f"input,library,eval_forward_us ({args.threads} threads, wall time)")
    for shape in EVAL_CASES:
        x = torch.randn(shape)
        for name, lib in (("normkit", nknn), ("torch", torch.nn)):
            layer = lib.BatchNorm2d(shape[1]).eval()
            with torch.no_grad():
                us = per_call_us(lambda: layer(x), args.calls, args.repeats, time.perf_counter)
            print(f"{'x'.join(map(str, shape))},{name},{us:.1f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--eval", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.eval:
        return eval_calls(args)
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
