"""The Python stages of ``benchmarks/gpu_check.sh``: one GPU check of at most 8 minutes.

    python benchmarks/gpu_check.py STAGE OUT [--dry-run] [--workers N] [--only TEXT]

``correct``  the CUDA ops at real shapes against float64 from the same inputs, beside
             torch's own error (LayerNorm / RMSNorm / add+norm at (4096, 4096), (4096,
             8192), (2048, 16384) in bf16/fp16/fp32, forward and backward; Batch, eval
             Batch, Group and InstanceNorm at CNN shapes, NCHW and channels_last); a
             LayerNorm over 2^31 elements; dtypes under autocast against torch's; CUDA-graph
             capture of forward and backward. Cases in N processes (Triton compiles per process).
``bench``    device-only time (``triton.testing.do_bench_cudagraph``) of normkit, torch and
             Liger-Kernel as GB/s and as a fraction of ``copy_``'s; host time per call;
             A/B of each kernel switch of ``normkit.backends.gpu`` (both sides, outputs
             compared); registers and spills of each compiled specialization.
``compile``  here, without a GPU: every specialization the other stages launch, compiled
             for sm_90a (``gpu_registers.compile_sm90``; the cases whose label holds
             ``--only``'s text).

Each stage writes ``OUT/STAGE.json`` and appends its summary to ``OUT/summary.txt``.
``--dry-run``: the same code on the CPU, tiny shapes, Triton's interpreter (set here
before triton is imported), the GPU backend taking CPU tensors; graphs and the 2^31 case
are skipped, times are wall-clock. ``tests/test_gpu_check.py`` runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gpu_registers  # noqa: E402
import normkit.functional as NF  # noqa: E402
from normkit import backends  # noqa: E402
from normkit.backends import gpu  # noqa: E402

DEV = "cpu" if DRY or "compile" in sys.argv[1:2] else "cuda"
EMPTY = not DRY and DEV == "cpu"                 # compile stage: shapes only, no values
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
ROW_SHAPES = [(5, 40), (3, 300), (2, 1000)] if DRY else [(4096, 4096), (4096, 8192),
                                                         (2048, 16384)]
BATCH = (2, 4, 5, 5) if DRY else (32, 256, 56, 56)
GROUP = (2, 8, 4, 4) if DRY else (2, 320, 64, 64)
INSTANCE = (2, 3, 5, 5) if DRY else (8, 256, 56, 56)
QK = (40, 16) if DRY else (65536, 128)          # per-head q/k norm rows
BIG = (4, 64) if DRY else (1 << 19, 1 << 12)    # 2^31 elements
# error floor per dtype, relative to the reference's largest magnitude
FLOOR = {F32: 2e-5, BF16: 1.6e-2, F16: 2e-3}
SWITCHES = {"STAGES": 1, "X0_MEAN": False, "LANES": False, "SMALL_ROW": 0,
            "OCCUPANCY": False}


def _accept_cpu_tensors():
    """Dry run and compile stage: let the dispatch hand CPU tensors to the GPU backend,
    as ``tests/_triton_interp_check.py`` does; in the dry run row blocks are shrunk so
    that the loops over blocks run."""
    real = gpu.supports

    class OnCuda:
        def __init__(self, t):
            self._t = t

        def __getattr__(self, name):
            return getattr(self._t, name)

        device = torch.device("cuda")

    if getattr(real, "cpu_too", False):
        return
    backends._loaded = (gpu,)
    gpu.supports = lambda x, *args: real(OnCuda(x), *args)
    gpu.supports.cpu_too = True
    if DRY:
        gpu.ROW_BLOCK_MAX = 512


def _rand(shape, dtype, seed, layout="contiguous", scale=1.0, offset=0.0):
    if EMPTY:
        x = torch.zeros(shape, dtype=dtype) + offset
    else:
        gen = torch.Generator(DEV).manual_seed(seed)
        x = (torch.randn(shape, generator=gen, device=DEV) * scale + offset).to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else x


# -- ops: each (lib, x, extra, params) -> output(s) ------------------------------------------

def _op(name, lib, x, params, extra):
    w, b = params
    c = x.shape[-1] if name in ("layer_norm", "rms_norm", "add_layer_norm",
                                "add_rms_norm") else x.shape[1]
    if name == "layer_norm":
        return lib.layer_norm(x, (c,), w, b)
    if name == "rms_norm":
        return lib.rms_norm(x, (c,), w, 1e-6)
    if name in ("add_layer_norm", "add_rms_norm"):
        if lib is not NF:                                          # torch: x + r, then norm
            h = x + extra
            y = (F.layer_norm(h, (c,), w, b) if name == "add_layer_norm"
                 else F.rms_norm(h, (c,), w, 1e-6))
            return y
        return (NF.add_layer_norm(x, extra, (c,), w, b)[0] if name == "add_layer_norm"
                else NF.add_rms_norm(x, extra, (c,), w, 1e-6)[0])
    if name == "group_norm":
        return lib.group_norm(x, 32 if not DRY else 4, w, b)
    if name == "instance_norm":
        return lib.instance_norm(x, weight=w, bias=b)
    rm, rv = extra
    if name == "batch_norm_relu":                 # normkit fused, torch BatchNorm then ReLU
        return (NF.batch_norm_act(x, rm, rv, w, b, training=True, activation="relu")
                if lib is NF else F.relu(F.batch_norm(x, rm, rv, w, b, training=True)))
    return lib.batch_norm(x, rm, rv, w, b, training=name == "batch_norm")


def _inputs(name, shape, dtype, layout, seed=0):
    c = shape[-1] if name in ("layer_norm", "rms_norm", "add_layer_norm",
                              "add_rms_norm") else shape[1]
    x = _rand(shape, dtype, seed, layout, scale=2.0, offset=1.0)
    w = _rand((c,), dtype, seed + 1, offset=1.0)
    b = None if name in ("rms_norm", "add_rms_norm") else _rand((c,), dtype, seed + 2)
    if name.startswith("add_"):
        extra = _rand(shape, dtype, seed + 3, layout)
    elif name.startswith("batch_norm"):
        extra = (_rand((c,), dtype, seed + 4), _rand((c,), dtype, seed + 5).abs() + 0.5)
    else:
        extra = None
    return x, (w, b), extra


# -- correct ------------------------------------------------------------------------------------

def _errors(name, shape, dtype, layout, backward=True):
    """Largest error of normkit's and torch's output (and gradients) against float64
    from the same inputs, each relative to the reference's largest magnitude; a residual
    sum is rounded to the dtype first, as both compute it."""
    x, params, extra = _inputs(name, shape, dtype, layout)
    gy = _rand(shape, dtype, 9, layout)
    add = name.startswith("add_")

    def run(lib, ref):
        xi, ps, ex = x, params, extra
        if ref:
            xi = (x + extra).double() if add else x.double()
            ps = [None if p is None else p.double() for p in params]
            ex = torch.zeros_like(xi) if add else extra
        if isinstance(ex, tuple):                                  # running statistics
            ex = tuple(e.to(xi.dtype, copy=True) for e in ex)
        xi = xi.detach().requires_grad_(backward)
        ps = [None if p is None else p.detach().requires_grad_(backward) for p in ps]
        y = _op(name, lib, xi, ps, ex)
        outs = [y]
        if backward:
            outs += torch.autograd.grad((y.double() * gy.double()).sum(),
                                        [t for t in [xi] + ps if t is not None])
        return [o.detach().double() for o in outs]

    expected = run(F, True)
    res = {}
    for lib, key in ((NF, "normkit"), (F, "torch")):
        res[key] = [float((a - e).abs().max() / e.abs().max().clamp_min(1e-30))
                    for a, e in zip(run(lib, False), expected)]
    floor = FLOOR[dtype] * (4 if backward else 1)
    res["ok"] = all(n <= max(2 * t, floor) for n, t in zip(res["normkit"], res["torch"]))
    return res


def correct_cases():
    """``(label, name, shape, dtype, layout, backward)`` of the correctness stage."""
    cases = []
    for shape in ROW_SHAPES:
        for dtype in (BF16, F16, F32):
            for name in ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"):
                cases.append((name, shape, dtype, "contiguous", True))
    if DRY:                                        # a third: every op, shape and dtype
        cases = cases[::3]
    for dtype in (F32, BF16):
        for layout in ("contiguous", "channels_last"):
            cases.append(("batch_norm", BATCH, dtype, layout, True))
        cases.append(("batch_norm_eval", BATCH, dtype, "channels_last", True))
        cases.append(("batch_norm_relu", BATCH, dtype, "channels_last", True))
        cases.append(("group_norm", GROUP, dtype, "channels_last", True))
        cases.append(("instance_norm", INSTANCE, dtype, "contiguous", True))
    cases.append(("rms_norm", QK, BF16, "contiguous", True))
    return [(f"{n} {'x'.join(map(str, s))} {str(d)[6:]} {lay}", n, s, d, lay, bw)
            for n, s, d, lay, bw in cases]


def _run_cases(cases):
    """Run correctness cases in this process; ``[(label, result)]`` and the compiled
    kernels' registers."""
    if DRY:
        _accept_cpu_tensors()
    out = []
    for label, name, shape, dtype, layout, backward in cases:
        try:
            out.append((label, _errors(name, shape, dtype, layout, backward)))
        except Exception as e:                                     # report every case
            out.append((label, {"ok": False, "error": f"{type(e).__name__}: {e}"[:400],
                                "trace": traceback.format_exc(limit=4)[-1500:]}))
        if not DRY:
            torch.cuda.empty_cache()
    return out, gpu_registers.loaded()


