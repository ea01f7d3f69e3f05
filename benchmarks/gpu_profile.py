"""Where the time of normkit's GPU calls goes: per case, the wall time of one call (host
bound or device bound?), the device time of each kernel it launches (torch.profiler), and
torch's call beside it. ``--host``: instead, the first call that waits for the device
(``torch.cuda.set_sync_debug_mode``, with its stack) and the host's Python profile.
A diagnostic for a GPU machine, not part of the tests.

    python benchmarks/gpu_profile.py [--calls 20] [--host] > profile.txt
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
import traceback

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import normkit.functional as NF

CASES = [  # op, shape, dtype, layout, mode
    ("batch_norm", (32, 256, 56, 56), torch.float32, "contiguous", "fwd"),
    ("batch_norm", (32, 256, 56, 56), torch.float32, "contiguous", "fwd+bwd"),
    ("batch_norm", (32, 256, 56, 56), torch.float32, "channels_last", "fwd"),
    ("group_norm", (32, 256, 56, 56), torch.float32, "contiguous", "fwd"),
    ("group_norm", (32, 256, 56, 56), torch.float32, "contiguous", "fwd+bwd"),
    ("batch_norm", (8, 64, 8, 8), torch.float32, "contiguous", "fwd+bwd"),
    ("instance_norm", (32, 256, 56, 56), torch.bfloat16, "contiguous", "fwd"),
    ("layer_norm", (8192, 4096), torch.float32, "contiguous", "fwd"),
    ("layer_norm", (8192, 4096), torch.bfloat16, "contiguous", "fwd"),
    ("layer_norm", (32768, 768), torch.float32, "contiguous", "fwd+bwd"),
    ("rms_norm", (32768, 768), torch.float32, "contiguous", "fwd"),
    ("rms_norm", (8192, 4096), torch.bfloat16, "contiguous", "fwd+bwd"),
]


def make(op, shape, dtype, layout, mode, lib):
    x = torch.randn(shape, device="cuda", dtype=dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    c = shape[-1] if op in ("layer_norm", "rms_norm") else shape[1]
    w = torch.randn(c, device="cuda", dtype=dtype, requires_grad=mode != "fwd")
    b = torch.randn(c, device="cuda", dtype=dtype, requires_grad=mode != "fwd")
    rm, rv = torch.zeros(c, device="cuda", dtype=dtype), torch.ones(c, device="cuda", dtype=dtype)
    f = {"layer_norm": lambda x: lib.layer_norm(x, (c,), w, b),
         "rms_norm": lambda x: lib.rms_norm(x, (c,), w),
         "group_norm": lambda x: lib.group_norm(x, 32, w, b),
         "batch_norm": lambda x: lib.batch_norm(x, rm, rv, w, b, training=True),
         "instance_norm": lambda x: lib.instance_norm(x, weight=w, bias=b)}[op]
    if mode == "fwd":
        return lambda: f(x)
    xg = x.detach().clone().requires_grad_(True)
    dy = torch.randn_like(x)

    def run():
        xg.grad = w.grad = b.grad = None
        f(xg).backward(dy)
    return run


def measure(fn, calls):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6                # launch-side us per call
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / calls * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [(e.key, getattr(e, "device_time_total", 0) / calls, e.count // calls)
               for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0]
    kernels.sort(key=lambda k: -k[1])
    return host, wall, kernels


def host_profile(fn, calls):
    """The first synchronizing call inside ``fn`` (with its stack), then cProfile."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        print("  no synchronizing call")
    except RuntimeError:
        print("  synchronizes:", "".join(traceback.format_exc().splitlines(True)[-14:]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--host", action="store_true")
    args = ap.parse_args()
    for case in CASES:
        if args.host:
            if case[0] in ("batch_norm", "layer_norm") and case[3] == "contiguous":
                print(f"== {case}")
                host_profile(make(*case, NF), args.calls)
            continue
        print(f"== {case[0]} {'x'.join(map(str, case[1]))} {str(case[2])[6:]} {case[3]} {case[4]}")
        for name, lib in (("normkit", NF), ("torch", F)):
            host, wall, kernels = measure(make(*case, lib), args.calls)
            dev = sum(k[1] for k in kernels)
            print(f"  {name:8s} wall {wall:8.1f} us/call, host {host:8.1f}, device {dev:8.1f} "
                  f"in {sum(k[2] for k in kernels)} kernels")
            for key, us, n in kernels[:8]:
                print(f"      {us:8.1f} us  x{n}  {key[:90]}")


if __name__ == "__main__":
    main()
