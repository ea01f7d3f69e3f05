"""GroupNorm (32 groups) on channels_last at Stable Diffusion's shapes and a small one:
normkit's layer against torch.nn's, 2 threads, microseconds per call (best of 7 rounds)
and the ratio, forward without grad and forward + backward (docs/performance.md,
"Instance/GroupNorm on channels_last on the node too").

    python benchmarks/bench_group_norm_channels_last.py
"""

from __future__ import annotations

import time

import torch

import normkit.nn as nknn
from normkit.bench.models import per_call_us

SHAPES = [(1, 320, 64, 64), (2, 320, 64, 64), (2, 640, 32, 32), (8, 128, 32, 32),
          (8, 64, 8, 8)]


def _us(fn):
    return per_call_us(fn, 20, 7, clock=time.perf_counter)


def main():
    torch.set_num_threads(2)
    print("GroupNorm(32) channels_last, 2 threads, us: normkit / torch (ratio)")
    for shape in SHAPES:
        groups = min(32, shape[1])
        x = torch.randn(shape).contiguous(memory_format=torch.channels_last)
        xg = x.clone().requires_grad_()
        theirs, ours = torch.nn.GroupNorm(groups, shape[1]), nknn.GroupNorm(groups, shape[1])
        with torch.no_grad():
            fwd = _us(lambda: ours(x)), _us(lambda: theirs(x))
        both = (_us(lambda: ours(xg).sum().backward()),
                _us(lambda: theirs(xg).sum().backward()))
        print(f"{str(shape):18s} forward {fwd[0]:7.0f} / {fwd[1]:7.0f} ({fwd[0] / fwd[1]:.2f})"
              f"   forward+backward {both[0]:7.0f} / {both[1]:7.0f} ({both[0] / both[1]:.2f})")


if __name__ == "__main__":
    main()
