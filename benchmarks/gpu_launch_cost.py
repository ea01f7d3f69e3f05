"""The host cost of one Triton launch, three ways, on a GPU machine (docs/gpu.md, "First GPU
run": normkit's CUDA calls are bound by it). For LayerNorm forward on a small (64, 4096)
fp32 tensor, so that the device is idle and the host's pace is what is timed:

* ``normkit``  ``normkit.functional.layer_norm`` (the dispatch, then the launch);
* ``launch``   ``_rows_fwd_kernel[grid](...)``, Triton's usual path (``JITFunction.run``:
               argument binding, specialization, cache key, launcher);
* ``direct``   the compiled kernel that the first launch returned, called through its
               launcher with the same arguments (``CompiledKernel.run``): what a cache of
               compiled kernels per specialization would do;
* ``torch``    ``torch.nn.functional.layer_norm``.

Each row: microseconds of host time per call (best of 5 rounds of 500 calls) and whether
its output equals the ``launch`` output bit for bit. ``CompiledKernel.run``'s signature is
Triton's internal API (checked against triton 3.6-3.9 sources, not yet run on a GPU).

    python benchmarks/gpu_launch_cost.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import normkit.functional as NF
from normkit.backends import _gpu_kernels as K
from normkit.backends import gpu


def host_us(fn, calls=500, rounds=5):
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def main():
    m, k = 64, 4096
    x = torch.randn(m, k, device="cuda")
    w, b = torch.randn(k, device="cuda"), torch.randn(k, device="cuda")
    y = torch.empty_like(x)
    mean, rstd, var = (torch.empty(m, device="cuda") for _ in range(3))
    block, single = gpu._row_block(k)
    args = (x, x, x, y, w, b, mean, rstd, var, m, k, k, 1e-5)
    consts = dict(HAS_RES=False, HAS_W=True, HAS_B=True, CENTER=True, SINGLE=single,
                  BLOCK=block, ROWS=gpu._rows_per_program(k, block), X0_MEAN=gpu.X0_MEAN)
    warps = gpu._warps(block)

    def launch():
        return K._rows_fwd_kernel[(m,)](*args, **consts, num_warps=warps)

    compiled = launch()
    torch.cuda.synchronize()
    expected = y.clone()
    stream = torch.cuda.current_stream().cuda_stream
    everything = (*args, *consts.values())          # every parameter, in the kernel's order

    def direct():
        compiled.run(m, 1, 1, stream, compiled.function, compiled.packed_metadata, None,
                     None, None, *everything)

    rows = {"normkit": lambda: NF.layer_norm(x, (k,), w, b), "launch": launch,
            "direct": direct, "torch": lambda: F.layer_norm(x, (k,), w, b)}
    for name, fn in rows.items():
        y.zero_()
        try:
            us = host_us(fn)
        except Exception as e:                          # the internal API may have moved
            print(f"{name:8s} failed: {type(e).__name__}: {e}"[:300])
            continue
        out = fn() if name in ("normkit", "torch") else (fn(), y)[1]
        torch.cuda.synchronize()
        same = torch.equal(out, expected)
        print(f"{name:8s} {us:8.1f} us/call host   output equal to launch's: {same}")


if __name__ == "__main__":
    main()
