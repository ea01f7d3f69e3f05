"""One training step of the study's MNIST-1D CNN (forward, cross-entropy, backward, SGD),
normkit's layers against torch.nn's: `python benchmarks/bench_study_step.py [--torch]`.

One thread; prints the calling thread's CPU time per step, best of 5 rounds of 200 steps
after 50 warm-up steps, for BatchNorm, GroupNorm and LayerNorm at batch 2 and 32 (the
table in docs/performance.md, "Whole models and the per-call cost"). ``--torch`` runs the
same networks reverted to torch.nn.
"""

from __future__ import annotations

import argparse
import time

import torch

import normkit
from normkit.study.model import Conv1dNet


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", action="store_true", help="torch.nn layers instead")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for method in ("batch", "group", "layer"):
        for batch in (2, 32):
            torch.manual_seed(0)
            model = Conv1dNet(method)
            if args.torch:
                normkit.revert(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            x, y = torch.randn(batch, 1, 40), torch.randint(0, 10, (batch,))

            def step():
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()

            for _ in range(50):
                step()
            best = float("inf")
            for _ in range(5):
                start = time.thread_time()
                for _ in range(200):
                    step()
                best = min(best, (time.thread_time() - start) / 200 * 1e3)
            print(f"{method:6s} batch {batch:2d}: {best:.3f} ms/step")


if __name__ == "__main__":
    main()
