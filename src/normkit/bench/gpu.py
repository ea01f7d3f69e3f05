"""``normkit bench --device cuda``: normkit's Triton kernels against torch native and, where
installed, Liger-Kernel, in GB/s and as a fraction of the GPU's memory bandwidth.

Same cases as ``normkit.bench.ops`` (op x shape x dtype x layout x mode) on a CUDA device.
Each provider is timed by ``triton.testing.do_bench`` (median, L2 flushed between runs).
Bytes counted are those that must move: the forward reads x and writes y; forward +
backward also reads x and dy and writes dx (5 tensors). The bandwidth is the device's
theoretical peak (``2 x memory clock x bus width``, when torch reports them) and the one
a plain ``copy_`` reaches on this device; both are printed, with each provider's GB/s as a
fraction of the peak (of the copy's when the peak is unknown).

First run on an H200 on 2026-12-04 (docs/gpu.md, "First GPU run"): ``do_bench`` times the
stream, so for normkit's calls, which are host-bound, the figures are the host's pace;
``benchmarks/gpu_profile.py`` separates host and device time.
"""

from __future__ import annotations

import json
import sys

from normkit.bench.ops import cases

LIGER_OPS = ("layer_norm", "rms_norm", "group_norm")


def peak_bandwidth(device=0):
    """Theoretical memory bandwidth in GB/s (None when torch does not report it)."""
    import torch

    p = torch.cuda.get_device_properties(device)
    clock_khz = getattr(p, "memory_clock_rate", None)
    bus_bits = getattr(p, "memory_bus_width", None)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9


def _timer():
    from triton.testing import do_bench

    def ms(fn):
        try:
            return do_bench(fn, warmup=25, rep=100, return_mode="median")
        except TypeError:                                          # older triton
            return do_bench(fn, warmup=25, rep=100)
    return ms


def copy_bandwidth(ms, nbytes=1 << 30):
    """GB/s of ``dst.copy_(src)`` on ``nbytes`` (read + write)."""
    import torch

    src = torch.empty(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    t = ms(lambda: dst.copy_(src))
    return 2 * nbytes / (t * 1e-3) / 1e9


def _liger(op):
    """A Liger-Kernel callable for ``op`` (None when not installed or not offered)."""
    if op not in LIGER_OPS:
        return None
    try:
        if op == "layer_norm":
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction
            return lambda x, c, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5)
        if op == "rms_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction
            return lambda x, c, w, b: LigerRMSNormFunction.apply(x, w, 1e-6)
        from liger_kernel.ops.group_norm import LigerGroupNormFunction
        return lambda x, c, w, b: LigerGroupNormFunction.apply(x, w, b, c, 32, 1e-5)
    except ImportError:
        return None


def _make(case):
    """``{provider: callable}`` and the bytes moved for one case."""
    import torch
    import torch.nn.functional as F

    import normkit.functional as NF

    op, dtype = case["op"], getattr(torch, case["dtype"])
    shape = tuple(case["shape"])
    x = torch.randn(shape, device="cuda", dtype=dtype)
    if case["layout"] == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    c = shape[-1] if op in ("layer_norm", "rms_norm") else shape[1]
    w = torch.randn(c, device="cuda", dtype=dtype)
    b = torch.randn(c, device="cuda", dtype=dtype)
    rm, rv = torch.zeros(c, device="cuda", dtype=dtype), torch.ones(c, device="cuda", dtype=dtype)

    def of(lib):
        return {"layer_norm": lambda x: lib.layer_norm(x, (c,), w, b),
                "rms_norm": lambda x: lib.rms_norm(x, (c,), w),
                "group_norm": lambda x: lib.group_norm(x, 32, w, b),
                "batch_norm": lambda x: lib.batch_norm(x, rm, rv, w, b, training=True),
                "instance_norm": lambda x: lib.instance_norm(x, weight=w, bias=b)}[op]

    fns = {"normkit": of(NF), "torch": of(F)}
    liger = _liger(op)
    if liger is not None and case["layout"] == "contiguous":
        fns["liger"] = lambda x: liger(x, c, w, b)
    nbytes = x.numel() * x.element_size()
    if case["mode"] == "fwd":
        return {k: (lambda f=f: f(x)) for k, f in fns.items()}, 2 * nbytes
    xg = x.detach().clone().requires_grad_(True)
    w.requires_grad_(True)
    b.requires_grad_(True)
    dy = torch.randn_like(x)

    def full(f):
        def run():
            xg.grad = w.grad = b.grad = None
            f(xg).backward(dy)
        return run
    return {k: full(f) for k, f in fns.items()}, 5 * nbytes


def run(case_list):
    """Time every case; returns the report dict."""
    import torch

    ms = _timer()
    peak = peak_bandwidth()
    copy = copy_bandwidth(ms)
    ref = peak or copy
    results = []
    for case in case_list:
        fns, nbytes = _make(case)
        row = dict(case)
        for name, fn in fns.items():
            try:
                t = ms(fn)
            except Exception as e:                                 # a provider may not take the case
                row[name] = dict(error=f"{type(e).__name__}: {e}"[:200])
                continue
            gbps = nbytes / (t * 1e-3) / 1e9
            row[name] = dict(ms=t, gbps=gbps, fraction=gbps / ref)
        results.append(row)
    return dict(device=torch.cuda.get_device_name(), peak_gbps=peak, copy_gbps=copy,
                fraction_of="peak" if peak else "copy", results=results,
                statistic="median of triton.testing.do_bench")


def format_table(report):
    lines = [f"device: {report['device']}; peak {report['peak_gbps'] or 'unknown'} GB/s; "
             f"copy_ reaches {report['copy_gbps']:.0f} GB/s; fractions of the "
             f"{report['fraction_of']}; {report['statistic']}"]
    head = (f"{'op':<14}{'shape':<20}{'dtype':<10}{'layout':<15}{'mode':<9}"
            + "".join(f"{p + ' GB/s':>14}{'frac':>6}" for p in ("normkit", "torch", "liger")))
    lines += [head, "-" * len(head)]
    for r in report["results"]:
        cells = ""
        for p in ("normkit", "torch", "liger"):
            v = r.get(p)
            cells += (f"{v['gbps']:>14.0f}{v['fraction']:>6.2f}" if v and "gbps" in v
                      else f"{'-':>14}{'':>6}")
        lines.append(f"{r['op']:<14}{'x'.join(map(str, r['shape'])):<20}{r['dtype']:<10}"
                     f"{r['layout']:<15}{r['mode']:<9}{cells}")
    return "\n".join(lines)


def main(args) -> int:
    """The ``--device cuda`` branch of ``normkit bench``."""
    import torch

    if not torch.cuda.is_available():
        print("normkit bench --device cuda: no CUDA device is visible to torch; run it on a "
              "GPU machine or drop --device cuda", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("normkit bench --device cuda needs triton: pip install 'normkit[gpu]'",
              file=sys.stderr)
        return 2
    report = run(cases(args.ops, args.dtypes, args.modes, quick=args.quick))
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(format_table(report))
    return 0


__all__ = ["run", "format_table", "main", "peak_bandwidth", "copy_bandwidth"]
