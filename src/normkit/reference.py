"""Readable NumPy float64 reference of every normalization, with hand-derived backward.

This module is the oracle: every fast path in normkit is tested against it. It favours
clarity over speed and computes everything in float64.

Each op has a ``*_forward`` returning ``(out, cache)`` and a ``*_backward(dout, cache)``
returning ``(dx, dweight, dbias)`` (``None`` for absent parameters). All ops share one
core, ``normalize_forward`` / ``normalize_backward``, over a *view* of the input in which
some dims are reduced to get one statistic per group (see ``normkit.grouping``).

Derivation of the backward (one group of n elements; sums run over the group)
------------------------------------------------------------------------------
Forward::

    mu    = sum(x) / n                      (0 when not centering, i.e. RMSNorm)
    var   = sum((x - mu)**2) / n            (biased)
    rstd  = 1 / sqrt(var + eps)
    xhat  = (x - mu) * rstd
    y     = w * xhat + b

Let g = dL/dy and dxhat = g * w. The parameter gradients sum over every element that
shares a parameter::

    dw = sum(g * xhat),  db = sum(g)

For the input, xhat depends on x directly and through mu and rstd::

    d xhat_i / d x_j = rstd * (delta_ij - 1/n) - (x_i - mu) * rstd**3 * (x_j - mu) / n
                     = rstd * (delta_ij - 1/n - xhat_i * xhat_j / n)

so, contracting with dxhat::

    dx_j = rstd * ( dxhat_j                  # term 1: direct path
                    - mean(dxhat)             # term 2: through the mean
                    - xhat_j * mean(dxhat * xhat) )   # term 3: through the variance

With ``c1 = mean(dxhat * xhat)`` and ``c2 = mean(dxhat)``: ``dx = rstd * (dxhat - c2 -
xhat * c1)``. Without centering (RMSNorm: mu = 0, var = mean(x**2)) term 2 vanishes. When
the statistics are fixed constants (BatchNorm in eval, InstanceNorm with
``use_input_stats=False``), terms 2 and 3 vanish: ``dx = rstd * dxhat``.

Only ``x``, ``mu`` and ``rstd`` are kept in the cache; ``xhat`` is recomputed.
"""

from __future__ import annotations

import numpy as np

from normkit import grouping as G
from normkit.activation import resolve

__all__ = [
    "normalize_forward", "normalize_backward",
    "batch_norm_forward", "batch_norm_backward",
    "layer_norm_forward", "layer_norm_backward",
    "instance_norm_forward", "instance_norm_backward",
    "group_norm_forward", "group_norm_backward",
    "rms_norm_forward", "rms_norm_backward",
    "batch_renorm_forward", "batch_renorm_backward",
    "activation_forward", "activation_derivative",
    "batch_norm_act_forward", "batch_norm_act_backward",
]


def _f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def _param(p, grouping: G.Grouping):
    p = _f64(p)
    if p is None or grouping.param_view is None:
        return p
    return p.reshape(grouping.param_view)


# ---------------------------------------------------------------------------------------
# the one core
# ---------------------------------------------------------------------------------------

def normalize_forward(x, grouping: G.Grouping, weight=None, bias=None, eps=1e-5, center=True,
                      mean=None, rstd=None):
    """``y = weight * (x - mean) * rstd + bias`` over the groups of ``grouping``.

    ``mean`` and ``rstd`` (shaped ``grouping.stat_shape``) may be given to normalize with
    fixed statistics; otherwise they are the batch statistics of each group.
    Returns ``(y, cache)``; ``y`` has the shape of ``x``.
    """
    x = _f64(x)
    xv = x.reshape(grouping.view)                                   # view, e.g. N,C,S
    fixed = mean is not None
    if not fixed:
        red = grouping.reduce
        mean = xv.mean(axis=red, keepdims=True) if center else np.zeros(grouping.stat_shape)
        var = ((xv - mean) ** 2).mean(axis=red, keepdims=True)  # biased, two-pass
        rstd = 1.0 / np.sqrt(var + eps)                             # eps inside the root
    xhat = (xv - mean) * rstd                                       # view shape
    w, b = _param(weight, grouping), _param(bias, grouping)
    y = xhat if w is None else xhat * w
    if b is not None:
        y = y + b
    cache = dict(x=x, mean=mean, rstd=rstd, weight=w, has_bias=bias is not None,
                 grouping=grouping, center=center, fixed=fixed,
                 wshape=None if weight is None else np.shape(weight),
                 bshape=None if bias is None else np.shape(bias))
    return y.reshape(x.shape), cache


