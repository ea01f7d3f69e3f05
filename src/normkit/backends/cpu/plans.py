"""What a CPU normalization runs, decided once per shape: one plan class per kernel family.

A plan is built by ``normkit.backends.plan`` the first time a (grouping, dtype, layout,
centering, fixed statistics, thread count) is seen, and kept: it holds everything that
depends only on those -- the kernel family, sizes, block and prefetch choices, the thread
split, the defaults for a missing weight or bias -- so that a call does only what depends
on the data: allocate the outputs, take NumPy views of the tensors (no copy) and launch.
On a small tensor the Python around the kernel is most of the time (``docs/performance.md``,
"Whole models and the per-call cost"), so that is where this matters.

``RowsPlan``          LayerNorm/RMSNorm on contiguous (M, K)               (``rows``)
``PlanesPlan``        Batch/Instance/GroupNorm on contiguous NCHW planes   (``planes``)
``ChannelsLastPlan``  Batch/Instance/GroupNorm on channels_last           (``channels_last``)

Every plan has ``forward(x, weight, bias, eps, mean=None, rstd=None, keep_stats=True) ->
(y, mean, rstd, var)`` (statistics None with ``keep_stats=False``) and ``backward(grad,
x, mean, rstd, weight, needs) -> (dx, dweight, dbias)`` with the meaning of the backend
interface (``normkit.backends``); ``y`` and ``dx`` are laid out as ``torch.empty_like(x)``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from normkit.backends._memory import HUGE_MIN_BYTES, empty_like
from normkit.backends._parallel import launch
from normkit.backends.cpu import channels_last as cl
from normkit.backends.cpu import planes, rows, tuning
from normkit.backends.torch_ops import stat_dtype

__all__ = ["RowsPlan", "PlanesPlan", "ChannelsLastPlan", "np_view"]

# storage dtype seen by the kernels for each torch dtype (see ``half``)
_STORAGE = {torch.bfloat16: torch.uint16, torch.float16: torch.int16}
_NP_STAT = {torch.float64: np.float64, torch.float32: np.float32}


def np_view(t):
    """Zero-copy NumPy view of a CPU tensor's storage (16-bit floats as integers)."""
    if t.requires_grad:
        t = t.detach()
    storage = _STORAGE.get(t.dtype)
    return (t if storage is None else t.view(storage)).numpy()


def _ncs(xv, grouping):
    """The (N, C, S) view of a batch/instance/group view."""
    v = grouping.view
    return xv.view(v[0], v[1] * v[2], v[3]) if grouping.kind == "group" else xv


class _Plan:
    """What every family shares: sizes, dtypes, threads, the output allocation."""

    def __init__(self, x, grouping, center, fixed, params):
        self.grouping, self.center, self.fixed = grouping, bool(center), bool(fixed)
        self.sdtype = stat_dtype(x.dtype)
        self.st = _NP_STAT[self.sdtype]
        self.itemsize = x.element_size()
        self.threads = tuning.threads(x)
        self.stat_shape = grouping.stat_shape
        self.stat_count = math.prod(self.stat_shape)
        self.stats_block = (3, *self.stat_shape)
        self.params = params                                       # elements per weight
        self.ones = np.ones(params, dtype=self.st)                 # weight None
        self.zeros = np.zeros(params, dtype=self.st)               # bias None
        nbytes = x.numel() * self.itemsize
        self.large = nbytes >= HUGE_MIN_BYTES                      # outputs advised huge pages

    def empty(self, x):
        return empty_like(x) if self.large else torch.empty_like(x)

    def param(self, p, default):
        """A weight or bias as a contiguous 1-D array of the statistics dtype."""
        if p is None:
            return default
        if p.dtype != self.sdtype:
            p = p.detach().to(self.sdtype)
        return np_view(p).reshape(self.params)

    def run(self, kernel, total, *args):
        if self.threads == 1 or total == 1:
            kernel(*args, 0, total)
        else:
            launch(kernel, total, self.threads, *args)

    def stats(self, keep=True):
        """Three fresh statistics tensors (mean, rstd, var) shaped ``stat_shape`` and
        their NumPy views as 1-D arrays; ``keep=False``: scratch arrays only (tensors
        None), for a caller that wants ``y`` alone."""
        if keep:
            block = torch.empty(self.stats_block, dtype=self.sdtype)
            tensors, arrays = block.unbind(0), block.numpy().reshape(3, self.stat_count)
        else:
            tensors, arrays = (None, None, None), np.empty((3, self.stat_count), self.st)
        return tensors, (arrays[0], arrays[1], arrays[2])

    def dparams(self, dw, db, shape, needs):
        """dweight and dbias as tensors of ``shape`` where asked for in ``needs``."""
        return (torch.from_numpy(dw).view(shape) if needs[1] else None,
                torch.from_numpy(db).view(shape) if needs[2] else None)


