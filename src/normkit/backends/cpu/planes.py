"""Batch/Instance/GroupNorm on contiguous NCHW, viewed (N, C, S): planes of S elements.

A *unit* is the set of (n, c) planes that share a statistic: a (sample, group) of C/G
adjacent planes for GroupNorm, one plane for InstanceNorm, a channel (N planes at a
stride of C*S) for BatchNorm.

``planes_forward`` / ``planes_backward`` (Instance/GroupNorm): one unit per iteration.
Plane moments Chan-merged over the unit (``moments.plane_merge``), then the unit is
normalized while still in L2, so x is read from memory once; meanwhile the float32/
float64 kernels prefetch the plane ``ahead`` planes on, if it belongs to a later unit of
the range (``tuning.rows_ahead``: a plane is a row of S).

``channels_forward`` / ``channels_backward`` (BatchNorm): blocks of channels
(``tuning.channel_block``) walked sample by sample, so that the planes read in a row
(n, c0..c0+cb) are adjacent in memory (a channel alone would restart the hardware
prefetcher at every plane); per-channel statistics, then the block normalized from
L2/L3.

Backward (see ``stores.dx_rows_planes``): per plane the sums ``sg = sum(g)`` and
``sgx = sum(g * xhat)`` (dbias and dweight before the sum over n, written per (n, c) so
no two iterations write the same memory), then per unit ``c_var = sum(w * sgx) / count``,
``c_mean = sum(w * sg) / count`` (0 without centering; both 0 for fixed statistics).

The BatchNorm kernels (``channels_*``) take ``act`` (``act_stores``): y is stored
through that activation, and the backward's sums and dx use g' = g * act'(z), z = xhat *
w + b recomputed from x and the statistics; ``act`` None (no activation) picks, when
compiling, the loops without its code (the overloads ``_plane_sums_act``,
``_small_store``, ``_small_dx`` and the store drivers).

Arguments are grouped: ``stats = (mean, rstd, var)`` per unit, read (``fixed``) or
written; ``sums = (sg, sgx)``: (N, C); ``out = (stream, ahead)`` as in ``rows``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, types
from numba.extending import overload, register_jitable

from normkit.backends.cpu.half import SUM_RUN, accumulate, copy, like, load, store
from normkit.backends.cpu.moments import plane_merge, split_mean, two_pass
from normkit.backends.cpu.rows import JIT
from normkit.backends.cpu.act_stores import (ACT_SILU, affine_scalar_clamp, affine_scalar_silu,
                                             clamp_grad, dx_rows_planes_clamp,
                                             dx_rows_planes_silu, silu_grad,
                                             store_affine_scalar_act,
                                             store_dx_rows_planes_act)
from normkit.backends.cpu.stores import (affine_scalar, dx_rows_planes, fence,
                                         store_affine_scalar, store_dx_rows_planes)

__all__ = ["channels_backward", "channels_fixed", "channels_forward", "channels_small",
           "channels_small_backward", "planes_backward", "planes_forward", "planes_small",
           "planes_small_backward"]


@register_jitable
def _plane_ahead(a, n, c, ahead, first, last):
    """The plane ``ahead`` planes after a[n, c] (a: (N, C, S), planes counted n * C + c)
    if it lies in [first, last] (the next units of this thread's range), else an empty
    one."""
    f = n * a.shape[1] + c + ahead
    if f < first or f > last:
        return a[0, 0, :0]
    return a[f // a.shape[1], f % a.shape[1]]


@njit(inline="always")   # inlined: see cpu.rows.JIT
def _plane_sums(gb, xb, mu, rs, sdt):
    """(sum(g), sum(g * xhat)) over one plane, xhat = (x - mu) * rs."""
    zero = like(sdt, 0.0)
    n = xb.shape[0]
    sg, sgx = 0.0, 0.0
    for lo in range(0, n, SUM_RUN):
        gr, xr = gb[lo:lo + SUM_RUN], xb[lo:lo + SUM_RUN]
        a, b = zero, zero
        for i in range(xr.shape[0]):
            gi = load(gr, i)
            a = accumulate(a, gi)
            b = accumulate(b, gi * ((load(xr, i) - mu) * rs))
        sg += np.float64(a)
        sgx += np.float64(b)
    return like(sdt, sg), like(sdt, sgx)


def _plane_sums_act(gb, xb, mu, rs, wb, act, sdt):
    """(sum(g'), sum(g' * xhat)) over one plane of BatchNorm followed by ``act``:
    g' = g * act'(z), z = xhat * w + b (``wb = (w, b)`` of the plane's channel); g itself
    where ``act`` is None (``_plane_sums``, chosen when compiling)."""


@overload(_plane_sums_act, inline="always")   # inlined: see cpu.rows.JIT
def _plane_sums_act_impl(gb, xb, mu, rs, wb, act, sdt):
    if isinstance(act, types.NoneType):
        return lambda gb, xb, mu, rs, wb, act, sdt: _plane_sums(gb, xb, mu, rs, sdt)
    return _act_plane_sums


def _act_plane_sums(gb, xb, mu, rs, wb, act, sdt):
    """``_plane_sums_act`` with an activation: one loop per formula, chosen outside it
    (see ``_small_store``)."""
    code, cl, si = act
    wc, bc = wb
    zero = like(sdt, 0.0)
    n = xb.shape[0]
    sg, sgx = 0.0, 0.0
    if code == ACT_SILU:
        for lo in range(0, n, SUM_RUN):
            gr, xr = gb[lo:lo + SUM_RUN], xb[lo:lo + SUM_RUN]
            a, b = zero, zero
            for i in range(xr.shape[0]):
                xh = (load(xr, i) - mu) * rs
                gi = silu_grad(load(gr, i), xh * wc + bc, si[0])
                a = accumulate(a, gi)
                b = accumulate(b, gi * xh)
            sg += np.float64(a)
            sgx += np.float64(b)
        return like(sdt, sg), like(sdt, sgx)
    low, slope, top, leaky = cl[0], cl[1], cl[2], cl[3]
    for lo in range(0, n, SUM_RUN):
        gr, xr = gb[lo:lo + SUM_RUN], xb[lo:lo + SUM_RUN]
        a, b = zero, zero
        for i in range(xr.shape[0]):
            xh = (load(xr, i) - mu) * rs
            gi = clamp_grad(load(gr, i), xh * wc + bc, low, slope, top, leaky)
            a = accumulate(a, gi)
            b = accumulate(b, gi * xh)
        sg += np.float64(a)
        sgx += np.float64(b)
    return like(sdt, sg), like(sdt, sgx)


def _small_store(yr, xr, coefs, act):
    """``y = act(((x - mean_hi) - mean_lo) * scale + shift)`` (``stores.affine_scalar``,
    its ``act_stores`` variants) over one small plane in a plain loop; without ``act``
    where it is None (chosen when compiling: the loop of no activation has none of its
    code, which in the same body, not run, made an eval (64, 32, 8, 8) call on 2 threads
    take 22 us, not 18), else one loop per formula chosen outside it (a branch on the
    activation inside keeps LLVM from vectorizing the loop: (16, 256, 14, 14) eval with
    relu ran 6x slower than without)."""


@overload(_small_store, inline="always")
def _small_store_impl(yr, xr, coefs, act):
    if isinstance(act, types.NoneType):
        return _small_store_plain
    return _small_store_act


def _small_store_plain(yr, xr, coefs, act):
    mh, ml, scale, shift = coefs
    for i in range(xr.shape[0]):
        store(yr, i, affine_scalar(load(xr, i), mh, ml, scale, shift))


def _small_store_act(yr, xr, coefs, act):
    mh, ml, scale, shift = coefs
    code, cl, si = act
    if code == ACT_SILU:
        for i in range(xr.shape[0]):
            store(yr, i, affine_scalar_silu(load(xr, i), mh, ml, scale, shift, si[0]))
    else:
        zero, slope, top, leaky = cl[0], cl[1], cl[2], cl[3]
        for i in range(xr.shape[0]):
            store(yr, i, affine_scalar_clamp(load(xr, i), mh, ml, scale, shift, zero, slope,
                                             top, leaky))


def _small_dx(dr, gr, xr, coefs, act):
    """``dx = (g' * w - c_mean - xhat * c_var) * rstd`` (``stores.dx_rows_planes``, its
    ``act_stores`` variants) over one small plane in a plain loop, ``coefs = (mean, rstd,
    w, b, c_mean, c_var)``: g' = g where ``act`` is None (chosen when compiling: the
    activation's loops in the same body, not run, made a (8, 64, 8, 8) training call 4-9 %
    slower), else g * act'(z), z = xhat * w + b, one loop per formula (see
    ``_small_store``)."""


@overload(_small_dx, inline="always")
def _small_dx_impl(dr, gr, xr, coefs, act):
    if isinstance(act, types.NoneType):
        return _small_dx_plain
    return _small_dx_act


def _small_dx_plain(dr, gr, xr, coefs, act):
    mu, rs, wc, _, c_mean, c_var = coefs
    for i in range(xr.shape[0]):
        store(dr, i, dx_rows_planes(load(gr, i), load(xr, i), wc, mu, rs, c_var, c_mean))


def _small_dx_act(dr, gr, xr, coefs, act):
    mu, rs, wc, bc, c_mean, c_var = coefs
    code, cl, si = act
    if code == ACT_SILU:
        for i in range(xr.shape[0]):
            store(dr, i, dx_rows_planes_silu(load(gr, i), load(xr, i), wc, mu, rs, c_var,
                                             c_mean, bc, si[0]))
    else:
        zero, slope, top, leaky = cl[0], cl[1], cl[2], cl[3]
        for i in range(xr.shape[0]):
            store(dr, i, dx_rows_planes_clamp(load(gr, i), load(xr, i), wc, mu, rs, c_var,
                                              c_mean, bc, zero, slope, top, leaky))


@njit(inline="always")   # inlined: see cpu.rows.JIT
def _unit_coefs(g, x, w, u, groups, stats, flags, sums):
    """The unit ``u`` of Instance/GroupNorm backward: ``(n, c0, cg, mu, rs, c_var,
    c_mean)`` for its planes (n, c0 .. c0 + cg) of g, x: (N, C, S), its per-plane sums
    written to sums = (sg, sgx): (N, C); stats = (mean, rstd) per unit, flags = (center,
    fixed)."""
    mean, rstd = stats
    center, fixed = flags
    sg, sgx = sums
    cg = x.shape[1] // groups
    n, c0 = u // groups, (u % groups) * cg
    mu, rs = mean[u], rstd[u]
    count = cg * x.shape[2]
    wsgx, wsg = 0.0, 0.0
    for c in range(c0, c0 + cg):
        a, q = _plane_sums(g[n, c], x[n, c], mu, rs, mean)
        sg[n, c], sgx[n, c] = a, q
        wsgx += w[c] * q
        wsg += w[c] * a
    c_var = like(mean, 0.0 if fixed else wsgx / count)
    c_mean = like(mean, wsg / count if center and not fixed else 0.0)
    return n, c0, cg, mu, rs, c_var, c_mean


@njit(**JIT)
def planes_forward(x, y, w, b, eps, groups, fixed, stats, out, lo, hi):
    """Instance/GroupNorm: normalize the units [lo, hi) (sample, group) of x: (N, C, S),
    C/groups adjacent planes each; stats per unit, (N * groups,)."""
    mean, rstd, var = stats
    stream, ahead = out
    n_, c_, s_ = x.shape
    cg = c_ // groups
    inv_s = like(mean, 1.0 / s_)
    for u in range(lo, hi):
        n, c0 = u // groups, (u % groups) * cg
        if fixed:
            mh, ml, rs = mean[u], like(mean, 0.0), rstd[u]
        else:
            x0 = load(x[n, c0], 0)                                 # shift of the unit
            count, mean64, m2 = 0.0, 0.0, 0.0                      # float64 merge
            for c in range(c0, c0 + cg):
                count, mean64, m2 = plane_merge(x[n, c], x0, inv_s, mean, count, mean64, m2)
            v = m2 / count
            mh, ml = split_mean(x0, mean64, mean)
            rs = like(mean, 1.0 / math.sqrt(v + eps))
            mean[u], rstd[u], var[u] = mh, rs, v
        for c in range(c0, c0 + cg):                               # unit still in L2
            ahead_plane = _plane_ahead(x, n, c, ahead, n * c_ + c0 + cg, hi * cg - 1)
            store_affine_scalar(y[n, c], (x[n, c],), (mh, ml, rs * w[c], b[c]),
                                (ahead_plane, x[0, 0, :0]), stream)
    if stream:
        fence()


@njit(**JIT)
def planes_backward(g, x, w, stats, groups, center, fixed, dx, sums, out, lo, hi):
    """Instance/GroupNorm: dx of the units [lo, hi) of x, g: (N, C, S); stats =
    (mean, rstd) per unit; sums = (sg, sgx) written per plane."""
    stream, ahead = out
    c_ = x.shape[1]
    for u in range(lo, hi):
        n, c0, cg, mu, rs, c_var, c_mean = _unit_coefs(g, x, w, u, groups, stats,
                                                       (center, fixed), sums)
        for c in range(c0, c0 + cg):                               # unit still in L2
            first, last = n * c_ + c0 + cg, hi * cg - 1
            ahead_planes = (_plane_ahead(g, n, c, ahead, first, last),
                            _plane_ahead(x, n, c, ahead, first, last))
            store_dx_rows_planes(dx[n, c], (g[n, c], x[n, c]), (w[c], mu, rs, c_var, c_mean),
                                 ahead_planes, stream)
    if stream:
        fence()


@njit(**JIT)
def channels_forward(x, y, w, b, eps, block, fixed, stats, stream, act, lo, hi):
    """BatchNorm: the channels [lo, hi) of x: (N, C, S) in blocks of ``block``: plane
    moments by two-pass for the first sample, shifted by the running channel mean for
    the others, Chan-merged per channel, then the block normalized from L2/L3 (followed
    by ``act``, ``act_stores``). stats per channel, (C,)."""
    mean, rstd, var = stats
    n_, c_, s_ = x.shape
    inv_s = like(mean, 1.0 / s_)
    mean64 = np.empty(block)                                       # channel mean - x0
    m2 = np.empty(block)                                           # channel M2
    mh = np.empty(block, dtype=mean.dtype)                         # channel mean: hi
    ml = np.empty(block, dtype=mean.dtype)                         # and lo (split_mean)
    for c0 in range(lo, hi, block):
        c1 = min(hi, c0 + block)
        if fixed:
            copy(mh[:c1 - c0], mean[c0:c1])
            ml[:] = 0.0
        else:
            mean64[:] = 0.0
            m2[:] = 0.0
            for n in range(n_):                                    # the block's planes in a row
                for c in range(c0, c1):                            # x[0, c, 0]: the shift
                    _, mean64[c - c0], m2[c - c0] = plane_merge(
                        x[n, c], load(x[0, c], 0), inv_s, mean, n * s_, mean64[c - c0],
                        m2[c - c0])
            for c in range(c0, c1):
                v = m2[c - c0] / (n_ * s_)
                mh[c - c0], ml[c - c0] = split_mean(load(x[0, c], 0), mean64[c - c0], mean)
                rstd[c] = 1.0 / math.sqrt(v + eps)
                mean[c], var[c] = mh[c - c0], v
        for n in range(n_):
            for c in range(c0, c1):                                # block from L2/L3
                store_affine_scalar_act(y[n, c], (x[n, c],),
                                        (mh[c - c0], ml[c - c0], rstd[c] * w[c], b[c]),
                                        (x[0, 0, :0], x[0, 0, :0]), stream, act, ())
    if stream:
        fence()


@njit(**JIT)
def channels_fixed(x, y, w, b, stats, small, out, act, lo, hi):
    """BatchNorm with given statistics (eval) on several threads: the (n, c) planes
    [lo, hi) of x: (N, C, S), counted n * C + c, in memory order, each
    ``y = ((x - mean) - 0) * (rstd * w) + b`` with its channel's statistics -- the
    arithmetic of ``channels_forward`` and ``channels_small`` with fixed statistics.
    Split like an elementwise op, a thread's range is contiguous memory: the planes its
    neighbours in a model (a convolution before, an activation after) leave in, or take
    from, the same core's cache (on one thread the channel loops cost less). ``small``
    planes (``tuning.SMALL_PLANE``) in a plain loop, as ``channels_small``; ``act``:
    followed by that activation. stats per channel, (C,)."""
    mean, rstd, _ = stats
    stream, ahead = out
    c_, s_ = x.shape[1], x.shape[2]
    n, c = lo // c_, lo % c_
    for u in range(lo, hi):
        if u > lo:                                                 # (n, c) of plane u
            c += 1
            if c == c_:
                n, c = n + 1, 0
        mh, ml = mean[c], like(mean, 0.0)
        scale, shift = rstd[c] * w[c], b[c]
        if small:
            _small_store(y[n, c], x[n, c], (mh, ml, scale, shift), act)
        else:
            store_affine_scalar_act(y[n, c], (x[n, c],), (mh, ml, scale, shift),
                                    (_plane_ahead(x, n, c, ahead, lo, hi - 1), x[0, 0, :0]),
                                    stream, act, ())
    if stream:
        fence()


@njit(**JIT)
def channels_backward(g, x, w, b, stats, block, center, fixed, dx, sums, stream, act, lo, hi):
    """BatchNorm backward: the channels [lo, hi) of x, g: (N, C, S) in blocks, walked
    sample by sample as ``channels_forward`` does: per-plane sums, the channel's
    coefficients, then dx from L2/L3; with ``act``, of g' = g * act'(z) in place of g
    (z = xhat * w + b recomputed). stats = (mean, rstd) per channel."""
    mean, rstd = stats
    sg, sgx = sums
    n_, c_, s_ = x.shape
    c_var = np.empty(block, dtype=mean.dtype)
    c_mean = np.empty(block, dtype=mean.dtype)
    count = n_ * s_
    for c0 in range(lo, hi, block):
        c1 = min(hi, c0 + block)
        for n in range(n_):                                        # the block's planes in a row
            for c in range(c0, c1):
                sg[n, c], sgx[n, c] = _plane_sums_act(g[n, c], x[n, c], mean[c], rstd[c],
                                                      (w[c], b[c]), act, mean)
        for c in range(c0, c1):
            tgx, tg = 0.0, 0.0
            for n in range(n_):
                tgx += sgx[n, c]
                tg += sg[n, c]
            c_var[c - c0] = 0.0 if fixed else w[c] * tgx / count
            c_mean[c - c0] = w[c] * tg / count if center and not fixed else 0.0
        for n in range(n_):                                        # block from L2/L3
            for c in range(c0, c1):
                store_dx_rows_planes_act(dx[n, c], (g[n, c], x[n, c]),
                                         (w[c], mean[c], rstd[c], c_var[c - c0],
                                          c_mean[c - c0]), (x[0, 0, :0], x[0, 0, :0]),
                                         stream, act, (b[c],))
    if stream:
        fence()


@njit(**JIT)
def channels_small(x, y, w, b, eps, fixed, stats, act, lo, hi):
    """BatchNorm forward on small planes (``tuning.SMALL_PLANE``): the channels [lo, hi) of
    x: (N, C, S), each by a two-pass over its N planes in float64 (or the given
    statistics), then ``y = ((x - mean_hi) - mean_lo) * (rstd * w) + b`` -- the formula of
    ``channels_forward`` -- in one plain loop: none of the per-plane machinery (moment
    merges, prefetch, streamed stores), whose fixed cost dominates planes of a few dozen
    elements; ``act``: followed by that activation. stats per channel, (C,)."""
    mean, rstd, var = stats
    n_, c_, s_ = x.shape
    count = n_ * s_
    for c in range(lo, hi):
        if fixed:
            mh, ml, rs = mean[c], like(mean, 0.0), rstd[c]
        else:
            x0 = load(x[0, c], 0)                                  # the channel's shift
            total = 0.0
            for n in range(n_):
                xr = x[n, c]
                for i in range(s_):
                    total = accumulate(total, np.float64(load(xr, i) - x0))
            mean64 = total / count
            m2 = 0.0
            for n in range(n_):
                xr = x[n, c]
                for i in range(s_):
                    d = np.float64(load(xr, i) - x0) - mean64
                    m2 = accumulate(m2, d * d)
            v = m2 / count
            mh, ml = split_mean(x0, mean64, mean)
            rs = like(mean, 1.0 / math.sqrt(v + eps))
            mean[c], rstd[c], var[c] = mh, rs, v
        scale, shift = rs * w[c], b[c]
        for n in range(n_):
            _small_store(y[n, c], x[n, c], (mh, ml, scale, shift), act)


@njit(**JIT)
def channels_small_backward(g, x, w, b, stats, center, fixed, dx, sums, act, lo, hi):
    """BatchNorm backward on small planes: per channel, the per-plane sums of g and
    g * xhat (written to sums = (sg, sgx): (N, C), as ``channels_backward`` writes them),
    then ``dx = (g * w - c_mean - xhat * c_var) * rstd`` (``stores.dx_rows_planes``) in
    one plain loop; with ``act``, of g' = g * act'(z) in place of g. stats = (mean,
    rstd) per channel."""
    mean, rstd = stats
    sg, sgx = sums
    n_, c_, s_ = x.shape
    count = n_ * s_
    for c in range(lo, hi):
        mu, rs, wc, bc = mean[c], rstd[c], w[c], b[c]
        tgx, tg = 0.0, 0.0
        for n in range(n_):
            a, q = _plane_sums_act(g[n, c], x[n, c], mu, rs, (wc, bc), act, mean)
            sg[n, c], sgx[n, c] = a, q
            tgx += q
            tg += a
        c_var = like(mean, 0.0 if fixed else wc * tgx / count)
        c_mean = like(mean, wc * tg / count if center and not fixed else 0.0)
        for n in range(n_):
            _small_dx(dx[n, c], g[n, c], x[n, c], (mu, rs, wc, bc, c_mean, c_var), act)


@njit(**JIT)
def planes_small(x, y, w, b, eps, groups, fixed, stats, lo, hi):
    """Instance/GroupNorm forward on small planes (``tuning.SMALL_PLANE``): the units
    [lo, hi) (sample, group) of x: (N, C, S), each by ``moments.two_pass`` over its C/groups
    planes as one row (a unit is contiguous memory; LayerNorm's row moments), or the given
    statistics, then the formula of ``planes_forward`` in one plain loop per plane
    (``_small_store``). stats per unit, (N * groups,)."""
    mean, rstd, var = stats
    n_, c_, s_ = x.shape
    cg = c_ // groups
    count = cg * s_
    rows = x.reshape(n_ * groups, count)                           # a unit per row
    for u in range(lo, hi):
        n, c0 = u // groups, (u % groups) * cg
        if fixed:
            mh, ml, rs = mean[u], like(mean, 0.0), rstd[u]
        else:
            estimate, correction, m2 = two_pass(rows[u], like(mean, 1.0 / count), mean, True,
                                                 SUM_RUN)
            v = np.float64(m2) / count
            rs = like(mean, 1.0 / math.sqrt(v + eps))
            mh, ml = split_mean(estimate, correction, mean)
            mean[u], rstd[u], var[u] = mh, rs, v
        for c in range(c0, c0 + cg):
            _small_store(y[n, c], x[n, c], (mh, ml, rs * w[c], b[c]), None)


@njit(**JIT)
def planes_small_backward(g, x, w, stats, groups, center, fixed, dx, sums, lo, hi):
    """Instance/GroupNorm backward on small planes: the per-plane sums and coefficients of
    ``planes_backward``, then its dx formula in one plain loop per plane."""
    s_ = x.shape[2]
    for u in range(lo, hi):
        n, c0, cg, mu, rs, c_var, c_mean = _unit_coefs(g, x, w, u, groups, stats,
                                                       (center, fixed), sums)
        for c in range(c0, c0 + cg):
            gr, xr, dr, wc = g[n, c], x[n, c], dx[n, c], w[c]
            for i in range(s_):
                store(dr, i, dx_rows_planes(load(gr, i), load(xr, i), wc, mu, rs, c_var,
                                            c_mean))
