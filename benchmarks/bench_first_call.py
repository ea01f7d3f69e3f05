"""What a fresh install's first training step costs: a small converted CNN (two residual
blocks, BatchNorm2d, ReLU, LayerNorm; batch 8, 32 px, float32), its first and second
training steps timed in a new process with nothing built (an empty extension folder and
numba cache: the C++ executor builds while the first call's kernels compile), then with
the executor built (``make setup``) and an empty numba cache, then after ``python -m
normkit.backends.cpu`` compiled the kernels ahead into that cache. docs/performance.md
("First call") quotes it.

    PYTHONPATH=src python benchmarks/bench_first_call.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

_STEP = """
import time, torch, torch.nn as nn, normkit

class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))) + x)

model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), Block(32),
                      Block(32), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
                      nn.LayerNorm(10))
normkit.convert(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
for step in ("first", "second"):
    start = time.perf_counter()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    print(f"{step} step: {time.perf_counter() - start:.2f} s", flush=True)
"""


def main() -> None:
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as built:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache, TORCH_EXTENSIONS_DIR=built)
        print("nothing built (executor and kernels):", flush=True)
        subprocess.run([sys.executable, "-c", _STEP], env=env, check=True)
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        print("executor built, empty kernel cache:", flush=True)
        subprocess.run([sys.executable, "-c", _STEP], env=env, check=True)
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "normkit.backends.cpu", "--dtypes", "float32"],
                       env=env, check=True)
        print(f"compiled ahead in {time.perf_counter() - start:.0f} s; then:")
        subprocess.run([sys.executable, "-c", _STEP], env=env, check=True)


if __name__ == "__main__":
    main()
