r"""The Python autograd Functions of the normalizations (two; every eager CPU call is
recorded by the C++ executor's own node instead, ``backends/cpu/native.cpp``).

``NormFunction`` is the autograd of the registered operator
``torch.ops.normkit.norm_forward`` (``normkit.ops``) and of the eager calls of a plan
without a node of its own (the GPU's, the composite's; ``normkit.ops.run``): it saves
only the input, the fp32 (fp64 for fp64 inputs) ``mean`` and ``rstd``, and the weight,
and its backward is the hand-derived gradient (see ``normkit.reference``), never
autograd through the forward.

Double backward: when the backward itself is differentiated (``create_graph=True``),
``norm_backward`` runs the composite torch-op path (``normkit.backends.torch_ops``) with
the statistics recomputed from the saved input by differentiable ops, so autograd
differentiates the hand-derived formula, including its dependence on ``x`` through
``mean`` and ``rstd``.

With ``cast`` in its arguments (``normkit.ops.cast_norm``) ``NormFunction`` runs a
model's norm with its casting rule (``normkit.rms_casting``: Llama's cast then multiply,
Gemma's ``(1 + w)`` in fp32) in one op: the kernel normalizes ``x`` without a weight (in
fp32, or in ``x``'s own dtype where its output is already the rule's cast), the rule's
torch ops run inside the Function, and only ``x`` in its own dtype, the fp32 ``rstd``
(``mean`` too where centered) and the weight are saved, where the composed ops keep an
fp32 copy of ``x`` and ``x_hat`` besides. The backward recomputes ``x_hat`` with the
forward's kernel for the weight's gradient, runs the rule's gradient
(``rms_casting.scale_and_cast_backward``: the ops autograd would run) and the kernel's
backward: the composed ops' gradients bit for bit.

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

* one pass each way: a plan with ``add_forward`` (the CPU executor: x and residual read
  once, h and y written in the same pass, the ``+ g_h`` folded into the store of dh) or a
  backend with ``fused_add_forward`` (the GPU one, on CUDA tensors: one kernel each way);
* otherwise (the composite backend) ``h = x + residual`` then the dispatched norm, with
  the same saved tensors and backward;
* traced by torch.compile / torch.export, or no fused route without memory saving:
  ``add_*`` do not use this Function at all but ``x + residual`` and
  ``normkit.functional``'s op, which also supports double backward.

Memory-saving backward (opt-in, ``normkit.backends.memory_saving``): save the output
``y`` instead of ``h`` and recompute ``xhat = (y - b) / w``. It needs every weight element
nonzero; with a zero the forward saves ``h`` as usual. Double backward: through the
registered ``norm_backward`` operator (as ``NormFunction``), from the saved ``h``; not
with the memory-saving backward (an error).
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad

from normkit import backends
from normkit import grouping as G
from normkit.activation import Activation
from normkit.backends import torch_ops
from normkit.rms_casting import scale_and_cast, scale_and_cast_backward

__all__ = ["NormFunction", "AddNormFunction", "grouping_args", "activation_args",
           "as_activation", "plain_eager", "transformed", "view_as"]


def view_as(t, shape):
    """``t`` in ``shape``: a view for contiguous and channels_last tensors, a copy only for
    strides no view can express (a transposed activation)."""
    return t.reshape(shape)


def grouping_args(grouping):
    """A ``Grouping`` as the four schema arguments ``(kind, view, reduce, param_view)``."""
    pv = None if grouping.param_view is None else list(grouping.param_view)
    return grouping.kind, list(grouping.view), list(grouping.reduce), pv


def activation_args(act):
    """An ``Activation`` (or None) as the two schema arguments ``(activation,
    negative_slope)``."""
    return (None, 0.0) if act is None else (act.name, act.slope)


def as_activation(activation, negative_slope):
    """The ``Activation`` of the two schema arguments (None for ``activation=None``)."""
    return None if activation is None else Activation(activation, negative_slope)


def _grouping(kind, view, reduce, param_view):
    pv = None if param_view is None else tuple(param_view)
    return G.Grouping(kind, tuple(view), tuple(reduce), pv)


def plain_eager(x) -> bool:
    """Whether nothing traces, intercepts or transforms this call: a plain tensor, no
    dispatch mode (fake tensors, functionalization, make_fx, torch.compile all fail this)
    and no ``torch.func`` transform (``transformed``)."""
    if torch.compiler.is_compiling():  # first: dynamo cannot trace the checks below
        return False
    return (type(x) is torch.Tensor and not torch._C._len_torch_dispatch_stack()
            and not transformed())


def transformed() -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``, ``jvp``, ``jacrev``, ...),
    forward-mode AD (``torch.autograd.forward_ad.dual_level``) or the TorchScript tracer
    (``torch.jit.trace``, the legacy ONNX exporter) is active. A transform's wrapped tensors
    have no storage a kernel could read, neither the C++ executor's autograd node nor these
    Functions have a vmap rule or a jvp (a kernel's output would drop a dual tensor's
    tangent), and the tracer records no kernel: such calls take the composite torch ops,
    which all of them support, as torch's own norms do."""
    return (torch._C._functorch.maybe_current_level() is not None
            or forward_ad._current_level >= 0 or torch._C._is_tracing())


