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
``ColumnsPlan``       BatchNorm on rows of channels: channels_last, (N, C) (``columns``)
``ChannelsLastPlan``  Instance/GroupNorm on channels_last                  (``channels_last``)

Every plan has ``forward(x, weight, bias, eps, mean=None, rstd=None, keep_stats=True,
var=None) -> (y, mean, rstd, var)`` (statistics None with ``keep_stats=False``; fixed
statistics may come as ``mean`` and ``var`` instead of ``rstd``: eval BatchNorm's running
statistics, the rstd then computed in the kernel) and ``backward(grad,
x, mean, rstd, weight, needs) -> (dx, dweight, dbias)`` with the meaning of the backend
interface (``normkit.backends``); ``x`` comes in the shape and strides the plan was
built for (the grouping's view, or any shape of a contiguous input: the kernels see only
its memory), and ``y`` and ``dx`` are laid out as ``torch.empty_like(x)``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from normkit.backends._memory import HUGE_MIN_BYTES, empty_like, huge_pages_advised
from normkit.backends._parallel import launch
from normkit.backends.cpu import channels_last as cl
from normkit.backends.cpu import entries, native, tuning
from normkit.backends.torch_ops import rstd_from_var, stat_dtype

__all__ = ["RowsPlan", "PlanesPlan", "ColumnsPlan", "ChannelsLastPlan", "np_view"]

# storage dtype seen by the kernels for each torch dtype (see ``half``)
_STORAGE = {torch.bfloat16: torch.uint16, torch.float16: torch.int16}
_NP_STAT = {torch.float64: np.float64, torch.float32: np.float32}


def np_view(t):
    """Zero-copy NumPy view of a CPU tensor's storage (16-bit floats as integers)."""
    if t.requires_grad:
        t = t.detach()
    storage = _STORAGE.get(t.dtype)
    return (t if storage is None else t.view(storage)).numpy()


def _ncs_shape(grouping):
    """The (N, C, S) sizes of a batch/instance/group view."""
    v = grouping.view
    return (v[0], v[1] * v[2], v[3]) if grouping.kind == "group" else tuple(v)


def _ncs(x, grouping):
    """The (N, C, S) view of a batch/instance/group input."""
    return x.view(_ncs_shape(grouping))


class _Plan:
    """What every family shares: sizes, dtypes, threads, the output allocation, the
    parameters and statistics as the kernels' entries take them (``entries``).

    ``native``: the plan's C++ node (``normkit.backends.cpu.native``, set by
    ``normkit.backends.cpu.plan``) or None. Where there is one, the plan's own calls run
    its compiled callbacks too (``_native_forward``, ``_native_backward``), so that every
    path of one shape -- the node, the operator, the residual-add and SyncBatchNorm
    calls -- runs one compilation of the kernels and rounds alike."""

    native = None

    #: the family's C++ callbacks (``native``: "rows" or "planes"), None where it has none;
    #: a plan with them may start its threads from C++
    cpp_family = None

    def __init__(self, x, grouping, center, fixed, params):
        self.grouping, self.center, self.fixed = grouping, bool(center), bool(fixed)
        self.sdtype = stat_dtype(x.dtype)
        self.st = _NP_STAT[self.sdtype]
        self.proto = np.empty(0, np_view(x[:0]).dtype)              # storage dtype
        self.sproto = np.empty(0, self.st)                         # statistics dtype
        self.itemsize = x.element_size()
        self.threads = tuning.threads(x, self.cpp_family is not None
                                      and native.threads_in_cpp())
        self.stat_shape = grouping.stat_shape
        self.stat_count = math.prod(self.stat_shape)
        self.params = params                                       # elements per weight
        self.ones = torch.ones(params, dtype=self.sdtype)          # weight None
        self.zeros = torch.zeros(params, dtype=self.sdtype)        # bias None
        nbytes = x.numel() * self.itemsize
        # outputs advised huge pages (where _memory advises them at all)
        self.large = nbytes >= HUGE_MIN_BYTES and huge_pages_advised()
        self.may_stream = nbytes >= tuning.STREAM_BYTES

    def stream(self, out):
        """``tuning.stream_out(out)``, not asked below its size threshold."""
        return self.may_stream and tuning.stream_out(out)

    def empty(self, x):
        return empty_like(x) if self.large else torch.empty_like(x)

    def param(self, p, default):
        """A weight or bias as contiguous memory of the statistics dtype (the default for
        None), to pass by address."""
        if p is None:
            return default
        if p.dtype != self.sdtype or not p.is_contiguous():
            p = p.detach().to(self.sdtype).contiguous()
        return p

    def stat(self, t):
        """Given statistics (saved, or fixed ones) as contiguous memory of the statistics
        dtype, one element per unit."""
        if t.dtype != self.sdtype or not t.is_contiguous():
            t = t.to(self.sdtype).contiguous()
        return t

    def run(self, kernel, total, *args):
        if self.threads == 1 or total == 1:
            kernel(*args, 0, total)
        else:
            launch(kernel, total, self.threads, *args)

    def stats(self, keep=True):
        """Fresh (mean, rstd, var) tensors of ``stat_shape`` and their three addresses;
        ``keep=False``: none, addresses 0 (the kernel's own scratch). Three tensors, not
        the rows of one block: a row is a view, and views cost autograd several
        microseconds more per call when saved for backward (``docs/performance.md``)."""
        if not keep:
            return None, (0, 0, 0)
        shape, sdtype = self.stat_shape, self.sdtype
        stats = (torch.empty(shape, dtype=sdtype), torch.empty(shape, dtype=sdtype),
                 torch.empty(shape, dtype=sdtype))
        return stats, (stats[0].data_ptr(), stats[1].data_ptr(), stats[2].data_ptr())


