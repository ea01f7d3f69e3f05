"""BatchNorm's mini-batch noise as a regularizer, where there is something to regularize.

The second article says BatchNorm's batch noise regularizes mildly (the BatchNorm paper:
dropout can be removed). The grid cannot show it: on 24,000 training signals for a few
epochs the networks hardly overfit (gaps of about one point). Here the study's CNN trains
on the first ``n`` training signals only (each size of ``sizes``) for ``steps`` SGD steps
at batch ``batch_size`` -- the grid's protocol otherwise (``cfg["train"]``: rate,
momentum, weight decay, schedule) -- long enough to fit them. Measured: the test error,
and the eval-mode error on those ``n`` training signals (about 0 once fitted). Three
methods, same seeds:

============  ================================================================
method        the norm layers
============  ================================================================
batch         BatchNorm: statistics of the whole batch of ``batch_size``
ghost         BatchNorm with statistics of each ``ghost`` consecutive signals of
              the batch (ghost batches, Hoffer et al. 2017): the same batch, rate
              and steps, more noise in the statistics
group         GroupNorm: per-sample statistics, no batch noise
============  ================================================================

With the training sets fitted, a lower test error is better generalization: BatchNorm
below GroupNorm says BatchNorm generalizes better; ghost below BatchNorm says it is the
batch noise that does it (more noise, lower error).
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch import nn

from normkit.study.model import build_model
from normkit.study.train import TrainConfig, _error, train_model

__all__ = ["METHODS", "DEFAULT", "QUICK", "GhostBatchNorm", "run"]

METHODS = ("batch", "ghost", "group")
DEFAULT = dict(sizes=(1000, 2000), steps=2000, batch_size=32, ghost=4, seeds=(0, 1, 2))
QUICK = dict(sizes=(64,), steps=6, batch_size=16, ghost=4, seeds=(0,))


class GhostBatchNorm(nn.Module):
    """``norm`` (a BatchNorm layer) applied in training mode to each ``size`` consecutive
    samples of the batch on their own (its running averages updated by each); in eval mode
    ``norm`` as it is."""

    def __init__(self, norm: nn.Module, size: int):
        super().__init__()
        self.norm, self.size = norm, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return self.norm(x)
        return torch.cat([self.norm(part) for part in x.split(self.size)])


def _ghost_net(data, size: int):
    """``net(total_steps)``: the study's BatchNorm CNN with each BatchNorm in ghost batches."""
    def net(total):
        model = build_model("batch", data.spatial, data.n_classes, total)
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.modules.batchnorm._BatchNorm):
                    setattr(module, name, GhostBatchNorm(child, size))
        return model
    return net


def run(data, method: str, cfg: dict) -> dict:
    """Train ``method`` on the first ``n`` training signals for each ``n`` of ``cfg["sizes"]``
    and each seed; per run the test error and the training error on those ``n``."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r} for the regularization runs; choose from {', '.join(METHODS)}")
    start = time.process_time()
    config = TrainConfig()
    config.update(cfg.get("train", {}))
    x_test, y_test = torch.from_numpy(data.x_test), torch.from_numpy(data.y_test)
    runs = []
    for n in cfg["sizes"]:
        if n > len(data.y_train) or n < cfg["batch_size"]:
            raise ValueError(f"the regularization runs need {n} training signals, at least a batch of "
                             f"{cfg['batch_size']}; the data have {len(data.y_train)}")
        subset = dataclasses.replace(data, x_train=data.x_train[:n], y_train=data.y_train[:n])
        net = _ghost_net(subset, cfg["ghost"]) if method == "ghost" else None
        train = (torch.from_numpy(subset.x_train), torch.from_numpy(subset.y_train))
        for seed in cfg["seeds"]:
            model, info = train_model(subset, "batch" if method == "ghost" else method, cfg["batch_size"], seed,
                                      config, net=net, steps=cfg["steps"])
            model.eval()
            runs.append({"n_train": n, "seed": seed, "diverged": info["diverged"],
                         "test_error": _error(model, x_test, y_test, 1024),
                         "train_error": _error(model, *train, 1024)})
    return {"method": method, "runs": runs, "cpu_seconds": time.process_time() - start}