def normalize_backward(dout, cache):
    """Hand-derived gradients of ``normalize_forward``: ``(dx, dweight, dbias)``."""
    g_ = cache["grouping"]
    x, mean, rstd, w = cache["x"], cache["mean"], cache["rstd"], cache["weight"]
    xv = x.reshape(g_.view)
    g = _f64(dout).reshape(g_.view)                                 # dL/dy, view shape
    xhat = (xv - mean) * rstd                                       # recomputed, not cached
    dxhat = g if w is None else g * w
    if cache["fixed"]:
        dx = dxhat * rstd                                           # stats are constants
    else:
        red = g_.reduce
        c1 = (dxhat * xhat).mean(axis=red, keepdims=True)           # term 3 (variance path)
        dx = dxhat - xhat * c1
        if cache["center"]:
            c2 = dxhat.mean(axis=red, keepdims=True)                # term 2 (mean path)
            dx = dx - c2
        dx = dx * rstd
    dw = db = None
    if w is not None:
        dw = _sum_to(g * xhat, cache["wshape"], g_)
    if cache["has_bias"]:
        db = _sum_to(g, cache["bshape"], g_)
    return dx.reshape(x.shape), dw, db


def _sum_to(t, shape, grouping):
    """Sum a view-shaped gradient down to a parameter's shape."""
    if grouping.param_view is not None:
        return t.sum(axis=grouping.param_reduce, keepdims=True).reshape(shape)
    # parameters broadcast against the view as given: undo numpy broadcasting
    lead = t.ndim - len(shape)
    t = t.sum(axis=tuple(range(lead))) if lead else t
    axes = tuple(i for i, s in enumerate(shape) if s == 1 and t.shape[i] != 1)
    return t.sum(axis=axes, keepdims=True).reshape(shape)


# ---------------------------------------------------------------------------------------
# the methods: each is a grouping plus its own handling of statistics
# ---------------------------------------------------------------------------------------

def batch_norm_forward(x, running_mean=None, running_var=None, weight=None, bias=None,
                       training=False, momentum=0.1, eps=1e-5):
    """BatchNorm over ``(N, C, *S)``: per channel over N and S.

    Training normalizes with the batch statistics and returns updated running statistics
    in the cache (``new_running_mean``, ``new_running_var``; the variance stored unbiased,
    ``var * n / (n - 1)``); eval normalizes with the running statistics.
    """
    x = _f64(x)
    grouping = G.batch(x.shape)
    c = x.shape[1]
    if training or running_mean is None:
        y, cache = normalize_forward(x, grouping, weight, bias, eps)
        n = grouping.group_size
        if running_mean is not None:
            bmean = cache["mean"].reshape(c)
            bvar = ((x.reshape(grouping.view) - cache["mean"]) ** 2).mean(axis=(0, 2)).reshape(c)
            cache["new_running_mean"] = (1 - momentum) * _f64(running_mean) + momentum * bmean
            cache["new_running_var"] = ((1 - momentum) * _f64(running_var)
                                        + momentum * bvar * n / max(n - 1, 1))
        return y, cache
    mean = _f64(running_mean).reshape(grouping.stat_shape)
    rstd = 1.0 / np.sqrt(_f64(running_var).reshape(grouping.stat_shape) + eps)
    return normalize_forward(x, grouping, weight, bias, eps, mean=mean, rstd=rstd)


