"""Gradients through depth: the second article's central reason for normalization.

The article writes the gradient of the loss as a product over layers,
``dL/dθ = dL/dh(L) · Π_l dh(l+1)/dh(l)``, and says that without normalization this product
"runs out of control" as the network deepens: it grows or vanishes from layer to layer.

:class:`DeepMLP` is a plain network of :data:`DEPTH` hidden layers (``Linear(w, w)`` ->
norm -> ReLU, width :data:`WIDTH`, PyTorch's default initialisation) on MNIST-1D's 40
values, and a linear head. :func:`layer_gradients` measures, on a fixed batch of
:data:`PROBE` training signals in training mode, the norm of the loss's gradient with
respect to each hidden layer's output ``h(l)`` -- the article's product, layer by layer --
and with respect to each layer's weight. It is taken at initialisation and again after
the network has been trained with the study's SGD protocol. The spread of a curve is its
largest value over its smallest: 1 for a gradient that keeps its size through the depth.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import normkit.nn as nk
from normkit.study.train import TrainConfig, _error, train_error, train_model

__all__ = ["DEPTH", "WIDTH", "PROBE", "METHODS", "DEFAULT", "QUICK", "DeepMLP", "layer_gradients", "spread",
           "run"]

DEPTH = 20    # hidden layers, each Linear -> norm -> ReLU
WIDTH = 64
PROBE = 256   # training signals the gradients are measured on
METHODS = ("none", "batch", "layer")
DEFAULT = dict(steps=1000, batch_size=32, base_lr=0.002)  # docs/study.md: LayerNorm collapses from 0.005
QUICK = dict(steps=10, batch_size=16, base_lr=0.002)


def _norm(method: str, width: int) -> nn.Module:
    if method == "none":
        return nn.Identity()
    if method == "batch":
        return nk.BatchNorm1d(width)
    if method == "layer":
        return nk.LayerNorm(width)
    raise ValueError(f"unknown method {method!r} for the deep network; choose from {', '.join(METHODS)}")


class DeepMLP(nn.Module):
    """``depth`` blocks ``h(l) = relu(norm(W_l h(l-1)))`` of ``width`` units on the flattened
    signal, then a linear head; ``kept`` holds each block's output of the last forward with
    its gradient retained (when ``keep`` is set)."""

    def __init__(self, method: str, inputs: int = 40, n_classes: int = 10, depth: int = DEPTH,
                 width: int = WIDTH):
        super().__init__()
        bias = method == "none"  # a centering norm makes the bias redundant
        self.linears = nn.ModuleList(nn.Linear(inputs if i == 0 else width, width, bias=bias)
                                     for i in range(depth))
        self.norms = nn.ModuleList(_norm(method, width) for _ in range(depth))
        self.head = nn.Linear(width, n_classes)
        self.keep = False
        self.kept = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.flatten(1)  # N,40
        self.kept = []
        for linear, norm in zip(self.linears, self.norms):
            h = torch.relu(norm(linear(h)))  # N,W
            if self.keep:
                h.retain_grad()
                self.kept.append(h)
        return self.head(h)  # N,10


def layer_gradients(model: DeepMLP, x: torch.Tensor, y: torch.Tensor) -> dict:
    """``{"activation": [||dL/dh(l)||], "weight": [||dL/dW_l||]}`` for l = 1..depth, on one
    batch in training mode, on a copy of the model's buffers (running averages are put back)."""
    buffers = [b.clone() for b in model.buffers()]
    model.train()
    model.keep = True
    model.zero_grad(set_to_none=True)
    try:
        F.cross_entropy(model(x), y).backward()
        act = [float(h.grad.norm()) for h in model.kept]
        weight = [float(lin.weight.grad.norm()) for lin in model.linears]
    finally:
        model.keep = False
        model.kept = []
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for b, saved in zip(model.buffers(), buffers):
                b.copy_(saved)
    return {"activation": act, "weight": weight}


def spread(values) -> float:
    """Largest over smallest of a gradient curve (inf if a value is 0 or not finite)."""
    v = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(v)) or np.any(v <= 0):
        return float("inf")
    return float(v.max() / v.min())


def run(data, method: str, cfg: dict, seed: int = 0) -> dict:
    """Gradients per layer at initialisation and after ``cfg["steps"]`` SGD steps (the study's
    protocol: momentum 0.9, weight decay 5e-4, warm-up and cosine decay) at peak rate
    ``cfg["base_lr"]``, with their spreads, the final training loss and the test error."""
    start = time.process_time()
    x = torch.from_numpy(data.x_train[:PROBE])
    y = torch.from_numpy(data.y_train[:PROBE])
    grads = {}

    def make(total):
        net = DeepMLP(method, inputs=int(np.prod(data.spatial)), n_classes=data.n_classes)
        grads["init"] = layer_gradients(net, x, y)
        return net

    config = TrainConfig(base_lr=cfg["base_lr"])
    model, info = train_model(data, method, cfg["batch_size"], seed, config, net=make, steps=cfg["steps"])
    grads["trained"] = layer_gradients(model, x, y)
    test = _error(model.eval(), torch.from_numpy(data.x_test), torch.from_numpy(data.y_test), 1024)
    return {"method": method, "depth": DEPTH, "width": WIDTH, "steps": info["steps"], "lr": info["lr"],
            "diverged": info["diverged"], "final_train_loss": info["final_train_loss"],
            "train_error": train_error(model, data, 256, info["diverged"]), "test_error": test,
            "gradients": grads,
            "spread": {k: {"activation": spread(g["activation"]), "weight": spread(g["weight"])}
                       for k, g in grads.items()},
            "cpu_seconds": time.process_time() - start}