class RowsPlan(_Plan):
    """LayerNorm / RMSNorm over the rows of a contiguous (M, K) view."""

    def __init__(self, x, grouping, center, fixed):
        self.m, self.k = grouping.view
        super().__init__(x, grouping, center, fixed, self.k)
        self.ahead = tuning.rows_ahead(self.k, self.itemsize)

    def forward(self, x, weight, bias, eps, mean=None, rstd=None, keep_stats=True):
        y = self.empty(x)
        tensors, arrays = self.stats(keep_stats)
        self.run(rows.rows_forward, self.m, np_view(x), np_view(y),
                 self.param(weight, self.ones), self.param(bias, self.zeros), float(eps),
                 self.center, arrays, (tuning.stream_out(y), self.ahead))
        return (y, *tensors)

    def backward(self, grad, x, mean, rstd, weight, needs):
        grad = grad.contiguous()
        dx = self.empty(x)
        chunks = self.threads
        partials = np.zeros((2, chunks, self.k), dtype=self.st)
        self.run(rows.rows_backward, chunks, np_view(grad), np_view(x),
                 self.param(weight, self.ones),
                 (np_view(mean).reshape(self.m), np_view(rstd).reshape(self.m)), self.center,
                 np_view(dx), (partials[0], partials[1]), (tuning.stream_out(dx), self.ahead))
        sums = partials[:, 0] if chunks == 1 else partials.sum(1)
        return ((dx if needs[0] else None),
                *self.dparams(sums[0], sums[1], (1, self.k), needs))


def _per_unit(t):
    """Statistics shaped ``grouping.stat_shape`` (or expanded to it) as the NCHW kernels'
    per-unit array: (C,) per channel for BatchNorm, (N * C) or (N * groups,) otherwise."""
    return np.ascontiguousarray(np_view(t)).reshape(-1)


def _groups(grouping, c):
    return {"batch": c, "instance": c, "group": grouping.view[1]}[grouping.kind]


class _ChannelsPlan(_Plan):
    """Batch / Instance / GroupNorm: the (N, C, S) sizes and the per-channel parameters."""

    def __init__(self, x, grouping, center, fixed):
        self.n, self.c, self.s = _ncs(x, grouping).shape
        super().__init__(x, grouping, center, fixed, self.c)
        self.groups = _groups(grouping, self.c)
        self.pshape = grouping.param_view


