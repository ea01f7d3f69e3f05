"""Batch/Instance/GroupNorm on channels_last, viewed (N, S*C): rows of C channels.

The per-(n, c) family (the GPU backend's ``_nc_*`` kernels are the same family over any
strides): a statistic belongs to unit ``u = n * sn + c // cg`` ((sn, cg) = (0, 1) for
BatchNorm, (C, 1) for InstanceNorm, (G, C/G) for GroupNorm), and every pass works on
per-(n, c) quantities:

1. ``nc_moments`` / ``nc_grad_sums``: per-(n, c) partial moments (``moments.
   cl_range_moments``) or gradient sums over ranges of the S positions, in parallel;
2. ``nc_stats`` / ``nc_grad_coefs``: one serial call merges them (float64, Chan) into
   the grouping's statistics and per-(n, c) coefficients;
3. ``nc_apply`` / ``nc_grad_apply``: one pass applies the coefficients, a row at a time
   (``stores.affine_per_channel``, ``stores.dx_per_channel``).

Instance/GroupNorm forward with at least one sample per thread takes one sample per
iteration instead (``cl_sample_forward``): its statistics, then the sample normalized
while it is still in the last-level cache, so x is read from memory once.

The reductions read a block of rows as runs of rows into lanes of the statistics dtype
(``tuning.cl_blocks``): one sequential stream per input, read once (the first block of a
range twice, for its own mean).

Arguments are grouped: ``blocks = (block, run)`` rows per block and per run of lanes;
``partials``: two (N, parts, C) float64 arrays (range p holds the rows [p*len,
(p+1)*len), len = ceil(S / parts)); ``unit = (sn, cg)``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit
from numba.extending import register_jitable

from normkit.backends.cpu.half import copy
from normkit.backends.cpu.moments import (cl_range_grad_sums, cl_range_moments, from_memory,
                                          grad_lanes, lane_scratch, merge_channels)
from normkit.backends.cpu.rows import JIT
from normkit.backends.cpu.stores import fence, store_affine_per_channel, store_dx_per_channel
from normkit.stats_numba import chan_merge

__all__ = ["cl_sample_forward", "nc_apply", "nc_coefs_fixed", "nc_expand", "nc_grad_apply",
           "nc_grad_coefs", "nc_grad_sums", "nc_moments", "nc_stats"]


@register_jitable
def _range(t, parts, s_):
    """(n, first row, end row) of work item t = n * parts + p."""
    n, p = t // parts, t % parts
    plen = (s_ + parts - 1) // parts
    return n, p * plen, min(s_, (p + 1) * plen)


@njit(**JIT)
def nc_moments(x, c_, parts, blocks, sdt, partials, lo, hi):
    """Per-(n, c) mean and M2 of x: (N, S*C) over each range of S, into partials =
    (mean, m2): (N, parts, C) float64. sdt: an empty array of the statistics dtype."""
    block, run = blocks
    pmean, pm2 = partials
    s_ = x.shape[1] // c_
    scratch = lane_scratch(c_, run, sdt)
    fetch = from_memory(x)
    for t in range(lo, hi):
        n, s0, s1 = _range(t, parts, s_)
        p = t % parts
        cl_range_moments(x[n], c_, s0, s1, block, run, pmean[n, p], pm2[n, p], scratch,
                         fetch)


@njit(**JIT)
def cl_sample_forward(x, y, w, b, eps, c_, groups, blocks, stats, stream, lo, hi):
    """Instance/GroupNorm, the samples [lo, hi) of x, y: (N, S*C): statistics of each
    (sample, group), then the sample normalized; stats = (mean, rstd, var):
    (N * groups,)."""
    block, run = blocks
    mean, rstd, var = stats
    s_ = x.shape[1] // c_
    cg = c_ // groups
    cmean = np.empty(c_)                                           # float64
    cm2 = np.empty(c_)
    scratch = lane_scratch(c_, run, mean)
    mu = np.empty(c_, dtype=mean.dtype)
    scale = np.empty(c_, dtype=mean.dtype)
    shift = np.empty(c_, dtype=mean.dtype)
    fetch = from_memory(x)
    for n in range(lo, hi):
        cl_range_moments(x[n], c_, 0, s_, block, run, cmean, cm2, scratch, fetch)
        for g in range(groups):
            gm, m2 = merge_channels(cmean, cm2, np.float64(s_), g * cg, (g + 1) * cg)
            v = m2 / (cg * s_)
            rs = 1.0 / math.sqrt(v + eps)
            u = n * groups + g
            mean[u], rstd[u], var[u] = gm, rs, v
            rest = gm - np.float64(mean[u])                        # (_coefs)
            for c in range(g * cg, (g + 1) * cg):
                mu[c] = mean[u]
                scale[c] = rs * w[c]
                shift[c] = np.float64(b[c]) - rest * np.float64(scale[c])
        store_affine_per_channel(y[n], (x[n],), (mu, scale, shift), c_, 0, s_, stream)
    if stream:
        fence()


@njit(**JIT)
def nc_apply(x, y, c_, parts, coefs, stream, lo, hi):
    """y = (x - mean) * scale + shift with coefs = (mean, scale, shift): (N, C), a row
    at a time; x, y: (N, S*C)."""
    mu, scale, shift = coefs
    s_ = x.shape[1] // c_
    for t in range(lo, hi):
        n, s0, s1 = _range(t, parts, s_)
        store_affine_per_channel(y[n], (x[n],), (mu[n], scale[n], shift[n]), c_, s0, s1,
                                 stream)
    if stream:
        fence()


@njit(**JIT)
def nc_grad_sums(g, x, c_, parts, blocks, stats_nc, partials, lo, hi):
    """Per-(n, c) partial sums of g and g * xhat over each range of S; x, g: (N, S*C);
    stats_nc = (mean, rstd): (N, C); partials = (sg, sgx): (N, parts, C) float64. Per
    block the sums of g and g * (x - mean) accumulate in lanes of the statistics dtype,
    then go to float64 (the second times rstd)."""
    block, run = blocks
    mu, rs = stats_nc
    psg, psgx = partials
    s_ = x.shape[1] // c_
    lanes = grad_lanes(c_, run, mu)
    fetch = from_memory(x)
    for t in range(lo, hi):
        n, s_begin, s_end = _range(t, parts, s_)
        p = t % parts
        sg, sgx = psg[n, p], psgx[n, p]                            # C, float64
        sg[:] = 0.0
        sgx[:] = 0.0
        for r in range(run):
            copy(lanes[2][r * c_:(r + 1) * c_], mu[n])
        cl_range_grad_sums(g[n], x[n], c_, s_begin, s_end, block, run, lanes, rs[n], sg, sgx,
                           fetch)


@njit(**JIT)
def nc_grad_apply(g, x, dx, c_, parts, coefs, stream, lo, hi):
    """dx = g * scale_g - (x - mean) * scale_x - offset with coefs = (mean, scale_g,
    scale_x, offset): (N, C), a row at a time (``stores.dx_per_channel``)."""
    mu, scale_g, scale_x, offset = coefs
    s_ = x.shape[1] // c_
    for t in range(lo, hi):
        n, s0, s1 = _range(t, parts, s_)
        store_dx_per_channel(dx[n], (g[n], x[n]), (mu[n], scale_g[n], scale_x[n], offset[n]),
                             c_, s0, s1, stream)
    if stream:
        fence()


# ---- the serial merges between the passes -------------------------------------------------

@register_jitable
def _unit_of(c_, cg):
    """c // cg for every channel (an integer division per element costs more than the
    rest of these loops)."""
    uc = np.empty(c_, dtype=np.intp)
    for c in range(c_):
        uc[c] = c // cg
    return uc


@njit(**JIT)
def nc_expand(stat, unit, out):
    """out[n, c] = stat[n * sn + c // cg]: per-unit statistics to per-(n, c), (N, C)."""
    sn, cg = unit
    uc = _unit_of(out.shape[1], cg)
    for n in range(out.shape[0]):
        for c in range(out.shape[1]):
            out[n, c] = stat[n * sn + uc[c]]


@register_jitable
def _coefs(stats, sn, uc, w, b, rest, coefs):
    """coefs = (mean, rstd * w (in float64, then rounded), b - rest * scale) per (n, c):
    ``(x - mean) * scale + shift`` with ``rest`` (U,) float64, what the mean's rounding
    to the statistics dtype left off (0 for given statistics), folded into the shift, so
    that data far from zero keep it (an output 250 rounding units off at an offset of
    1000 without). (Not so for BatchNorm's ``columns``: the backward of its activation
    recomputes z from the saved mean.)"""
    mean, rstd = stats[0], stats[1]
    mu, scale, shift = coefs
    for n in range(mu.shape[0]):
        for c in range(mu.shape[1]):
            u = n * sn + uc[c]
            mu[n, c] = mean[u]
            scale[n, c] = np.float64(rstd[u]) * np.float64(w[c])
            shift[n, c] = np.float64(b[c]) - rest[u] * np.float64(scale[n, c])


@njit(**JIT)
def nc_stats(partials, s_, unit, eps, w, b, stats, coefs):
    """The grouping's stats = (mean, rstd, var): (U,) and the forward coefs = (mean,
    scale, shift): (N, C) from the per-range partial moments (N, parts, C) of
    ``nc_moments``: Chan-merged in float64 over the ranges of each (n, c), then over the
    (n, c) of each unit."""
    pmean, pm2 = partials
    mean, rstd, var = stats
    sn, cg = unit
    n_, parts, c_ = pmean.shape
    plen = (s_ + parts - 1) // parts
    uc = _unit_of(c_, cg)
    u_ = mean.shape[0]
    ucount, umean, um2 = np.zeros(u_), np.zeros(u_), np.zeros(u_)
    for n in range(n_):
        for c in range(c_):
            cnt, m, q = 0.0, 0.0, 0.0
            for p in range(parts):
                rows = max(0, min(plen, s_ - p * plen))
                if rows:
                    cnt, m, q = chan_merge(cnt, m, q, np.float64(rows), pmean[n, p, c],
                                           pm2[n, p, c])
            u = n * sn + uc[c]
            ucount[u], umean[u], um2[u] = chan_merge(ucount[u], umean[u], um2[u], cnt, m, q)
    for u in range(u_):
        v = um2[u] / ucount[u]
        mean[u], var[u], rstd[u] = umean[u], v, 1.0 / math.sqrt(v + eps)
        umean[u] -= np.float64(mean[u])                            # the rest (_coefs)
    _coefs(stats, sn, uc, w, b, umean, coefs)


@njit(**JIT)
def nc_coefs_fixed(stats, unit, w, b, coefs):
    """The forward coefs of ``nc_stats`` for given stats = (mean, rstd) (BatchNorm in
    eval)."""
    sn, cg = unit
    _coefs(stats, sn, _unit_of(coefs[0].shape[1], cg), w, b, np.zeros(stats[0].shape[0]),
           coefs)


@njit(**JIT)
def nc_grad_coefs(partials, rstd, w, unit, count, center, fixed, coefs, grads):
    """The backward coefs = (scale_g, scale_x, offset): (N, C) of ``nc_grad_apply`` (see
    ``stores.dx_per_channel``) and grads = (dweight, dbias): (C,) from the per-range sums
    partials = (sum(g), sum(g xhat)): (N, parts, C), with c_var = sum(w g xhat) / count
    and c_mean = sum(w g) / count over each unit (float64; both 0 for fixed statistics,
    c_mean 0 without centering)."""
    psg, psgx = partials
    scale_g, scale_x, offset = coefs
    dw, db = grads
    sn, cg = unit
    n_, parts, c_ = psg.shape
    u_ = rstd.shape[0]
    uc = _unit_of(c_, cg)
    sg = np.zeros((n_, c_))
    sgx = np.zeros((n_, c_))
    for n in range(n_):
        for p in range(parts):
            for c in range(c_):
                sg[n, c] += psg[n, p, c]
                sgx[n, c] += psgx[n, p, c]
    c_var = np.zeros(u_)
    c_mean = np.zeros(u_)
    if not fixed:
        for n in range(n_):
            for c in range(c_):
                u = n * sn + uc[c]
                c_var[u] += np.float64(w[c]) * sgx[n, c]
                c_mean[u] += np.float64(w[c]) * sg[n, c]
        for u in range(u_):
            c_var[u] /= count
            c_mean[u] = c_mean[u] / count if center else 0.0
    for n in range(n_):
        for c in range(c_):
            u = n * sn + uc[c]
            r = np.float64(rstd[u])
            scale_g[n, c] = r * np.float64(w[c])
            scale_x[n, c] = r * r * c_var[u]
            offset[n, c] = r * c_mean[u]
    for c in range(c_):
        tw, tb = 0.0, 0.0
        for n in range(n_):
            tw += sgx[n, c]
            tb += sg[n, c]
        dw[c], db[c] = tw, tb
