"""Memory of inputs of many shapes: a new sequence length (or image size) every step.

Each new shape builds a normkit plan (``normkit.backends.plan``). This runs, for torch.nn
and for normkit in a process of its own each, four LayerNorm(768) layers (forward and
backward, parameters frozen) over batches (8, T, 768) with T = 1, 2, ..., 512 (a dataset
sorted by length), then over random T (a dataloader with dynamic padding), and BatchNorm,
GroupNorm and InstanceNorm over images of 4 to 131 pixels. It prints the process's
resident memory over what it held before the steps and the free memory that glibc keeps
in its heap (``mallinfo2``: freed, neither reused nor given back), in MB.

    python benchmarks/bench_many_shapes.py
"""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import ctypes, gc, random, sys, time, torch
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
lib, case = sys.argv[1], sys.argv[2]
if lib == "normkit":
    import normkit.nn as L
else:
    import torch.nn as L
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
if case == "images":
    model = torch.nn.Sequential(L.BatchNorm2d(32), L.GroupNorm(8, 32),
                                L.InstanceNorm2d(32, affine=True))
    inputs = [(4, 32, s, s + 1) for s in range(4, 132)]
else:
    model = torch.nn.Sequential(*[L.LayerNorm(768) for _ in range(4)])
    rng = random.Random(0)
    inputs = ([(8, t, 768) for t in range(1, 513)] if case == "growing"
              else [(8, rng.randint(1, 512), 768) for _ in range(1000)])
model.requires_grad_(False)
model(torch.randn(inputs[0]).requires_grad_()).sum().backward()
gc.collect()
before, start = rss(), time.perf_counter()
for shape in inputs:
    model(torch.randn(shape).requires_grad_()).sum().backward()
gc.collect()
print(f"{rss() - before:.0f} {libc.mallinfo2().fordblks / 2**20:.0f} "
      f"{(time.perf_counter() - start) / len(inputs) * 1e3:.2f}")
"""


def main():
    print("case,library,resident_mb,free_heap_mb,ms_per_step")
    for case in ("growing", "random", "images"):
        for lib in ("torch", "normkit"):
            out = subprocess.run([sys.executable, "-c", CHILD, lib, case], capture_output=True,
                                 text=True, check=True)
            resident, free, ms = out.stdout.split()
            print(f"{case},{lib},{resident},{free},{ms}")


if __name__ == "__main__":
    main()
