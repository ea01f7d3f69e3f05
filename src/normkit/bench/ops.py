"""Benchmarks of normkit's normalizations against torch's native ones and a memory copy.

For each op x shape x dtype x layout x mode (forward, forward+backward), three callables
run interleaved in one loop -- normkit, torch native, and ``dst.copy_(x)`` into a
preallocated tensor of the same size (the floor of any forward pass: read x once, write
once) -- and the median of each is reported, with the ratios normkit/torch and
normkit/copy and normkit's effective bandwidth (bytes that must move: forward reads x and
writes y; forward+backward also reads x and dy and writes dx). The residual-add norms
(``add_layer_norm``, ``add_rms_norm``) against torch's add followed by its norm: forward
reads x and the residual and writes h and y; backward reads h, dy and dh, writes dx.

The allocator matters as much as the kernel on large shapes: glibc serves allocations
above its mmap threshold (at most 32 MiB) with fresh pages from the kernel, so an op that
returns a new 100 MiB tensor page-faults on every page of it on every call, whoever wrote
the op. ``run`` therefore measures in child processes, once with the default allocator
and once with ``MALLOC_MMAP_MAX_=0`` (no mmap: freed blocks go back to the heap and are
reused without faults), and says which is which.

``normkit bench`` (``normkit.cli.bench``) and the scripts in ``benchmarks/`` are front
ends of this module; each allocator setting runs in a child (``python -m normkit.bench``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

OPS = ("layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm", "add_layer_norm",
       "add_rms_norm")
_ROWS = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")
DTYPES = ("float32", "bfloat16")
MODES = ("fwd", "fwd+bwd")

# default shapes per op family; --quick uses the small ones
SHAPES = {
    "layer_norm": [(8192, 4096), (32768, 768)],
    "rms_norm": [(8192, 4096), (32768, 768)],
    "group_norm": [(32, 256, 56, 56)],
    "batch_norm": [(32, 256, 56, 56)],
    "instance_norm": [(32, 256, 56, 56)],
    "add_layer_norm": [(8192, 768)],
    "add_rms_norm": [(8192, 768)],
}
QUICK_SHAPES = {
    "layer_norm": [(64, 256)],
    "rms_norm": [(64, 256)],
    "group_norm": [(2, 64, 8, 8)],
    "batch_norm": [(2, 64, 8, 8)],
    "instance_norm": [(2, 64, 8, 8)],
    "add_layer_norm": [(64, 256)],
    "add_rms_norm": [(64, 256)],
}
ALLOCATORS = {
    "default": ({}, "glibc default: outputs over the mmap threshold (<= 32 MiB) are fresh "
                    "pages that fault on every call (4 KiB at a time for torch's; normkit "
                    "advises its large outputs huge pages where THP is in madvise mode)"),
    "no-mmap": ({"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)},
                "MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2**40: large blocks come from "
                "the heap and stay there when freed, so they are reused without page "
                "faults"),
    "thp": ({"THP_MEM_ALLOC_ENABLE": "1"},
            "THP_MEM_ALLOC_ENABLE=1: torch's allocator asks for transparent huge pages for "
            "large tensors too (normkit's outputs get them in every setting where the "
            "kernel's THP mode is madvise), so fresh outputs fault 2 MiB at a time"),
}


def _layouts(op):
    return ("contiguous",) if op in _ROWS else ("contiguous", "channels_last")


def cases(ops=OPS, dtypes=DTYPES, modes=MODES, quick=False):
    """Every (op, shape, dtype, layout, mode) to measure."""
    table = QUICK_SHAPES if quick else SHAPES
    return [dict(op=op, shape=list(shape), dtype=dt, layout=lay, mode=mode)
            for op in ops for shape in table[op] for lay in _layouts(op)
            for dt in dtypes for mode in modes]


def _added(norm, x, r):
    """``(norm(h), h)`` with ``h = x + r``: torch's side of the residual-add norms."""
    h = x + r
    return norm(h), h


def _make(case):
    """``(normkit_fn, torch_fn, copy_fn, bytes_moved)`` for one case."""
    import torch
    import torch.nn.functional as F

    import normkit.functional as NF

    op, mode = case["op"], case["mode"]
    dtype = getattr(torch, case["dtype"])
    shape = tuple(case["shape"])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(dtype)
    if case["layout"] == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    c = shape[-1] if op in _ROWS else shape[1]
    r = torch.randn(shape, generator=gen).to(dtype)               # the residual of add_*
    w = torch.randn(c, generator=gen).to(dtype)
    b = torch.randn(c, generator=gen).to(dtype)
    rm, rv = torch.zeros(c, dtype=dtype), torch.ones(c, dtype=dtype)

    def ops(lib, name=op):
        if name == "layer_norm":
            return lambda x: lib.layer_norm(x, (c,), w, b)
        if name == "rms_norm":
            return lambda x: lib.rms_norm(x, (c,), w)
        if name == "group_norm":
            return lambda x: lib.group_norm(x, 32, w, b)
        if name == "batch_norm":
            return lambda x: lib.batch_norm(x, rm, rv, w, b, training=True)
        if name.startswith("add_") and lib is NF:   # (y, h), h = x + r
            fused, extra = getattr(NF, name), ((b,) if name == "add_layer_norm" else ())
            return lambda x: fused(x, r, (c,), w, *extra)
        if name.startswith("add_"):                 # torch: the add, then the norm
            norm = ops(F, name[4:])
            return lambda x: _added(norm, x, r)
        return lambda x: lib.instance_norm(x, weight=w, bias=b)

    dst = torch.empty_like(x)

    def copy():
        dst.copy_(x)

    nbytes = x.numel() * x.element_size()
    added = 2 if op.startswith("add_") else 1      # read x and r, write y and h
    if mode == "fwd":
        nk, tn = ops(NF), ops(F)
        return (lambda: nk(x)), (lambda: tn(x)), copy, 2 * added * nbytes

    xg = x.detach().clone().requires_grad_(True)
    w.requires_grad_(True)
    b.requires_grad_(True)
    dy = torch.randn(shape, generator=gen).to(dtype)
    if case["layout"] == "channels_last":
        dy = dy.contiguous(memory_format=torch.channels_last)

    def full(fn):
        def run():
            xg.grad = w.grad = b.grad = None
            out = fn(xg)
            if isinstance(out, tuple):                             # (y, h): dy and dh
                torch.autograd.backward(out, (dy, dy))
            else:
                out.backward(dy)
        return run

    # forward, then: read x (h), dy (and dh), write dx
    return full(ops(NF)), full(ops(F)), copy, (5 if added == 1 else 8) * nbytes


