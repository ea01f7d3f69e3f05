r"""The autograd of the normalizations: ``apply_norm`` (every method), and the
residual-add norms.

``apply_norm`` calls the registered operator ``torch.ops.normkit.norm_forward`` (see
``normkit.ops``), whose autograd is ``NormFunction``: it saves only the input, the fp32
(fp64 for fp64 inputs) ``mean`` and ``rstd``, and the weight, and its backward is the
hand-derived gradient (see ``normkit.reference``), never autograd through the forward.

Double backward: when the backward itself is differentiated (``create_graph=True``),
``norm_backward`` runs the composite torch-op path (``normkit.backends.torch_ops``) with
the statistics recomputed from the saved input by differentiable ops, so autograd
differentiates the hand-derived formula, including its dependence on ``x`` through
``mean`` and ``rstd``.

``AddNormFunction`` (residual add fused with LayerNorm / RMSNorm: ``h = x + residual``,
``y = norm(h)``; the pre-norm transformer block computes both, and fused, the sum is
written once and read zero extra times) returns ``(y, h)`` and takes gradients from both
outputs; since ``dh/dx = dh/dresidual = 1`` both inputs receive

.. math:: \frac{\partial L}{\partial h} = \underbrace{\mathrm{rstd}\,(\hat g - c_2 -
          \hat h\, c_1)}_{\text{through } y} + \underbrace{g_h}_{\text{direct}},
          \qquad \hat g = g_y \cdot w,\; c_1 = \mathrm{mean}(\hat g\,\hat h),\;
          c_2 = \mathrm{mean}(\hat g)

(``c2 = 0`` for RMSNorm), the gradient of ``normkit.reference`` plus the direct one.

Paths:

* a backend with ``fused_add_forward`` (the GPU one, on CUDA tensors): one kernel each
  way, the ``+ g_h`` folded into the backward kernel;
* otherwise ``h = x + residual`` then the dispatched norm (the numba or composite
  backend), with the same saved tensors and backward -- this is what runs on CPU;
* no memory saving and no fused backend, or traced by torch.compile / torch.export:
  ``add_*`` do not use this Function at all but ``x + residual`` and
  ``normkit.functional``'s op, which also supports double backward.

Memory-saving backward (opt-in, ``normkit.backends.memory_saving``): save the output
``y`` instead of ``h`` and recompute ``xhat = (y - b) / w``. It needs every weight element
nonzero; with a zero the forward saves ``h`` as usual. Double backward through this
Function is not supported (``once_differentiable``).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from normkit import backends, ops
from normkit import grouping as G
from normkit.backends import torch_ops
from normkit.ops import NormFunction

__all__ = ["NormFunction", "AddNormFunction", "apply_norm", "add_norm", "view_as"]


def view_as(t, shape):
    """``t`` in ``shape``: a view for contiguous and channels_last tensors, a copy only for
    strides no view can express (a transposed activation)."""
    return t.reshape(shape)


def apply_norm(x, grouping, weight=None, bias=None, eps=1e-5, center=True,
               fixed_mean=None, fixed_rstd=None, keep_stats=True, fixed_var=None,
               running=None):
    """Run ``torch.ops.normkit.norm_forward`` on ``x`` seen through ``grouping.view`` (the
    composite torch ops where ``normkit.ops.decomposing()``); returns ``(y, mean, var)``
    with ``y`` in ``x``'s shape (and memory layout); ``keep_stats=False``: the caller uses
    ``y`` alone, ``mean`` and ``var`` may be None. Fixed statistics come as ``fixed_mean`` and
    ``fixed_rstd``, or ``fixed_var`` instead of the rstd. ``running``: the running
    buffers to update on the way where the path can (``normkit.ops.norm_forward``; then
    ``mean`` and ``var`` come back None and the caller has nothing left to update). ``y``
    is never a view of ``x``, so callers may modify it in place."""
    if not torch.compiler.is_compiling():        # eager (the common case, checked first)
        y, mean, _, var = ops.norm_forward(x, grouping, weight, bias, eps, center, fixed_mean,
                                           fixed_rstd, keep_stats, fixed_var, running)
        return y, mean, var
    if ops.decomposing():
        if fixed_mean is not None:
            fixed_mean, fixed_rstd = torch_ops.fixed_stats(grouping, fixed_mean, fixed_rstd,
                                                           fixed_var, eps)
        y, mean, _, var = torch_ops.forward(x.reshape(grouping.view), grouping, weight, bias,
                                            eps, center, fixed_mean, fixed_rstd)
        return y.reshape(x.shape), mean, var
    y, mean, _, var = ops.norm_forward(x, grouping, weight, bias, eps, center, fixed_mean,
                                       fixed_rstd, keep_stats, fixed_var)
    return y, mean, var


class AddNormFunction(torch.autograd.Function):
    """``(y, h)`` with ``h = x + residual`` and ``y = w * (h - mean) * rstd + b`` over the
    rows of (M, K) views (``center=False``: RMSNorm, mean = 0)."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, center, memory_saving):
        grouping = G.layer(tuple(x.shape), 1)
        backend = backends.select(x, grouping, center)
        fused = hasattr(backend, "fused_add_forward")
        if fused:
            y, h, mean, rstd = backend.fused_add_forward(x, residual, weight, bias, eps,
                                                         center)
        else:
            h = x + residual
            backend = backends.select(h, grouping, center)
            y, mean, rstd, _ = backend.forward(h, grouping, weight, bias, eps, center)
        from_y = bool(memory_saving) and (weight is None or not bool((weight == 0).any()))
        ctx.save_for_backward(y if from_y else h, weight, bias, mean, rstd)
        ctx.backend, ctx.fused, ctx.from_y = backend, fused, from_y
        ctx.grouping, ctx.center = grouping, center
        return y, h

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y, grad_h):
        saved, weight, bias, mean, rstd = ctx.saved_tensors
        nx, nr, nw, nb = ctx.needs_input_grad[:4]
        needs = (nx or nr, nw, nb)
        if ctx.fused:
            dh, dw, db = ctx.backend.fused_add_backward(
                grad_y, grad_h, saved, mean.reshape(-1), rstd.reshape(-1), weight, bias,
                ctx.center, ctx.from_y, needs)
        elif ctx.from_y:
            # memory-saving path: y = w * xhat + b gives xhat back, x itself was not kept
            sd = mean.dtype
            xhat = saved.to(sd)                                    # M, K
            if bias is not None:
                xhat = xhat - bias.to(sd).reshape(-1)
            if weight is not None:
                xhat = xhat / weight.to(sd).reshape(-1)
            dh, dw, db = torch_ops.backward(grad_y, saved, mean, rstd.reshape(-1, 1), weight,
                                            ctx.grouping, ctx.center, False, needs, xhat=xhat)
        else:
            dh, dw, db = ctx.backend.backward(grad_y, saved, mean, rstd, weight,
                                              ctx.grouping, ctx.center, False, needs)
        if not ctx.fused and dh is not None and grad_h is not None:
            dh = dh + grad_h                                       # the direct path of h
        dw = None if dw is None or weight is None else dw.reshape(weight.shape).to(weight.dtype)
        db = None if db is None or bias is None else db.reshape(bias.shape).to(bias.dtype)
        return (dh if nx else None), (dh if nr else None), dw, db, None, None, None


def add_norm(x, residual, normalized_ndim, weight, bias, eps, center, memory_saving):
    """``(norm(x + residual), x + residual)`` over the last ``normalized_ndim`` dims
    (arguments already validated by ``normkit.functional.add_layer_norm`` /
    ``add_rms_norm``); ``memory_saving=None`` follows ``backends.memory_saving``."""
    grouping = G.layer(tuple(x.shape), normalized_ndim)
    if memory_saving is None:
        memory_saving = backends.memory_saving_enabled()
    xv = x.reshape(grouping.view)                                  # M, K
    rv = residual.reshape(grouping.view)
    backend = backends.select(xv, grouping, center)
    if ops.tracing() or (not memory_saving and not hasattr(backend, "fused_add_forward")):
        # traced (compile, export, ONNX): the registered norm after a plain add
        h = x + residual
        return apply_norm(h, grouping, weight, bias, eps, center)[0], h
    w = None if weight is None else weight.reshape(-1)
    b = None if bias is None else bias.reshape(-1)
    y, h = AddNormFunction.apply(xv, rv, w, b, eps, center, bool(memory_saving))
    if y.shape != x.shape:
        y, h = y.view(x.shape), h.view(x.shape)
    return y, h
