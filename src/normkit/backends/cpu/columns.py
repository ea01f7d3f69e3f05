"""BatchNorm on rows of channels: an (M, C) matrix whose column c is channel c.

That is BatchNorm's memory on channels_last (N, *spatial, C: M = N * S positions) and
BatchNorm1d's (N, C): one channels_last "sample" of M rows, read with the lane loops of
``moments`` and written with the per-channel stores of ``stores``. Every pass walks the
rows in memory order and splits them: a thread's share is contiguous memory, as in an
elementwise op (a split by columns had both cores pull in every line: the spatial
prefetcher fetches lines in pairs). Statistics need every row, so each direction runs in
three stages (``stage``):

0. per chunk of ``chunk`` rows (``tuning.cl_blocks``: one block of lane sums, read twice,
   the second time from L2), per column, in float64: forward the chunk's mean and M2
   (``moments.cl_range_moments``), backward the sums of g and g * xhat
   (``moments.cl_range_grad_sums``). Chunks [lo, hi), into ``sums = (2, chunks, C)``.
1. on one thread: the chunks merged in order into ``sums[:, 0]`` (forward Chan's rule,
   ``stats_numba``; backward a float64 sum), giving the statistics, or dweight, dbias and
   the two coefficients below. The chunks, not the threads, fix the rounding: the same
   bits on any number of threads.
2. per row, rows [lo, hi)::

       y  = (x - mean) * (rstd * w) + b                          (stores.affine_per_channel)
       (followed by the activation of ``act``, with g' = g * act'(z) in place of g in the
       backward: ``act_stores``)
       dx = g * (rstd * w) - (x - mean) * (rstd^2 * c_var) - rstd * c_mean
                                                                 (stores.dx_per_channel)
       c_var  = w * sum(g * xhat) / M    (0 with fixed statistics)
       c_mean = w * sum(g) / M           (0 without centering, or with fixed statistics)
       dweight = sum(g * xhat),  dbias = sum(g),  xhat = (x - mean) * rstd

Eval BatchNorm (given statistics) is stage 2 alone.

Arguments: x, y, g, dx (M*C,) storage (``half``: 16-bit floats as integers); w, b and the
statistics (C,) of the statistics dtype, ``stats = (mean, rstd, var)``; ``chunk = (rows,
run)``: rows per chunk and per run of lanes.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, types
from numba.extending import overload

from normkit.backends.cpu.half import copy
from normkit.backends.cpu.moments import (cl_range_grad_sums, cl_range_moments, from_memory,
                                          grad_lanes, lane_scratch)
from normkit.backends.cpu.rows import JIT
from normkit.backends.cpu.act_stores import (store_affine_per_channel_act,
                                             store_dx_per_channel_act)
from normkit.backends.cpu.stores import fence
from normkit.stats_numba import chan_merge

__all__ = ["chunk_moments", "merge_moments", "apply_rows", "chunk_grad_sums",
           "merge_grad_sums", "dx_rows"]


@njit(**JIT)
def _rows_of(u, rows, m):
    """The rows [r0, r1) of chunk u."""
    return u * rows, min(m, (u + 1) * rows)


@njit(**JIT)
def chunk_moments(x, c_, chunk, sdt, sums, lo, hi):
    """Stage 0 forward: each chunk's per-column mean and M2 into sums = (means, m2s):
    (chunks, C) float64. sdt: an empty array of the statistics dtype (the lanes')."""
    rows, run = chunk
    means, m2s = sums
    m = x.shape[0] // c_
    scratch = lane_scratch(c_, run, sdt)
    fetch = from_memory(x)
    for u in range(lo, hi):
        r0, r1 = _rows_of(u, rows, m)
        cl_range_moments(x, c_, r0, r1, rows, run, means[u], m2s[u], scratch, fetch)


@njit(**JIT)
def merge_moments(sums, rows, m, eps, stats):
    """Stage 1 forward: the chunks' moments merged in order (into sums[:, 0]), then
    stats = (mean, rstd, var) (C,) written."""
    means, m2s = sums
    mean, rstd, var = stats
    c_ = means.shape[1]
    count = np.float64(min(m, rows))
    for u in range(1, means.shape[0]):
        r0, r1 = _rows_of(u, rows, m)
        mu, q, mu_u, q_u = means[0], m2s[0], means[u], m2s[u]
        for c in range(c_):
            _, mu[c], q[c] = chan_merge(count, mu[c], q[c], np.float64(r1 - r0), mu_u[c],
                                        q_u[c])
        count += r1 - r0
    for c in range(c_):
        v = m2s[0, c] / m
        mean[c], var[c] = means[0, c], v
        rstd[c] = 1.0 / math.sqrt(v + eps)


@njit(**JIT)
def apply_rows(x, y, w, b, stats, stream, act, lo, hi):
    """Stage 2 forward (and eval): y = act((x - mean) * (rstd * w) + b) for the rows
    [lo, hi) (``act_stores``); stats = (mean, rstd) (C,), read; ``stream``: non-temporal
    stores."""
    mean, rstd = stats
    c_ = w.shape[0]
    scale = np.empty(c_, mean.dtype)
    for c in range(c_):
        scale[c] = rstd[c] * w[c]
    store_affine_per_channel_act(y, (x,), (mean, scale, b), c_, lo, hi, stream, act, ())
    if stream:
        fence()


def _lane_act(act, rstd, params, run):
    """``act`` with the forward's scale and shift per lane, (run*C,) each (``params =
    (w, b)``), as ``moments.cl_range_grad_sums`` takes it; None where ``act`` is None
    (chosen when compiling: the sums' loop then has none of the activation's code)."""


@overload(_lane_act, inline="always")
def _lane_act_impl(act, rstd, params, run):
    if isinstance(act, types.NoneType):
        return lambda act, rstd, params, run: None

    def lane_act(act, rstd, params, run):
        w, b = params
        c_ = w.shape[0]
        scale, shift = np.empty(run * c_, rstd.dtype), np.empty(run * c_, rstd.dtype)
        for r in range(run):
            for c in range(c_):
                scale[r * c_ + c], shift[r * c_ + c] = rstd[c] * w[c], b[c]
        return (act[0], act[1], act[2], scale, shift)
    return lane_act


@njit(**JIT)
def chunk_grad_sums(g, x, stats, chunk, sums, params, act, lo, hi):
    """Stage 0 backward: each chunk's per-column sums of g and g * xhat into
    sums = (sg, sgx): (chunks, C) float64; with an activation, of g' = g * act'(z), z
    the forward's (``params = (w, b)``)."""
    mean, rstd = stats
    rows, run = chunk
    sg, sgx = sums
    c_ = mean.shape[0]
    m = x.shape[0] // c_
    lanes = grad_lanes(c_, run, mean)
    fetch = from_memory(x)
    for r in range(run):
        copy(lanes[2][r * c_:(r + 1) * c_], mean)
    lane_act = _lane_act(act, rstd, params, run)
    for u in range(lo, hi):
        r0, r1 = _rows_of(u, rows, m)
        sg[u, :] = 0.0
        sgx[u, :] = 0.0
        cl_range_grad_sums(g, x, c_, r0, r1, rows, run, lanes, rstd, sg[u], sgx[u], fetch,
                           lane_act)


@njit(**JIT)
def merge_grad_sums(sums, m, w, center, fixed, grads):
    """Stage 1 backward: the chunks' sums added in order: grads = (dweight, dbias) (C,)
    written, and c_mean, c_var (float64) left in sums[0, 0], sums[1, 0]."""
    sg, sgx = sums
    dw, db = grads
    c_ = sg.shape[1]
    for u in range(1, sg.shape[0]):
        tg, tgx, ag, agx = sg[0], sgx[0], sg[u], sgx[u]
        for c in range(c_):
            tg[c] += ag[c]
            tgx[c] += agx[c]
    for c in range(c_):
        tg, tgx = sg[0, c], sgx[0, c]
        dw[c], db[c] = tgx, tg
        sg[0, c] = w[c] * tg / m if center and not fixed else 0.0  # c_mean
        sgx[0, c] = 0.0 if fixed else w[c] * tgx / m               # c_var


@njit(**JIT)
def dx_rows(g, x, w, b, stats, sums, dx, stream, act, lo, hi):
    """Stage 2 backward: dx for the rows [lo, hi), the coefficients from stage 1 (with an
    activation, g' = g * act'(z) in place of g, ``act_stores``); ``stream``:
    non-temporal stores."""
    mean, rstd = stats
    c_ = w.shape[0]
    scale_g, scale_x = np.empty(c_, mean.dtype), np.empty(c_, mean.dtype)
    offset = np.empty(c_, mean.dtype)
    for c in range(c_):
        rs = rstd[c]
        scale_g[c] = rs * w[c]
        scale_x[c] = rs * rs * sums[1][0, c]
        offset[c] = rs * sums[0][0, c]
    store_dx_per_channel_act(dx, (g, x), (mean, scale_g, scale_x, offset), c_, lo, hi, stream,
                             act, (b,))
    if stream:
        fence()