def measure(case, repeats=7, warmup=2):
    """Median seconds of normkit, torch and copy, interleaved; plus bytes moved."""
    fns = _make(case)
    funcs = fns[:3]
    for _ in range(warmup):
        for f in funcs:
            f()
    times = [[], [], []]
    for _ in range(repeats):
        for i, f in enumerate(funcs):
            t0 = time.perf_counter()
            f()
            times[i].append(time.perf_counter() - t0)
    med = [statistics.median(t) for t in times]
    out = dict(case, normkit_s=med[0], torch_s=med[1], copy_s=med[2],
               normkit_over_torch=med[0] / med[1], normkit_over_copy=med[0] / med[2],
               torch_over_copy=med[1] / med[2], normkit_gbps=fns[3] / med[0] / 1e9)
    return out


def _environment():
    import torch

    from normkit.backends import _memory, _parallel

    return dict(threads=torch.get_num_threads(), torch=torch.__version__,
                kernel_threads=_parallel.backend(),
                normkit_huge_pages=_memory.huge_pages_advised(),
                thp_mem_alloc_enable=os.environ.get("THP_MEM_ALLOC_ENABLE", "default"),
                malloc_mmap_max=os.environ.get("MALLOC_MMAP_MAX_", "default"),
                malloc_trim_threshold=os.environ.get("MALLOC_TRIM_THRESHOLD_", "default"),
                transparent_hugepage=_memory.thp_mode(), cpu_count=os.cpu_count())


def run_here(case_list, repeats=7, progress=True, label=""):
    """Measure every case in this process; returns the list of result dicts."""
    results = []
    bar = _progress(len(case_list), label) if progress else None
    for case in case_list:
        results.append(measure(case, repeats=repeats))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return results


def _progress(total, label):
    from tqdm import tqdm

    return tqdm(total=total, desc=label or "bench", unit="case", file=sys.stderr,
                leave=False)


def run(case_list, repeats=7, allocators=("default", "no-mmap"), threads=2, progress=True):
    """Measure in one child process per allocator setting; returns the report dict."""
    report = dict(threads=threads, allocators={}, copy="dst.copy_(x), dst preallocated",
                  statistic=f"median of {repeats} interleaved repeats")
    for name in allocators:
        env_extra, desc = ALLOCATORS[name]
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("MALLOC_") and k != "THP_MEM_ALLOC_ENABLE"}
        env.update(env_extra)
        env["OMP_NUM_THREADS"] = str(threads)
        with tempfile.TemporaryDirectory() as tmp:
            spec, out = os.path.join(tmp, "cases.json"), os.path.join(tmp, "out.json")
            with open(spec, "w") as f:
                json.dump(dict(cases=case_list, repeats=repeats, threads=threads,
                               progress=progress, label=name), f)
            subprocess.run([sys.executable, "-m", "normkit.bench", spec, out], env=env,
                           check=True)
            with open(out) as f:
                child = json.load(f)
        report["allocators"][name] = dict(description=desc, environment=child["environment"],
                                          results=child["results"])
    return report


def format_table(report):
    """Plain-text tables, one per allocator setting."""
    lines = [f"threads: {report['threads']}; copy baseline: {report['copy']}; "
             f"{report['statistic']}"]
    head = (f"{'op':<16}{'shape':<20}{'dtype':<10}{'layout':<15}{'mode':<9}"
            f"{'normkit ms':>11}{'torch ms':>10}{'copy ms':>9}{'nk/torch':>9}"
            f"{'nk/copy':>8}{'torch/copy':>11}{'GB/s':>7}")
    for name, block in report["allocators"].items():
        env = block["environment"]
        lines += ["", f"allocator: {name} -- {block['description']} "
                      f"(THP: {env['transparent_hugepage']}, torch {env['torch']}, "
                      f"{env['threads']} threads)", head, "-" * len(head)]
        for r in block["results"]:
            lines.append(
                f"{r['op']:<16}{'x'.join(map(str, r['shape'])):<20}{r['dtype']:<10}"
                f"{r['layout']:<15}{r['mode']:<9}{r['normkit_s'] * 1e3:>11.2f}"
                f"{r['torch_s'] * 1e3:>10.2f}{r['copy_s'] * 1e3:>9.2f}"
                f"{r['normkit_over_torch']:>9.2f}{r['normkit_over_copy']:>8.2f}"
                f"{r['torch_over_copy']:>11.2f}{r['normkit_gbps']:>7.1f}")
    return "\n".join(lines)


def child(spec_path, out_path):
    """Measure the cases of the JSON file ``spec_path``; write the results to ``out_path``."""
    import torch

    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(spec["threads"])
    results = run_here(spec["cases"], spec["repeats"], spec["progress"], spec["label"])
    with open(out_path, "w") as f:
        json.dump(dict(environment=_environment(), results=results), f)