def big_layer_norm():
    """One LayerNorm forward and backward over 2^31 elements (bf16): rows at both ends
    against float64, when the device has the memory (about 20 GiB)."""
    m, k = BIG
    if not DRY and torch.cuda.mem_get_info()[0] < 24 << 30:
        return {"skipped": "less than 24 GiB free"}
    x = _rand(BIG, BF16, 0).requires_grad_(True)
    w = _rand((k,), BF16, 1, offset=1.0).requires_grad_(True)
    y = NF.layer_norm(x, (k,), w, None)
    gy = torch.ones_like(y)
    (gx,) = torch.autograd.grad(y, [x], gy)
    y = y.detach()
    res = {"elements": m * k}
    for part, rows in (("first", slice(0, 8)), ("last", slice(m - 8, m))):
        xs = x.detach()[rows].double().requires_grad_(True)
        ry = F.layer_norm(xs, (k,), w.detach().double())
        (rgx,) = torch.autograd.grad(ry, [xs], gy[rows].double())
        res[part] = [float((y[rows].double() - ry.detach()).abs().max()),
                     float((gx[rows].double() - rgx).abs().max() / rgx.abs().max())]
    res["ok"] = all(e[0] < 0.05 and e[1] < 0.05 for e in (res["first"], res["last"]))
    return res


