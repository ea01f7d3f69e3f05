"""Fused CPU kernels (numba): the fast path of every normalization on CPU.

Same interface as ``normkit.backends.torch_ops`` (``supports``, ``forward``,
``backward``); the dispatch in ``normkit.backends`` tries this package first and skips it
when numba (the ``fast`` extra) is missing. This module chooses the layout and the kernel
family, prepares the arguments and launches the kernels; the modules below do the rest:

``half``           loads and stores of every storage type (bfloat16/float16 in registers)
``stores``         the output formulas, each written once, stored plainly or streamed,
                   with prefetch: one driver for every kernel
``tuning``         thresholds, block sizes, prefetch distances, each with its reason
``moments``        plane and channels_last moment loops, merged by the one jitted Chan
                   merge (``normkit.stats_numba``, shared with the scalers)
``rows``           LayerNorm/RMSNorm, contiguous (M, K)
``planes``         Batch/Instance/GroupNorm on contiguous NCHW
``channels_last``  Batch/Instance/GroupNorm on channels_last (the per-(n, c) family)

Memory is shared with torch, never copied: a detached CPU tensor's ``.numpy()`` is a view
of its storage (16-bit floats as integers, ``half``). Statistics are float32 (float64 for
float64 inputs), merged across blocks in float64. Each kernel is a serial ``nogil`` loop
over a range [lo, hi) of independent work items; ``_parallel.launch`` runs one range per
thread on torch's OpenMP team. Compiled kernels are cached on disk (``cache=True``, in
``__pycache__`` of this package or ``NUMBA_CACHE_DIR``); numba keys each to its own source
file, so ``_cache`` drops them all when any source of the package changed.
"""

from __future__ import annotations

import numpy as np
import torch

from normkit.backends import fused_kernels_cover
from normkit.backends._memory import empty_like
from normkit.backends._parallel import launch
from normkit.backends.cpu import _cache

_cache.check_package_cache()    # before any kernel is loaded from the cache

from normkit.backends.cpu import channels_last as cl  # noqa: E402
from normkit.backends.cpu import planes, rows, tuning  # noqa: E402
from normkit.backends.torch_ops import stat_dtype  # noqa: E402

__all__ = ["backward", "forward", "supports"]

# storage dtype seen by the kernels for each torch dtype (see ``half``)
_STORAGE = {
    torch.float64: torch.float64,
    torch.float32: torch.float32,
    torch.bfloat16: torch.uint16,
    torch.float16: torch.int16,
}
_NP_STAT = {torch.float64: np.float64, torch.float32: np.float32}


def _np(t):
    """Zero-copy NumPy view of a CPU tensor's storage (16-bit floats as integers)."""
    t = t.detach()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(_STORAGE[t.dtype])
    return t.numpy()


def _ncs(xv, grouping):
    """The (N, C, S) view of a batch/instance/group view."""
    v = grouping.view
    return xv.view(v[0], v[1] * v[2], v[3]) if grouping.kind == "group" else xv


def layout(xv, grouping):
    """The kernel family for the view ``xv``: ``"rows"`` (contiguous (M, K)), ``"nchw"``
    (contiguous planes), ``"channels_last"``, or None (not handled here)."""
    if grouping.kind == "layer":
        return "rows" if xv.is_contiguous() else None
    x3 = _ncs(xv, grouping)
    if x3.is_contiguous() and x3.shape[2] > 1:
        return "nchw"
    if x3.transpose(1, 2).is_contiguous():
        return "channels_last"
    return None


def supports(x, grouping, center=True, fixed=False) -> bool:
    if (x.device.type != "cpu" or x.dtype not in _STORAGE
            or not fused_kernels_cover(x, grouping, center, fixed)):
        return False
    try:
        xv = x.view(grouping.view)
    except RuntimeError:
        return False
    return layout(xv, grouping) is not None


def _params(weight, bias, n, sdtype):
    w = torch.ones(n, dtype=sdtype) if weight is None else weight.detach().reshape(n).to(sdtype)
    b = torch.zeros(n, dtype=sdtype) if bias is None else bias.detach().reshape(n).to(sdtype)
    return _np(w.contiguous()), _np(b.contiguous())


def _per_unit(t, grouping, n, c):
    """Statistics shaped ``grouping.stat_shape`` as the NCHW kernels' per-unit arrays:
    (C,) per channel for BatchNorm, (N * groups,) otherwise."""
    if grouping.kind == "group":
        return t.reshape(-1).contiguous()
    per_nc = t.reshape(-1, c).expand(n, c)                         # N, C
    return (per_nc[0] if grouping.kind == "batch" else per_nc).reshape(-1).contiguous()