def _native_forward(native, x, weight, bias, eps, mean, rstd, keep_stats, var):
    """A plan's ``forward`` on its C++ node's callbacks (no graph)."""
    from_var = mean is not None and rstd is None
    out = native.forward(x, weight, bias, eps, mean, var if from_var else rstd, from_var,
                         keep_stats)
    if len(out) == 4:
        return tuple(out)
    return out[0], mean, rstd, None          # fixed statistics, or none kept


def _asked(needs, *grads):
    """The gradients asked for in ``needs``, None for the others."""
    return tuple(g if need else None for g, need in zip(grads, needs))


def _outputs(y, stats, keep_stats):
    """``(y, mean, rstd, var)``, the statistics None unless kept."""
    if not keep_stats:
        return y, None, None, None
    return (y, *stats)


class RowsPlan(_Plan):
    """LayerNorm / RMSNorm over the rows of a contiguous (M, K) view."""

    cpp_family = "rows"

    def __init__(self, x, grouping, center, fixed):
        self.m, self.k = grouping.view
        super().__init__(x, grouping, center, fixed, self.k)
        self.ahead = tuning.rows_ahead(self.k, self.itemsize)

    def forward(self, x, weight, bias, eps, mean=None, rstd=None, keep_stats=True, var=None):
        if self.native is not None:
            return _native_forward(self.native, x, weight, bias, eps, mean, rstd, keep_stats,
                                   var)
        y = self.empty(x)
        stats, at = self.stats(keep_stats)
        w, b = self.param(weight, self.ones), self.param(bias, self.zeros)
        self.run(entries.rows_forward, self.m,
                 (x.data_ptr(), y.data_ptr(), w.data_ptr(), b.data_ptr(), *at),
                 self.m, self.k, self.proto, self.sproto, float(eps), self.center,
                 (self.stream(y), self.ahead))
        return _outputs(y, stats, keep_stats)

    def backward(self, grad, x, mean, rstd, weight, needs):
        if self.native is not None:
            return _asked(needs, *self.native.backward(grad, x, weight, mean, rstd))
        grad = grad.contiguous()
        dx = self.empty(x)
        chunks = self.threads
        # dw, db as tensors of their own (views of one block cost autograd more per call)
        shape = (chunks, self.k) if chunks > 1 else (self.k,)
        dw, db = torch.zeros(shape, dtype=self.sdtype), torch.zeros(shape, dtype=self.sdtype)
        w, mean, rstd = self.param(weight, self.ones), self.stat(mean), self.stat(rstd)
        self.run(entries.rows_backward, chunks,
                 (grad.data_ptr(), x.data_ptr(), dx.data_ptr(), w.data_ptr(), mean.data_ptr(),
                  rstd.data_ptr(), dw.data_ptr(), db.data_ptr()),
                 self.m, self.k, chunks, self.proto, self.sproto, self.center,
                 (self.stream(dx), self.ahead))
        if chunks > 1:
            dw, db = dw.sum(0), db.sum(0)                          # (K,) each
        return _asked(needs, dx, dw, db)


