"""Registers and spills of the GPU kernels' compiled specializations (for
``benchmarks/gpu_check.py``), two ways:

``loaded()``        the kernels this process has compiled and run on a GPU: Triton's
                    ``CompiledKernel.n_regs`` / ``n_spills`` (empty in the interpreter);
``compile_sm90()``  here, without a GPU: each launch compiled by Triton for sm_90a instead
                    (a stand-in driver that names the target, ``JITFunction.run(...,
                    warmup=True)``: compile, no launch), registers and local memory read
                    from the cubin by ``cuobjdump --dump-resource-usage`` (Triton's own).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import types


def _constexprs(fn, k):
    consts = getattr(getattr(k, "src", None), "constants", None) or {}
    return {fn.arg_names[i[0]] if isinstance(i, tuple) and len(i) == 1
            and isinstance(i[0], int) else str(i): v for i, v in consts.items()}


def _dtype(k):
    sig = getattr(getattr(k, "src", None), "signature", None) or {}
    return next((str(v)[1:] for v in sig.values() if str(v).startswith("*")), None)


def _kernels():
    import triton

    from normkit.backends import _gpu_kernels as K

    return K, {n: getattr(K, n) for n in dir(K)
               if isinstance(getattr(K, n), triton.runtime.jit.JITFunction)}


def loaded():
    """Every compiled specialization of the GPU kernels in this process: kernel, first
    pointer's dtype, constexprs, warps, stages, registers per thread, bytes spilled."""
    found = []
    for name, fn in _kernels()[1].items():
        for cache in getattr(fn, "device_caches", {}).values():
            kernels = cache[0] if isinstance(cache, tuple) else cache
            for key, k in kernels.items():
                meta = getattr(k, "metadata", None)
                found.append({"kernel": name, "dtype": _dtype(k),
                              "constexprs": str(_constexprs(fn, k) or key)[:300],
                              "num_warps": getattr(meta, "num_warps", None),
                              "num_stages": getattr(meta, "num_stages", None),
                              "n_regs": getattr(k, "n_regs", None),
                              "n_spills": getattr(k, "n_spills", None)})
    return found


def unique(regs):
    seen = {}
    for r in regs:
        seen[(r["kernel"], r["dtype"], r["constexprs"], r["num_warps"])] = r
    return list(seen.values())


def compile_sm90(gpu, runs):
    """Run each ``(label, thunk)`` of ``runs`` with the launches of the GPU backend
    ``gpu`` compiled for sm_90a instead; returns (registers of every specialization,
    ``[(label, error)]`` of the runs that failed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    K, fns = _kernels()
    compiled = {}

    class Sm90:                                    # what Triton asks of the driver
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    class Compile:                                 # kernel[grid](...): compile, no launch
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                k = fns[self.name].run(*args, grid=grid, warmup=True, **kwargs)
                compiled[(self.name, k.hash)] = k
                return k
            return run

    before = driver._active                       # None until a GPU driver was asked for
    driver.set_active(Sm90())
    gpu._kernels = types.SimpleNamespace(**{n: Compile(n) for n in fns if n.endswith("_kernel")})
    failed = []
    try:
        for label, thunk in runs:
            try:
                thunk()
            except Exception as e:                 # report every case
                failed.append((label, f"{type(e).__name__}: {e}"[:300]))
    finally:
        gpu._kernels = None
        driver.set_active(before)
    tool = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "cuobjdump")
    regs = []
    for (name, _), k in sorted(compiled.items(), key=lambda kv: kv[0][0]):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            usage = subprocess.run([tool, "--dump-resource-usage", f.name],
                                   capture_output=True, text=True).stdout
        fields = dict(kv.split(":", 1) for kv in usage.split() if ":" in kv and kv[0].isupper())
        regs.append({"kernel": name, "dtype": _dtype(k), "constexprs": _constexprs(fns[name], k),
                     "num_warps": k.metadata.num_warps, "num_stages": k.metadata.num_stages,
                     "n_regs": int(fields.get("REG", -1)),
                     "local_bytes": int(fields.get("LOCAL", -1))})
    return regs, failed


__all__ = ["loaded", "unique", "compile_sm90"]