def autocast_dtypes():
    """Output dtype of each op under autocast (fp16 and bf16), normkit against torch;
    inputs fp16/bf16 (a conv's output), parameters fp32 (a model's)."""
    res, lib = {}, None
    if DRY:                    # the CUDA rule at the CPU key: the dtypes are not torch's
        from normkit import autocast
        lib = torch.library.Library("normkit", "IMPL")
        kernel = autocast.autocast_kernel("AutocastCPU", torch.ops.normkit.norm_forward.default)
        lib.impl("norm_forward", kernel, "AutocastCPU")
    try:
        for cast in (F16, BF16):
            for name, shape in (("layer_norm", ROW_SHAPES[0]), ("rms_norm", ROW_SHAPES[0]),
                                ("group_norm", GROUP), ("batch_norm", BATCH),
                                ("instance_norm", INSTANCE)):
                x, (w, b), extra = _inputs(name, shape, F32, "contiguous")
                got = []
                for lib_ in (NF, F):
                    try:
                        with torch.autocast(DEV, dtype=cast):
                            got.append(str(_op(name, lib_, x.to(cast), (w, b), extra).dtype))
                    except Exception as e:
                        got.append(f"{type(e).__name__}: {e}"[:200])
                res[f"{name} {str(cast)[6:]}"] = {"normkit": got[0], "torch": got[1],
                                                  "ok": DRY or got[0] == got[1]}
    finally:
        if lib is not None:
            lib._destroy()
    return res


def graph_capture():
    """Forward and backward captured in one CUDA graph and replayed; output and
    gradient equal to an eager call's."""
    if DRY:
        return {"skipped": "no CUDA graphs on the CPU"}
    res = {}
    for name, shape, layout in (("layer_norm", (4096, 4096), "contiguous"),
                                ("add_rms_norm", (4096, 4096), "contiguous"),
                                ("batch_norm", (32, 64, 56, 56), "channels_last"),
                                ("group_norm", (2, 320, 64, 64), "channels_last")):
        try:
            x, params, extra = _inputs(name, shape, BF16, layout)
            x.requires_grad_(True)
            gy = _rand(shape, BF16, 9, layout)

            def step():
                x.grad = None
                _op(name, NF, x, params, extra).backward(gy)
                return x.grad
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    eager = step().clone()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            x.grad = None
            with torch.cuda.graph(graph):
                _op(name, NF, x, params, extra).backward(gy)
            graph.replay()
            torch.cuda.synchronize()
            diff = float((x.grad.float() - eager.float()).abs().max())
            res[name] = {"ok": diff == 0.0, "max_diff_vs_eager": diff}
        except Exception as e:
            res[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:400]}
    return res


