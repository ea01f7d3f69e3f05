"""Composite backend: the normalization written with plain torch ops.

Runs on any device and dtype; it is the fallback of the dispatch and the path taken by
double backward (every op here is differentiable, so autograd can differentiate the
hand-derived backward itself). See ``normkit.reference`` for the derivation.
"""

from __future__ import annotations

import torch


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics are fp64 for fp64 inputs and fp32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def supports(x, grouping, center=True, fixed=False) -> bool:
    return True


def _param(p, grouping, dtype):
    if p is None:
        return None
    p = p.to(dtype)
    return p if grouping.param_view is None else p.view(grouping.param_view)


def rstd_from_var(var, eps):
    """``1 / sqrt(var + eps)``: fixed statistics given as a variance (eval BatchNorm)."""
    return torch.rsqrt(var + eps)


def fixed_stats(grouping, mean, rstd, var, eps):
    """Fixed statistics ``(mean, rstd)`` in ``grouping.stat_shape``, as every path that
    broadcasts them takes them: rstd from ``var`` when given as a variance, and eval
    BatchNorm's running buffers, which come as (C,), viewed. (The CPU plans take the
    statistics as memory and need neither.)"""
    if rstd is None:
        rstd = rstd_from_var(var, eps)
    shape = grouping.stat_shape
    return (mean if mean.shape == shape else mean.view(shape),
            rstd if rstd.shape == shape else rstd.view(shape))


def compute_stats(xs, grouping, eps, center):
    """``(mean, var, rstd)`` of each group of the view ``xs`` (already in stat dtype).

    Biased variance by torch's Welford/two-pass reduction, never E[x^2] - E[x]^2;
    ``rstd = rsqrt(var + eps)``. Without centering, mean is 0 and var is mean(x^2).
    """
    red = grouping.reduce
    if xs.numel() == 0:  # an empty batch: nothing to normalize, no statistics to report
        var = xs.new_zeros(grouping.stat_shape)
        return var, var, torch.rsqrt(var + eps)
    if center:
        var, mean = torch.var_mean(xs, dim=red, correction=0, keepdim=True)
    else:
        var = xs.square().mean(dim=red, keepdim=True)
        mean = torch.zeros_like(var)
    return mean, var, torch.rsqrt(var + eps)


def update_running(running_mean, running_var, mean, var, momentum, unbias=1.0):
    """``running = (1 - momentum) * running + momentum * value`` in place for both
    buffers, ``var`` unbiased (``* unbias``) first, in the buffers' dtype, each product
    rounded before the sum, ``1 - momentum`` in the buffers' dtype too (as the CPU kernel
    does); no autograd: the values detached rather than a ``no_grad`` block, which
    ``torch.export`` cannot keep in a training graph. Per-tensor ops, not ``_foreach_*``,
    which ``torch.func.vmap`` cannot batch."""
    var = var * unbias          # (always: a branch on a symbolic n / (n - 1) is a guard)
    for buffer, value in ((running_mean, mean), (running_var, var)):
        value = value.detach().reshape(buffer.shape).to(buffer.dtype)
        buffer.mul_(torch.tensor(1.0 - momentum, dtype=buffer.dtype)).add_(value * momentum)


def group_moments(x, grouping):
    """``(mean, var)`` of each group of the view ``x``: biased variance, stat dtype,
    shaped ``grouping.stat_shape`` (zeros for an empty input)."""
    mean, var, _ = compute_stats(x.to(stat_dtype(x.dtype)), grouping, 0.0, True)
    return mean, var


def activate(z, act):
    """``act(z)`` (``act`` a ``normkit.activation.Activation``, or None: ``z``), in ``z``'s
    dtype, by torch's own functions (the composite path's fused BatchNorm)."""
    if act is None:
        return z
    if act.name == "relu":
        return torch.relu(z)
    if act.name == "relu6":
        return torch.nn.functional.relu6(z)
    if act.name == "leaky_relu":
        return torch.nn.functional.leaky_relu(z, act.slope)
    return torch.nn.functional.silu(z)


def activation_grad(g, z, act):
    r"""``g * act'(z)`` (``normkit.reference.activation_derivative``) in differentiable torch
    ops, so that autograd differentiates the fused backward too."""
    if act.name == "relu":
        return g * (z > 0).to(g.dtype)
    if act.name == "relu6":
        return g * ((z > 0) & (z < 6)).to(g.dtype)
    if act.name == "leaky_relu":
        return torch.where(z > 0, g, g * act.slope)
    s = torch.sigmoid(z)
    return g * (s * (1 + z * (1 - s)))


def _affine(xhat, w, b):
    y = xhat if w is None else xhat * w
    return y if b is None else y + b


