"""Fused CPU kernels (numba): the fast path of every normalization on CPU.

Same interface as ``normkit.backends.torch_ops`` (``supports``, ``forward``,
``backward``) plus ``plan``; the dispatch in ``normkit.backends`` tries this package first
and skips it when numba (the ``fast`` extra) is missing. This module says which inputs it
takes and which kernel family runs them; the modules below do the rest:

``plans``          per family, what is decided once per shape (sizes, blocks, threads)
                   and what each call does: allocate, view, launch
``entries``        the kernels as the plans call them: tensors passed by address and
                   rebuilt as arrays inside compiled code (``address``)
``native``         small calls in C++: a plan's entries as C callbacks behind a
                   ``torch::autograd::Function`` (``native.cpp``, compiled at first use)
``half``           loads and stores of every storage type (bfloat16/float16 in registers)
``stores``         the output formulas, each written once, stored plainly or streamed,
                   with prefetch: one driver for every kernel
``tuning``         thresholds, block sizes, prefetch distances, each with its reason
``moments``        plane and channels_last moment loops, merged by the one jitted Chan
                   merge (``normkit.stats_numba``, shared with the scalers)
``running``        BatchNorm's running statistics, both buffers in one loop
``rows``           LayerNorm/RMSNorm, contiguous (M, K)
``planes``         Batch/Instance/GroupNorm on contiguous NCHW
``columns``        BatchNorm on rows of channels: channels_last, and (N, C)
``channels_last``  Instance/GroupNorm on channels_last (the per-(n, c) family)

Memory is shared with torch, never copied: a kernel sees a tensor's storage either by its
address (``entries``) or as a detached tensor's ``.numpy()`` view (the channels_last
family); 16-bit floats as integers (``half``). Statistics are float32 (float64 for
float64 inputs), merged across blocks in float64. Each kernel is a serial ``nogil`` loop
over a range [lo, hi) of independent work items; ``_parallel.launch`` runs one range per
thread on torch's OpenMP team. Compiled kernels are cached on disk (``cache=True``, in
``__pycache__`` of this package or ``NUMBA_CACHE_DIR``); numba keys each to its own source
file, so ``_cache`` drops them all when any kernel source changed.
"""

from __future__ import annotations

import numpy as np
import torch

import normkit.backends as dispatch
from normkit.backends import fused_kernels_cover
from normkit.grouping import view_strides
from normkit.backends.cpu import _cache

_cache.check_package_cache()    # before any kernel is loaded from the cache

from normkit.backends.cpu.plans import (ChannelsLastPlan, ColumnsPlan, PlanesPlan,  # noqa: E402
                                        RowsPlan)
from normkit.backends.cpu import entries, native  # noqa: E402

__all__ = ["backward", "forward", "plan", "supports", "update_running"]

_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_FAMILIES = {"rows": RowsPlan, "nchw": PlanesPlan, "columns": ColumnsPlan,
             "channels_last": ChannelsLastPlan}


def layout(xv, grouping):
    """The kernel family for the view ``xv``: ``"rows"`` (contiguous (M, K)), ``"nchw"``
    (contiguous planes), ``"columns"`` (BatchNorm on rows of channels: channels_last, or
    (N, C)), ``"channels_last"`` (Instance/GroupNorm), or None (not handled here)."""
    if grouping.kind == "layer":
        return "rows" if xv.is_contiguous() else None
    v = grouping.view
    x3 = xv.view(v[0], v[1] * v[2], v[3]) if grouping.kind == "group" else xv
    if x3.is_contiguous() and x3.shape[2] > 1:
        return "nchw"
    if x3.transpose(1, 2).is_contiguous():
        return "columns" if grouping.kind == "batch" else "channels_last"
    return None


def supports(x, grouping, center=True, fixed=False) -> bool:
    if (x.device.type != "cpu" or x.dtype not in _DTYPES
            or not fused_kernels_cover(x, grouping, center, fixed)):
        return False
    if view_strides(x.shape, x.stride(), grouping.view) is None:
        return False
    return layout(x.view(grouping.view), grouping) is not None


def plan(x, grouping, center=True, fixed=False):
    """The plan of the family that runs ``x`` (``supports`` true; the view or any shape
    that views as it); see ``plans``. Its ``native`` is the C++ node that runs its small
    calls (``native``), or None."""
    found = _FAMILIES[layout(x.view(grouping.view), grouping)](x, grouping, center, fixed)
    found.native = native.node(found, x)
    return found


# the module-level interface (the residual-add norms, SyncBatchNorm) runs the cached plans
# of the dispatch point, not a plan built afresh per call

def forward(x, grouping, weight, bias, eps, center=True, mean=None, rstd=None):
    return dispatch.plan(x, grouping, center, mean is not None).forward(x, weight, bias, eps,
                                                                        mean, rstd)


def backward(grad, x, mean, rstd, weight, grouping, center, fixed, needs):
    return dispatch.plan(x, grouping, center, fixed).backward(grad, x, mean, rstd, weight,
                                                              needs)


_BUFFER = {torch.float32: np.float32, torch.float64: np.float64}
_PROTO = {st: np.empty(0, st) for st in _BUFFER.values()}


def update_running(running_mean, running_var, mean, var, momentum, unbias) -> bool:
    """The running statistics update of ``normkit.backends.update_running`` for CPU
    float32/float64 buffers (with statistics of their dtype); False: not handled here."""
    ext = native.extension()     # the same loop in C++, without a numba call's typing
    if ext is not None and ext.update_running(running_mean, running_var, mean, var, momentum,
                                              unbias):
        return True
    st = _BUFFER.get(running_mean.dtype)
    if (st is None or running_var.dtype != running_mean.dtype or mean.dtype != running_mean.dtype
            or var.dtype != running_mean.dtype or running_mean.device.type != "cpu"
            or not (running_mean.is_contiguous() and running_var.is_contiguous())):
        return False
    if not (mean.is_contiguous() and var.is_contiguous()):
        mean, var = mean.contiguous(), var.contiguous()
    entries.running_update((running_mean.data_ptr(), running_var.data_ptr(), mean.data_ptr(),
                            var.data_ptr()), running_mean.shape[0], _PROTO[st],
                           1.0 - momentum, float(momentum), float(unbias))
    return True