def _groups(grouping, c):
    return {"batch": c, "instance": c, "group": grouping.view[1]}.get(grouping.kind)


def _unit(grouping, c):
    """(sn, cg) of the statistic index u = n * sn + c // cg (``channels_last``)."""
    if grouping.kind == "batch":
        return 0, 1
    if grouping.kind == "instance":
        return c, 1
    g = grouping.view[1]
    return g, c // g


def _cl_flat(t3):
    """The (N, S*C) NumPy view of a channels_last (N, C, S) tensor (no copy)."""
    a = _np(t3).transpose(0, 2, 1)                                 # N, S, C contiguous
    return a.reshape(a.shape[0], -1)


def forward(x, grouping, weight, bias, eps, center=True, mean=None, rstd=None):
    threads = tuning.threads(x)
    sdtype = stat_dtype(x.dtype)
    fixed = mean is not None
    y = empty_like(x)                                              # keeps channels_last
    family = layout(x, grouping)
    shape = grouping.stat_shape
    if family == "rows":
        m, k = grouping.view
        w, b = _params(weight, bias, k, sdtype)
        stats = tuple(torch.empty(m, dtype=sdtype) for _ in range(3))
        out = (tuning.stream_out(y), tuning.rows_ahead(k, x.element_size()))
        launch(rows.rows_forward, m, threads, _np(x), _np(y), w, b, float(eps), bool(center),
               tuple(_np(t) for t in stats), out)
        return (y, *(t.view(shape) for t in stats))

    x3, y3 = _ncs(x, grouping), _ncs(y, grouping)
    n, c, s = x3.shape
    w, b = _params(weight, bias, c, sdtype)
    groups = _groups(grouping, c)
    if family == "nchw":
        by_channel = grouping.kind == "batch"
        units = c if by_channel else n * groups
        if fixed:
            stats = (_per_unit(mean.to(sdtype), grouping, n, c),
                     _per_unit(rstd.to(sdtype), grouping, n, c), torch.empty(units, dtype=sdtype))
        else:
            stats = tuple(torch.empty(units, dtype=sdtype) for _ in range(3))
        stats_np = tuple(_np(t) for t in stats)
        stream = tuning.stream_out(y)
        if by_channel:
            block = tuning.channel_block(n * s * x.element_size())
            launch(planes.channels_forward, units, threads, _np(x3), _np(y3), w, b, float(eps),
                   block, fixed, stats_np, stream)
        else:
            out = (stream, tuning.rows_ahead(s, x.element_size()))
            launch(planes.planes_forward, units, threads, _np(x3), _np(y3), w, b, float(eps),
                   groups, fixed, stats_np, out)
        if fixed:
            return y, mean, rstd, None
        return (y, *(t.view(shape) for t in stats))

    # channels_last: per-(n, c) moments, merged to the grouping's statistics in float64
    xt, yt = _cl_flat(x3), _cl_flat(y3)                            # N, S*C
    blocks = tuning.cl_blocks(c, x.element_size())
    if not fixed and grouping.kind != "batch" and n >= threads:
        stats = tuple(torch.empty(n * groups, dtype=sdtype) for _ in range(3))
        launch(cl.cl_sample_forward, n, threads, xt, yt, w, b, float(eps), c, groups, blocks,
               tuple(_np(t) for t in stats), tuning.stream_out(y))
        return (y, *(t.view(shape) for t in stats))
    parts = tuning.parts(n, s, threads)
    st = _NP_STAT[sdtype]
    unit = _unit(grouping, c)
    coefs = tuple(np.empty((n, c), dtype=st) for _ in range(3))
    if fixed:
        given = (_np(mean.to(sdtype).reshape(-1).contiguous()),
                 _np(rstd.to(sdtype).reshape(-1).contiguous()))
        cl.nc_coefs_fixed(given, unit, w, b, coefs)
        var = None
    else:
        partials = (np.empty((n, parts, c)), np.empty((n, parts, c)))
        launch(cl.nc_moments, n * parts, threads, xt, c, parts, blocks, np.empty(0, st),
               partials)
        mean, rstd, var = (torch.empty(shape, dtype=sdtype) for _ in range(3))
        cl.nc_stats(partials, s, unit, float(eps), w, b,
                    tuple(_np(t).reshape(-1) for t in (mean, rstd, var)), coefs)
    launch(cl.nc_apply, n * parts, threads, xt, yt, c, parts, coefs, tuning.stream_out(y))
    return y, mean, rstd, var