def stage_correct(out, workers):
    cases = correct_cases()
    if workers > 1:
        import concurrent.futures as cf
        import multiprocessing as mp

        shards = [cases[i::workers] for i in range(workers)]
        with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
            done = list(pool.map(_run_cases, shards))
        results = [r for rs, _ in done for r in rs]
        regs = [r for _, rg in done for r in rg]
    else:
        results, regs = _run_cases(cases)
    report = {"cases": dict(results), "big": _guarded(big_layer_norm),
              "autocast": _guarded(autocast_dtypes), "graphs": _guarded(graph_capture),
              "registers": gpu_registers.unique(regs)}
    lines = [f"correct: {sum(r['ok'] for r in report['cases'].values())} of "
             f"{len(results)} cases within max(2 x torch's error, floor)"]
    for label, r in results:
        if not r["ok"]:
            lines.append(f"  FAIL {label}: {r.get('error') or r}")
    for part in ("big", "autocast", "graphs"):
        lines.append(f"{part}: {json.dumps(report[part])[:600]}")
    return report, lines, all(r["ok"] for r in report["cases"].values())


def _guarded(fn):
    try:
        if DRY:
            _accept_cpu_tensors()
        return fn()
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:400]}


# -- bench --------------------------------------------------------------------------------------

def _timer():
    """Milliseconds per call of the device alone (CUDA graph of the calls), or the wall
    clock in the dry run."""
    if DRY:
        def ms(fn):
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        return ms
    from triton.testing import do_bench_cudagraph

    return lambda fn: do_bench_cudagraph(fn, rep=20, return_mode="median")


def host_us(fn, calls=1 if DRY else 30):
    """Microseconds of host time to issue one call (the device is not waited for)."""
    fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    _sync()
    return us


def _sync():
    if not DRY:
        torch.cuda.synchronize()


def _liger(name):
    """Liger-Kernel's op for ``name`` (x, params) -> y, or None."""
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction as LN
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction as RMS
    except ImportError:
        return None
    return {"layer_norm": lambda x, p: LN.apply(x, p[0], p[1], 1e-5),
            "rms_norm": lambda x, p: RMS.apply(x, p[0], 1e-6)}.get(name)


BENCH = [  # name, shape, dtype, layout, mode
    *[("layer_norm", s, BF16, "contiguous", m) for s in ROW_SHAPES for m in ("fwd", "fwd+bwd")],
    *[("rms_norm", s, BF16, "contiguous", m) for s in ROW_SHAPES for m in ("fwd", "fwd+bwd")],
    ("layer_norm", ROW_SHAPES[1], F32, "contiguous", "fwd"),
    ("add_rms_norm", ROW_SHAPES[1], BF16, "contiguous", "fwd+bwd"),
    ("rms_norm", QK, BF16, "contiguous", "fwd"),
    *[("batch_norm", BATCH, F32, lay, m) for lay in ("contiguous", "channels_last")
      for m in ("fwd", "fwd+bwd")],
    ("batch_norm_eval", BATCH, F32, "channels_last", "fwd"),
    *[("batch_norm_relu", BATCH, F32, "channels_last", m) for m in ("fwd", "fwd+bwd")],
    ("group_norm", GROUP, BF16, "channels_last", "fwd+bwd"),
    ("instance_norm", INSTANCE, BF16, "contiguous", "fwd"),
]
LN0, LN2 = (("layer_norm", s, BF16, "contiguous") for s in (ROW_SHAPES[0], ROW_SHAPES[2]))
BN_CL = ("batch_norm", BATCH, F32, "channels_last")
AB = {  # the cases each switch's A/B times, both sides back to back
    "STAGES": [(*LN0, "fwd+bwd"), (*BN_CL, "fwd+bwd")],
    "X0_MEAN": [(*LN0, "fwd"), (*LN2, "fwd"), ("instance_norm", INSTANCE, BF16, "contiguous",
                                                "fwd")],
    "LANES": [(*BN_CL, "fwd"), (*BN_CL, "fwd+bwd"), ("group_norm", GROUP, BF16,
                                                     "channels_last", "fwd+bwd")],
    "SMALL_ROW": [("rms_norm", QK, BF16, "contiguous", "fwd")],
    "OCCUPANCY": [(*LN0, "fwd+bwd"), ("layer_norm", ROW_SHAPES[1], BF16, "contiguous",
                                      "fwd+bwd")],
}


