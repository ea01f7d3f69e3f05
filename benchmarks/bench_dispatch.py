"""Per-call cost of a small normalization in eager mode: the dispatcher and Python
overhead around the kernels (``docs/performance.md``, "Registered operators").

Times LayerNorm on (4, 64) and BatchNorm2d (training) on (8, 64, 8, 8), fp32, one
thread, forward without grad and forward + backward with grad, for normkit and torch.nn;
prints the fastest of ``--repeats`` rounds of the calling thread's CPU time
(``time.thread_time``: on a shared machine, wall time mostly measures the neighbours) in microseconds per call as CSV.

    PYTHONPATH=src python benchmarks/bench_dispatch.py [--calls 200] [--repeats 25] [--composite]
"""

from __future__ import annotations

import argparse
import time

import torch

import normkit.nn as nknn


def per_call_us(fn, calls: int, repeats: int) -> float:
    for _ in range(calls // 10 + 10):
        fn()
    rounds = []
    for _ in range(repeats):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        rounds.append((time.thread_time() - t0) / calls * 1e6)
    return min(rounds)


def cases():
    x_ln, x_bn = torch.randn(4, 64), torch.randn(8, 64, 8, 8)
    for name, make, x in (("LayerNorm (4, 64)", lambda m: m.LayerNorm(64), x_ln),
                          ("BatchNorm2d (8, 64, 8, 8)", lambda m: m.BatchNorm2d(64), x_bn)):
        for lib, mod in (("normkit", nknn), ("torch", torch.nn)):
            layer = make(mod)
            xg = x.clone().requires_grad_()

            def fwd(layer=layer, x=x):
                with torch.no_grad():
                    layer(x)

            def fwd_bwd(layer=layer, xg=xg):
                layer(xg).sum().backward()

            yield name, lib, "forward, no grad", fwd
            yield name, lib, "forward + backward", fwd_bwd


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--composite", action="store_true",
                        help="run normkit on its composite torch-op backend (no numba): the "
                             "same small kernels as torch, so the difference between two "
                             "versions is their Python and dispatcher overhead")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.composite:
        from normkit import backends

        backends._loaded = ()  # no optional backend: every call runs torch_ops
    print("case,library,pass,us_per_call")
    for name, lib, kind, fn in cases():
        print(f"{name},{lib},{kind},{per_call_us(fn, args.calls, args.repeats):.1f}")


if __name__ == "__main__":
    main()
