"""Trained CNNs under changes of their test inputs, and the probes of :mod:`probes`.

For each method the study's CNN is trained once with the grid's protocol at batch
:data:`BATCH`, seed 0 (the same network as the grid's run). Then, in eval mode (BatchNorm
with its running averages), its test error is measured on changed test inputs:

* *style* (second article: "InstanceNorm removes each image's contrast and brightness"):
  every test signal gets its own contrast and brightness, ``x' = a x + b`` with
  ``a = exp(s u)`` and ``b = s v``, ``u, v`` uniform in [-1, 1], drawn per signal from a
  fixed seed: at size ``s = 1`` the contrast changes by up to e (2.7x) either way and the
  brightness by up to one standard deviation of the data;
* *drift* (second article: BatchNorm "suits distribution drift poorly"): the same change
  for every test signal, as when the data seen after training drift: a shift ``x + d`` and
  a rescaling ``x (1 + d)``.

Per size: test error and the fraction of predictions that change against the unchanged
inputs. The same trained networks give the probes of :mod:`normkit.study.probes` (weight
scale behind BatchNorm, a batch of one).
"""

from __future__ import annotations

import time

import torch

from normkit.study import probes
from normkit.study.train import TrainConfig, train_model

__all__ = ["METHODS", "BATCH", "STYLE_SIZES", "DRIFT_SIZES", "SEED", "style", "drift", "run"]

METHODS = ("none", "batch", "group", "layer", "instance")
BATCH = 32
STYLE_SIZES = (0.0, 0.5, 1.0, 1.5, 2.0)
DRIFT_SIZES = (0.0, 0.5, 1.0, 1.5, 2.0)
SEED = 0  # the changes' random draws


def style(x: torch.Tensor, size: float, seed: int = SEED) -> torch.Tensor:
    """Each signal of ``x`` (N, 1, L) with its own contrast ``exp(size u)`` and brightness
    ``size v`` (``u, v`` uniform in [-1, 1] per signal, from ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    u = 2 * torch.rand(len(x), 1, 1, generator=gen) - 1
    v = 2 * torch.rand(len(x), 1, 1, generator=gen) - 1
    return x * torch.exp(size * u) + size * v


DRIFTS = {"shift": lambda x, d: x + d, "rescale": lambda x, d: x * (1 + d)}


@torch.no_grad()
def _errors(model, x, y, base_pred):
    pred = torch.cat([model(x[i:i + 1024]).argmax(1) for i in range(0, len(x), 1024)])
    return float((pred != y).float().mean()), float((pred != base_pred).float().mean())


def _curve(model, x, y, sizes, change):
    model.eval()
    with torch.no_grad():
        base = torch.cat([model(x[i:i + 1024]).argmax(1) for i in range(0, len(x), 1024)])
    err, moved = zip(*(_errors(model, change(x, s), y, base) for s in sizes))
    return {"size": list(sizes), "test_error": list(err), "changed": list(moved)}


def run(data, method: str, cfg: dict, seed: int = 0) -> dict:
    """Train ``method`` with ``cfg["train"]`` (the grid's protocol) at batch :data:`BATCH`;
    return its style and drift curves and the two probes."""
    start = time.process_time()
    config = TrainConfig()
    config.update(cfg["train"])
    model, info = train_model(data, method, BATCH, seed, config)
    x, y = torch.from_numpy(data.x_test), torch.from_numpy(data.y_test)
    x_tr, y_tr = torch.from_numpy(data.x_train[:BATCH]), torch.from_numpy(data.y_train[:BATCH])
    return {"method": method, "batch_size": BATCH, "steps": info["steps"], "diverged": info["diverged"],
            "final_train_loss": info["final_train_loss"],
            "style": _curve(model, x, y, STYLE_SIZES, style),
            "drift": {k: _curve(model, x, y, DRIFT_SIZES, f) for k, f in DRIFTS.items()},
            "weight_scale": probes.weight_scale(model, x_tr, y_tr),
            "batch_of_one": probes.batch_of_one(model, method, x, y),
            "cpu_seconds": time.process_time() - start}
