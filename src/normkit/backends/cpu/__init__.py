"""Fused CPU kernels (numba) run by one C++ executor: the fast path of every
normalization on CPU.

The interface of a backend (``normkit.backends``): ``supports``, ``plan``, ``forward``,
``backward``, ``update_running``; the dispatch tries this package first and skips it when
numba (the ``fast`` extra) is missing or the C++ executor is not there (no compiler, or
``NORMKIT_NATIVE=0``: ``native``). This module says which inputs it takes and which
kernel family runs them; the modules below do the rest:

``plans``          per family, what is decided once per shape (kernels, sizes, blocks,
                   threads, stages and scratch)
``native``         the C++ ``Plan`` that runs every call (``native.cpp``, compiled at
                   first use)
``args``           the kernels' arguments, declared once: one slot per name
``compiling``      a plan's entries compiled side by side on an empty cache
``entries``        the kernels as the C++ executor calls them (named arguments, tensors by
                   address: ``address``)
``half``           loads and stores of every storage type (bfloat16/float16 in registers)
``stores``         the output formulas, each written once, stored plainly or streamed,
                   with prefetch: one driver for every kernel
``tuning``         thresholds, block sizes, prefetch distances, each with its reason
``moments``        plane and channels_last moment loops, merged by the one jitted Chan
                   merge (``normkit.stats_numba``, shared with the scalers)
``rows``           LayerNorm/RMSNorm, contiguous (M, K)
``planes``         Batch/Instance/GroupNorm on contiguous NCHW
``columns``        BatchNorm on rows of channels: channels_last, and (N, C)
``channels_last``  Instance/GroupNorm on channels_last (the per-(n, c) family)

Memory is shared with torch, never copied: a kernel sees a tensor's storage by its
address; 16-bit floats as integers (``half``). Statistics are float32 (float64 for
float64 inputs), merged across blocks in float64. Each kernel is a serial ``nogil`` loop
over a range [lo, hi) of independent work items; the C++ plan runs one range per thread
on torch's OpenMP team. Compiled kernels are cached on disk where numba finds a writable
folder (``NUMBA_CACHE_DIR``, this package's ``__pycache__``, the user's cache folder:
``normkit._numba_cache``); numba keys each to its own source file, so ``_cache`` drops
them all when any kernel source changed.
"""

from __future__ import annotations

import torch

import normkit.backends as dispatch
from normkit.backends import fused_kernels_cover
from normkit.backends.cpu import _cache, tuning
from normkit.grouping import view_strides

_cache.check_package_cache()    # before any kernel is loaded from the cache

from normkit.backends.cpu import compiling, native  # noqa: E402
from normkit.backends.cpu.plans import FAMILIES  # noqa: E402

__all__ = ["add_one_pass", "backward", "forward", "plan", "supports", "supports_activation",
           "update_running"]

_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def layout(xv, grouping):
    """The kernel family for the view ``xv``: ``"rows"`` (contiguous (M, K)), ``"planes"``
    (contiguous NCHW planes), ``"columns"`` (BatchNorm on rows of channels: channels_last,
    or (N, C)), ``"channels_last"`` (Instance/GroupNorm), or None (not handled here)."""
    if grouping.kind == "layer":
        return "rows" if xv.is_contiguous() else None
    v = grouping.view
    x3 = xv.view(v[0], v[1] * v[2], v[3]) if grouping.kind == "group" else xv
    if x3.is_contiguous() and x3.shape[2] > 1:
        return "planes"
    if x3.transpose(1, 2).is_contiguous():
        return "columns" if grouping.kind == "batch" else "channels_last"
    return None


def supports(x, grouping, center=True, fixed=False) -> bool:
    if (x.device.type != "cpu" or x.dtype not in _DTYPES
            or not fused_kernels_cover(x, grouping, center, fixed)
            or view_strides(x.shape, x.stride(), grouping.view) is None):
        return False
    family = layout(x.view(grouping.view), grouping)
    # (on a new machine, this call's kernels compile while the executor builds)
    return family is not None and native.extension(
        lambda: compiling.plan_callbacks(FAMILIES[family](x, grouping, center, fixed))
    ) is not None


def supports_activation(x, grouping, act) -> bool:
    """BatchNorm followed by ``act`` (``normkit.activation``) runs fused in the kernels of
    contiguous NCHW planes and of rows of channels (channels_last, (N, C)): the activation
    in the store of y, its derivative in the backward's sums and dx (``act_stores``)."""
    return grouping.kind == "batch" and layout(x.view(grouping.view), grouping) in (
        "planes", "columns")


def plan(x, grouping, center=True, fixed=False, act=None):
    """The C++ plan that runs ``x`` (``supports`` true; the view or any shape that views as
    it), made from its family's decisions (``plans``); ``act``: followed by that
    activation (``supports_activation`` true)."""
    family = FAMILIES[layout(x.view(grouping.view), grouping)](x, grouping, center, fixed,
                                                               act)
    return native.build(family, x)


# the module-level interface (the residual-add norms, SyncBatchNorm) runs the cached plans
# of the dispatch point, not a plan built afresh per call

def forward(x, grouping, weight, bias, eps, center=True, mean=None, rstd=None):
    return dispatch.plan(x, grouping, center, mean is not None).forward(x, weight, bias, eps,
                                                                        mean, rstd)


def backward(grad, x, mean, rstd, weight, grouping, center, fixed, needs):
    return dispatch.plan(x, grouping, center, fixed).backward(grad, x, mean, rstd, weight,
                                                              needs)


def add_one_pass(x) -> bool:
    """Whether ``add_layer_norm`` / ``add_rms_norm`` of the (M, K) rows ``x`` (``supports``
    true) take the plan's one pass (``add_forward``): where x, the residual, h and y
    together outrun the last-level cache (``tuning.ONE_PASS_ADD``); below, the add and then
    the norm, the same bits."""
    return 4 * x.numel() * x.element_size() >= tuning.ONE_PASS_ADD


def update_running(running_mean, running_var, mean, var, momentum, unbias) -> bool:
    """The running statistics update of ``normkit.backends.update_running`` for CPU
    float32/float64 buffers with statistics of their dtype, in C++; False: not handled
    here."""
    ext = native.extension()
    return ext is not None and ext.update_running(running_mean, running_var, mean, var,
                                                  momentum, unbias)
