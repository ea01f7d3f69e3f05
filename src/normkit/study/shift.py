"""Internal covariate shift, as in Figure 1 (b, c) of the BatchNorm paper (Ioffe & Szegedy
2015): how the distribution of one hidden layer's input to its nonlinearity moves while
the network trains.

:class:`ShiftRecorder` runs a fixed probe of inputs through the network at evenly spaced
steps and keeps the 15th, 50th and 85th percentiles of every channel of the last block's
pre-activation (over the probe's samples and positions). The probe runs in training mode,
as the layer is used while it learns, on ``torch.no_grad`` and with every buffer (running
averages, counters) put back afterwards, so recording changes nothing about the run.

:func:`movement` turns a recording into one number per percentile: how far it travels over
training, as the median over channels of (largest - smallest value) divided by the
channel's mean 15-85 spread -- a scale-free number, so a network whose activations are ten
times larger does not look ten times more shifted.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["PERCENTILES", "PROBE", "POINTS", "ShiftRecorder", "movement"]

PERCENTILES = (15, 50, 85)
PROBE = 256   # probe inputs (the first test inputs)
POINTS = 40   # recordings per run, evenly spaced, plus one before the first step


class ShiftRecorder:
    """Records ``model.pre_activation`` percentiles on ``x_probe[:PROBE]`` every
    ``total_steps / POINTS`` steps (and at step 0, before training)."""

    def __init__(self, model, x_probe: torch.Tensor, total_steps: int):
        if not hasattr(model, "keep_pre_activation"):
            raise ValueError(f"{type(model).__name__} does not expose a pre-activation to follow; "
                             f"the covariate-shift recording needs the MNIST-1D network (--dataset mnist1d)")
        self.model = model
        self.probe = x_probe[:PROBE]
        self.every = max(1, total_steps // POINTS)
        self.total = total_steps
        self.steps, self.values = [], []
        self.after_step(0)

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        """Record if ``step`` is a recording step (called after every optimizer step)."""
        if step % self.every and step != self.total:
            return
        buffers = [b.clone() for b in self.model.buffers()]
        self.model.keep_pre_activation = True
        try:
            self.model(self.probe)
            z = self.model.pre_activation  # N,C,L
        finally:
            self.model.keep_pre_activation = False
            self.model.pre_activation = None
            for b, saved in zip(self.model.buffers(), buffers):
                b.copy_(saved)
        per_channel = z.transpose(0, 1).reshape(z.shape[1], -1)  # C, N*L
        q = torch.quantile(per_channel.double(), torch.tensor(PERCENTILES, dtype=torch.float64) / 100, dim=1)
        self.steps.append(step)
        self.values.append(np.round(q.numpy(), 5).tolist())  # 3 x C

    def result(self) -> dict:
        """``{"step": [...], "percentiles": [15, 50, 85], "values": [recording][percentile][channel]}``"""
        return {"step": list(self.steps), "percentiles": list(PERCENTILES), "values": self.values}


def movement(shift: dict) -> dict:
    """``{percentile: travel}``: median over channels of the range of that percentile over
    training, in units of the channel's mean 15-85 spread (see the module docstring)."""
    v = np.asarray(shift["values"], dtype=np.float64)  # T,3,C
    spread = (v[:, -1, :] - v[:, 0, :]).mean(axis=0)   # C
    spread = np.where(spread > 0, spread, np.nan)
    travel = (v.max(axis=0) - v.min(axis=0)) / spread  # 3,C
    return {p: float(np.nanmedian(travel[i])) for i, p in enumerate(shift["percentiles"])}
