"""BatchNorm in a sequence model: the second article lists RNNs among the settings in which
BatchNorm "performs poorly", and the LayerNorm paper (Ba et al. 2016) was written for them.

:class:`StepRNN` reads an MNIST-1D signal ``chunk`` values at a time, left to right along
its 40 positions (its time axis), with one recurrent layer of :data:`HIDDEN` units, the norm
in one of two places (:data:`PLACES`)::

    "sum":        h(t) = tanh(norm(W_x x(t) + W_h h(t-1)))       (the LayerNorm paper's cell)
    "recurrent":  h(t) = tanh(W_x x(t) + b + norm(W_h h(t-1)))   (h(1) = tanh(W_x x(1) + b))

with ``h(0) = 0`` and ``logits = head(h(T))``. In the first the norm also takes each step's
input (LayerNorm removes its size, sample by sample); in the second the input enters as it
is. The norm is one layer shared by every time step, as a recurrent cell is: LayerNorm
normalizes each sample's hidden units at each step; BatchNorm normalizes each unit over
the batch, with one pair of running averages for all steps although the distribution
changes along the sequence. Without a norm the two places are one network, trained once.
Each method is trained with AdamW (as the transformer is: plain SGD hardly moves a tanh
RNN over 40 steps in this budget) at batch :data:`BATCH`; measured: test error in eval
mode and in training mode (each test batch's own statistics), and the final training loss.
"""

from __future__ import annotations

import time

import torch
from torch import nn

import normkit.nn as nk
from normkit.study.train import _batches, _error, _train_mode_error, fit, train_error

__all__ = ["METHODS", "PLACES", "PLACE_NAMES", "HIDDEN", "BATCH", "DEFAULT", "QUICK", "StepRNN", "run"]

METHODS = ("none", "batch", "layer")
PLACES = ("sum", "recurrent")
#: what the norm takes at each place, for the report
PLACE_NAMES = {"sum": "summed input", "recurrent": "recurrent term"}
HIDDEN = 48
BATCH = 32
DEFAULT = dict(steps=2000, lr=3e-3, seeds=(0, 1, 2), chunk=4, places=PLACES)
QUICK = dict(steps=8, lr=3e-3, seeds=(0,), chunk=4, places=PLACES)
WEIGHT_DECAY = 0.05
WARMUP_FRACTION = 0.1


class StepRNN(nn.Module):
    """The recurrent network of the module docstring with ``method`` as its norm, at
    ``place`` (one of :data:`PLACES`)."""

    def __init__(self, method: str, n_classes: int = 10, hidden: int = HIDDEN, chunk: int = 1,
                 place: str = "sum"):
        super().__init__()
        if place not in PLACES:
            raise ValueError(f"unknown place {place!r} for the recurrent network's norm; choose from "
                             f"{', '.join(PLACES)}")
        self.method = method
        self.hidden = hidden
        self.chunk = chunk
        self.place = place
        # the norm's bias serves the summed input where the norm takes it
        self.inp = nn.Linear(chunk, hidden, bias=method == "none" or place == "recurrent")
        self.rec = nn.Linear(hidden, hidden, bias=False)
        norms = {"batch": nk.BatchNorm1d, "layer": nk.LayerNorm}
        self.norm = norms[method](hidden) if method in norms else nn.Identity()
        self.head = nn.Linear(hidden, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = self.inp(x[:, 0, :].reshape(len(x), -1, self.chunk))  # N,L/chunk,H
        h = torch.zeros(len(x), self.hidden)  # N,H
        for t in range(xs.shape[1]):
            if self.place == "sum":
                h = torch.tanh(self.norm(xs[:, t] + self.rec(h)))
            else:
                h = torch.tanh(xs[:, t] + self.norm(self.rec(h))) if t else torch.tanh(xs[:, 0])
        return self.head(h)  # N,10


def run(data, method: str, cfg: dict) -> dict:
    """Train :class:`StepRNN` with ``method`` for ``cfg["steps"]`` steps at batch :data:`BATCH`
    for each of ``cfg["places"]`` (the first only without a norm) and each seed; per run the
    test error in eval and training mode and the final loss."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r} for the recurrent network; choose from {', '.join(METHODS)}")
    start = time.process_time()
    x, y = torch.from_numpy(data.x_test), torch.from_numpy(data.y_test)
    runs = []
    x_train, y_train = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    total = cfg["steps"]
    places = cfg["places"][:1] if method == "none" else cfg["places"]
    for place, seed in ((p, s) for p in places for s in cfg["seeds"]):
        torch.manual_seed(seed)
        model = StepRNN(method, data.n_classes, chunk=cfg["chunk"], place=place)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=WEIGHT_DECAY)
        batches = _batches(len(y_train), BATCH, total, torch.Generator().manual_seed(seed))
        steps, diverged, curve_steps, curve_loss = fit(model, opt, batches, x_train, y_train, total, cfg["lr"],
                                                       max(1, round(WARMUP_FRACTION * total)))
        test = _error(model.eval(), x, y, 1024)
        runs.append({"seed": seed, "place": place, "diverged": diverged,
                     "final_train_loss": curve_loss[-1] if curve_loss else float("nan"), "test_error": test,
                     "test_error_train_mode": _train_mode_error(model, x, y, BATCH),
                     "train_error": train_error(model, data, 1000, diverged),
                     "loss_curve": {"step": curve_steps, "loss": [round(v, 5) for v in curve_loss]}})
    return {"method": method, "batch_size": BATCH, "steps": cfg["steps"], "runs": runs,
            "cpu_seconds": time.process_time() - start}
