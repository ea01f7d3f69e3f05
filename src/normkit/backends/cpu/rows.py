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
(``tuning.rows_ahead``), spread over the output pass (``stores``); rows shorter than
``tuning.SMALL_ROW`` are written by a plain loop of the same formula instead.

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
from numba import njit, types
from numba.extending import overload

from normkit._numba_cache import can_cache
from normkit.backends.cpu.half import SUM_RUN, accumulate, like, load, store
from normkit.backends.cpu.moments import split_mean, two_pass
from normkit.backends.cpu.stores import (affine_per_element, dx_rows_planes, fence, store_add,
                                         store_affine_per_element, store_dx_rows_planes)
from normkit.backends.cpu.tuning import SMALL_ROW

# inline="always": each kernel, and each helper with a re-associable reduction
# (``half.accumulate``), is inlined into its caller in numba's IR, so that every entry is
# one compilation. A function compiled on its own and also linked into a caller exists
# twice, optimized in two contexts; with re-association the two round differently, and
# which one runs depended on whether the process compiled the kernels or loaded them from
# the cache (benchmarks/cache_rounding.py, docs/study.md). The helpers are
# ``njit(inline="always")``, inlined before typing: ``register_jitable(inline="always")``
# inlines after typing, for which numba first compiles the helper whole on its own, and
# nested helpers compiled an entry several times over (docs/performance.md, "First call").
# cache: on disk where numba finds a writable folder (normkit._numba_cache)
JIT = dict(cache=can_cache(__file__), nogil=True, inline="always")

__all__ = ["rows_backward", "rows_forward"]

#: rows whose dweight and dbias the backward sums in the statistics dtype before adding
#: them in float64: a sum per element, one row after another (no vector lanes), so kept
#: short (docs/architecture.md, "Long sums").
GRAD_ROWS = 64


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


@njit(inline="always")
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
        _row_out(y[r], xr, w, b, (mh, ml, rs), ahead_row, stream)
    if stream:
        fence()


@njit(inline="always")
def _row_out(yr, xr, w, b, coefs, ahead_row, stream):
    """y of one row, coefs = (mean_hi, mean_lo, rstd): a row shorter than
    ``tuning.SMALL_ROW`` in a plain loop of its formula (``stores.affine_per_element``),
    others through that formula's driver (prefetching ``ahead_row``, streamed where
    ``stream``)."""
    if xr.shape[0] < SMALL_ROW:
        mh, ml, rs = coefs
        for i in range(xr.shape[0]):
            store(yr, i, affine_per_element(load(xr, i), w[i], b[i], mh, ml, rs))
    else:
        store_affine_per_element(yr, (xr, w, b), coefs, (ahead_row, xr[:0]), stream)


@njit(**JIT)
def rows_backward(g, x, w, stats, center, dx, partials, out, lo, hi, plus):
    """dx of the row chunks [lo, hi) (chunk t: rows [t*len, (t+1)*len), len =
    ceil(M / chunks)); g, x, dx: (M, K); stats = (mean, rstd); partials = (dw, db):
    (chunks, K), zero on entry, chunk t's sums of g*xhat and g: summed over runs of
    ``GRAD_ROWS`` rows in the statistics dtype, the runs added in float64. ``plus = (on,
    gh)``, gh (M, K): where ``on``, gh is added to dx (the gradient of h in the
    residual-add norms)."""
    if x.shape[1] > SUM_RUN:            # long rows: a loop of their own (see rows_forward)
        _rows_backward(g, x, w, stats, center, dx, partials, out, lo, hi, plus, SUM_RUN)
    else:
        _rows_backward(g, x, w, stats, center, dx, partials, out, lo, hi, plus, None)


