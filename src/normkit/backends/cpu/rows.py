"""LayerNorm / RMSNorm on a contiguous (M, K) view: one row per iteration.

Forward: two passes over the row while it sits in L1 (its mean, then the deviations from
it, which correct the mean and give the squared deviations: ``moments.two_pass``), a
third writes y. Without centering (RMSNorm) mean = 0 and var = mean(x^2).

Backward: the rows split in one chunk per thread, each chunk keeping its own partial
dweight/dbias (summed by the caller), so no two iterations write the same memory::

    xhat   = (x - mean) * rstd
    c_var  = mean(g * w * xhat)          (the path through the variance)
    c_mean = mean(g * w)                 (the path through the mean; 0 without centering)
    dx     = (g * w - c_mean - xhat * c_var) * rstd
    dweight = sum(g * xhat),  dbias = sum(g)

While writing row r's output, the float32/float64 kernels prefetch row r + ahead
(``tuning.rows_ahead``), spread over the output pass (``stores``).

The residual-add norms (``add_layer_norm``, ``add_rms_norm``) normalize ``h = x + r``
in the same pass: the row of h is written (rounded to the storage dtype, as ``x + r``
is) and then normalized from L1, so x and r are read once and h is not read back from
memory; their backward adds the gradient of h (``gh``, through the output h) to each
row of dx while it is in L1.

Arguments are grouped: ``stats = (mean, rstd, var)`` (M,) arrays of the statistics dtype
(float32; float64 for float64 input), ``out = (stream, ahead)``: stream the output
(``tuning.STREAM_BYTES``), rows ahead to prefetch (0: none).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit
from numba.extending import register_jitable

from normkit._numba_cache import can_cache
from normkit.backends.cpu.half import SUM_RUN, accumulate, like, load
from normkit.backends.cpu.moments import split_mean, two_pass
from normkit.backends.cpu.stores import (fence, store_add, store_affine_per_element,
                                         store_dx_rows_planes)

# inline="always": each kernel, and each helper with a re-associable reduction
# (``half.accumulate``), is inlined into its caller in numba's IR, so that every entry is
# one compilation. A function compiled on its own and also linked into a caller exists
# twice, optimized in two contexts; with re-association the two round differently, and
# which one runs depended on whether the process compiled the kernels or loaded them from
# the cache (benchmarks/cache_rounding.py, docs/study.md).
# cache: on disk where numba finds a writable folder (normkit._numba_cache)
JIT = dict(cache=can_cache(__file__), nogil=True, inline="always")

__all__ = ["rows_backward", "rows_forward"]


@njit(**JIT)
def rows_forward(x, y, w, b, eps, center, stats, out, lo, hi, add):
    """y = (x - mean) * rstd * w + b for the rows [lo, hi) of x, y: (M, K) storage;
    w, b: (K,) statistics dtype; stats = (mean, rstd, var) written. ``add = (on, res,
    h)``, res and h (M, K): where ``on``, h = x + res is written first and normalized in
    place of x. Rows longer than ``SUM_RUN`` take their sums in runs (``two_pass``), in a
    loop of rows of their own."""
    if x.shape[1] > SUM_RUN:
        _rows_forward(x, y, w, b, eps, center, stats, out, lo, hi, add, SUM_RUN)
    else:
        _rows_forward(x, y, w, b, eps, center, stats, out, lo, hi, add, None)


@register_jitable(inline="always")
def _rows_forward(x, y, w, b, eps, center, stats, out, lo, hi, add, runs):
    mean, rstd, var = stats
    stream, ahead = out
    m, k = x.shape
    inv_k = like(mean, 1.0 / k)
    for r in range(lo, hi):
        xr = x[r]                                                  # K
        ahead_row = x[r + ahead] if ahead and r + ahead < hi else xr[:0]
        on, res, h = add
        if on:                                                     # h = x + res, kept in L1
            ahead_res = res[r + ahead] if ahead and r + ahead < hi else xr[:0]
            store_add(h[r], (xr, res[r]), (), (ahead_row, ahead_res), False)
            xr, ahead_row = h[r], xr[:0]
        estimate, correction, q = two_pass(xr, inv_k, mean, center, runs)
        v = q * inv_k
        rs = like(mean, 1.0 / math.sqrt(v + eps))
        mh, ml = split_mean(estimate, correction, mean)            # the mean, hi + lo
        mean[r] = mh
        rstd[r] = rs
        var[r] = v
        store_affine_per_element(y[r], (xr, w, b), (mh, ml, rs), (ahead_row, xr[:0]),
                                 stream)
    if stream:
        fence()


@njit(**JIT)
def rows_backward(g, x, w, stats, center, dx, partials, out, lo, hi, plus):
    """dx of the row chunks [lo, hi) (chunk t: rows [t*len, (t+1)*len), len =
    ceil(M / chunks)); g, x, dx: (M, K); stats = (mean, rstd); partials = (dw, db):
    (chunks, K), zero on entry, chunk t's sums of g*xhat and g. ``plus = (on, gh)``, gh
    (M, K): where ``on``, gh is added to dx (the gradient of h in the residual-add
    norms)."""
    mean, rstd = stats
    dwp, dbp = partials
    stream, ahead = out
    on, gh = plus
    m, k = x.shape
    chunks = dwp.shape[0]
    chunk = (m + chunks - 1) // chunks
    inv_k = like(mean, 1.0 / k)
    for t in range(lo, hi):
        dwt = dwp[t]                                               # K
        dbt = dbp[t]                                               # K
        r_end = min(m, (t + 1) * chunk)
        for r in range(t * chunk, r_end):
            xr, gr = x[r], g[r]                                    # K each
            if ahead and r + ahead < r_end:
                ahead_rows = (g[r + ahead], x[r + ahead])
            else:
                ahead_rows = (gr[:0], xr[:0])
            mu, rs = mean[r], rstd[r]
            zero = like(mean, 0.0)
            var64, mean64 = 0.0, 0.0
            for lo_k in range(0, k, SUM_RUN):
                hi_k = lo_k + SUM_RUN
                g_, x_, w_ = gr[lo_k:hi_k], xr[lo_k:hi_k], w[lo_k:hi_k]
                dw_, db_ = dwt[lo_k:hi_k], dbt[lo_k:hi_k]
                sv, sm = zero, zero
                for i in range(x_.shape[0]):
                    gi = load(g_, i)
                    xh = (load(x_, i) - mu) * rs
                    dxh = gi * w_[i]
                    sv = accumulate(sv, dxh * xh)
                    sm = accumulate(sm, dxh)
                    dw_[i] += gi * xh
                    db_[i] += gi
                var64 += np.float64(sv)
                mean64 += np.float64(sm)
            c_var = like(mean, var64) * inv_k
            c_mean = like(mean, mean64) * inv_k if center else zero
            store_dx_rows_planes(dx[r], (gr, xr, w), (mu, rs, c_var, c_mean), ahead_rows,
                                 stream and not on)                # x, g from L1/L2
            if on:                                                 # dx rounded, then + gh
                store_add(dx[r], (dx[r], gh[r]), (), (gr[:0], xr[:0]), stream)
    if stream:
        fence()
