"""The activations a fused BatchNorm applies in its stores (``normkit.activation``).

A BatchNorm kernel with an activation stores ``y = act(z)``, ``z`` its usual output, and
its backward uses ``g' = g * act'(z)`` in place of ``g`` (``z`` recomputed from x and the
saved statistics; ``normkit.reference.batch_norm_act_backward``). Each formula below is
the plain formula of ``stores`` followed by the activation, written once as a Python
function of numbers and made into drivers by ``stores.span_store`` / ``rows_store``.

The kernels take ``act = (code, clamp scalars, silu scalars)`` (``act_params``): the
code of ``normkit.activation.CODES`` and the scalars of its formula in the statistics
dtype; or ``act = None``, no activation, told apart by its type when compiling: an
``overload`` picks the loops without the activation's code, so a callback compiled
unfused (``args.callback``'s ``fused``) has none of it. relu, relu6 and leaky_relu are
one formula of selects (``clamp``), so the streamed (non-temporal) stores evaluate them
on vectors as the plain loop does, with the same bits. SiLU needs ``exp``, which LLVM
does not vectorize without a vector math library (a call of ``expf`` per element): its
stores are the plain loop alone (``streamed=False``), whose pace is that call, not the
memory a streamed store saves.

``span_act_store(..)`` makes one driver of the three (none, clamp, silu): the plain one
where ``act`` is None, chosen when compiling (the unfused driver exactly), else clamp or
silu, chosen once per call outside the loops.
"""

from __future__ import annotations

import math

from numba import types
from numba.extending import overload, register_jitable

from normkit.backends.cpu.stores import (rows_store, span_store, store_affine_per_channel,
                                         store_affine_scalar, store_dx_per_channel,
                                         store_dx_rows_planes, where)

__all__ = ["ACT_SILU", "act_params", "clamp",
           "clamp_grad", "silu", "silu_grad", "store_affine_per_channel_act",
           "store_affine_scalar_act", "store_dx_per_channel_act", "store_dx_rows_planes_act"]

#: the codes of normkit.activation.CODES the kernels tell apart (relu 1, relu6 2 and
#: leaky_relu 3 are ``clamp``'s)
ACT_RELU6, ACT_LEAKY, ACT_SILU = 2, 3, 4

# (register_jitable returns the Python function itself: the streamed stores call it on
# LLVM values, the jitted formulas inline it)


@register_jitable(inline="always")
def clamp(z, zero, slope, top, leaky):
    """relu (``leaky`` 0, ``top`` inf), relu6 (``top`` 6) and leaky_relu (``leaky`` 1)
    of z, as torch's kernels compute them: ``z < 0`` maps to 0 or ``z * slope`` (NaN and
    -0.0 pass through, as ``clamp_min`` and ``leaky_relu`` let them), then ``z > top`` to
    top. (A select, not ``z * 0``: relu(-inf) is 0.)"""
    y = where(z < zero, where(leaky > zero, z * slope, zero), z)
    return where(y > top, top, y)


@register_jitable(inline="always")
def clamp_grad(g, z, zero, slope, top, leaky):
    """``g * clamp'(z)``, at the kinks as torch's backward takes them: relu's
    (``threshold_backward``: 0 where the output is <= 0), relu6's (``hardtanh_backward``:
    0 at z <= 0 and z >= 6), leaky_relu's (``leaky_relu_backward``: ``g * slope`` at
    z <= 0)."""
    return where(z > zero, where(z < top, g, zero), where(leaky > zero, g * slope, zero))


@register_jitable(inline="always")
def silu(z, one):
    """``z * sigmoid(z)`` as torch's CPU kernel computes it: ``z / (1 + exp(-z))``."""
    return z / (one + math.exp(-z))


@register_jitable(inline="always")
def silu_grad(g, z, one):
    """``g * silu'(z)`` as torch's ``silu_backward``: ``g * (s * (1 + z * (1 - s)))``,
    ``s = 1 / (1 + exp(-z))``."""
    s = one / (one + math.exp(-z))
    return g * (s * (one + z * (one - s)))


@register_jitable(inline="always")
def affine_scalar_clamp(x, mean_hi, mean_lo, scale, shift, zero, slope, top, leaky):
    """``clamp(affine_scalar(..))``: the NCHW planes forward with relu, relu6, leaky_relu."""
    return clamp(((x - mean_hi) - mean_lo) * scale + shift, zero, slope, top, leaky)


@register_jitable(inline="always")
def affine_scalar_silu(x, mean_hi, mean_lo, scale, shift, one):
    """``silu(affine_scalar(..))``."""
    return silu(((x - mean_hi) - mean_lo) * scale + shift, one)


@register_jitable(inline="always")
def affine_per_channel_clamp(x, mean, scale, shift, zero, slope, top, leaky):
    """``clamp(affine_per_channel(..))``: the rows-of-channels forward with an activation."""
    return clamp((x - mean) * scale + shift, zero, slope, top, leaky)


@register_jitable(inline="always")
def affine_per_channel_silu(x, mean, scale, shift, one):
    """``silu(affine_per_channel(..))``."""
    return silu((x - mean) * scale + shift, one)


@register_jitable(inline="always")
def dx_rows_planes_clamp(g, x, w, mean, rstd, c_var, c_mean, shift, zero, slope, top, leaky):
    """``dx_rows_planes`` of BatchNorm followed by ``clamp``: ``g`` replaced by
    ``g' = g * clamp'(z)``, ``z = xhat * w + b`` recomputed (``shift``: the plane's b)."""
    xhat = (x - mean) * rstd
    gp = clamp_grad(g, xhat * w + shift, zero, slope, top, leaky)
    return (gp * w - c_mean - xhat * c_var) * rstd


