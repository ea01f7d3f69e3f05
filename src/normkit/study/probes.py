"""Two probes of a trained CNN's normalization layers, measured rather than stated.

:func:`weight_scale` -- "the weights' scale no longer sets the activations' scale" (second
article, on BatchNorm). The weight of the second convolution, which feeds a norm, is
multiplied by a constant ``c`` on a copy of the trained network; on one training batch in
training mode the copy's logits are compared with the original's (relative change of
their norm) and the gradient of the loss with respect to that weight is compared too
(the original's norm over the copy's). Behind BatchNorm the logits do not move and the
gradient is divided by ``c``: a ratio of ``c``. Without normalization the scale passes
through to the logits.

:func:`batch_of_one` -- "with a batch of one, BatchNorm cannot compute statistics at all"
(first article). It calls the method's layer for ``(N, D)`` features in training mode on a
batch of one and records the error (type and message) it raises, or None; and it runs the
trained CNN in training mode on single signals: how far a signal's logits move between a
batch of one and a batch of :data:`BATCH` (0 for a per-sample norm), and the test error
with each signal normalized alone, against eval mode.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import normkit.nn as nk

__all__ = ["SCALES", "BATCH", "ALONE", "weight_scale", "batch_of_one", "feature_layer"]

SCALES = (0.1, 10.0)   # the constants the weight is multiplied by
BATCH = 32             # the batch the probes use
ALONE = 500            # test signals run one at a time in training mode


def _logits_and_grad(model, x, y):
    model.train()
    model.zero_grad(set_to_none=True)
    logits = model(x)
    F.cross_entropy(logits, y).backward()
    return logits.detach(), model.conv2.weight.grad.detach().clone()


def weight_scale(model, x: torch.Tensor, y: torch.Tensor) -> list:
    """Per constant of :data:`SCALES`: ``{"scale", "logit_change", "grad_ratio"}`` for
    ``conv2.weight`` of a :class:`~normkit.study.model.Conv1dNet` (see the module docstring);
    the model itself is left as it is."""
    base, g = _logits_and_grad(copy.deepcopy(model), x, y)
    out = []
    for c in SCALES:
        scaled = copy.deepcopy(model)
        with torch.no_grad():
            scaled.conv2.weight.mul_(c)
        logits, g_c = _logits_and_grad(scaled, x, y)
        out.append({"scale": c, "logit_change": float((logits - base).norm() / base.norm()),
                    "grad_ratio": float(g.norm() / g_c.norm())})
    return out


def feature_layer(method: str, width: int = 32):
    """The method's layer for ``(N, D)`` features, or None where it has none here."""
    return {"batch": lambda: nk.BatchNorm1d(width), "group": lambda: nk.GroupNorm(8, width),
            "layer": lambda: nk.LayerNorm(width)}.get(method, lambda: None)()


@torch.no_grad()
def batch_of_one(model, method: str, x: torch.Tensor, y: torch.Tensor) -> dict:
    """``{"error", "alone_change", "alone_error", "eval_error"}`` (see the module docstring);
    ``error`` is None when the layer normalizes a batch of one, absent when the method has
    no ``(N, D)`` layer."""
    out = {}
    layer = feature_layer(method)
    if layer is not None:
        out["error"] = None
        try:
            layer.train()(torch.randn(1, 32))
        except (ValueError, RuntimeError) as e:  # the measurement: which error, with which message
            out["error"] = f"{type(e).__name__}: {e}"
    probe = copy.deepcopy(model).train()
    batch = probe(x[:BATCH])
    alone = torch.cat([probe(x[i:i + 1]) for i in range(BATCH)])
    out["alone_change"] = float((batch - alone).abs().max())
    n = min(ALONE, len(y))
    pred = torch.cat([probe(x[i:i + 1]) for i in range(n)]).argmax(1)
    out["alone_error"] = float((pred != y[:n]).float().mean())
    model.eval()
    out["eval_error"] = float((model(x[:n]).argmax(1) != y[:n]).float().mean())
    return out