def _dparams(dw, db, shape, needs):
    """dweight and dbias as tensors of ``shape`` where asked for in ``needs``."""
    return (torch.from_numpy(dw).view(shape) if needs[1] else None,
            torch.from_numpy(db).view(shape) if needs[2] else None)


def backward(grad, x, mean, rstd, weight, grouping, center, fixed, needs):
    threads = tuning.threads(x)
    sdtype = mean.dtype
    st = _NP_STAT[sdtype]
    family = layout(x, grouping)
    if family == "rows":
        grad = grad.contiguous()
        m, k = grouping.view
        w, _ = _params(weight, None, k, sdtype)
        dx = empty_like(x)
        partials = (np.zeros((threads, k), dtype=st), np.zeros((threads, k), dtype=st))
        out = (tuning.stream_out(dx), tuning.rows_ahead(k, x.element_size()))
        launch(rows.rows_backward, threads, threads, _np(grad), _np(x), w,
               (_np(mean.reshape(m)), _np(rstd.reshape(m))), bool(center), _np(dx), partials,
               out)
        return ((dx if needs[0] else None),
                *_dparams(partials[0].sum(0), partials[1].sum(0), (1, k), needs))

    x3 = _ncs(x, grouping)
    n, c, s = x3.shape
    pshape = grouping.param_view
    w, _ = _params(weight, None, c, sdtype)
    groups = _groups(grouping, c)
    if family == "nchw":
        g3 = grad.reshape(n, c, s).contiguous()
        dx = empty_like(x3)
        stats = (_np(_per_unit(mean, grouping, n, c)), _np(_per_unit(rstd, grouping, n, c)))
        sums = (np.empty((n, c), dtype=st), np.empty((n, c), dtype=st))
        stream = tuning.stream_out(dx)
        if grouping.kind == "batch":
            block = tuning.channel_block(2 * n * s * x.element_size())   # x and g
            launch(planes.channels_backward, c, threads, _np(g3), _np(x3), w, stats, block,
                   bool(center), bool(fixed), _np(dx), sums, stream)
        else:
            out = (stream, tuning.rows_ahead(s, x.element_size()))
            launch(planes.planes_backward, n * groups, threads, _np(g3), _np(x3), w, stats,
                   groups, bool(center), bool(fixed), _np(dx), sums, out)
        # dweight, dbias: the per-plane sums over n, in float64
        dw, db = (a.astype(np.float64).sum(0).astype(st) for a in (sums[1], sums[0]))
        return (dx.view(grouping.view) if needs[0] else None), *_dparams(dw, db, pshape, needs)

    g3 = grad.reshape(n, c, s)
    if not g3.transpose(1, 2).is_contiguous():
        g3 = g3.transpose(1, 2).contiguous().transpose(1, 2)
    gt, xt = _cl_flat(g3), _cl_flat(x3)                            # N, S*C
    blocks = tuning.cl_blocks(c, x.element_size())
    parts = tuning.parts(n, s, threads)
    unit = _unit(grouping, c)
    rstd_u = _np(rstd.reshape(-1))
    stats_nc = (np.empty((n, c), dtype=st), np.empty((n, c), dtype=st))
    cl.nc_expand(_np(mean.reshape(-1)), unit, stats_nc[0])
    cl.nc_expand(rstd_u, unit, stats_nc[1])
    partials = (np.empty((n, parts, c)), np.empty((n, parts, c)))
    launch(cl.nc_grad_sums, n * parts, threads, gt, xt, c, parts, blocks, stats_nc, partials)
    coefs = tuple(np.empty((n, c), dtype=st) for _ in range(3))
    grads = (np.empty(c, dtype=st), np.empty(c, dtype=st))
    cl.nc_grad_coefs(partials, rstd_u, w, unit, float(grouping.group_size), bool(center),
                     bool(fixed), coefs, grads)
    dx = empty_like(x3)
    launch(cl.nc_grad_apply, n * parts, threads, gt, xt, _cl_flat(dx), c, parts,
           (stats_nc[0], *coefs), tuning.stream_out(dx))
    return (dx.view(grouping.view) if needs[0] else None), *_dparams(*grads, pshape, needs)