@njit(inline="always")
def _rows_backward(g, x, w, stats, center, dx, partials, out, lo, hi, plus, runs):
    dwp, dbp = partials
    m, k = x.shape
    chunks = dwp.shape[0]
    chunk = (m + chunks - 1) // chunks
    inv_k = like(stats[0], 1.0 / k)
    for t in range(lo, hi):
        dwt = dwp[t]                                               # K
        dbt = dbp[t]                                               # K
        r_end = min(m, (t + 1) * chunk)
        dw64, db64 = np.zeros(k), np.zeros(k)
        for r0 in range(t * chunk, r_end, GRAD_ROWS):
            for r in range(r0, min(r_end, r0 + GRAD_ROWS)):
                _row_backward(g, x, w, stats, center, dx, (dwt, dbt), out, r, r_end, plus,
                              inv_k, runs)
            for i in range(k):                                     # the run, in float64
                dw64[i] += dwt[i]
                db64[i] += dbt[i]
                dwt[i] = 0
                dbt[i] = 0
        for i in range(k):
            dwt[i] = dw64[i]
            dbt[i] = db64[i]
    if out[0]:
        fence()


@njit(inline="always")
def _row_backward(g, x, w, stats, center, dx, partials, out, r, r_end, plus, inv_k, runs):
    """Row r of ``rows_backward``: dx, and g*xhat and g added to ``partials``."""
    mean, rstd = stats
    dwt, dbt = partials
    stream, ahead = out
    on, gh = plus
    xr, gr = x[r], g[r]                                            # K each
    if ahead and r + ahead < r_end:
        ahead_rows = (g[r + ahead], x[r + ahead])
    else:
        ahead_rows = (gr[:0], xr[:0])
    mu, rs = mean[r], rstd[r]
    sv, sm = _grad_sums(gr, xr, w, (dwt, dbt), mu, rs, mean, runs)
    c_var = sv * inv_k
    c_mean = sm * inv_k if center else like(mean, 0.0)
    _row_dx(dx[r], gr, xr, w, (mu, rs, c_var, c_mean), ahead_rows,
            stream and not on)                                     # x, g from L1/L2
    if on:                                                         # dx rounded, then + gh
        store_add(dx[r], (dx[r], gh[r]), (), (gr[:0], xr[:0]), stream)


@njit(inline="always")
def _row_dx(dr, gr, xr, w, coefs, ahead_rows, stream):
    """dx of one row, coefs = (mean, rstd, c_var, c_mean), as ``_row_out`` writes y: a
    plain loop of ``stores.dx_rows_planes`` for a row shorter than ``tuning.SMALL_ROW``,
    else its driver."""
    if xr.shape[0] < SMALL_ROW:
        mu, rs, c_var, c_mean = coefs
        for i in range(xr.shape[0]):
            store(dr, i, dx_rows_planes(load(gr, i), load(xr, i), w[i], mu, rs, c_var, c_mean))
    else:
        store_dx_rows_planes(dr, (gr, xr, w), coefs, ahead_rows, stream)


def _grad_sums(gr, xr, w, partials, mu, rs, sdt, runs):
    """(sum(g * w * xhat), sum(g * w)) over the row, g * xhat and g added to ``partials``
    = (dw, db); in runs of ``runs`` elements added in float64, or (None, chosen when
    compiling) the row at most ``SUM_RUN`` long, one run."""


@overload(_grad_sums, inline="always")   # inlined: see JIT
def _grad_sums_impl(gr, xr, w, partials, mu, rs, sdt, runs):
    if isinstance(runs, types.NoneType):
        return lambda gr, xr, w, partials, mu, rs, sdt, runs: _grad_run(gr, xr, w, partials,
                                                                        mu, rs, sdt)
    return _grad_runs


@njit(inline="always")
def _grad_run(gr, xr, w, partials, mu, rs, sdt):
    dw, db = partials
    sv, sm = like(sdt, 0.0), like(sdt, 0.0)
    for i in range(xr.shape[0]):
        gi = load(gr, i)
        xh = (load(xr, i) - mu) * rs
        dxh = gi * w[i]
        sv = accumulate(sv, dxh * xh)
        sm = accumulate(sm, dxh)
        dw[i] += gi * xh
        db[i] += gi
    return sv, sm


def _grad_runs(gr, xr, w, partials, mu, rs, sdt, runs):
    dw, db = partials
    var64, mean64 = 0.0, 0.0
    for lo in range(0, xr.shape[0], runs):
        sv, sm = _grad_run(gr[lo:lo + runs], xr[lo:lo + runs], w[lo:lo + runs],
                           (dw[lo:lo + runs], db[lo:lo + runs]), mu, rs, sdt)
        var64 += np.float64(sv)
        mean64 += np.float64(sm)
    return like(sdt, var64), like(sdt, mean64)
