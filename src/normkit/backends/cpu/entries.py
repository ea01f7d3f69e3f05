"""The kernels as the C++ executor calls them: every argument named, one meaning per name.

The node (``native.cpp``) calls every kernel through one C signature, ``void(int64 *a,
double eps)``. An entry's parameters (all but ``eps``, ``proto``, ``sproto``) are its
declaration: each name is a slot of ``a`` (``normkit.backends.cpu.args.SLOTS``: a name
means the same in every entry), and ``args.callback`` compiles the entry as a callback
that reads ``a[slot]`` for each parameter, in order. The node fills the slots it owns
(the tensors' addresses and the call's ``from_var``, ``stream``, ``stage``, ``lo``,
``hi``); the plan fills the others by name from its attributes (``args.constants``), and
a name missing on either side is an error when the plan is built.

Tensors come as addresses of contiguous memory (``address.at`` rebuilds the arrays inside
compiled code, for free); ``proto`` and ``sproto`` are empty arrays of the storage dtype
(``half``: 16-bit floats as integers) and of the statistics dtype, constants of each
callback. Statistics are ``(units,)``; an address 0 for ``mean``, ``rstd``, ``var``: the
caller keeps none (the kernel's own memory). With fixed statistics ``var`` is never
written; ``from_var``: ``rstd`` holds the variance, the rstd is computed from it.

A call covers the work items ``[lo, hi)`` of its ``stage``. Entries with more than one
stage (``args.Work``): stage 0 over its items in parallel, writing partial sums into
``scratch``; stage 1 once, on one thread, merging them in order (so one thread and many
give the same bits); stage 2 over its items in parallel. The scratch each needs, in bytes,
is ``args.scratch_bytes``, its layout in the docstring of the entry.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload, register_jitable

from normkit.backends.cpu import channels_last as cl
from normkit.backends.cpu import columns, planes, rows
from normkit.backends.cpu.act_stores import act_params
from normkit.backends.cpu.address import at as _at
from normkit.backends.cpu.address import float_of_bits
from normkit.backends.cpu.half import copy
from normkit.backends.cpu.rows import JIT

__all__ = ["rows_forward", "rows_backward", "channels_small", "channels_small_backward",
           "planes_small", "planes_small_backward", "channels_forward", "channels_backward",
           "channels_fixed", "planes_forward", "planes_backward", "columns_forward",
           "columns_backward", "cl_forward", "cl_backward"]

_F64 = np.empty(0, np.float64)


@register_jitable
def _stat(address, sproto, units):
    """The (units,) statistics at ``address``, or scratch for address 0 (none kept)."""
    if address == 0:
        return np.empty(units, sproto.dtype)
    return _at(address, sproto, (units,))


@register_jitable
def _rstd(var, eps):
    """1 / sqrt(var + eps) per unit, in var's dtype (torch.rsqrt(var + eps)'s rounding)."""
    out = np.empty_like(var)
    e = var.dtype.type(eps)
    for i in range(var.shape[0]):
        out[i] = var.dtype.type(1.0) / np.sqrt(var[i] + e)
    return out


def _act(act, slope, sproto):
    """The kernels' ``act`` of the constants ``act`` (a code) and ``slope`` (float64 bits),
    in the statistics dtype (``act_stores.act_params``); None where the callback passes
    None (compiled without an activation: ``args.callback``)."""


@overload(_act, inline="always")
def _act_impl(act, slope, sproto):
    if isinstance(act, types.NoneType):
        return lambda act, slope, sproto: None
    return lambda act, slope, sproto: act_params(act, float_of_bits(slope), sproto)


@register_jitable
def _given(mean, rstd, units, from_var, eps, sproto):
    """Fixed statistics (mean, rstd) (units,) as the kernels read them."""
    r = _at(rstd, sproto, (units,))
    return _at(mean, sproto, (units,)), _rstd(r, eps) if from_var else r


# ---- rows: LayerNorm / RMSNorm on (M, K) ------------------------------------------------

@njit(**JIT)
def rows_forward(x, y, w, b, mean, rstd, var, r, h, m, k, center, ahead, stream, lo, hi, eps,
                 proto, sproto):
    """The rows [lo, hi): x, y (M, K); w, b (K,); mean, rstd, var (M,) written; r, h (M, K)
    where given (address not 0): h = x + r, normalized."""
    stats = (_stat(mean, sproto, m), _stat(rstd, sproto, m), _stat(var, sproto, m))
    add = (r != 0, _at(r if r else x, proto, (m, k)), _at(h if h else y, proto, (m, k)))
    rows.rows_forward(_at(x, proto, (m, k)), _at(y, proto, (m, k)), _at(w, sproto, (k,)),
                      _at(b, sproto, (k,)), eps, center != 0, stats, (stream != 0, ahead),
                      lo, hi, add)


@njit(**JIT)
def rows_backward(g, x, dx, w, mean, rstd, dw, db, scratch, gh, m, k, center, ahead, chunks,
                  stream, stage, lo, hi, eps, proto, sproto):
    """g, x, dx (M, K); mean, rstd (M,). Stage 0 over the chunks [lo, hi) of rows: dx (plus
    gh (M, K) where given), and each chunk's sums of g * xhat and g in scratch (2, chunks,
    K) of the statistics dtype; stage 1: dw, db (K,) their sums over the chunks, in
    order."""
    sums = _at(scratch, sproto, (2, chunks, k))
    if stage == 0:
        sums[:, lo:hi] = 0
        rows.rows_backward(_at(g, proto, (m, k)), _at(x, proto, (m, k)), _at(w, sproto, (k,)),
                           (_at(mean, sproto, (m,)), _at(rstd, sproto, (m,))), center != 0,
                           _at(dx, proto, (m, k)), (sums[0], sums[1]), (stream != 0, ahead),
                           lo, hi, (gh != 0, _at(gh if gh else g, proto, (m, k))))
    else:
        dwa, dba = _at(dw, sproto, (k,)), _at(db, sproto, (k,))
        copy(dwa, sums[0, 0])           # (loops: see half.copy)
        copy(dba, sums[1, 0])
        for t in range(1, chunks):
            for i in range(k):
                dwa[i] += sums[0, t, i]
                dba[i] += sums[1, t, i]


# ---- planes: Batch/Instance/GroupNorm on NCHW (N, C, S) ----------------------------------
# forward: the units [lo, hi), a channel (BatchNorm) or a (sample, group); statistics per
# unit, read when fixed. backward stage 0: dx of the units, each plane's sums of g and
# g * xhat in scratch (2, N, C) of the statistics dtype; stage 1: db, dw (C,) those sums
# added over n in float64, in order.

@register_jitable
def _planes_in(x, y, w, b, mean, rstd, var, n, c, s, units, fixed, from_var, eps, proto,
               sproto):
    if fixed:
        given_mean, given_rstd = _given(mean, rstd, units, from_var, eps, sproto)
        stats = (given_mean, given_rstd, _stat(0, sproto, units))
    else:
        stats = (_stat(mean, sproto, units), _stat(rstd, sproto, units),
                 _stat(var, sproto, units))
    return (_at(x, proto, (n, c, s)), _at(y, proto, (n, c, s)), _at(w, sproto, (c,)),
            _at(b, sproto, (c,)), stats)


@njit(**JIT)
def channels_small(x, y, w, b, mean, rstd, var, n, c, s, fixed, from_var, act, slope, lo, hi,
                   eps, proto, sproto):
    xa, ya, wa, ba, stats = _planes_in(x, y, w, b, mean, rstd, var, n, c, s, c, fixed,
                                       from_var, eps, proto, sproto)
    planes.channels_small(xa, ya, wa, ba, eps, fixed != 0, stats, _act(act, slope, sproto), lo,
                          hi)


@njit(**JIT)
def channels_forward(x, y, w, b, mean, rstd, var, n, c, s, fixed, from_var, block, stream, act,
                     slope, lo, hi, eps, proto, sproto):
    xa, ya, wa, ba, stats = _planes_in(x, y, w, b, mean, rstd, var, n, c, s, c, fixed,
                                       from_var, eps, proto, sproto)
    planes.channels_forward(xa, ya, wa, ba, eps, block, fixed != 0, stats, stream != 0,
                            _act(act, slope, sproto), lo, hi)


@njit(**JIT)
def channels_fixed(x, y, w, b, mean, rstd, var, n, c, s, from_var, small, ahead, stream, act,
                   slope, lo, hi, eps, proto, sproto):
    """Eval BatchNorm over the N * C planes [lo, hi) in memory order."""
    xa, ya, wa, ba, stats = _planes_in(x, y, w, b, mean, rstd, var, n, c, s, c, 1, from_var,
                                       eps, proto, sproto)
    planes.channels_fixed(xa, ya, wa, ba, stats, small != 0, (stream != 0, ahead),
                          _act(act, slope, sproto), lo, hi)


@njit(**JIT)
def planes_small(x, y, w, b, mean, rstd, var, n, c, s, groups, fixed, from_var, lo, hi, eps,
                 proto, sproto):
    xa, ya, wa, ba, stats = _planes_in(x, y, w, b, mean, rstd, var, n, c, s, n * groups,
                                       fixed, from_var, eps, proto, sproto)
    planes.planes_small(xa, ya, wa, ba, eps, groups, fixed != 0, stats, lo, hi)


@njit(**JIT)
def planes_forward(x, y, w, b, mean, rstd, var, n, c, s, groups, fixed, from_var, ahead,
                   stream, lo, hi, eps, proto, sproto):
    xa, ya, wa, ba, stats = _planes_in(x, y, w, b, mean, rstd, var, n, c, s, n * groups,
                                       fixed, from_var, eps, proto, sproto)
    planes.planes_forward(xa, ya, wa, ba, eps, groups, fixed != 0, stats,
                          (stream != 0, ahead), lo, hi)


@register_jitable
def _planes_back(g, x, dx, w, mean, rstd, scratch, n, c, s, units, proto, sproto):
    sums = _at(scratch, sproto, (2, n, c))
    return (_at(g, proto, (n, c, s)), _at(x, proto, (n, c, s)), _at(dx, proto, (n, c, s)),
            _at(w, sproto, (c,)), (_at(mean, sproto, (units,)), _at(rstd, sproto, (units,))),
            (sums[0], sums[1]))


@register_jitable
def _bias(b, c, sproto):
    """The bias (C,) a backward with an activation reads (its z); the node always gives
    one (its plan's zeros for none), so nothing is allocated per call."""
    return _at(b, sproto, (c,))


@register_jitable
def _sum_planes(scratch, n, c, dw, db, sproto):
    """Stage 1 of the planes backward: db, dw (C,) from the per-plane sums (2, N, C), each
    added over n in float64 (in the order n = 0, 1, ...) and rounded once."""
    sums = _at(scratch, sproto, (2, n, c))
    for grad, per_plane in ((_at(db, sproto, (c,)), sums[0]), (_at(dw, sproto, (c,)), sums[1])):
        for ch in range(c):
            total = 0.0
            for i in range(n):
                total += np.float64(per_plane[i, ch])
            grad[ch] = total


@njit(**JIT)
def channels_small_backward(g, x, dx, w, b, mean, rstd, dw, db, scratch, n, c, s, center,
                            fixed, act, slope, stage, lo, hi, eps, proto, sproto):
    if stage == 1:
        _sum_planes(scratch, n, c, dw, db, sproto)
        return
    ga, xa, dxa, wa, stats, sums = _planes_back(g, x, dx, w, mean, rstd, scratch, n, c, s, c,
                                                proto, sproto)
    planes.channels_small_backward(ga, xa, wa, _bias(b, c, sproto), stats, center != 0,
                                   fixed != 0, dxa, sums, _act(act, slope, sproto), lo, hi)


@njit(**JIT)
def channels_backward(g, x, dx, w, b, mean, rstd, dw, db, scratch, n, c, s, block_bwd, center,
                      fixed, stream, act, slope, stage, lo, hi, eps, proto, sproto):
    if stage == 1:
        _sum_planes(scratch, n, c, dw, db, sproto)
        return
    ga, xa, dxa, wa, stats, sums = _planes_back(g, x, dx, w, mean, rstd, scratch, n, c, s, c,
                                                proto, sproto)
    planes.channels_backward(ga, xa, wa, _bias(b, c, sproto), stats, block_bwd, center != 0,
                             fixed != 0, dxa, sums, stream != 0, _act(act, slope, sproto), lo,
                             hi)


@njit(**JIT)
def planes_small_backward(g, x, dx, w, mean, rstd, dw, db, scratch, n, c, s, groups, center,
                          fixed, stage, lo, hi, eps, proto, sproto):
    if stage == 1:
        _sum_planes(scratch, n, c, dw, db, sproto)
        return
    ga, xa, dxa, wa, stats, sums = _planes_back(g, x, dx, w, mean, rstd, scratch, n, c, s,
                                                n * groups, proto, sproto)
    planes.planes_small_backward(ga, xa, wa, stats, groups, center != 0, fixed != 0, dxa, sums,
                                 lo, hi)


@njit(**JIT)
def planes_backward(g, x, dx, w, mean, rstd, dw, db, scratch, n, c, s, groups, center, fixed,
                    ahead, stream, stage, lo, hi, eps, proto, sproto):
    if stage == 1:
        _sum_planes(scratch, n, c, dw, db, sproto)
        return
    ga, xa, dxa, wa, stats, sums = _planes_back(g, x, dx, w, mean, rstd, scratch, n, c, s,
                                                n * groups, proto, sproto)
    planes.planes_backward(ga, xa, wa, stats, groups, center != 0, fixed != 0, dxa, sums,
                           (stream != 0, ahead), lo, hi)


# ---- columns: BatchNorm on an (M, C) matrix of rows of channels (``columns``) -------------
# x flat (M * C), in chunks of ``rows`` rows (runs of ``run``); scratch (2, chunks, C)
# float64. Forward: stage 0 over the chunks (moments), 1 (merged: mean, rstd, var (C,)
# written), 2 over the rows (y); with fixed statistics stage 2 alone. Backward: stage 0
# (sums of g and g * xhat), 1 (dw, db (C,) written), 2 over the rows (dx).

@register_jitable
def _columns_sums(scratch, m, c, rows_):
    sums = _at(scratch, _F64, (2, -(-m // rows_), c))
    return sums[0], sums[1]


@njit(**JIT)
def columns_forward(x, y, w, b, mean, rstd, var, scratch, m, c, rows, run, from_var, stream,
                    act, slope, stage, lo, hi, eps, proto, sproto):
    xa = _at(x, proto, (m * c,))
    if stage == 0:
        columns.chunk_moments(xa, c, (rows, run), sproto, _columns_sums(scratch, m, c, rows),
                              lo, hi)
    elif stage == 1:
        columns.merge_moments(_columns_sums(scratch, m, c, rows), rows, m, eps,
                              (_at(mean, sproto, (c,)), _at(rstd, sproto, (c,)),
                               _at(var, sproto, (c,))))
    else:
        columns.apply_rows(xa, _at(y, proto, (m * c,)), _at(w, sproto, (c,)),
                           _at(b, sproto, (c,)), _given(mean, rstd, c, from_var, eps, sproto),
                           stream != 0, _act(act, slope, sproto), lo, hi)


@njit(**JIT)
def columns_backward(g, x, dx, w, b, mean, rstd, dw, db, scratch, m, c, rows, run, center,
                     fixed, stream, act, slope, stage, lo, hi, eps, proto, sproto):
    ga, xa = _at(g, proto, (m * c,)), _at(x, proto, (m * c,))
    wa, ba = _at(w, sproto, (c,)), _bias(b, c, sproto)
    stats = (_at(mean, sproto, (c,)), _at(rstd, sproto, (c,)))
    sums = _columns_sums(scratch, m, c, rows)
    acts = _act(act, slope, sproto)
    if stage == 0:
        columns.chunk_grad_sums(ga, xa, stats, (rows, run), sums, (wa, ba), acts, lo, hi)
    elif stage == 1:
        columns.merge_grad_sums(sums, m, wa, center != 0, fixed != 0,
                                (_at(dw, sproto, (c,)), _at(db, sproto, (c,))))
    else:
        columns.dx_rows(ga, xa, wa, ba, stats, sums, _at(dx, proto, (m * c,)), stream != 0,
                        acts, lo, hi)


# ---- channels_last Instance/GroupNorm (``channels_last``), viewed (N, S * C) -------------
# The items are (sample, range of positions), ``parts`` ranges per sample; statistics per
# unit u = n * sn + c // cg (N * sn units). Scratch: the per-range partials (2, N, parts,
# C) float64, then (4, N, C) of the statistics dtype (coefficients per (n, c)).
# Forward: stage 0 (partial moments), 1 (statistics and coefficients), 2 (y); with fixed
# statistics stages 1 (coefficients) and 2; ``per_sample``: stage 0 over the samples is
# the whole call (a sample's statistics, then the sample). Backward: stage 0 (partial
# sums), 1 (dw, db and coefficients), 2 (dx).

@register_jitable
def _cl_scratch(scratch, n, c, parts, sproto):
    partials = _at(scratch, _F64, (2, n, parts, c))
    per_nc = _at(scratch + 16 * n * parts * c, sproto, (4, n, c))
    return (partials[0], partials[1]), per_nc


@njit(**JIT)
def cl_forward(x, y, w, b, mean, rstd, var, scratch, n, c, s, parts, rows, run, sn, cg,
               per_sample, fixed, from_var, stream, stage, lo, hi, eps, proto, sproto):
    xa, ya = _at(x, proto, (n, s * c)), _at(y, proto, (n, s * c))
    wa, ba = _at(w, sproto, (c,)), _at(b, sproto, (c,))
    u = n * sn
    if per_sample:
        cl.cl_sample_forward(xa, ya, wa, ba, eps, c, sn, (rows, run),
                             (_stat(mean, sproto, u), _stat(rstd, sproto, u),
                              _stat(var, sproto, u)), stream != 0, lo, hi)
        return
    partials, per_nc = _cl_scratch(scratch, n, c, parts, sproto)
    coefs = (per_nc[0], per_nc[1], per_nc[2])                       # mean, scale, shift
    if stage == 0:
        cl.nc_moments(xa, c, parts, (rows, run), sproto, partials, lo, hi)
    elif stage == 1 and fixed:
        cl.nc_coefs_fixed(_given(mean, rstd, u, from_var, eps, sproto), (sn, cg), wa, ba, coefs)
    elif stage == 1:
        cl.nc_stats(partials, s, (sn, cg), eps, wa, ba,
                    (_stat(mean, sproto, u), _stat(rstd, sproto, u), _stat(var, sproto, u)),
                    coefs)
    else:
        cl.nc_apply(xa, ya, c, parts, coefs, stream != 0, lo, hi)


@njit(**JIT)
def cl_backward(g, x, dx, w, mean, rstd, dw, db, scratch, n, c, s, parts, rows, run, sn, cg,
                count, center, fixed, stream, stage, lo, hi, eps, proto, sproto):
    ga, xa = _at(g, proto, (n, s * c)), _at(x, proto, (n, s * c))
    u = n * sn
    mean_u, rstd_u = _at(mean, sproto, (u,)), _at(rstd, sproto, (u,))
    partials, per_nc = _cl_scratch(scratch, n, c, parts, sproto)
    if stage == 0:          # (each range expands the statistics per (n, c) for itself)
        stats_nc = (np.empty((n, c), sproto.dtype), np.empty((n, c), sproto.dtype))
        cl.nc_expand(mean_u, (sn, cg), stats_nc[0])
        cl.nc_expand(rstd_u, (sn, cg), stats_nc[1])
        cl.nc_grad_sums(ga, xa, c, parts, (rows, run), stats_nc, partials, lo, hi)
    elif stage == 1:
        cl.nc_grad_coefs(partials, rstd_u, _at(w, sproto, (c,)), (sn, cg), float(count),
                         center != 0, fixed != 0, (per_nc[1], per_nc[2], per_nc[3]),
                         (_at(dw, sproto, (c,)), _at(db, sproto, (c,))))
        cl.nc_expand(mean_u, (sn, cg), per_nc[0])
    else:
        cl.nc_grad_apply(ga, xa, _at(dx, proto, (n, s * c)), c, parts,
                         (per_nc[0], per_nc[1], per_nc[2], per_nc[3]), stream != 0, lo, hi)