def _groups(grouping, c):
    return {"batch": c, "instance": c, "group": grouping.view[1]}[grouping.kind]


class _ChannelsPlan(_Plan):
    """Batch / Instance / GroupNorm: the (N, C, S) sizes and the per-channel parameters."""

    def __init__(self, x, grouping, center, fixed):
        self.n, self.c, self.s = _ncs_shape(grouping)
        super().__init__(x, grouping, center, fixed, self.c)
        self.groups = _groups(grouping, self.c)

    def _forward_inputs(self, x, weight, bias, mean, rstd, var):
        """``(y, w, b, from_var, given)`` of a forward by address: the output, the
        parameters, whether fixed statistics come as a variance (``rstd`` then computed in
        the kernel), and those statistics ``(mean, rstd or var)`` as the kernels read them
        (None without)."""
        y = self.empty(x)
        w, b = self.param(weight, self.ones), self.param(bias, self.zeros)
        from_var = rstd is None and var is not None
        given = (self.stat(mean), self.stat(var if from_var else rstd)) if self.fixed else None
        return y, w, b, from_var, given


class PlanesPlan(_ChannelsPlan):
    """Contiguous NCHW: per channel (BatchNorm, blocks of channels) or per (sample,
    group) of planes (Instance/GroupNorm)."""

    cpp_family = "planes"

    def __init__(self, x, grouping, center, fixed):
        super().__init__(x, grouping, center, fixed)
        self.by_channel = grouping.kind == "batch"
        self.small = self.s < tuning.SMALL_PLANE
        self.units = self.c if self.by_channel else self.n * self.groups
        # given statistics (eval BatchNorm) on several threads: the N * C planes in memory
        # order (``planes.channels_fixed``; on one thread the channel loops cost less)
        self.plane_order = self.by_channel and self.fixed and self.threads > 1
        self.forward_units = self.n * self.c if self.plane_order else self.units
        self.ncs = (self.n, self.c, self.s)
        # (no larger than C: each kernel call allocates its per-block scratch)
        self.block = min(self.c, tuning.channel_block(self.n * self.s * self.itemsize))
        self.block_bwd = min(self.c, tuning.channel_block(2 * self.n * self.s * self.itemsize))
        self.ahead = tuning.rows_ahead(self.s, self.itemsize)

    def forward(self, x, weight, bias, eps, mean=None, rstd=None, keep_stats=True, var=None):
        if self.native is not None:
            return _native_forward(self.native, x, weight, bias, eps, mean, rstd, keep_stats,
                                   var)
        y, w, b, from_var, given = self._forward_inputs(x, weight, bias, mean, rstd, var)
        if self.fixed:     # read, never written (the third: unused); rstd, or var for it
            mean = given[0]
            addresses = (mean.data_ptr(), given[1].data_ptr(), mean.data_ptr())
        else:
            stats, addresses = self.stats(keep_stats)
        at = (x.data_ptr(), y.data_ptr(), w.data_ptr(), b.data_ptr(), *addresses)
        args = (self.proto, self.sproto, float(eps), self.fixed, from_var)
        stream = self.stream(y)
        if self.plane_order:
            self.run(entries.channels_fixed, self.forward_units, at, self.ncs, self.proto,
                     self.sproto, float(eps), from_var, self.small, (stream, self.ahead))
        elif self.small and self.by_channel:
            self.run(entries.channels_small, self.units, at, self.ncs, *args)
        elif self.small:
            self.run(entries.planes_small, self.units, at, self.ncs, self.groups, *args)
        elif self.by_channel:
            self.run(entries.channels_forward, self.units, at, self.ncs, *args, self.block,
                     stream)
        else:
            self.run(entries.planes_forward, self.units, at, self.ncs, self.groups, *args,
                     (stream, self.ahead))
        if self.fixed:
            return y, mean, rstd, None
        return _outputs(y, stats, keep_stats)

    def backward(self, grad, x, mean, rstd, weight, needs):
        if self.native is not None:
            return _asked(needs, *self.native.backward(grad, x, weight, mean, rstd))
        if not grad.is_contiguous():
            grad = grad.contiguous()
        dx = self.empty(x)
        # dbias, dweight: the per-plane sums over n, in float64, as (C,) tensors of their
        # own (the weight's usual shape, no view on the way out); a serial call adds them
        # up in its kernel, a threaded one leaves its sums to param_sums
        db = torch.empty(self.c, dtype=self.sdtype)
        dw = torch.empty(self.c, dtype=self.sdtype)
        serial = self.threads == 1 or self.units == 1
        sums = None if serial else torch.empty((2, self.n, self.c), dtype=self.sdtype)
        w, mean, rstd = self.param(weight, self.ones), self.stat(mean), self.stat(rstd)
        at = (grad.data_ptr(), x.data_ptr(), dx.data_ptr(), w.data_ptr(), mean.data_ptr(),
              rstd.data_ptr(), *((0, db.data_ptr(), dw.data_ptr()) if serial
                                 else (sums.data_ptr(), 0, 0)))
        args = (self.proto, self.sproto)
        flags = (self.center, self.fixed)
        stream = self.stream(dx)
        units = self.units
        if self.small and self.by_channel:
            self.run(entries.channels_small_backward, units, at, self.ncs, *args, *flags)
        elif self.small:
            self.run(entries.planes_small_backward, units, at, self.ncs, self.groups, *args,
                     *flags)
        elif self.by_channel:
            self.run(entries.channels_backward, units, at, self.ncs, *args, self.block_bwd,
                     *flags, stream)
        else:
            self.run(entries.planes_backward, units, at, self.ncs, self.groups, *args, *flags,
                     (stream, self.ahead))
        if not serial:
            entries.param_sums((sums.data_ptr(), db.data_ptr(), dw.data_ptr()), self.n,
                               self.c, self.sproto)
        return _asked(needs, dx, dw, db)