def _to_param(grad, shape, dtype, grouping):
    """Bring a backend's parameter gradient to the parameter's shape and dtype."""
    if grouping.param_view is None:
        grad = grad.sum_to_size(shape)
    if grad.shape != shape:
        grad = grad.reshape(shape)
    return grad if grad.dtype == dtype else grad.to(dtype)


class NormFunction(torch.autograd.Function):
    """The autograd of ``norm_forward``: saves the input, the weight and the fp32 (fp64)
    ``mean`` and ``rstd`` -- ``xhat`` is recomputed -- and runs ``norm_backward``.

    ``apply(x, weight, bias, (grouping, eps, center, mean, rstd, stats[, act[,
    reduce_sums[, cast]]]))`` returns ``y`` in ``x``'s shape; the statistics ``(mean, rstd,
    var)``, never differentiable, are appended to the list ``stats`` (one output instead of four, and the arguments that
    take no gradient in one tuple: each argument and output of an ``autograd.Function``
    costs a fraction of a microsecond to a few per call, a noticeable share on a small
    tensor). ``x`` may come in any shape with the view's number of elements: the view is
    taken inside, where autograd records nothing (no view node each way), and ``y`` goes
    out as a tensor of its own, not a view of the Function's output, so that an in-place
    op on it (ResNet's ``hidden += residual``) does not make autograd copy it back through
    a view on every backward. In plain eager mode both directions run the backend's plan
    directly.

    ``act`` (a ``normkit.activation.Activation``, BatchNorm followed by it, fused): ``y =
    act(w * xhat + b)``; the bias is kept too, and the backward recomputes ``z = w * xhat +
    b`` and takes ``g * act'(z)`` for ``g``.

    ``reduce_sums`` (SyncBatchNorm, ``normkit.nn._sync``): ``mean`` and ``rstd`` are the
    batch statistics of every rank, given, and the backward differentiates through them
    with its two reductions summed over the ranks by ``reduce_sums(sum_g, sum_gx) ->
    (c_mean, c_var)`` (the composite backward; not differentiable twice).

    ``cast = (casting, offset, kernel_dtype)`` (eager mode only, contiguous ``x``, batch
    statistics): the model's norm with its casting rule (module docstring).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, spec):
        grouping, eps, center, mean, rstd, stats, *more = spec
        fixed = mean is not None
        act = more[0] if more else None
        ctx.reduce_sums = more[1] if len(more) > 1 else None
        ctx.cast = more[2] if len(more) > 2 else None
        ctx.act = act
        ctx.plan = None
        if ctx.cast is not None:
            return _cast_forward(ctx, x, weight, bias, grouping, eps, center, stats)
        shape = x.shape
        eager = plain_eager(x)
        # a contiguous input goes to the plan in its own shape (the kernels see only its
        # memory); any other is viewed as the grouping says, and y viewed back
        ctx.reshaped = shape != grouping.view and not (eager and x.is_contiguous())
        xv = x.reshape(grouping.view) if ctx.reshaped else x
        if eager:
            ctx.plan = backends.plan(xv, grouping, center, fixed, act)
            y, mean_out, rstd_out, var = ctx.plan.forward(xv, weight, bias, eps, mean, rstd)
        else:
            with torch._C._AutoDispatchBelowAutograd():
                y, mean_out, rstd_out, var = torch.ops.normkit.norm_forward.default(
                    xv, weight, bias, *grouping_args(grouping), eps, center, mean, rstd,
                    *activation_args(act))
        stats += (mean_out, rstd_out, var)
        ctx.save_for_backward(x, weight, mean if fixed else mean_out,   # x: double backward
                              rstd if fixed else rstd_out, bias if act is not None else None)
        ctx.grouping, ctx.eps, ctx.center, ctx.fixed = grouping, eps, center, fixed
        ctx.bias_meta = None if bias is None else (bias.shape, bias.dtype)
        if ctx.reshaped:   # an alias autograd does not track as a view
            y = torch.ops.aten._unsafe_view(y, shape)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        if ctx.cast is not None:
            return _cast_backward(ctx, grad_y)
        x, weight, mean, rstd, bias = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        plan = ctx.plan if not torch.is_grad_enabled() and plain_eager(grad_y) else None
        shape, view = x.shape, ctx.grouping.view
        if plan is None or ctx.reshaped:       # the operator, or a plan built on the view
            grad_y, x = grad_y.reshape(view), x.reshape(view)
        if ctx.reduce_sums is not None:
            if torch.is_grad_enabled():
                raise RuntimeError("SyncBatchNorm's backward cannot be differentiated (its "
                                   "reductions are summed over the ranks); use "
                                   "create_graph=False")
            dx, dw, db = torch_ops.backward(grad_y.reshape(view), x.reshape(view), mean, rstd,
                                            weight, ctx.grouping, True, False, needs,
                                            reduce_sums=ctx.reduce_sums)
        elif plan is not None:
            dx, dw, db = (plan.backward(grad_y, x, mean, rstd, weight, needs) if ctx.act is None
                          else plan.backward(grad_y, x, mean, rstd, weight, needs, bias))
        else:
            dx, dw, db = torch.ops.normkit.norm_backward.default(
                grad_y, x, mean, rstd, weight, *grouping_args(ctx.grouping), ctx.eps,
                ctx.center, ctx.fixed, list(needs), bias, *activation_args(ctx.act))
        grouping = ctx.grouping
        dx = (dx if dx.shape == shape else dx.reshape(shape)) if needs[0] else None
        dw = _to_param(dw, weight.shape, weight.dtype, grouping) if needs[1] else None
        db = _to_param(db, *ctx.bias_meta, grouping) if needs[2] else None
        return dx, dw, db, None


def _cast_forward(ctx, x, weight, bias, grouping, eps, center, stats):
    """``NormFunction.forward`` with a casting rule: ``x_hat`` by the plan of ``x`` in the
    kernel dtype, without a weight, then the rule. Saves ``x``, the weight, ``rstd`` and
    (centered only: RMSNorm's is 0) ``mean``."""
    casting, offset, kdtype = ctx.cast
    xn = x.to(kdtype)                         # (an fp32 copy where the rule needs one: not kept)
    ctx.plan = backends.plan(xn, grouping, center, False)
    x_hat, mean, rstd, var = ctx.plan.forward(xn, None, None, eps)
    stats += (mean, rstd, var)
    ctx.save_for_backward(x, weight, mean if center else None, rstd)
    ctx.grouping, ctx.eps, ctx.center = grouping, eps, center
    ctx.bias = None if bias is None else torch.empty(bias.shape, dtype=bias.dtype,
                                                     device="meta")      # (shape, dtype)
    return scale_and_cast(x_hat, x.dtype, weight, offset, casting, bias)


def _cast_backward(ctx, grad_y):
    """``NormFunction.backward`` with a casting rule: ``x_hat`` recomputed by the forward's
    plan (the same bits) where the weight's gradient needs it, the rule's gradient, then
    the kernel's backward of ``x_hat``. Differentiated itself (``create_graph``) or
    intercepted, the same through the registered operators, which recompute the
    statistics from ``x`` with differentiable ops."""
    x, weight, mean, rstd = ctx.saved_tensors
    casting, offset, kdtype = ctx.cast
    grouping, eps, center = ctx.grouping, ctx.eps, ctx.center
    needs = ctx.needs_input_grad[:3]
    if mean is None:
        mean = torch.zeros_like(rstd)
    xn = x.to(kdtype)
    direct = not torch.is_grad_enabled() and plain_eager(grad_y)
    x_hat = None
    if needs[1] and weight is not None:
        if direct:
            x_hat = ctx.plan.forward(xn, None, None, eps, None, None, False)[0]
        else:
            x_hat = torch.ops.normkit.norm_forward.default(
                xn.reshape(grouping.view), None, None, *grouping_args(grouping), eps,
                center)[0].reshape(x.shape)
    d_xhat, dw, db = scale_and_cast_backward(grad_y, x_hat, kdtype, x.dtype, weight, ctx.bias,
                                             offset, casting, needs)
    dx = None
    if needs[0]:
        if direct:
            dxn = ctx.plan.backward(d_xhat.contiguous(), xn, mean, rstd, None,
                                    (True, False, False))[0]
        else:
            dxn = torch.ops.normkit.norm_backward.default(
                d_xhat.reshape(grouping.view), xn.reshape(grouping.view), mean, rstd, None,
                *grouping_args(grouping), eps, center, False,
                [True, False, False])[0].reshape(x.shape)
        dx = dxn.to(x.dtype)
    return dx, dw, db, None


class AddNormFunction(torch.autograd.Function):
    """``(y, h)`` with ``h = x + residual`` and ``y = w * (h - mean) * rstd + b`` over the
    rows of (M, K) views (``center=False``: RMSNorm, mean = 0); ``route = (grouping,
    backend, plan, one_pass, cast)`` of those rows (``normkit.ops.add_norm``; the plan
    where ``one_pass``). ``cast = (casting, offset)``, or None: the kernels normalize
    without the weight, ``x_hat`` in ``h``'s dtype (the rules ``ops._x_hat_in_x_dtype``
    admits), and the RMSNorm casting rule scales it as ``NormFunction``'s ``cast`` does,
    saving no more than ``h``, the statistics and the weight."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, center, memory_saving, route):
        grouping, backend, plan, one_pass, cast = route
        ctx.cast = cast
        kw = weight if cast is None else None   # with a rule: x_hat from the kernels, then it
        fused = one_pass and hasattr(backend, "fused_add_forward")
        one_pass = one_pass and not fused
        if fused:
            y, h, mean, rstd = backend.fused_add_forward(x, residual, kw, bias, eps, center)
        elif one_pass:
            y, h, mean, rstd = plan.add_forward(x, residual, kw, bias, eps)
        else:
            h = x + residual
            y, mean, rstd, _ = backend.forward(h, grouping, kw, bias, eps, center)
        if cast is not None:
            y = scale_and_cast(y, x.dtype, weight, cast[1], cast[0])
        from_y = bool(memory_saving) and cast is None and (
            weight is None or not bool((weight == 0).any()))
        ctx.save_for_backward(y if from_y else h, weight, bias, mean if center else None, rstd)
        ctx.backend, ctx.plan, ctx.fused, ctx.from_y = backend, plan, fused, from_y
        ctx.one_pass = one_pass
        ctx.grouping, ctx.center, ctx.eps = grouping, center, eps
        return y, h

    @staticmethod
    def backward(ctx, grad_y, grad_h):
        saved, weight, bias, mean, rstd = ctx.saved_tensors
        if mean is None:                                           # RMSNorm's: zeros
            mean = torch.zeros_like(rstd)
        nx, nr, nw, nb = ctx.needs_input_grad[:4]
        dw_cast = None
        if ctx.cast is not None:       # the rule's gradient, then the norm's without weight
            grad_y, dw_cast = _cast_rule_backward(ctx, grad_y, saved, weight, nw)
            weight, nw = None, False
        needs = (nx or nr, nw, nb)
        if torch.is_grad_enabled():    # double backward: the operator's formula, through h
            if ctx.from_y:
                raise RuntimeError("the memory-saving backward of add_layer_norm / "
                                   "add_rms_norm cannot be differentiated; call them with "
                                   "memory_saving=False for a double backward")
            dh, dw, db = torch.ops.normkit.norm_backward.default(
                grad_y, saved, mean, rstd, weight, *grouping_args(ctx.grouping), ctx.eps,
                ctx.center, False, list(needs))
        elif ctx.fused:
            dh, dw, db = ctx.backend.fused_add_backward(
                grad_y, grad_h, saved, mean.reshape(-1), rstd.reshape(-1), weight, bias,
                ctx.center, ctx.from_y, needs)
        elif not ctx.from_y and ctx.one_pass:
            dh, dw, db = ctx.plan.backward(grad_y, saved, mean, rstd, weight, needs,
                                           grad_h=grad_h)
            grad_h = None                                          # (added in the pass)
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
        if (torch.is_grad_enabled() or not ctx.fused) and dh is not None and grad_h is not None:
            dh = dh + grad_h                                       # the direct path of h
        dw = None if dw is None or weight is None else dw.reshape(weight.shape).to(weight.dtype)
        db = None if db is None or bias is None else db.reshape(bias.shape).to(bias.dtype)
        if dw_cast is not None:
            dw = dw_cast
        return (dh if nx else None), (dh if nr else None), dw, db, None, None, None, None


def _cast_rule_backward(ctx, grad_y, h, weight, needs_w):
    """``(d_xhat, dweight)`` of ``AddNormFunction``'s casting rule: ``x_hat`` recomputed
    from ``h`` where the weight's gradient needs it (the forward's kernel: the same bits;
    differentiable through the operator when the backward is differentiated)."""
    casting, offset = ctx.cast
    grouping, eps, center = ctx.grouping, ctx.eps, ctx.center
    x_hat = None
    if needs_w and weight is not None:
        if not torch.is_grad_enabled() and plain_eager(grad_y):
            x_hat = backends.plan(h, grouping, center).forward(h, None, None, eps, None, None,
                                                               False)[0]
        else:
            x_hat = torch.ops.normkit.norm_forward.default(h, None, None,
                                                           *grouping_args(grouping), eps,
                                                           center)[0]
    d_xhat, dw, _ = scale_and_cast_backward(grad_y, x_hat, h.dtype, h.dtype, weight, None,
                                            offset, casting, (True, needs_w, False))
    return d_xhat, dw


