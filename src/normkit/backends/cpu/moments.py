"""Moment loops of the CPU kernels: (mean, M2) of NCHW planes and of channels_last rows.

Every partial result is merged with ``normkit.stats_numba.chan_merge`` in float64 (the
one jitted Chan merge, shared with the scalers' kernels). The variance is never
``E[x^2] - E[x]^2`` of raw values: each loop sums deviations from a shift close to the
mean, so the cancellation stays at a few roundings even for data far from zero.

* The first plane of a unit (or channel), and the first block of rows of a channels_last
  range, take a two-pass (the mean, then squared deviations, the data still in L1/L2).
* The planes and blocks after it take one pass of the sums of ``d = x - k`` and ``d*d``,
  ``k`` the running mean of those before: ``M2 = sum(d*d) - sum(d)^2 / n``. The pass
  overlaps with the memory stream, where a second pass from L1/L2 does not; a shift by
  the block's first value instead of the running mean is not enough (it loses digits on
  a large outlier).

A row of LayerNorm/RMSNorm is one block: its moments are ``two_pass``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload, register_jitable

from normkit.backends.cpu.act_stores import ACT_SILU, clamp_grad, silu_grad
from normkit.backends.cpu.half import SUM_RUN, accumulate, copy, like, load
from normkit.backends.cpu.stores import prefetch_lines
from normkit.backends.cpu.tuning import AHEAD_BYTES, AHEAD_FROM_BYTES
from normkit.stats_numba import chan_merge

__all__ = ["cl_range_grad_sums", "cl_range_moments", "fold_lanes", "grad_lanes",
           "from_memory", "lane_scratch", "merge_channels", "plane_merge", "two_pass"]


# ---- rows and NCHW planes ------------------------------------------------------------

def two_pass(xs, inv_n, sdt, center, runs):
    """``(estimate, correction, M2)`` of a row or plane xs: (n,) in the dtype of the array
    sdt, inv_n = 1 / n: the first pass's mean (the estimate), then the deviations from it
    (xs still in L1), whose mean corrects it: the mean is ``estimate + correction`` and
    ``M2 = sum(d^2) - sum(d)^2 / n`` (the corrected two-pass; ``split_mean`` keeps the
    sum whole). The deviations are exact for data far from zero with a small spread, and
    no element is trusted to lie near the others (an outlier as the shift rounded every
    ``x - x0`` at its size). Without ``center`` (RMSNorm): (0, 0, sum(x^2)).

    ``runs``: ``SUM_RUN``, each sum taken in runs of that many elements added in
    float64; None (chosen when compiling), xs is at most ``SUM_RUN`` long and each sum is
    one run. (The rows' kernels compile a loop of rows for each: the runs' loops in the
    short rows' loop, taken or not, slowed it; docs/performance-history.md.)"""


@overload(two_pass, inline="always")   # inlined: see cpu.rows.JIT
def _two_pass_impl(xs, inv_n, sdt, center, runs):
    return _two_pass_whole if isinstance(runs, types.NoneType) else _two_pass_runs


def _two_pass_whole(xs, inv_n, sdt, center, runs):
    zero = like(sdt, 0.0)
    if not center:
        q = zero
        for i in range(xs.shape[0]):
            v = load(xs, i)
            q = accumulate(q, v * v)
        return zero, zero, q
    s = zero
    for i in range(xs.shape[0]):
        s = accumulate(s, load(xs, i))
    estimate = s * inv_n
    sd, q = zero, zero
    for i in range(xs.shape[0]):                                   # from L1
        d = load(xs, i) - estimate
        sd = accumulate(sd, d)
        q = accumulate(q, d * d)
    correction = sd * inv_n
    return estimate, correction, q - sd * correction


def _two_pass_runs(xs, inv_n, sdt, center, runs):
    zero = like(sdt, 0.0)
    n = xs.shape[0]
    if not center:
        q64 = 0.0
        for lo in range(0, n, runs):
            run = xs[lo:lo + runs]
            qr = zero
            for i in range(run.shape[0]):
                v = load(run, i)
                qr = accumulate(qr, v * v)
            q64 += np.float64(qr)
        return zero, zero, like(sdt, q64)
    s64 = 0.0
    for lo in range(0, n, runs):
        run = xs[lo:lo + runs]
        sr = zero
        for i in range(run.shape[0]):
            sr = accumulate(sr, load(run, i))
        s64 += np.float64(sr)
    estimate = like(sdt, s64) * inv_n
    sd, q = _deviation_sums(xs, estimate, sdt, runs)               # from L1
    correction = sd * inv_n
    return estimate, correction, q - sd * correction


@njit(inline="always")
def _deviation_sums(xs, k, sdt, runs):
    """(sum(d), sum(d^2)) of d = x - k over xs, in runs of ``runs`` elements added in
    float64, rounded to the dtype of the array sdt."""
    zero = like(sdt, 0.0)
    s64, q64 = 0.0, 0.0
    for lo in range(0, xs.shape[0], runs):
        run = xs[lo:lo + runs]
        sr, qr = zero, zero
        for i in range(run.shape[0]):
            d = load(run, i) - k
            sr = accumulate(sr, d)
            qr = accumulate(qr, d * d)
        s64 += np.float64(sr)
        q64 += np.float64(qr)
    return like(sdt, s64), like(sdt, q64)


@njit(inline="always")
def split_mean(base, rest, sdt):
    """``(hi, lo)``: the mean ``base + rest`` (an estimate and its correction, or a shift
    and the mean relative to it) as hi, the mean rounded to the dtype of the array sdt
    (the mean stored), and lo, the rest (exact in float64 by TwoSum, then rounded). The
    output formulas compute ``((x - hi) - lo) * scale + shift``: ``x - hi`` is exact for
    data far from zero with a small spread, and lo keeps the digits hi rounded off.
    (``(x - x0) - (mean - x0)``, x0 the first element, rounded at the size of ``x0 -
    mean``, a random distance: about twice torch's error on centred data.)"""
    a, b = np.float64(base), np.float64(rest)
    s = a + b
    bb = s - a
    err = (a - (s - bb)) + (b - bb)                               # s + err == a + b
    hi = like(sdt, s)
    return hi, like(sdt, (s - np.float64(hi)) + err)


@njit(inline="always")   # inlined: see cpu.rows.JIT
def _plane_shifted(xb, x0, mean_x0, inv_s, sdt):
    """(mean - x0, M2) of the plane xb: (S,) in one pass of the sums of d = x - k and
    d*d, with the shift k = x0 + mean_x0 (the running mean of the planes before it)."""
    k = like(sdt, x0 + mean_x0)
    s, q = _deviation_sums(xb, k, sdt, SUM_RUN)
    block_mean = s * inv_s
    return (np.float64(k) - x0) + block_mean, q - s * block_mean


@njit(inline="always")   # inlined: see cpu.rows.JIT
def plane_merge(xb, x0, inv_s, sdt, count, mean_x0, m2):
    """(count, mean - x0, M2) merged with the plane xb: (S,) (float64): the first plane
    (count 0) by two-pass, the others in one pass shifted by the running mean."""
    if count == 0.0:
        estimate, correction, q = two_pass(xb, inv_s, sdt, True, SUM_RUN)
        block_mean = (np.float64(estimate) - x0) + np.float64(correction)
    else:
        block_mean, q = _plane_shifted(xb, x0, mean_x0, inv_s, sdt)
    return chan_merge(count, mean_x0, m2, np.float64(xb.shape[0]), np.float64(block_mean),
                      np.float64(q))


# ---- channels_last rows ---------------------------------------------------------------

@register_jitable
def fold_lanes(lanes, out, c_, run):
    """out[c] = the sum over r < run of lanes[r*C + c] (lane j holds channel j % C)."""
    copy(out, lanes[:c_])
    for r in range(1, run):
        lr = lanes[r * c_:(r + 1) * c_]
        for c in range(c_):
            out[c] += lr[c]


@register_jitable
def lane_scratch(c_, run, sdt):
    """The scratch of ``cl_range_moments``: three (run*C,) and two (C,) arrays of the
    dtype of the array sdt."""
    return (np.empty(run * c_, sdt.dtype), np.empty(run * c_, sdt.dtype),
            np.empty(run * c_, sdt.dtype), np.empty(c_, sdt.dtype), np.empty(c_, sdt.dtype))


@register_jitable
def grad_lanes(c_, run, sdt):
    """The lanes of ``cl_range_grad_sums``: three (run*C,) and one (C,) array of the dtype
    of the array sdt (the third to be filled with the mean, repeated over a run)."""
    return (np.empty(run * c_, sdt.dtype), np.empty(run * c_, sdt.dtype),
            np.empty(run * c_, sdt.dtype), np.empty(c_, sdt.dtype))


@register_jitable
def from_memory(a):
    """Whether the reductions over ``a`` (a whole input) prefetch ahead: ``a`` is at least
    ``tuning.AHEAD_FROM_BYTES``, so its rows come from memory, once."""
    return a.size * a.itemsize >= AHEAD_FROM_BYTES


@njit(inline="always")
def _fetch_ahead(a, i0, count, fetch):
    """Where ``fetch``, prefetch ``count`` elements of a, ``AHEAD_BYTES`` past a[i0]: rows
    read once from memory keep a miss in flight past each 4 KiB page, where the hardware
    prefetcher stops; in cache the prefetches only cost (docs/performance.md)."""
    if fetch:
        ahead = i0 + AHEAD_BYTES // a.itemsize
        prefetch_lines(a, ahead, ahead + count)


@register_jitable
def _lane_sums(xn, c_, s0, s1, run, sums, fetch):
    """sums[j] += x of lane j over the rows [s0, s1) of xn: (S*C,), read as runs of
    ``run`` rows. Two runs per iteration: each lane is loaded and stored once per two
    runs (the loop is bound by the lanes' loads and stores, not by x)."""
    width = run * c_
    g0 = s0
    while g0 + 2 * run <= s1:
        xa, xb = xn[g0 * c_:g0 * c_ + width], xn[g0 * c_ + width:g0 * c_ + 2 * width]
        for j in range(width):
            sums[j] += load(xa, j) + load(xb, j)
        _fetch_ahead(xn, g0 * c_, 2 * width, fetch)
        g0 += 2 * run
    for g in range(g0, s1, run):
        xs = xn[g * c_:min(s1, g + run) * c_]                      # <= run*C
        for j in range(xs.shape[0]):
            sums[j] += load(xs, j)


@register_jitable
def _lane_shifted_sums(xn, c_, s0, s1, run, shift, sums, squares, fetch):
    """sums[j] += d, squares[j] += d * d, d = x - shift[j], over the rows [s0, s1) of xn,
    two runs per iteration as ``_lane_sums``."""
    width = run * c_
    g0 = s0
    while g0 + 2 * run <= s1:
        xa, xb = xn[g0 * c_:g0 * c_ + width], xn[g0 * c_ + width:g0 * c_ + 2 * width]
        for j in range(width):
            da = load(xa, j) - shift[j]
            db = load(xb, j) - shift[j]
            sums[j] += da + db
            squares[j] += da * da + db * db
        _fetch_ahead(xn, g0 * c_, 2 * width, fetch)
        g0 += 2 * run
    for g in range(g0, s1, run):
        xs = xn[g * c_:min(s1, g + run) * c_]
        for j in range(xs.shape[0]):
            d = load(xs, j) - shift[j]
            sums[j] += d
            squares[j] += d * d


@register_jitable
def cl_range_moments(xn, c_, s_begin, s_end, block, run, mean, m2, scratch, fetch):
    """Per-channel mean and M2 (float64, written to mean, m2: (C,)) of the rows
    [s_begin, s_end) of one channels_last sample xn: (S*C,), over blocks of ``block``
    rows Chan-merged in float64. A block is read as runs of ``run`` rows, run*C
    consecutive elements summed into as many lanes of the statistics dtype and folded to
    channels per block. ``scratch`` = (lane sums, lane squares, lane shifts: (run*C,);
    channel sums, channel squares: (C,)), arrays of the statistics dtype. ``fetch``:
    prefetch ahead (``from_memory`` of the whole input)."""
    sums, squares, shift, csum, csq = scratch
    mean[:] = 0.0
    m2[:] = 0.0
    count = 0.0
    for s0 in range(s_begin, s_end, block):
        s1 = min(s_end, s0 + block)
        nb = s1 - s0
        if count == 0.0:                                           # the block's own mean
            sums[:] = 0.0
            _lane_sums(xn, c_, s0, s1, run, sums, fetch)
            fold_lanes(sums, csum, c_, run)
            inv = like(csum, 1.0 / nb)
            for c in range(c_):
                csum[c] *= inv
        else:                                                      # the running mean
            for c in range(c_):
                csum[c] = mean[c]
        for r in range(run):                                       # the shift, per lane
            copy(shift[r * c_:(r + 1) * c_], csum)
        sums[:] = 0.0
        squares[:] = 0.0
        _lane_shifted_sums(xn, c_, s0, s1, run, shift, sums, squares, fetch)
        fold_lanes(sums, csum, c_, run)
        fold_lanes(squares, csq, c_, run)
        for c in range(c_):
            sd = np.float64(csum[c])
            _, mean[c], m2[c] = chan_merge(count, mean[c], m2[c], np.float64(nb),
                                           np.float64(shift[c]) + sd / nb,
                                           np.float64(csq[c]) - sd * sd / nb)
        count += nb


@register_jitable
def _lane_grad_sums(gn, xn, c_, s0, s1, run, lanes, fetch):
    """lane_g[j] += g, lane_gx[j] += g * (x - lane_mean[j]) over the rows [s0, s1) of gn,
    xn, two runs per iteration as ``_lane_sums``."""
    lane_g, lane_gx, lane_mean, _ = lanes
    width = run * c_
    g0 = s0
    while g0 + 2 * run <= s1:
        i0, i1 = g0 * c_, g0 * c_ + width
        xa, xb, ga, gb = xn[i0:i1], xn[i1:i1 + width], gn[i0:i1], gn[i1:i1 + width]
        for j in range(width):
            m = lane_mean[j]
            gi, gk = load(ga, j), load(gb, j)
            lane_g[j] += gi + gk
            lane_gx[j] += gi * (load(xa, j) - m) + gk * (load(xb, j) - m)
        _fetch_ahead(xn, i0, 2 * width, fetch)
        _fetch_ahead(gn, i0, 2 * width, fetch)
        g0 += 2 * run
    for g in range(g0, s1, run):
        i0, i1 = g * c_, min(s1, g + run) * c_
        xs, gs = xn[i0:i1], gn[i0:i1]                              # <= run*C
        for j in range(xs.shape[0]):
            gi = load(gs, j)
            lane_g[j] += gi
            lane_gx[j] += gi * (load(xs, j) - lane_mean[j])


@register_jitable
def _lane_grad_sums_act(gn, xn, c_, s0, s1, run, lanes, act, fetch):
    """``_lane_grad_sums`` of g' = g * act'(z), z = (x - mean) * (rstd * w) + b (the
    forward's z, bit for bit: ``act_stores``), a run at a time; ``act = (code, clamp,
    silu, lane scale rstd * w, lane b)``, the lanes repeated over a run as the mean."""
    lane_g, lane_gx, lane_mean, _ = lanes
    code, cl, si, lane_scale, lane_shift = act
    zero, slope, top, leaky = cl[0], cl[1], cl[2], cl[3]
    for g in range(s0, s1, run):       # one loop per formula (planes._small_store)
        i0, i1 = g * c_, min(s1, g + run) * c_
        xs, gs = xn[i0:i1], gn[i0:i1]                              # <= run*C
        if code == ACT_SILU:
            for j in range(xs.shape[0]):
                d = load(xs, j) - lane_mean[j]
                gi = silu_grad(load(gs, j), d * lane_scale[j] + lane_shift[j], si[0])
                lane_g[j] += gi
                lane_gx[j] += gi * d
        else:
            for j in range(xs.shape[0]):
                d = load(xs, j) - lane_mean[j]
                gi = clamp_grad(load(gs, j), d * lane_scale[j] + lane_shift[j], zero, slope,
                                top, leaky)
                lane_g[j] += gi
                lane_gx[j] += gi * d
        _fetch_ahead(xn, i0, i1 - i0, fetch)
        _fetch_ahead(gn, i0, i1 - i0, fetch)


@register_jitable
def cl_range_grad_sums(gn, xn, c_, s_begin, s_end, block, run, lanes, rstd, sg, sgx,
                       fetch, act=None):
    """Per-channel sums of g and g * xhat (float64, added into sg, sgx: (C,)) over the
    rows [s_begin, s_end) of one channels_last sample gn, xn: (S*C,). Per block of
    ``block`` rows the sums of g and g * (x - mean) accumulate in lanes of the statistics
    dtype, then go to float64 (the second times rstd). ``lanes`` = (lane g, lane g * (x -
    mean), the mean repeated over a run: (run*C,); folded: (C,)). ``fetch``: prefetch
    ahead, as ``cl_range_moments``. ``act`` (BatchNorm with an activation,
    ``_lane_grad_sums_act``): the sums of g' = g * act'(z) instead."""
    lane_g, lane_gx, lane_mean, folded = lanes
    for s0 in range(s_begin, s_end, block):
        lane_g[:] = 0.0
        lane_gx[:] = 0.0
        if act is None:
            _lane_grad_sums(gn, xn, c_, s0, min(s_end, s0 + block), run, lanes, fetch)
        else:
            _lane_grad_sums_act(gn, xn, c_, s0, min(s_end, s0 + block), run, lanes, act,
                                fetch)
        fold_lanes(lane_g, folded, c_, run)
        for c in range(c_):
            sg[c] += folded[c]
        fold_lanes(lane_gx, folded, c_, run)
        for c in range(c_):
            sgx[c] += folded[c] * rstd[c]


@register_jitable
def merge_channels(mean, m2, count, c0, c1):
    """(mean, M2) of the channels [c0, c1) merged, each holding ``count`` elements with
    the given per-channel mean and M2 (float64)."""
    n, gm, gq = 0.0, 0.0, 0.0
    for c in range(c0, c1):
        n, gm, gq = chan_merge(n, gm, gq, count, mean[c], m2[c])
    return gm, gq