class ColumnsPlan(_ChannelsPlan):
    """BatchNorm on an (M, C) matrix of rows of channels (``columns``): channels_last
    (M = N * S positions) or (N, C); chunks of rows, each direction in three stages."""

    cpp_family = "columns"

    def __init__(self, x, grouping, center, fixed):
        super().__init__(x, grouping, center, fixed)
        m = self.n * self.s
        self.mcr = (m, self.c, *tuning.cl_blocks(self.c, self.itemsize))  # M, C, rows, run
        self.chunks = -(-m // self.mcr[2])

    def _sums(self):
        return torch.empty((2, self.chunks, self.c), dtype=torch.float64)

    def _stages(self, entry, at, *args):
        """``entry`` (``entries.columns_*``) in stages 0, 1, 2 (``columns``)."""
        self.run(entry, self.chunks, at, self.mcr, *args, 0)
        entry(at, self.mcr, *args, 1, 0, 1)
        self.run(entry, self.mcr[0], at, self.mcr, *args, 2)

    def forward(self, x, weight, bias, eps, mean=None, rstd=None, keep_stats=True, var=None):
        if self.native is not None:
            return _native_forward(self.native, x, weight, bias, eps, mean, rstd, keep_stats,
                                   var)
        y, w, b, from_var, given = self._forward_inputs(x, weight, bias, mean, rstd, var)
        at = (x.data_ptr(), y.data_ptr(), w.data_ptr(), b.data_ptr())
        args = (self.proto, self.sproto, float(eps), from_var, self.stream(y))
        if self.fixed:     # rstd, or var for it; stage 2 alone
            self.run(entries.columns_forward, self.mcr[0],
                     (*at, given[0].data_ptr(), given[1].data_ptr(), 0, 0), self.mcr, *args, 2)
            return y, given[0], rstd, None
        stats, addresses = self.stats()                            # (stage 2 reads them)
        sums = self._sums()
        self._stages(entries.columns_forward, (*at, *addresses, sums.data_ptr()), *args)
        return _outputs(y, stats, keep_stats)

    def backward(self, grad, x, mean, rstd, weight, needs):
        if self.native is not None:
            return _asked(needs, *self.native.backward(grad, x, weight, mean, rstd))
        rows = grad.reshape(self.n, self.c, self.s).transpose(1, 2)  # N, S, C
        if not rows.is_contiguous():
            rows = rows.contiguous()
        dx = self.empty(x)
        dw = torch.empty(self.c, dtype=self.sdtype)
        db = torch.empty(self.c, dtype=self.sdtype)
        w, mean, rstd = self.param(weight, self.ones), self.stat(mean), self.stat(rstd)
        sums = self._sums()
        self._stages(entries.columns_backward,
                     (rows.data_ptr(), x.data_ptr(), dx.data_ptr(), w.data_ptr(),
                      mean.data_ptr(), rstd.data_ptr(), dw.data_ptr(), db.data_ptr(),
                      sums.data_ptr()), self.proto, self.sproto, self.center, self.fixed,
                     self.stream(dx))
        return _asked(needs, dx, dw, db)


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
        # C++ callbacks (``native``, three stages) for batch statistics
        self.cpp_family = None if fixed else "channels_last"
        super().__init__(x, grouping, center, fixed)
        self.blocks = tuning.cl_blocks(self.c, self.itemsize)
        self.parts = tuning.parts(self.n, self.s, self.threads)
        self.unit = _unit(grouping, self.c)
        self.per_sample = (not fixed and grouping.kind != "batch" and self.n >= self.threads)

    def np_param(self, p, default):
        return np_view(self.param(p, default)).reshape(self.params)

    def np_stats(self):
        """Fresh statistics (``stats``): as tensors (mean, rstd, var) and as flat arrays."""
        tensors, _ = self.stats()
        return tensors, tuple(t.numpy().reshape(self.stat_count) for t in tensors)

    def forward(self, x, weight, bias, eps, mean=None, rstd=None, keep_stats=True, var=None):
        if self.native is not None:
            return _native_forward(self.native, x, weight, bias, eps, mean, rstd, keep_stats,
                                   var)
        if self.fixed and rstd is None:
            rstd = rstd_from_var(var, eps)
        n, c, g = self.n, self.c, self.grouping
        x3 = _ncs(x, g)
        y = self.empty(x)
        xt, yt = _cl_flat(x3), _cl_flat(_ncs(y, g))                # N, S*C
        w, b = self.np_param(weight, self.ones), self.np_param(bias, self.zeros)
        if self.per_sample:
            tensors, arrays = self.np_stats()
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
            (mean, rstd, var), arrays = self.np_stats()
            cl.nc_stats(partials, self.s, self.unit, float(eps), w, b, arrays, coefs)
        self.run(cl.nc_apply, n * self.parts, xt, yt, c, self.parts, coefs, tuning.stream_out(y))
        return y, mean, rstd, var

    def backward(self, grad, x, mean, rstd, weight, needs):
        if self.native is not None:
            return _asked(needs, *self.native.backward(grad, x, weight, mean, rstd))
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
        cl.nc_grad_coefs(partials, rstd_u, self.np_param(weight, self.ones), self.unit,
                         float(g.group_size), self.center, self.fixed, coefs, grads)
        dx = self.empty(x)
        self.run(cl.nc_grad_apply, n * self.parts, gt, xt, _cl_flat(_ncs(dx, g)), c, self.parts,
                 (stats_nc[0], *coefs), tuning.stream_out(dx))
        dw, db = (torch.from_numpy(t) for t in grads)              # (C,), not views
        return _asked(needs, dx, dw, db)