def _callable(case, lib):
    """``(fn, nbytes, tensors_to_reset)`` of one bench case for ``lib`` (NF, F or a
    Liger op): forward reads x and writes y; forward+backward also reads x and dy and
    writes dx (5 tensors, 6 with a residual)."""
    name, shape, dtype, layout, mode = case
    x, params, extra = _inputs(name, shape, dtype, layout)
    nbytes = x.numel() * x.element_size() * ((2 if mode == "fwd" else 5)
                                             + (extra is not None and name.startswith("add")))
    if callable(lib) and lib not in (NF, F):
        op = (lambda xi: lib(xi, params))
    else:
        op = (lambda xi: _op(name, lib, xi, params, extra))
    if mode == "fwd":
        return (lambda: op(x)), nbytes, None
    xg = x.detach().clone().requires_grad_(True)
    leaves = [xg] + [p.requires_grad_(True) for p in params if p is not None]
    gy = _rand(shape, dtype, 9, layout)
    return (lambda: op(xg).backward(gy)), nbytes, leaves


def _time(ms, case, lib, host=True):
    fn, nbytes, leaves = _callable(case, lib)
    if leaves is not None:
        inner = fn

        def fn():
            for t in leaves:
                t.grad = None
            inner()
    timer = "graph"
    try:
        t = ms(fn)
    except Exception:                  # not capturable: the stream's time, host included
        from triton.testing import do_bench
        t, timer = do_bench(fn, return_mode="median"), "do_bench (capture failed)"
    res = {"ms": t, "gbps": nbytes / (t * 1e-3) / 1e9, "timer": timer}
    if host:
        res["host_us"] = host_us(fn)
    return res