@register_jitable(inline="always")
def dx_rows_planes_silu(g, x, w, mean, rstd, c_var, c_mean, shift, one):
    """``dx_rows_planes`` of BatchNorm followed by SiLU (see ``dx_rows_planes_clamp``)."""
    xhat = (x - mean) * rstd
    gp = silu_grad(g, xhat * w + shift, one)
    return (gp * w - c_mean - xhat * c_var) * rstd


@register_jitable(inline="always")
def dx_per_channel_clamp(g, x, mean, scale_g, scale_x, offset, shift, zero, slope, top, leaky):
    """``dx_per_channel`` with ``g' = g * clamp'(z)``, ``z = (x - mean) * (rstd * w) + b``
    (``scale_g = rstd * w``, ``shift = b``: the forward's z, bit for bit)."""
    d = x - mean
    gp = clamp_grad(g, d * scale_g + shift, zero, slope, top, leaky)
    return gp * scale_g - d * scale_x - offset


@register_jitable(inline="always")
def dx_per_channel_silu(g, x, mean, scale_g, scale_x, offset, shift, one):
    """``dx_per_channel`` with ``g' = g * silu'(z)`` (see ``dx_per_channel_clamp``)."""
    d = x - mean
    gp = silu_grad(g, d * scale_g + shift, one)
    return gp * scale_g - d * scale_x - offset


@register_jitable(inline="always")
def act_params(code, slope, sdt):
    """``act = (code, (zero, slope, top, leaky), (one,))`` of an activation code and
    leaky_relu's slope (a float64), in the dtype of the array ``sdt`` (the statistics
    dtype). The slope is rounded to it as torch's leaky_relu rounds its ``negval`` to the
    opmath type: float32 for float32, bfloat16 and float16, float64 for float64."""
    t = sdt.dtype.type
    top = t(6.0) if code == ACT_RELU6 else t(math.inf)
    leaky = code == ACT_LEAKY
    return (code, (t(0.0), t(slope if leaky else 0.0), top, t(1.0 if leaky else 0.0)),
            (t(1.0),))


# ---- the drivers ---------------------------------------------------------------------

def span_act_store(plain, clamped, silu_store):
    """``store(dst, arrays, scalars, prefetch, stream, act, extra)``: ``plain`` (a
    ``span_store`` driver) where ``act`` is None, else ``clamped`` or ``silu_store`` (the
    drivers of the formula followed by the activation) with ``extra`` (scalars the
    activation's formula alone reads: the backward's b) and the activation's scalars
    appended to ``scalars``."""
    def driver(dst, arrays, scalars, prefetch, stream, act, extra):
        """The output with the activation of ``act``."""

    @overload(driver, inline="always")
    def _driver_impl(dst, arrays, scalars, prefetch, stream, act, extra):
        if isinstance(act, types.NoneType):
            def run_plain(dst, arrays, scalars, prefetch, stream, act, extra):
                plain(dst, arrays, scalars, prefetch, stream)
            return run_plain

        def run(dst, arrays, scalars, prefetch, stream, act, extra):
            if act[0] == ACT_SILU:
                silu_store(dst, arrays, scalars + extra + act[2], prefetch, stream)
            else:
                clamped(dst, arrays, scalars + extra + act[1], prefetch, stream)
        return run
    return driver


def rows_act_store(plain, clamped, silu_store):
    """``store(dst, row_arrays, channel_arrays, c_, r0, r1, stream, act, extra)`` of three
    ``rows_store`` drivers, as ``span_act_store`` (``extra``: channel arrays the
    activation's formula alone reads)."""
    def driver(dst, row_arrays, channel_arrays, c_, r0, r1, stream, act, extra):
        """The output with the activation of ``act``."""

    @overload(driver, inline="always")
    def _driver_impl(dst, row_arrays, channel_arrays, c_, r0, r1, stream, act, extra):
        if isinstance(act, types.NoneType):
            def run_plain(dst, row_arrays, channel_arrays, c_, r0, r1, stream, act, extra):
                plain(dst, row_arrays, channel_arrays, c_, r0, r1, stream)
            return run_plain

        def run(dst, row_arrays, channel_arrays, c_, r0, r1, stream, act, extra):
            if act[0] == ACT_SILU:
                silu_store(dst, row_arrays, channel_arrays + extra, c_, r0, r1, stream,
                           act[2])
            else:
                clamped(dst, row_arrays, channel_arrays + extra, c_, r0, r1, stream, act[1])
        return run
    return driver


store_affine_scalar_act = span_act_store(store_affine_scalar, span_store(affine_scalar_clamp),
                                         span_store(affine_scalar_silu, streamed=False))
store_dx_rows_planes_act = span_act_store(store_dx_rows_planes,
                                          span_store(dx_rows_planes_clamp),
                                          span_store(dx_rows_planes_silu, streamed=False))
store_affine_per_channel_act = rows_act_store(store_affine_per_channel,
                                              rows_store(affine_per_channel_clamp),
                                              rows_store(affine_per_channel_silu,
                                                         streamed=False))
store_dx_per_channel_act = rows_act_store(store_dx_per_channel,
                                          rows_store(dx_per_channel_clamp),
                                          rows_store(dx_per_channel_silu, streamed=False))
