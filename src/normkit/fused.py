r"""Residual add fused with LayerNorm / RMSNorm: ``h = x + residual``, ``y = norm(h)``.

The pre-norm transformer block computes both; fused, the sum is written once and read
zero extra times. ``AddNormFunction`` returns ``(y, h)`` and takes gradients from both
outputs; since ``dh/dx = dh/dresidual = 1`` both inputs receive

.. math:: \frac{\partial L}{\partial h} = \underbrace{\mathrm{rstd}\,(\hat g - c_2 -
          \hat h\, c_1)}_{\text{through } y} + \underbrace{g_h}_{\text{direct}},
          \qquad \hat g = g_y \cdot w,\; c_1 = \mathrm{mean}(\hat g\,\hat h),\;
          c_2 = \mathrm{mean}(\hat g)

(``c2 = 0`` for RMSNorm), the gradient of ``normkit.reference`` plus the direct one.

Paths:

* a backend with ``fused_add_forward`` (the GPU one, on CUDA tensors): one kernel each
  way, the ``+ g_h`` folded into the backward kernel;
* otherwise ``h = x + residual`` then the dispatched norm (the numba or composite
  backend), with the same saved tensors and backward -- this is what runs on CPU;
* no memory saving and no fused backend: ``add_*`` do not use this Function at all but
  ``x + residual`` and ``normkit.functional``'s op, which also supports double backward.

Memory-saving backward (opt-in, ``normkit.backends.memory_saving``): save the output
``y`` instead of ``h`` and recompute ``xhat = (y - b) / w``. It needs every weight element
nonzero; with a zero the forward saves ``h`` as usual. Double backward through this
Function is not supported (``once_differentiable``).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from normkit import backends
from normkit import grouping as G
from normkit.autograd import normalize as _normalize
from normkit.backends.torch_ops import stat_dtype

__all__ = ["AddNormFunction", "add_norm"]


def _backward_from_output(gy, gh, y, rstd, weight, bias, center, needs):
    """Composite memory-saving backward over (M, K): ``xhat = (y - b) / w``, then the
    usual ``dx = rstd * (dxhat - c2 - xhat * c1) + gh``; dweight/dbias (K,)."""
    sd = stat_dtype(y.dtype)
    xhat = y.to(sd)                                                # M, K
    if bias is not None:
        xhat = xhat - bias.to(sd).reshape(-1)
    if weight is not None:
        xhat = xhat / weight.to(sd).reshape(-1)
    g = gy.to(sd)                                                  # M, K
    dxhat = g if weight is None else g * weight.to(sd).reshape(-1)
    dx = dw = db = None
    if needs[0]:
        c1 = (dxhat * xhat).mean(-1, keepdim=True)                 # M, 1 (variance path)
        dx = dxhat - xhat * c1
        if center:
            dx = dx - dxhat.mean(-1, keepdim=True)                 # mean path
        dx = dx * rstd.reshape(-1, 1)
        if gh is not None:
            dx = dx + gh.to(sd)
        dx = dx.to(y.dtype)
    if needs[1]:
        dw = (g * xhat).sum(0)
    if needs[2]:
        db = g.sum(0)
    return dx, dw, db


class AddNormFunction(torch.autograd.Function):
    """``(y, h)`` with ``h = x + residual`` and ``y = w * (h - mean) * rstd + b`` over the
    rows of (M, K) views (``center=False``: RMSNorm, mean = 0)."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, center, memory_saving):
        grouping = G.layer(tuple(x.shape), 1)
        backend = backends.select(x, grouping, center)
        fused = hasattr(backend, "fused_add_forward")
        if fused:
            y, h, mean, rstd = backend.fused_add_forward(x, residual, weight, bias, eps,
                                                         center)
        else:
            h = x + residual
            backend = backends.select(h, grouping, center)
            y, mean, rstd, _ = backend.forward(h, grouping, weight, bias, eps, center)
        from_y = bool(memory_saving) and (weight is None or not bool((weight == 0).any()))
        ctx.save_for_backward(y if from_y else h, weight, bias, mean, rstd)
        ctx.backend, ctx.fused, ctx.from_y = backend, fused, from_y
        ctx.grouping, ctx.center = grouping, center
        return y, h

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y, grad_h):
        saved, weight, bias, mean, rstd = ctx.saved_tensors
        nx, nr, nw, nb = ctx.needs_input_grad[:4]
        needs = (nx or nr, nw, nb)
        if ctx.fused:
            dh, dw, db = ctx.backend.fused_add_backward(
                grad_y, grad_h, saved, mean.reshape(-1), rstd.reshape(-1), weight, bias,
                ctx.center, ctx.from_y, needs)
        elif ctx.from_y:
            dh, dw, db = _backward_from_output(grad_y, grad_h, saved, rstd, weight, bias,
                                               ctx.center, needs)
        else:
            dh, dw, db = ctx.backend.backward(grad_y, saved, mean, rstd, weight,
                                              ctx.grouping, ctx.center, False, needs)
            if dh is not None and grad_h is not None:
                dh = dh + grad_h
        dw = None if dw is None or weight is None else dw.reshape(weight.shape).to(weight.dtype)
        db = None if db is None or bias is None else db.reshape(bias.shape).to(bias.dtype)
        return (dh if nx else None), (dh if nr else None), dw, db, None, None, None


def add_norm(x, residual, normalized_ndim, weight, bias, eps, center, memory_saving):
    """``(norm(x + residual), x + residual)`` over the last ``normalized_ndim`` dims
    (arguments already validated by ``normkit.functional.add_layer_norm`` /
    ``add_rms_norm``); ``memory_saving=None`` follows ``backends.memory_saving``."""
    grouping = G.layer(tuple(x.shape), normalized_ndim)
    if memory_saving is None:
        memory_saving = backends.memory_saving_enabled()
    xv = x.reshape(grouping.view)                                  # M, K
    rv = residual.reshape(grouping.view)
    backend = backends.select(xv, grouping, center)
    if not memory_saving and not hasattr(backend, "fused_add_forward"):
        h = x + residual
        return _normalize(h, grouping, weight, bias, eps, center)[0], h
    w = None if weight is None else weight.reshape(-1)
    b = None if bias is None else bias.reshape(-1)
    y, h = AddNormFunction.apply(xv, rv, w, b, eps, center, bool(memory_saving))
    if y.shape != x.shape:
        y, h = y.view(x.shape), h.view(x.shape)
    return y, h