class PlanesPlan(_ChannelsPlan):
    """Contiguous NCHW: per channel (BatchNorm, blocks of channels) or per (sample,
    group) of planes (Instance/GroupNorm)."""

    def __init__(self, x, grouping, center, fixed):
        super().__init__(x, grouping, center, fixed)
        self.by_channel = grouping.kind == "batch"
        self.small = self.s < tuning.SMALL_PLANE
        self.units = self.c if self.by_channel else self.n * self.groups
        # (no larger than C: each kernel call allocates its per-block scratch)
        self.block = min(self.c, tuning.channel_block(self.n * self.s * self.itemsize))
        self.block_bwd = min(self.c, tuning.channel_block(2 * self.n * self.s * self.itemsize))
        self.ahead = tuning.rows_ahead(self.s, self.itemsize)

    def forward(self, x, weight, bias, eps, mean=None, rstd=None, keep_stats=True):
        x3, g = _ncs(x, self.grouping), self.grouping
        y = self.empty(x)
        y3 = _ncs(y, g)
        w, b = self.param(weight, self.ones), self.param(bias, self.zeros)
        if self.fixed:
            arrays = (_per_unit(mean.to(self.sdtype)), _per_unit(rstd.to(self.sdtype)),
                      np.empty(self.units, self.st))
        else:
            tensors, arrays = self.stats(keep_stats)
        stream = tuning.stream_out(y)
        if self.small and self.by_channel:
            self.run(planes.channels_small, self.units, np_view(x3), np_view(y3), w, b,
                     float(eps), self.fixed, arrays)
        elif self.small:
            self.run(planes.planes_small, self.units, np_view(x3), np_view(y3), w, b,
                     float(eps), self.groups, self.fixed, arrays)
        elif self.by_channel:
            self.run(planes.channels_forward, self.units, np_view(x3), np_view(y3), w, b,
                     float(eps), self.block, self.fixed, arrays, stream)
        else:
            self.run(planes.planes_forward, self.units, np_view(x3), np_view(y3), w, b,
                     float(eps), self.groups, self.fixed, arrays, (stream, self.ahead))
        if self.fixed:
            return y, mean, rstd, None
        return (y, *tensors)

    def backward(self, grad, x, mean, rstd, weight, needs):
        g, n, c, s = self.grouping, self.n, self.c, self.s
        x3 = _ncs(x, g)
        g3 = grad.reshape(n, c, s).contiguous()
        dx = self.empty(x3)
        stats = (_per_unit(mean), _per_unit(rstd))
        sums = np.empty((2, n, c), dtype=self.st)
        w = self.param(weight, self.ones)
        stream = tuning.stream_out(dx)
        if self.small and self.by_channel:
            self.run(planes.channels_small_backward, c, np_view(g3), np_view(x3), w, stats,
                     self.center, self.fixed, np_view(dx), (sums[0], sums[1]))
        elif self.small:
            self.run(planes.planes_small_backward, n * self.groups, np_view(g3), np_view(x3),
                     w, stats, self.groups, self.center, self.fixed, np_view(dx),
                     (sums[0], sums[1]))
        elif self.by_channel:
            self.run(planes.channels_backward, c, np_view(g3), np_view(x3), w, stats,
                     self.block_bwd, self.center, self.fixed, np_view(dx), (sums[0], sums[1]),
                     stream)
        else:
            self.run(planes.planes_backward, n * self.groups, np_view(g3), np_view(x3), w,
                     stats, self.groups, self.center, self.fixed, np_view(dx),
                     (sums[0], sums[1]), (stream, self.ahead))
        # dweight, dbias: the per-plane sums over n, in float64
        db, dw = np.add.reduce(sums, axis=1, dtype=np.float64).astype(self.st)
        return ((dx.view(g.view) if needs[0] else None),
                *self.dparams(dw, db, self.pshape, needs))


def _cl_flat(t3):
    """The (N, S*C) NumPy view of a channels_last (N, C, S) tensor (no copy)."""
    a = np_view(t3).transpose(0, 2, 1)                             # N, S, C contiguous
    return a.reshape(a.shape[0], -1)


def _unit(grouping, c):
    """(sn, cg) of the statistic index u = n * sn + c // cg (``channels_last``)."""
    if grouping.kind == "batch":
        return 0, 1
    if grouping.kind == "instance":
        return c, 1
    g = grouping.view[1]
    return g, c // g


