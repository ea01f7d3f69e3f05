"""One ``torch.autograd.Function`` for every normalization.

``NormFunction`` runs the backend chosen by ``normkit.backends.select`` and saves only the
input, the fp32 (fp64 for fp64 inputs) ``mean`` and ``rstd``, and the weight. Its backward
is the hand-derived gradient (see ``normkit.reference``), never autograd through the
forward.

Double backward: when the backward itself is differentiated (``create_graph=True``),
it runs the composite torch-op path (``normkit.backends.torch_ops``) with the statistics
recomputed from the saved input by differentiable ops, so autograd differentiates the
hand-derived formula, including its dependence on ``x`` through ``mean`` and ``rstd``.
"""

from __future__ import annotations

import torch

from normkit import backends
from normkit.backends import torch_ops


def _view(t, shape):
    # a view for contiguous and channels_last tensors, a copy only for exotic strides
    try:
        return t.view(shape)
    except RuntimeError:
        return t.reshape(shape)


def _to_param(grad, shape, dtype, grouping):
    """Bring a backend's parameter gradient to the parameter's shape and dtype."""
    if grad is None:
        return None
    if grouping.param_view is None:
        grad = grad.sum_to_size(shape)
    return grad.reshape(shape).to(dtype)


class NormFunction(torch.autograd.Function):
    """``y = weight * (x - mean) * rstd + bias`` over the groups of a ``Grouping``.

    Returns ``(y, mean, var)``; ``mean`` and ``var`` (biased) are the batch statistics,
    non-differentiable, for running-statistic updates (empty when ``fixed_mean`` and
    ``fixed_rstd`` supply the statistics).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, grouping, eps, center, fixed_mean, fixed_rstd):
        # x arrives already viewed as grouping.view; y leaves in that shape (not a view of
        # anything, so that callers may modify it in place)
        fixed = fixed_mean is not None
        backend = backends.select(x, grouping, center, fixed)
        y, mean, rstd, var = backend.forward(x, grouping, weight, bias, eps, center,
                                             fixed_mean, fixed_rstd)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.grouping, ctx.eps, ctx.center, ctx.fixed = grouping, eps, center, fixed
        ctx.backend = backend
        ctx.bias_meta = (bias.shape, bias.dtype) if bias is not None else None
        if fixed:
            mean = var = x.new_empty(0)
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward(ctx, grad_y, _grad_mean, _grad_var):
        x, weight, mean, rstd = ctx.saved_tensors
        grouping = ctx.grouping
        needs = ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():
            # double backward: differentiable composite path, statistics recomputed from x
            if not ctx.fixed:
                xs = x.to(torch_ops.stat_dtype(x.dtype))
                mean, _, rstd = torch_ops.compute_stats(xs, grouping, ctx.eps, ctx.center)
            dx, dw, db = torch_ops.backward(grad_y, x, mean, rstd, weight, grouping,
                                            ctx.center, ctx.fixed, needs)
        else:
            dx, dw, db = ctx.backend.backward(grad_y, x, mean, rstd, weight, grouping,
                                              ctx.center, ctx.fixed, needs)
        if weight is not None:
            dw = _to_param(dw, weight.shape, weight.dtype, grouping)
        if ctx.bias_meta is not None:
            db = _to_param(db, *ctx.bias_meta, grouping)
        return dx, dw, db, None, None, None, None, None


def normalize(x, grouping, weight=None, bias=None, eps=1e-5, center=True,
              fixed_mean=None, fixed_rstd=None):
    """Apply ``NormFunction`` to ``x`` seen through ``grouping.view``; returns
    ``(y, mean, var)`` with ``y`` in ``x``'s shape (and memory layout)."""
    y, mean, var = NormFunction.apply(_view(x, grouping.view), weight, bias, grouping, eps,
                                      center, fixed_mean, fixed_rstd)
    return _view(y, x.shape), mean, var
