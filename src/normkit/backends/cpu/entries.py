"""The kernels' entries by address: what the plans call.

Each entry takes the tensors of one call as addresses (``address``), rebuilds them as
arrays inside compiled code and runs the kernel of ``rows``, ``planes``, ``columns`` or
``running`` of the same name over the range [lo, hi): the same kernel, without the
microseconds per argument that converting tensors to NumPy arrays costs a Python call.

Conventions: ``at`` is a tuple of addresses in the order the docstring gives; ``proto``
and ``sproto`` are empty arrays of the storage dtype (``half``: 16-bit floats as
integers) and of the statistics dtype; statistics blocks are ``(3, units)`` (mean, rstd,
var, each its own address, or 0 for statistics the caller does not keep; with fixed
statistics ``var`` is never written and may be any address), sums blocks ``(2, ...)``.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.extending import register_jitable

from normkit.backends.cpu import channels_last as cl
from normkit.backends.cpu import columns, planes, rows, running
from normkit.backends.cpu.address import at as _at
from normkit.backends.cpu.rows import JIT

__all__ = ["rows_forward", "rows_backward", "channels_small", "channels_small_backward",
           "planes_small", "planes_small_backward", "channels_forward", "channels_backward",
           "planes_forward", "planes_backward", "columns_forward", "columns_backward",
           "cl_forward", "cl_backward", "param_sums", "running_update"]


@njit(**JIT)
def rows_forward(at, m, k, proto, sproto, eps, center, out, lo, hi):
    """at = (x, y: (M, K); w, b: (K,); mean, rstd, var: (M,))."""
    x, y = _at(at[0], proto, (m, k)), _at(at[1], proto, (m, k))
    w, b = _at(at[2], sproto, (k,)), _at(at[3], sproto, (k,))
    stats = (_stat(at[4], sproto, m), _stat(at[5], sproto, m), _stat(at[6], sproto, m))
    rows.rows_forward(x, y, w, b, eps, center, stats, out, lo, hi)


@njit(**JIT)
def rows_backward(at, m, k, chunks, proto, sproto, center, out, lo, hi):
    """at = (g, x, dx: (M, K); w: (K,); mean, rstd: (M,); dw, db partials: (chunks, K)
    each)."""
    g, x, dx = _at(at[0], proto, (m, k)), _at(at[1], proto, (m, k)), _at(at[2], proto, (m, k))
    w = _at(at[3], sproto, (k,))
    mean, rstd = _at(at[4], sproto, (m,)), _at(at[5], sproto, (m,))
    partials = (_at(at[6], sproto, (chunks, k)), _at(at[7], sproto, (chunks, k)))
    rows.rows_backward(g, x, w, (mean, rstd), center, dx, partials, out, lo, hi)


@register_jitable
def _forward_arrays(at, ncs, units, proto, sproto, eps, from_var):
    n, c, s = ncs
    x, y = _at(at[0], proto, (n, c, s)), _at(at[1], proto, (n, c, s))
    w, b = _at(at[2], sproto, (c,)), _at(at[3], sproto, (c,))
    mean, rstd = _stat(at[4], sproto, units), _stat(at[5], sproto, units)
    if from_var:   # fixed statistics given as (mean, var): rstd = 1 / sqrt(var + eps)
        rstd = _rstd(rstd, eps)
    return x, y, w, b, (mean, rstd, _stat(at[6], sproto, units))


@register_jitable
def _stat(address, sproto, units):
    """The (units,) statistics at ``address``, or scratch for address 0 (the caller
    keeps no statistics)."""
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


@register_jitable
def _backward_arrays(at, ncs, units, proto, sproto):
    n, c, s = ncs
    g, x, dx = (_at(at[0], proto, (n, c, s)), _at(at[1], proto, (n, c, s)),
                _at(at[2], proto, (n, c, s)))
    w = _at(at[3], sproto, (c,))
    mean, rstd = _at(at[4], sproto, (units,)), _at(at[5], sproto, (units,))
    sums = _at(at[6], sproto, (2, n, c)) if at[6] != 0 else np.empty((2, n, c), sproto.dtype)
    return g, x, dx, w, (mean, rstd), (sums[0], sums[1])


@register_jitable
def _sum_planes(sums, db, dw):
    """dbias, dweight (C,): each per-plane sum of ``sums = (sg, sgx)`` (N, C) added over n
    in float64 (in the order n = 0, 1, ...), rounded once."""
    for grad, per_plane in ((db, sums[0]), (dw, sums[1])):
        for ch in range(per_plane.shape[1]):
            total = 0.0
            for i in range(per_plane.shape[0]):
                total += np.float64(per_plane[i, ch])
            grad[ch] = total


@register_jitable
def _grads_here(at, sums, c, sproto):
    """dbias, dweight at at[7], at[8] from this call's sums: a serial call covers every
    plane (address 0: the plan adds them up with ``param_sums`` after its threads)."""
    if at[7] != 0:
        _sum_planes(sums, _at(at[7], sproto, (c,)), _at(at[8], sproto, (c,)))


# forward: at = (x, y: (N, C, S); w, b: (C,); mean, rstd, var: (units,)), read when fixed;
# from_var: at[5] holds the variance, rstd is computed from it
# backward: at = (g, x, dx: (N, C, S); w: (C,); mean, rstd: (units,); sums: (2, N, C) or 0
# for scratch; db, dw: (C,) written here, or 0 each)


@njit(**JIT)
def channels_small(at, ncs, proto, sproto, eps, fixed, from_var, lo, hi):
    x, y, w, b, stats = _forward_arrays(at, ncs, ncs[1], proto, sproto, eps, from_var)
    planes.channels_small(x, y, w, b, eps, fixed, stats, lo, hi)


@njit(**JIT)
def channels_forward(at, ncs, proto, sproto, eps, fixed, from_var, block, stream, lo, hi):
    x, y, w, b, stats = _forward_arrays(at, ncs, ncs[1], proto, sproto, eps, from_var)
    planes.channels_forward(x, y, w, b, eps, block, fixed, stats, stream, lo, hi)


@njit(**JIT)
def channels_fixed(at, ncs, proto, sproto, eps, from_var, small, out, lo, hi):
    """Eval BatchNorm over the N * C planes (``planes.channels_fixed``)."""
    x, y, w, b, stats = _forward_arrays(at, ncs, ncs[1], proto, sproto, eps, from_var)
    planes.channels_fixed(x, y, w, b, stats, small, out, lo, hi)


@njit(**JIT)
def planes_small(at, ncs, groups, proto, sproto, eps, fixed, from_var, lo, hi):
    x, y, w, b, stats = _forward_arrays(at, ncs, ncs[0] * groups, proto, sproto, eps,
                                        from_var)
    planes.planes_small(x, y, w, b, eps, groups, fixed, stats, lo, hi)


@njit(**JIT)
def planes_forward(at, ncs, groups, proto, sproto, eps, fixed, from_var, out, lo, hi):
    x, y, w, b, stats = _forward_arrays(at, ncs, ncs[0] * groups, proto, sproto, eps,
                                        from_var)
    planes.planes_forward(x, y, w, b, eps, groups, fixed, stats, out, lo, hi)


@njit(**JIT)
def channels_small_backward(at, ncs, proto, sproto, center, fixed, lo, hi):
    g, x, dx, w, stats, sums = _backward_arrays(at, ncs, ncs[1], proto, sproto)
    planes.channels_small_backward(g, x, w, stats, center, fixed, dx, sums, lo, hi)
    _grads_here(at, sums, ncs[1], sproto)


@njit(**JIT)
def channels_backward(at, ncs, proto, sproto, block, center, fixed, stream, lo, hi):
    g, x, dx, w, stats, sums = _backward_arrays(at, ncs, ncs[1], proto, sproto)
    planes.channels_backward(g, x, w, stats, block, center, fixed, dx, sums, stream, lo, hi)
    _grads_here(at, sums, ncs[1], sproto)


@njit(**JIT)
def planes_small_backward(at, ncs, groups, proto, sproto, center, fixed, lo, hi):
    g, x, dx, w, stats, sums = _backward_arrays(at, ncs, ncs[0] * groups, proto, sproto)
    planes.planes_small_backward(g, x, w, stats, groups, center, fixed, dx, sums, lo, hi)
    _grads_here(at, sums, ncs[1], sproto)


@njit(**JIT)
def planes_backward(at, ncs, groups, proto, sproto, center, fixed, out, lo, hi):
    g, x, dx, w, stats, sums = _backward_arrays(at, ncs, ncs[0] * groups, proto, sproto)
    planes.planes_backward(g, x, w, stats, groups, center, fixed, dx, sums, out, lo, hi)
    _grads_here(at, sums, ncs[1], sproto)


# columns (``columns``): x as M rows of C channels, flat, in chunks of rows; each direction
# in stages (stage 0 over the chunks [lo, hi), 1 on one thread, 2 over the rows [lo, hi));
# sums: (2, chunks, C) float64 scratch; mcr = (M, C, rows per chunk, run). forward at =
# (x, y; w, b; mean, rstd, var: (C,), read when fixed (stage 2 alone), else written in
# stage 1; sums); backward at = (g, x, dx; w; mean, rstd; dw, db: (C,) written in stage 1;
# sums)


@register_jitable
def _columns_sums(address, mcr):
    m, c, rows, _ = mcr
    sums = _at(address, np.empty(0, np.float64), (2, -(-m // rows), c))
    return sums[0], sums[1]


@njit(**JIT)
def columns_forward(at, mcr, proto, sproto, eps, from_var, stream, stage, lo, hi):
    m, c, rows, run = mcr
    x = _at(at[0], proto, (m * c,))
    mean, rstd = _at(at[4], sproto, (c,)), _at(at[5], sproto, (c,))
    if stage == 0:
        columns.chunk_moments(x, c, (rows, run), sproto, _columns_sums(at[7], mcr), lo, hi)
    elif stage == 1:
        columns.merge_moments(_columns_sums(at[7], mcr), rows, m, eps,
                              (mean, rstd, _at(at[6], sproto, (c,))))
    else:
        if from_var:    # given statistics as (mean, var): rstd = 1 / sqrt(var + eps)
            rstd = _rstd(rstd, eps)
        columns.apply_rows(x, _at(at[1], proto, (m * c,)), _at(at[2], sproto, (c,)),
                           _at(at[3], sproto, (c,)), (mean, rstd), stream, lo, hi)


@njit(**JIT)
def columns_backward(at, mcr, proto, sproto, center, fixed, stream, stage, lo, hi):
    m, c, rows, run = mcr
    g, x = _at(at[0], proto, (m * c,)), _at(at[1], proto, (m * c,))
    w = _at(at[3], sproto, (c,))
    stats = (_at(at[4], sproto, (c,)), _at(at[5], sproto, (c,)))
    sums = _columns_sums(at[8], mcr)
    if stage == 0:
        columns.chunk_grad_sums(g, x, stats, (rows, run), sums, lo, hi)
    elif stage == 1:
        columns.merge_grad_sums(sums, m, w, center, fixed,
                                (_at(at[6], sproto, (c,)), _at(at[7], sproto, (c,))))
    else:
        columns.dx_rows(g, x, w, stats, sums, _at(at[2], proto, (m * c,)), stream, lo, hi)


# channels_last Instance/GroupNorm (``channels_last``) in the same three stages, for the C++
# node: at as the columns', dims = (N, C, S, parts), unit = (sn, cg) (statistics of N * sn
# units); the scratch: the per-range partials (2, N, parts, C) float64, then (4, N, C) of
# the statistics dtype (the coefficients per (n, c))


@register_jitable
def _cl_scratch(address, dims, sproto):
    n, c, s, parts = dims
    partials = _at(address, np.empty(0, np.float64), (2, n, parts, c))
    per_nc = _at(address + 16 * n * parts * c, sproto, (4, n, c))
    return (partials[0], partials[1]), per_nc


@njit(**JIT)
def cl_forward(at, dims, blocks, unit, proto, sproto, eps, per_sample, stage, lo, hi):
    n, c, s, parts = dims
    x = _at(at[0], proto, (n, s * c))
    if per_sample:          # stage 0 over the samples is the whole call
        u = n * unit[0]
        cl.cl_sample_forward(x, _at(at[1], proto, (n, s * c)), _at(at[2], sproto, (c,)),
                             _at(at[3], sproto, (c,)), eps, c, unit[0], blocks,
                             (_at(at[4], sproto, (u,)), _at(at[5], sproto, (u,)),
                              _at(at[6], sproto, (u,))), False, lo, hi)
        return
    partials, per_nc = _cl_scratch(at[7], dims, sproto)
    coefs = (per_nc[0], per_nc[1], per_nc[2])                       # mean, scale, shift
    if stage == 0:
        cl.nc_moments(x, c, parts, blocks, sproto, partials, lo, hi)
    elif stage == 1:
        u = n * unit[0]
        stats = (_at(at[4], sproto, (u,)), _at(at[5], sproto, (u,)), _at(at[6], sproto, (u,)))
        cl.nc_stats(partials, s, unit, eps, _at(at[2], sproto, (c,)), _at(at[3], sproto, (c,)),
                    stats, coefs)
    else:
        cl.nc_apply(x, _at(at[1], proto, (n, s * c)), c, parts, coefs, False, lo, hi)


@njit(**JIT)
def cl_backward(at, dims, blocks, unit, count, proto, sproto, center, fixed, stage, lo, hi):
    n, c, s, parts = dims
    g, x = _at(at[0], proto, (n, s * c)), _at(at[1], proto, (n, s * c))
    u = n * unit[0]
    mean, rstd = _at(at[4], sproto, (u,)), _at(at[5], sproto, (u,))
    partials, per_nc = _cl_scratch(at[8], dims, sproto)
    if stage == 0:          # (each range expands the statistics per (n, c) for itself)
        stats_nc = (np.empty((n, c), sproto.dtype), np.empty((n, c), sproto.dtype))
        cl.nc_expand(mean, unit, stats_nc[0])
        cl.nc_expand(rstd, unit, stats_nc[1])
        cl.nc_grad_sums(g, x, c, parts, blocks, stats_nc, partials, lo, hi)
    elif stage == 1:
        cl.nc_grad_coefs(partials, rstd, _at(at[3], sproto, (c,)), unit, count, center, fixed,
                         (per_nc[1], per_nc[2], per_nc[3]),
                         (_at(at[6], sproto, (c,)), _at(at[7], sproto, (c,))))
        cl.nc_expand(mean, unit, per_nc[0])
    else:
        cl.nc_grad_apply(g, x, _at(at[2], proto, (n, s * c)), c, parts,
                         (per_nc[0], per_nc[1], per_nc[2], per_nc[3]), False, lo, hi)


@njit(**JIT)
def param_sums(at, n, c, sproto):
    """at = (sums: (2, N, C), dbias, dweight: (C,)): ``_sum_planes`` after a threaded
    backward."""
    sums = _at(at[0], sproto, (2, n, c))
    _sum_planes((sums[0], sums[1]), _at(at[1], sproto, (c,)), _at(at[2], sproto, (c,)))


@njit(**JIT)
def running_update(at, c, proto, keep, momentum, unbias):
    """at = (running_mean, running_var, mean, var), each (C,) of ``proto``'s dtype; the
    scalars come as Python floats (typing a NumPy scalar argument costs microseconds) and
    are rounded to that dtype here."""
    values = (_at(at[2], proto, (c,)), _at(at[3], proto, (c,)))
    buffers = (_at(at[0], proto, (c,)), _at(at[1], proto, (c,)))
    st = proto.dtype.type
    running.running_update(buffers, values, st(keep), st(momentum), st(unbias),
                           np.empty(c, proto.dtype))