class ChannelsLastPlan(_ChannelsPlan):
    """channels_last: per-(n, c) moments merged to the grouping's statistics in float64
    (or, for per-sample groupings with enough samples, one sample per work item)."""

    def __init__(self, x, grouping, center, fixed):
        super().__init__(x, grouping, center, fixed)
        self.blocks = tuning.cl_blocks(self.c, self.itemsize)
        self.parts = tuning.parts(self.n, self.s, self.threads)
        self.unit = _unit(grouping, self.c)
        self.per_sample = (not fixed and grouping.kind != "batch" and self.n >= self.threads)

    def forward(self, x, weight, bias, eps, mean=None, rstd=None, keep_stats=True):
        n, c, g = self.n, self.c, self.grouping
        x3 = _ncs(x, g)
        y = self.empty(x)
        xt, yt = _cl_flat(x3), _cl_flat(_ncs(y, g))                # N, S*C
        w, b = self.param(weight, self.ones), self.param(bias, self.zeros)
        if self.per_sample:
            tensors, arrays = self.stats(keep_stats)
            self.run(cl.cl_sample_forward, n, xt, yt, w, b, float(eps), c, self.groups,
                     self.blocks, arrays, tuning.stream_out(y))
            return (y, *tensors)
        st = self.st
        coefs = tuple(np.empty((n, c), dtype=st) for _ in range(3))
        if self.fixed:
            given = (np_view(mean.to(self.sdtype).reshape(-1).contiguous()),
                     np_view(rstd.to(self.sdtype).reshape(-1).contiguous()))
            cl.nc_coefs_fixed(given, self.unit, w, b, coefs)
            var = None
        else:
            partials = (np.empty((n, self.parts, c)), np.empty((n, self.parts, c)))
            self.run(cl.nc_moments, n * self.parts, xt, c, self.parts, self.blocks,
                     np.empty(0, st), partials)
            (mean, rstd, var), arrays = self.stats(keep_stats)
            cl.nc_stats(partials, self.s, self.unit, float(eps), w, b, arrays, coefs)
        self.run(cl.nc_apply, n * self.parts, xt, yt, c, self.parts, coefs, tuning.stream_out(y))
        return y, mean, rstd, var

    def backward(self, grad, x, mean, rstd, weight, needs):
        g, n, c, st = self.grouping, self.n, self.c, self.st
        x3 = _ncs(x, g)
        g3 = grad.reshape(n, c, self.s)
        if not g3.transpose(1, 2).is_contiguous():
            g3 = g3.transpose(1, 2).contiguous().transpose(1, 2)
        gt, xt = _cl_flat(g3), _cl_flat(x3)                        # N, S*C
        rstd_u = np_view(rstd.reshape(-1))
        stats_nc = (np.empty((n, c), dtype=st), np.empty((n, c), dtype=st))
        cl.nc_expand(np_view(mean.reshape(-1)), self.unit, stats_nc[0])
        cl.nc_expand(rstd_u, self.unit, stats_nc[1])
        partials = (np.empty((n, self.parts, c)), np.empty((n, self.parts, c)))
        self.run(cl.nc_grad_sums, n * self.parts, gt, xt, c, self.parts, self.blocks, stats_nc,
                 partials)
        coefs = tuple(np.empty((n, c), dtype=st) for _ in range(3))
        grads = (np.empty(c, dtype=st), np.empty(c, dtype=st))
        cl.nc_grad_coefs(partials, rstd_u, self.param(weight, self.ones), self.unit,
                         float(g.group_size), self.center, self.fixed, coefs, grads)
        dx = self.empty(x3)
        self.run(cl.nc_grad_apply, n * self.parts, gt, xt, _cl_flat(dx), c, self.parts,
                 (stats_nc[0], *coefs), tuning.stream_out(dx))
        return ((dx.view(g.view) if needs[0] else None),
                *self.dparams(*grads, self.pshape, needs))
