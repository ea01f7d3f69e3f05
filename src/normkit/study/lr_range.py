"""Larger learning rates: the second article's "the gradient is insensitive to the learning
rate, which can be set larger" (BatchNorm).

The study's CNN (:class:`~normkit.study.model.Conv1dNet`) without normalization and with
BatchNorm is trained at batch :data:`BATCH` for the same number of steps at each peak
learning rate of a geometric sweep (SGD, momentum 0.9, weight decay 5e-4, warm-up and
cosine decay: the study's protocol). A run *reaches the target* when its final training
loss (the mean over the last window of steps) is at most :data:`TARGET`; a run whose loss
becomes non-finite is marked diverged. A method's *range* is the span of rates, from the
smallest to the largest, at which it reaches the target.
"""

from __future__ import annotations

import math
import time

import torch

from normkit.study.train import TrainConfig, _error, train_error, train_model

__all__ = ["METHODS", "BATCH", "TARGET", "DEFAULT", "QUICK", "run", "reached", "rate_range"]

METHODS = ("none", "batch")
BATCH = 32
TARGET = 0.5  # the grid's target training loss on MNIST-1D
DEFAULT = dict(lrs=(0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0), steps=600)
QUICK = dict(lrs=(0.01, 1.0), steps=8)


def run(data, method: str, cfg: dict, seed: int = 0) -> dict:
    """Train ``method`` at every rate of ``cfg["lrs"]`` for ``cfg["steps"]`` steps; per rate
    the final training loss, whether it diverged, and the test error in eval mode."""
    start = time.process_time()
    x_test, y_test = torch.from_numpy(data.x_test), torch.from_numpy(data.y_test)
    runs = []
    for lr in cfg["lrs"]:
        model, info = train_model(data, method, BATCH, seed, TrainConfig(base_lr=lr), steps=cfg["steps"])
        test = 1.0 - 1.0 / data.n_classes if info["diverged"] else _error(model.eval(), x_test, y_test, 1024)
        runs.append({"lr": lr, "diverged": info["diverged"], "final_train_loss": info["final_train_loss"],
                     "test_error": test, "train_error": train_error(model, data, 256, info["diverged"])})
    return {"method": method, "batch_size": BATCH, "steps": cfg["steps"], "target": TARGET, "runs": runs,
            "cpu_seconds": time.process_time() - start}


def reached(result: dict) -> list:
    """The rates at which ``result``'s runs end at or below the target loss."""
    return [r["lr"] for r in result["runs"]
            if not r["diverged"] and math.isfinite(r["final_train_loss"]) and r["final_train_loss"] <= result["target"]]


def rate_range(result: dict) -> float:
    """Largest over smallest rate that reaches the target (0 if none does, 1 if one does)."""
    ok = reached(result)
    return max(ok) / min(ok) if ok else 0.0