def stage_bench(out):
    if DRY:
        _accept_cpu_tensors()
    ms = _timer()
    if DRY:
        copy = None
    else:
        src = torch.empty(1 << 28, device="cuda")
        dst = torch.empty_like(src)
        copy = 2 * src.numel() * 4 / (ms(lambda: dst.copy_(src)) * 1e-3) / 1e9
        del src, dst
    rows, lines = [], [f"bench: copy_ {copy and round(copy)} GB/s; device-only times "
                       f"({'wall clock, dry run' if DRY else 'do_bench_cudagraph median'})"]
    for case in BENCH[::4] if DRY else BENCH:                    # dry: a few of each kind
        row = {"case": _label(case)}
        libs = {"normkit": NF, "torch": F}
        liger = _liger(case[0])
        if liger is not None:
            libs["liger"] = liger
        for key, lib in libs.items():
            try:
                row[key] = _time(ms, case, lib)
                if copy:
                    row[key]["of_copy"] = row[key]["gbps"] / copy
            except Exception as e:
                row[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
        rows.append(row)
        lines.append(_fmt(row))
    ab = {}
    for switch, cases in AB.items():
        default = getattr(gpu, switch)
        for case in cases[:1] if DRY else cases:
            r = {"default": default, "switched": SWITCHES[switch]}
            try:
                r["default_ms"] = _time(ms, case, NF, host=False)["ms"]
                ref = _output(case)
                setattr(gpu, switch, SWITCHES[switch])
                r["switched_ms"] = _time(ms, case, NF, host=False)["ms"]
                r["max_diff"] = float((_output(case) - ref).abs().max())
            except Exception as e:
                r["error"] = f"{type(e).__name__}: {e}"[:300]
            finally:
                setattr(gpu, switch, default)
            ab[f"{switch} {_label(case)}"] = r
            lines.append(f"A/B {switch}={default} vs {SWITCHES[switch]} {_label(case)}: "
                         f"{_us(r.get('default_ms'))} vs {_us(r.get('switched_ms'))} us, "
                         f"outputs differ by {r.get('max_diff')} {r.get('error', '')}")
    regs = gpu_registers.loaded()
    lines += [f"registers: {len(regs)} compiled specializations; spilling: "
              f"{[r for r in regs if r.get('n_spills')]}"]
    return {"copy_gbps": copy, "rows": rows, "ab": ab, "registers": regs}, lines, True


def _output(case):
    """The output (forward) or the gradients (forward+backward) of normkit's call."""
    fn, _, leaves = _callable(case, NF)
    y = fn()
    _sync()
    if leaves is None:
        return y.detach().float().flatten()
    return torch.cat([t.grad.float().flatten() for t in leaves])


def _us(t):
    return None if t is None else round(t * 1e3, 1)


def _label(case):
    name, shape, dtype, layout, mode = case
    return f"{name} {'x'.join(map(str, shape))} {str(dtype)[6:]} {layout} {mode}"


def _fmt(row):
    cells = []
    for key in ("normkit", "torch", "liger"):
        v = row.get(key)
        if v and "ms" in v:
            share = f" ({v['of_copy']:.2f} of copy_)" if "of_copy" in v else ""
            cells.append(f"{key} {_us(v['ms'])} us {v['gbps']:.0f} GB/s{share} "
                         f"host {v['host_us']:.0f} us")
        elif v:
            cells.append(f"{key} {v['error'][:80]}")
    return f"{row['case']}: " + "; ".join(cells)


# -- compile (here, no GPU) ------------------------------------------------------------------

def stage_compile(out, only):
    """Compile, for sm_90a and without launching, every specialization the check
    launches (``gpu_registers.compile_sm90``); registers and local memory of each."""
    def runs():
        cases = [(label, (n, s, d, lay, "fwd+bwd"), None)
                 for label, n, s, d, lay, _ in correct_cases()]
        cases += [(_label(c), c, None) for c in BENCH]
        cases += [(f"{sw}={SWITCHES[sw]} {_label(c)}", c, sw) for sw, cs in AB.items()
                  for c in cs]
        for label, case, switch in cases:
            if only in label:
                yield label, lambda case=case, switch=switch: _run_switched(case, switch)

    _accept_cpu_tensors()
    regs, failed = gpu_registers.compile_sm90(gpu, runs())
    lines = [f"compile: {len(regs)} specializations for sm_90a, {len(failed)} cases failed; "
             f"using local memory (spills): {sum(r['local_bytes'] > 0 for r in regs)}"]
    lines += [f"  FAIL {label}: {err}" for label, err in failed]
    lines += [f"{r['kernel']} {r['dtype']} warps {r['num_warps']} regs {r['n_regs']} local "
              f"{r['local_bytes']} {r['constexprs']}" for r in regs]
    return {"registers": regs, "failed": failed}, lines, not failed


def _run_switched(case, switch):
    default = getattr(gpu, switch) if switch else None
    try:
        if switch:
            setattr(gpu, switch, SWITCHES[switch])
        _callable(case, NF)[0]()
    finally:
        if switch:
            setattr(gpu, switch, default)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("stage", choices=("correct", "bench", "compile"))
    p.add_argument("out", help="folder for STAGE.json and summary.txt")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, interpreter")
    p.add_argument("--workers", type=int, default=1 if DRY else 6,
                   help="processes for the correctness cases")
    p.add_argument("--only", default="", help="compile: the cases whose label holds this")
    a = p.parse_args(argv)
    if a.stage != "compile" and not DRY and not torch.cuda.is_available():
        print("gpu_check.py: no CUDA device is visible to torch; run it on a GPU machine, "
              "or pass --dry-run to run it here on the CPU", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    report, lines, ok = {"correct": lambda: stage_correct(a.out, a.workers),
                         "bench": lambda: stage_bench(a.out),
                         "compile": lambda: stage_compile(a.out, a.only)}[a.stage]()
    report.update(stage=a.stage, dry_run=DRY, seconds=time.time() - t0,
                  device="cpu" if DEV == "cpu" else torch.cuda.get_device_name(),
                  torch=torch.__version__, triton=__import__("triton").__version__)
    with open(os.path.join(a.out, f"{a.stage}.json"), "w") as f:
        json.dump(report, f, indent=1)
    text = "\n".join(lines + [f"{a.stage}: {time.time() - t0:.0f} s"]) + "\n"
    with open(os.path.join(a.out, "summary.txt"), "a") as f:
        f.write(text)
    print(text, end="")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