def layer_norm_forward(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """LayerNorm over the trailing ``normalized_shape`` dims, one statistic per row."""
    x = _f64(x)
    return normalize_forward(x, G.layer(x.shape, len(tuple(normalized_shape))), weight, bias, eps)


def rms_norm_forward(x, normalized_shape, weight=None, eps=None):
    """RMSNorm: ``y = weight * x / sqrt(mean(x**2) + eps)``; eps defaults to float64 eps
    (torch uses the input dtype's eps)."""
    x = _f64(x)
    eps = np.finfo(np.float64).eps if eps is None else eps
    grouping = G.layer(x.shape, len(tuple(normalized_shape)))
    return normalize_forward(x, grouping, weight, None, eps, center=False)


def instance_norm_forward(x, weight=None, bias=None, eps=1e-5, running_mean=None,
                          running_var=None, use_input_stats=True, momentum=0.1):
    """InstanceNorm over ``(N, C, *S)``: per (sample, channel) over S.

    With ``use_input_stats`` the running statistics (if given) are updated with the mean
    over the batch of the per-instance mean and unbiased variance, as torch does.
    """
    x = _f64(x)
    grouping = G.instance(x.shape)
    c = x.shape[1]
    if not use_input_stats:
        mean = np.broadcast_to(_f64(running_mean).reshape(1, c, 1), grouping.stat_shape)
        rstd = 1.0 / np.sqrt(np.broadcast_to(_f64(running_var).reshape(1, c, 1),
                                             grouping.stat_shape) + eps)
        return normalize_forward(x, grouping, weight, bias, eps, mean=mean, rstd=rstd)
    y, cache = normalize_forward(x, grouping, weight, bias, eps)
    if running_mean is not None:
        s = grouping.group_size
        xv = x.reshape(grouping.view)
        ivar = ((xv - cache["mean"]) ** 2).mean(axis=2) * s / max(s - 1, 1)   # N,C unbiased
        cache["new_running_mean"] = ((1 - momentum) * _f64(running_mean)
                                     + momentum * cache["mean"].reshape(-1, c).mean(axis=0))
        cache["new_running_var"] = (1 - momentum) * _f64(running_var) + momentum * ivar.mean(0)
    return y, cache


def group_norm_forward(x, num_groups, weight=None, bias=None, eps=1e-5):
    """GroupNorm over ``(N, C, *S)``: per (sample, group of C/G channels)."""
    x = _f64(x)
    return normalize_forward(x, G.group(x.shape, num_groups), weight, bias, eps)


# every backward is the one core backward: the grouping in the cache says which sums to take
batch_norm_backward = normalize_backward
layer_norm_backward = normalize_backward
rms_norm_backward = normalize_backward
instance_norm_backward = normalize_backward
group_norm_backward = normalize_backward


# ---------------------------------------------------------------------------------------
# Batch Renormalization (Ioffe, 2017)
# ---------------------------------------------------------------------------------------
#
# Forward, one channel over its n values (N and S):
#
#     mu_B  = mean(x),  sigma_B = sqrt(var_B + eps),  rstd = 1 / sigma_B
#     sigma = sqrt(running_var + eps)
#     r     = clip(sigma_B / sigma, 1/r_max, r_max)           stop-gradient: a constant
#     d     = clip((mu_B - running_mean) / sigma, -d_max, d_max)   stop-gradient
#     xhat  = (x - mu_B) * rstd
#     y     = w * (xhat * r + d) + b
#
# Backward. With r and d constants, y is BatchNorm with the effective weight w * r and
# bias w * d + b, so the BatchNorm gradient applies with dxhat = g * w * r. Writing
# dxhat' = g * w (the plain BatchNorm one) and pulling the constant r out of both means:
#
#     dx = rstd * (r*dxhat' - mean(r*dxhat') - xhat * mean(r*dxhat' * xhat))
#        = (r * rstd) * (dxhat'                    # term 1: direct path
#                        - mean(dxhat')            # term 2: through mu_B
#                        - xhat * mean(dxhat' * xhat))   # term 3: through sigma_B
#
# r and d do depend on mu_B and sigma_B, but stop-gradient drops those paths, as the
# paper prescribes. The parameters see y = w * (xhat * r + d) + b directly:
#
#     dw = sum(g * (xhat * r + d)),  db = sum(g)
#
# In eval mode batch renormalization is BatchNorm with the running statistics.

def batch_renorm_forward(x, running_mean, running_var, weight=None, bias=None, training=False,
                         momentum=0.1, eps=1e-5, r_max=3.0, d_max=5.0):
    """Batch renormalization over ``(N, C, *S)``; returns ``(y, cache)``.

    Training: the cache holds ``r``, ``d`` and the updated running statistics
    (``new_running_mean``, ``new_running_var``, variance stored unbiased). Eval: BatchNorm
    with the running statistics.
    """
    if not training:
        y, cache = batch_norm_forward(x, running_mean, running_var, weight, bias, False,
                                      momentum, eps)
        cache["renorm"] = False
        return y, cache
    x = _f64(x)
    grouping = G.batch(x.shape)
    c, n = x.shape[1], grouping.group_size
    xv = x.reshape(grouping.view)                                     # N, C, S
    mu_b = xv.mean(axis=(0, 2), keepdims=True)                        # 1, C, 1
    var_b = ((xv - mu_b) ** 2).mean(axis=(0, 2), keepdims=True)       # 1, C, 1, biased
    sigma_b = np.sqrt(var_b + eps)
    rstd = 1.0 / sigma_b
    rm = _f64(running_mean).reshape(1, c, 1)
    sigma = np.sqrt(_f64(running_var).reshape(1, c, 1) + eps)
    r = np.clip(sigma_b / sigma, 1.0 / r_max, r_max)                  # 1, C, 1
    d = np.clip((mu_b - rm) / sigma, -d_max, d_max)                   # 1, C, 1
    xhat = (xv - mu_b) * rstd                                         # N, C, S
    z = xhat * r + d                                                  # renormalized
    w, b = _param(weight, grouping), _param(bias, grouping)
    y = z if w is None else z * w
    if b is not None:
        y = y + b
    cache = dict(x=x, mean=mu_b, rstd=rstd, r=r, d=d, weight=w, has_bias=bias is not None,
                 grouping=grouping, renorm=True,
                 wshape=None if weight is None else np.shape(weight),
                 bshape=None if bias is None else np.shape(bias))
    cache["new_running_mean"] = (1 - momentum) * _f64(running_mean) + momentum * mu_b.reshape(c)
    cache["new_running_var"] = ((1 - momentum) * _f64(running_var)
                                + momentum * var_b.reshape(c) * n / max(n - 1, 1))
    return y.reshape(x.shape), cache


def batch_renorm_backward(dout, cache):
    """Hand-derived gradients of ``batch_renorm_forward``: ``(dx, dweight, dbias)``."""
    if not cache["renorm"]:
        return normalize_backward(dout, cache)
    g_ = cache["grouping"]
    x, mean, rstd, r, d, w = (cache[k] for k in ("x", "mean", "rstd", "r", "d", "weight"))
    xv = x.reshape(g_.view)
    g = _f64(dout).reshape(g_.view)                                   # N, C, S
    xhat = (xv - mean) * rstd                                         # recomputed
    dxhat = g if w is None else g * w                                 # dxhat' = g * w
    c2 = dxhat.mean(axis=(0, 2), keepdims=True)                       # term 2 (mean path)
    c1 = (dxhat * xhat).mean(axis=(0, 2), keepdims=True)              # term 3 (variance path)
    dx = (r * rstd) * (dxhat - c2 - xhat * c1)
    dw = db = None
    if w is not None:
        dw = _sum_to(g * (xhat * r + d), cache["wshape"], g_)
    if cache["has_bias"]:
        db = _sum_to(g, cache["bshape"], g_)
    return dx.reshape(x.shape), dw, db


# ---------------------------------------------------------------------------------------
# BatchNorm followed by an activation (normkit.activation), fused
# ---------------------------------------------------------------------------------------
# Forward, per channel c, with the statistics of BatchNorm (batch or running):
#
#     z = w * xhat + b                      (the plain BatchNorm output)
#     y = act(z)
#
# Backward. Let g = dL/dy. The activation is elementwise, so dL/dz = g * act'(z) =: g'
# (z recomputed from x and the kept statistics: nothing more is kept than for BatchNorm
# alone). From there it is BatchNorm's backward with g' in place of g:
#
#     dxhat = g' * w
#     dw = sum(g' * xhat),  db = sum(g')
#     dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))   (batch statistics)
#     dx = rstd * dxhat                                               (fixed statistics)
#
# so the two sums the backward takes anyway are sums over g' and g' * xhat, and the
# activation costs one more factor per element, no pass of its own.

def activation_forward(z, activation, negative_slope=0.01):
    """``act(z)`` in float64 for an activation name of ``normkit.activation``."""
    act = resolve(activation, negative_slope)
    z = _f64(z)
    if act.name == "relu":
        return np.maximum(z, 0.0)
    if act.name == "relu6":
        return np.minimum(np.maximum(z, 0.0), 6.0)
    if act.name == "leaky_relu":
        return np.where(z > 0, z, act.slope * z)
    return z / (1.0 + np.exp(-z))                                    # silu: z * sigmoid(z)


def activation_derivative(z, activation, negative_slope=0.01):
    """``act'(z)`` in float64; at the kinks as torch's backward takes it (0 at ``z = 0``
    for relu and at ``z = 0``, ``z = 6`` for relu6; ``slope`` at 0 for leaky_relu)."""
    act = resolve(activation, negative_slope)
    z = _f64(z)
    if act.name == "relu":
        return (z > 0).astype(np.float64)
    if act.name == "relu6":
        return ((z > 0) & (z < 6)).astype(np.float64)
    if act.name == "leaky_relu":
        return np.where(z > 0, 1.0, act.slope)
    s = 1.0 / (1.0 + np.exp(-z))                                     # sigmoid(z)
    return s * (1.0 + z * (1.0 - s))                                 # d(z * s)/dz


def batch_norm_act_forward(x, running_mean=None, running_var=None, weight=None, bias=None,
                           training=False, momentum=0.1, eps=1e-5, activation="relu",
                           negative_slope=0.01):
    """``act(batch_norm(x))``: returns ``(y, cache)``, the cache BatchNorm's (running
    statistics updated as ``batch_norm_forward`` does) plus the activation; ``z`` is not
    kept."""
    z, cache = batch_norm_forward(x, running_mean, running_var, weight, bias, training,
                                  momentum, eps)
    cache["activation"] = (activation, negative_slope)
    cache["bias"] = _param(bias, cache["grouping"])
    return activation_forward(z, activation, negative_slope), cache


def batch_norm_act_backward(dout, cache):
    """Hand-derived gradients of ``batch_norm_act_forward``: ``(dx, dweight, dbias)``."""
    g_ = cache["grouping"]
    x, mean, rstd, w, b = (cache[k] for k in ("x", "mean", "rstd", "weight", "bias"))
    xhat = (x.reshape(g_.view) - mean) * rstd                       # N, C, S, recomputed
    z = xhat if w is None else xhat * w                             # N, C, S
    if b is not None:
        z = z + b                                                   # the pre-activation
    g = _f64(dout).reshape(g_.view) * activation_derivative(z, *cache["activation"])  # g'
    return normalize_backward(g.reshape(x.shape), cache)