def forward(x, grouping, weight, bias, eps, center=True, mean=None, rstd=None, act=None, *,
            own_shape=False):
    """``y = act(w * xhat + b)`` (``act`` None: no activation), computed in the statistics
    dtype and cast once to ``x``'s; returns ``(y, mean, rstd, var)``, the statistics in
    ``grouping.stat_shape``.

    ``x`` comes in the view's shape, or with ``own_shape`` (Batch/Instance/GroupNorm) in its
    own ``(N, C, *S)``: the statistics are taken over the view of it, and they and the
    parameters, broadcast per channel, meet ``x`` itself, so that ``y`` comes from
    elementwise ops on ``x`` (the same ops per element: the same bits), not as a reshape of
    a view that merged the spatial dims. Traced by ``torch.compile`` with symbolic spatial
    sizes, inductor cannot order the strides of such a reshape when a convolution reads it
    (docs/pytorch2.md)."""
    sdtype = stat_dtype(x.dtype)
    xs = x.to(sdtype)
    var = None
    if mean is None:
        mean, var, rstd = compute_stats(xs.reshape(grouping.view) if own_shape else xs,
                                        grouping, eps, center)
    m, r = mean, rstd
    w, b = _param(weight, grouping, sdtype), _param(bias, grouping, sdtype)
    if own_shape:
        m, r, w, b = (_per_channel(t, grouping, x.shape) for t in (m, r, w, b))
    y = activate(_affine((xs - m) * r, w, b), act)
    return y.to(x.dtype), mean, rstd, var


def _per_channel(t, grouping, shape):
    """``t``, broadcast over ``grouping.view`` of an ``(N, C, *S)`` input with one value
    per channel or group (statistics, parameters), as the same values broadcast over
    ``shape``: ``(1 or N, C, 1, ...)``."""
    if t is None:
        return None
    if grouping.kind == "group":                  # a group's value for each of its channels
        t = t.expand(t.shape[0], grouping.view[1], grouping.view[2], 1)
    return t.reshape(t.shape[0], shape[1], *(1,) * (len(shape) - 2))


def backward(grad, x, mean, rstd, weight, grouping, center, fixed, needs, *, xhat=None,
             reduce_sums=None, act=None, bias=None):
    r"""The hand-derived gradient of ``y = w * xhat + b``, ``xhat = (x - mean) * rstd``:

    .. math:: dx = \mathrm{rstd}\,(\hat g - c_2 - \hat x\, c_1), \quad
              c_1 = \mathrm{mean}(\hat g\,\hat x),\; c_2 = \mathrm{mean}(\hat g),\;
              \hat g = g \cdot w

    over each group (``c2 = 0`` without centering; ``dx = rstd * dxhat`` for fixed
    statistics), ``dw = sum(g * xhat)``, ``db = sum(g)`` over the parameter's broadcast dims.

    The two variations the callers need:

    * ``xhat`` given: use it instead of recomputing ``(x - mean) * rstd`` (the memory-saving
      add-norm recovers it from the output; ``x`` is then only a shape/dtype template);
    * ``reduce_sums(sum_g, sum_gx) -> (c2, c1)``: turns this process's per-group sums of
      ``dxhat`` and ``dxhat * xhat`` into the two means (SyncBatchNorm all-reduces them and
      divides by the global count). Default: divide by the local group size;
    * ``act`` (with the forward's ``bias``): the output was ``act(w * xhat + b)``; the
      pre-activation ``z`` is recomputed from ``xhat`` and ``g`` becomes ``g * act'(z)``
      before all of the above (``normkit.reference.batch_norm_act_backward``).
    """
    sdtype = mean.dtype
    g = grad.to(sdtype)                                           # view shape
    if xhat is None:
        xhat = (x.to(sdtype) - mean) * rstd                       # recomputed
    if act is not None:                                           # g' = g * act'(z)
        z = _affine(xhat, _param(weight, grouping, sdtype), _param(bias, grouping, sdtype))
        g = activation_grad(g, z, act)
    dx = dw = db = None
    if needs[0]:
        w = _param(weight, grouping, sdtype)
        dxhat = g if w is None else g * w
        if fixed:
            dx = dxhat * rstd
        else:
            red = grouping.reduce
            if reduce_sums is None:
                c1 = (dxhat * xhat).mean(dim=red, keepdim=True)   # variance path
                c2 = dxhat.mean(dim=red, keepdim=True) if center else None  # mean path
            else:
                c2, c1 = reduce_sums(dxhat.sum(dim=red, keepdim=True),
                                     (dxhat * xhat).sum(dim=red, keepdim=True))
            dx = dxhat - xhat * c1
            if center:
                dx = dx - c2
            dx = dx * rstd
        dx = dx.to(x.dtype)
    if needs[1]:
        dw = _param_sum(g * xhat, grouping)
    if needs[2]:
        db = _param_sum(g, grouping)
    return dx, dw, db


def _param_sum(t, grouping):
    """Sum over the dims a parameter is broadcast along (kept as size 1); for the
    ``dims`` grouping, whose parameters broadcast as given, the caller sums to size."""
    if grouping.param_view is None or not grouping.param_reduce:
        return t                            # (torch's sum over dim=() would sum everything)
    return t.sum(dim=grouping.param_reduce, keepdim=True)
