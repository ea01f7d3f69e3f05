r"""normkit's operators in the PyTorch dispatcher: ``torch.ops.normkit.*``.

Two core operators carry every normalization, over the *view* of the input that a
``normkit.grouping.Grouping`` describes (passed as ``kind, view, reduce, param_view``):

``norm_forward(x, weight, bias, kind, view, reduce, param_view, eps, center, mean, rstd)``
    ``-> (y, mean, rstd, var)``:

    .. math:: y = \gamma \cdot (x - \mu)\, \mathrm{rstd} + \beta, \qquad
              \mathrm{rstd} = 1 / \sqrt{\sigma^2 + \epsilon}

    with :math:`\mu` and the biased :math:`\sigma^2` per group (fp32 statistics, fp64 for
    fp64 inputs), or the given ``mean`` / ``rstd`` (fixed statistics: eval BatchNorm);
    then the three statistic outputs are empty.
``norm_backward(grad, x, mean, rstd, weight, kind, view, reduce, param_view, eps,
center, fixed, needs)``
    ``-> (dx, dweight, dbias)``, the hand-derived gradient
    ``dx = rstd * (g*w - mean(g*w) - xhat * mean(g*w * xhat))`` of ``normkit.reference``;
    an output not asked for in ``needs`` is an empty tensor.

Kernels: ``CompositeExplicitAutograd`` runs the backend ``normkit.backends.select``
picks (numba on CPU, Triton on CUDA, the composite torch ops elsewhere); the fake
(meta) kernels give the same shapes, dtypes and strides (``y`` and ``dx`` laid out as
``torch.empty_like(x)``: a dense input -- channels_last included -- keeps its strides).

Autograd, at the ``Autograd`` key, in Python: when no input requires a gradient the
forward goes straight below autograd (no ``autograd.Function``); otherwise
``normkit.autograd.NormFunction`` records ``norm_backward``.
``norm_backward`` is itself differentiable: when its inputs require a gradient (double
backward, ``create_graph``) it evaluates the same formula with differentiable torch ops
and statistics recomputed from ``x``, so autograd differentiates the hand-derived
backward. In plain eager mode (no tracing, no dispatch mode, a plain tensor)
``norm_forward`` here runs what those kernels would run without the two Python round
trips through the dispatcher (``run``): on the CPU the plan's C++ executor
(``normkit.backends.cpu.native``, its own autograd node ``NormNode``, whose backward
calls ``norm_backward`` when it is itself differentiated), else ``NormFunction``.
``apply_norm`` and ``add_norm`` are what ``normkit.functional``'s ops call.

The public operators, one per ``normkit.functional`` op with its signature
(``layer_norm``, ``rms_norm``, ``group_norm``, ``instance_norm``, ``batch_norm``,
``batch_renorm``, ``normalize``, ``add_layer_norm``, ``add_rms_norm``), are
``CompositeImplicitAutograd``: they validate, view, call ``norm_forward`` and update the
running statistics in place -- declared in their schemas as mutations (``Tensor(a!)``)
of ``running_mean`` / ``running_var``. A traced graph therefore shows ``norm_forward``,
``norm_backward`` and the in-place buffer updates.

``decompositions()`` is torch's default decomposition table with the core operators as
plain aten ops (the composite backend), for ``ExportedProgram.run_decompositions``.
"""

from __future__ import annotations

import sys

try:
    import torch
except ModuleNotFoundError as error:   # (an optional dependency)
    from normkit._extras import needs

    raise needs(error, "normkit.ops") from None

from normkit import backends
from normkit import grouping as G
from normkit.autograd import (AddNormFunction, NormFunction, _grouping, activation_args,
                              as_activation, grouping_args, plain_eager, transformed)
from normkit.backends import torch_ops
from normkit.rms_casting import kernel_dtype, normalize_dtype, scale_and_cast

__all__ = ["add_norm", "apply_norm", "cast_norm", "run", "norm_forward", "norm_backward",
           "grouping_args", "decompositions", "tracing", "decomposing", "compile_decomposed",
           "NormFunction"]

_lib = torch.library.Library("normkit", "DEF")

_GROUPING = "str kind, SymInt[] view, int[] reduce, SymInt[]? param_view"
_ACT = "str? activation=None, float negative_slope=0.0"
_lib.define(f"norm_forward(Tensor x, Tensor? weight, Tensor? bias, {_GROUPING}, float eps, "
            f"bool center, Tensor? mean=None, Tensor? rstd=None, {_ACT}) "
            f"-> (Tensor, Tensor, Tensor, Tensor)")
_lib.define(f"norm_backward(Tensor grad, Tensor x, Tensor mean, Tensor rstd, Tensor? weight, "
            f"{_GROUPING}, float eps, bool center, bool fixed, bool[3] needs, "
            f"Tensor? bias=None, {_ACT}) -> (Tensor, Tensor, Tensor)")

_forward_op = torch.ops.normkit.norm_forward.default
_backward_op = torch.ops.normkit.norm_backward.default


def _param_grad_shape(grouping):
    """Shape of a backend's weight/bias gradient: the view with ``param_reduce`` kept as 1
    (the whole view for the ``dims`` grouping, whose caller sums to the parameter)."""
    if grouping.param_view is None or not grouping.param_reduce:
        return tuple(grouping.view)
    red = grouping.param_reduce
    return tuple(1 if d in red else s for d, s in enumerate(grouping.view))


# ---------------------------------------------------------------------------- kernels

def _forward_impl(x, weight, bias, kind, view, reduce, param_view, eps, center, mean=None,
                  rstd=None, activation=None, negative_slope=0.0):
    grouping = _grouping(kind, view, reduce, param_view)
    fixed = mean is not None
    act = as_activation(activation, negative_slope)
    y, mean_out, rstd_out, var = backends.plan(x, grouping, center, fixed, act).forward(
        x, weight, bias, eps, mean, rstd)
    if fixed:  # the given statistics are the caller's tensors: return none of them
        return (y, *_empty_stats(x))
    return (y, *_own_storage(mean_out, rstd_out, var))


def _own_storage(*stats):
    """The statistics as outputs of an operator: memory of their own, contiguous, as the
    fake kernel promises (a backend may return views or aliases of its own buffers)."""
    return tuple(t.clone(memory_format=torch.contiguous_format) for t in stats)


def _empty_stats(x):
    empty = x.new_empty(0, dtype=torch_ops.stat_dtype(x.dtype))
    return empty, empty.clone(), empty.clone()


def _forward_fake(x, weight, bias, kind, view, reduce, param_view, eps, center, mean=None,
                  rstd=None, activation=None, negative_slope=0.0):
    sdtype = torch_ops.stat_dtype(x.dtype)
    if mean is not None:
        return (torch.empty_like(x), x.new_empty(0, dtype=sdtype), x.new_empty(0, dtype=sdtype),
                x.new_empty(0, dtype=sdtype))
    shape = _grouping(kind, view, reduce, param_view).stat_shape
    return (torch.empty_like(x), x.new_empty(shape, dtype=sdtype),
            x.new_empty(shape, dtype=sdtype), x.new_empty(shape, dtype=sdtype))


def _backward_outputs(grouping, x, sdtype, dx, dw, db):
    """Fill the not-needed gradients with empty tensors and fix the layouts."""
    empty = x.new_empty(0, dtype=sdtype)
    dx = empty.to(x.dtype) if dx is None else backends.like(dx, x)
    shape = _param_grad_shape(grouping)
    dw = empty.clone() if dw is None else dw.reshape(shape).contiguous()
    db = empty.clone() if db is None else db.reshape(shape).contiguous()
    return dx, dw, db


def _backward_impl(grad, x, mean, rstd, weight, kind, view, reduce, param_view, eps, center,
                   fixed, needs, bias=None, activation=None, negative_slope=0.0):
    grouping = _grouping(kind, view, reduce, param_view)
    act = as_activation(activation, negative_slope)
    plan = backends.plan(x, grouping, center, fixed, act)
    dx, dw, db = (plan.backward(grad, x, mean, rstd, weight, tuple(needs)) if act is None
                  else plan.backward(grad, x, mean, rstd, weight, tuple(needs), bias))
    return _backward_outputs(grouping, x, mean.dtype, dx, dw, db)


def _backward_fake(grad, x, mean, rstd, weight, kind, view, reduce, param_view, eps, center,
                   fixed, needs, bias=None, activation=None, negative_slope=0.0):
    grouping = _grouping(kind, view, reduce, param_view)
    sdtype = mean.dtype
    empty = x.new_empty(0, dtype=sdtype)
    dx = torch.empty_like(x) if needs[0] else empty.to(x.dtype)
    shape = _param_grad_shape(grouping)
    dw = x.new_empty(shape, dtype=sdtype) if needs[1] else empty.clone()
    db = x.new_empty(shape, dtype=sdtype) if needs[2] else empty.clone()
    return dx, dw, db


def _composite_backward(grad, x, mean, rstd, weight, grouping, eps, center, fixed, needs,
                        bias=None, act=None):
    """The backward in differentiable torch ops, statistics recomputed from ``x`` (unless
    fixed), so that autograd differentiates it, their dependence on ``x`` included: the
    double-backward path."""
    if not fixed:
        xs = x.to(torch_ops.stat_dtype(x.dtype))
        mean, _, rstd = torch_ops.compute_stats(xs, grouping, eps, center)
    return torch_ops.backward(grad, x, mean, rstd, weight, grouping, center, fixed, needs,
                              act=act, bias=bias)


# ---------------------------------------------------------------------------- autograd

def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _forward_autograd(x, weight, bias, kind, view, reduce, param_view, eps, center, mean=None,
                      rstd=None, activation=None, negative_slope=0.0):
    if _needs_grad(x, weight, bias):
        stats = []
        y = NormFunction.apply(x, weight, bias, (_grouping(kind, view, reduce, param_view), eps,
                                                 center, mean, rstd, stats,
                                                 as_activation(activation, negative_slope)))
        if mean is not None:  # fixed: the given statistics are not outputs
            return (y, *_empty_stats(x))
        return (y, *(_own_storage(*stats) if plain_eager(x) else stats))
    with torch._C._AutoDispatchBelowAutograd():  # nothing to record: no autograd.Function
        return _forward_op(x, weight, bias, kind, view, reduce, param_view, eps, center, mean,
                           rstd, activation, negative_slope)


def _backward_autograd(grad, x, mean, rstd, weight, kind, view, reduce, param_view, eps, center,
                       fixed, needs, bias=None, activation=None, negative_slope=0.0):
    if _needs_grad(grad, x, mean, rstd, weight, bias):
        grouping = _grouping(kind, view, reduce, param_view)
        dx, dw, db = _composite_backward(grad, x, mean, rstd, weight, grouping, eps, center,
                                         fixed, tuple(needs), bias,
                                         as_activation(activation, negative_slope))
        return _backward_outputs(grouping, x, mean.dtype, dx, dw, db)
    with torch._C._AutoDispatchBelowAutograd():
        return _backward_op(grad, x, mean, rstd, weight, kind, view, reduce, param_view, eps,
                            center, fixed, needs, bias, activation, negative_slope)


_lib.impl("norm_forward", _forward_impl, "CompositeExplicitAutograd")
_lib.impl("norm_backward", _backward_impl, "CompositeExplicitAutograd")
_lib.impl("norm_forward", _forward_autograd, "Autograd")
_lib.impl("norm_backward", _backward_autograd, "Autograd")
torch.library.register_fake("normkit::norm_forward", _forward_fake, lib=_lib)
torch.library.register_fake("normkit::norm_backward", _backward_fake, lib=_lib)


def run(plan, x, weight, bias, eps, mean=None, rstd=None, keep_stats=True, var=None,
        running=None):
    """The one call of a plan in eager mode: every layer and functional op reaches the
    kernels through here (``norm_forward``, and the layers with the plan they keep,
    ``normkit.nn._kept``). Returns ``(y, mean, rstd, var)``, ``y`` in ``x``'s shape.

    A C++ plan (``normkit.backends.cpu``) runs the call itself: ``apply`` when a gradient
    is to be recorded (it records its autograd node), ``forward`` otherwise. Any other
    plan (the GPU's, the composite's) runs ``forward``, or ``NormFunction`` when a
    gradient is to be recorded. Fixed statistics: ``mean`` with ``rstd``, or with ``var``
    (``rstd`` None: computed from it). ``running = (running_mean, running_var, momentum,
    unbias)``: the running buffers updated from the batch statistics (in the C++ call
    where it can), which then come back None; ``keep_stats=False``: the statistics may
    come back None."""
    grad = torch.is_grad_enabled() and (
        x.requires_grad or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad))
    executor = hasattr(plan, "apply")
    if executor:
        call = plan.apply if grad else plan.forward
        out = (call(x, weight, bias, eps, mean, rstd, keep_stats, var) if running is None
               else call(x, weight, bias, eps, mean, rstd, keep_stats, var, *running))
    elif grad:
        grouping = plan.grouping
        if mean is not None:
            mean, rstd = torch_ops.fixed_stats(grouping, mean, rstd, var, eps)
        stats = []
        y = NormFunction.apply(x, weight, bias, (grouping, eps, plan.center, mean, rstd, stats,
                                                 plan.act))
        out = (y, *stats)
    else:
        out = plan.forward(x, weight, bias, eps, mean, rstd, keep_stats, var)
    if running is not None and out[1] is not None and not (executor and mean is not None):
        backends.update_running(running[0], running[1], out[1].reshape(-1),
                                out[3].reshape(-1), running[2], running[3])
        return out[0], None, None, None
    return out


def norm_forward(x, grouping, weight=None, bias=None, eps=1e-5, center=True, mean=None,
                 rstd=None, keep_stats=True, var=None, running=None, act=None):
    """``torch.ops.normkit.norm_forward`` over ``grouping`` for ``x`` in any shape with the
    view's number of elements. Returns ``(y, mean, rstd, var)`` with ``y`` in ``x``'s
    shape (with fixed statistics: the given ``mean`` and ``rstd`` and ``var = None`` in
    eager mode, empty tensors when traced; ``keep_stats=False``: the caller wants ``y``
    alone, the statistics may be None). Fixed statistics may be given as ``mean`` and
    ``var`` (``rstd=None``): eval BatchNorm's running statistics, as (C,) buffers or in
    the grouping's ``stat_shape``. ``running = (running_mean, running_var, momentum,
    unbias)`` (training BatchNorm): the buffers updated on the way, and no statistics
    returned (eager); traced, the caller updates them. ``act`` (a
    ``normkit.activation.Activation``): ``y`` is the activation of the norm's output
    (BatchNorm followed by it, fused).

    In plain eager mode (``plain_eager``) this skips the dispatcher's two Python hops
    and runs the plan of the input (``run``); traced, it is the operator call on the
    view."""
    if _eager(x):
        # the plan of x itself: contiguous, or channels_last (the plan of its view, whose
        # C++ plan reads any shape of that memory); other strides as the view, copied
        # where no view can express them (a permuted LayerNorm input: ConvNeXt's blocks)
        xv = x if x.is_contiguous() else _rows_of_channels_view(x, grouping)
        if xv is None and x.device.type == "cpu":
            x = xv = x.contiguous()
        elif xv is None:                  # (the plan of the view; its forward views x)
            xv = x.reshape(grouping.view)
        plan = backends.plan(xv, grouping, center, mean is not None, act)
        return run(plan, x, weight, bias, eps, mean, rstd, keep_stats, var, running)
    if mean is not None:
        mean, rstd = torch_ops.fixed_stats(grouping, mean, rstd, var, eps)
    y, *stats = _forward_op(x.reshape(grouping.view), weight, bias, *grouping_args(grouping),
                            eps, center, mean, rstd, *activation_args(act))
    return (y.reshape(x.shape), *stats)


def _eager(x) -> bool:
    """Whether a call runs its plan directly (``run``): plain eager mode (``plain_eager``:
    a plain tensor, no dispatch mode, no ``torch.func`` transform) and no autocast (under
    autocast the operators' dtypes apply: ``normkit.autocast``)."""
    return plain_eager(x) and not torch._C._is_any_autocast_enabled()


def _rows_of_channels_view(x, grouping):
    """The grouping's view of a Batch/Instance/GroupNorm input whose channels are adjacent
    in memory (stride 1: channels_last, whose rows of channels the ``columns`` and
    ``channels_last`` families' nodes read), else None."""
    if (grouping.kind not in ("batch", "instance", "group") or x.dim() < 3 or x.stride(1) != 1
            or G.view_strides(x.shape, x.stride(), grouping.view) is None):
        return None
    return x.view(grouping.view)


def norm_backward(grad, x, mean, rstd, weight, grouping, eps, center, fixed, needs, bias=None,
                  act=None):
    """``torch.ops.normkit.norm_backward`` over ``grouping``: ``(dx, dweight, dbias)``."""
    return _backward_op(grad, x, mean, rstd, weight, *grouping_args(grouping), eps, center,
                        fixed, list(needs), bias, *activation_args(act))


# ---------------------------------------------------------------------------- when to decompose

_compile_decomposed = True


def compile_decomposed(enabled: bool = True) -> None:
    """Choose what ``torch.compile`` sees of a normkit norm: its plain torch ops (``True``,
    the default: the compiler fuses them with their neighbours) or the opaque operator
    ``torch.ops.normkit.norm_forward`` (``False``: normkit's kernels and hand-derived
    backward run inside the compiled graph). Takes effect at the next compilation; eager
    mode and ``torch.export`` always use the operator."""
    global _compile_decomposed
    _compile_decomposed = bool(enabled)


def tracing() -> bool:
    """Whether torch.compile, torch.export or the ONNX exporter is tracing this call."""
    return torch.compiler.is_compiling()


def decomposing() -> bool:
    """Whether the norms run as plain torch ops (the composite backend) instead of
    ``norm_forward``: under the ONNX exporter (standard ONNX operators only), under
    ``torch.compile`` so that the compiler fuses them with their neighbours, and under a
    ``torch.func`` transform (``normkit.autograd.transformed``); never in plain eager
    mode nor under ``torch.export``."""
    if not torch.compiler.is_compiling():
        return transformed()
    if torch.onnx.is_in_onnx_export():
        return True
    return _compile_decomposed and not torch.compiler.is_exporting()


def _composite_forward(x, weight, bias, kind, view, reduce, param_view, eps, center, mean=None,
                       rstd=None, activation=None, negative_slope=0.0):
    grouping = _grouping(kind, view, reduce, param_view)
    y, mean_out, rstd_out, var = torch_ops.forward(x, grouping, weight, bias, eps, center,
                                                   mean, rstd,
                                                   as_activation(activation, negative_slope))
    if mean is not None:
        empty = x.new_empty(0, dtype=torch_ops.stat_dtype(x.dtype))
        return y, empty, empty.clone(), empty.clone()
    return y, mean_out, rstd_out, var


def _composite_backward_op(grad, x, mean, rstd, weight, kind, view, reduce, param_view, eps,
                           center, fixed, needs, bias=None, activation=None, negative_slope=0.0):
    grouping = _grouping(kind, view, reduce, param_view)
    dx, dw, db = torch_ops.backward(grad, x, mean, rstd, weight, grouping, center, fixed,
                                    tuple(needs), act=as_activation(activation, negative_slope),
                                    bias=bias)
    return _backward_outputs(grouping, x, mean.dtype, dx, dw, db)


def decompositions():
    """torch's default table (``torch.export.default_decompositions()``, to the core aten
    ops) with plain-torch implementations of ``norm_forward`` and ``norm_backward``, for
    ``ExportedProgram.run_decompositions``: the program then holds only aten ops, e.g. to
    hand it to ``torch.onnx.export`` or AOTInductor. (A table of normkit's two ops alone
    replaces torch's: torch 2.13 then drops ``contiguous()`` before a ``view`` in T5's
    attention, and the program raises at its first call, with or without normkit.)"""
    table = torch.export.default_decompositions()
    table[_forward_op] = _composite_forward
    table[_backward_op] = _composite_backward_op
    return table


# ---------------------------------------------------------------------------- the functional ops' entry

def apply_norm(x, grouping, weight=None, bias=None, eps=1e-5, center=True,
               fixed_mean=None, fixed_rstd=None, keep_stats=True, fixed_var=None,
               running=None, act=None):
    """Run ``torch.ops.normkit.norm_forward`` on ``x`` seen through ``grouping.view`` (the
    composite torch ops where ``normkit.decomposing()``); returns ``(y, mean, var)``
    with ``y`` in ``x``'s shape (and memory layout); ``keep_stats=False``: the caller uses
    ``y`` alone, ``mean`` and ``var`` may be None. Fixed statistics come as ``fixed_mean`` and
    ``fixed_rstd``, or ``fixed_var`` instead of the rstd. ``running``: the running
    buffers to update on the way where the path can (``normkit.ops.norm_forward``; then
    ``mean`` and ``var`` come back None and the caller has nothing left to update). ``y``
    is never a view of ``x``, so callers may modify it in place. ``act``: ``y`` is that
    activation of the norm's output (``normkit.activation``)."""
    sharded = _sharded(x)
    if not (torch.compiler.is_compiling() or transformed() or sharded):  # eager (common)
        y, mean, _, var = norm_forward(x, grouping, weight, bias, eps, center, fixed_mean,
                                       fixed_rstd, keep_stats, fixed_var, running, act)
        return y, mean, var
    if sharded or decomposing():
        if fixed_mean is not None:
            fixed_mean, fixed_rstd = torch_ops.fixed_stats(grouping, fixed_mean, fixed_rstd,
                                                           fixed_var, eps)
        own = grouping.kind in ("batch", "instance", "group")     # (see torch_ops.forward)
        y, mean, _, var = torch_ops.forward(x if own else x.reshape(grouping.view), grouping,
                                            weight, bias, eps, center, fixed_mean, fixed_rstd,
                                            act, own_shape=own)
        return (y if own else y.reshape(x.shape)), mean, var
    y, mean, _, var = norm_forward(x, grouping, weight, bias, eps, center, fixed_mean,
                                   fixed_rstd, keep_stats, fixed_var, act=act)
    return y, mean, var


def _sharded(x) -> bool:
    """Whether ``x`` is a DTensor (tensor parallelism): its sharding rules cover torch's
    ops, not normkit's operator, so its calls take the composite ops, whose reductions it
    distributes itself. (Looked up only where ``torch.distributed.tensor`` is loaded.)"""
    if type(x) is torch.Tensor:
        return False
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def cast_norm(x, grouping, weight, bias, eps, center, casting, offset, ndtype):
    """A model's norm with its casting rule (``normkit.rms_casting``): ``x`` normalized in
    ``ndtype`` (the model's ``x.float()``) over ``grouping`` without affine, then
    ``scale_and_cast`` with ``weight`` (broadcast, ``offset`` added), ``bias`` and the
    ``casting`` rule; arguments already validated (``normkit.functional.rms_norm``,
    ``normkit.conversion.recipes``).

    In eager mode, on a contiguous input, one op: with a gradient to record,
    ``NormFunction`` with ``cast``, which keeps for backward only ``x`` in its own dtype,
    the statistics and the weight; without, the plan of ``x`` in ``rms_casting.kernel_dtype``
    and the rule. Traced, intercepted or under autocast, the model's order of ops around
    the registered norm: ``x.to(ndtype)``, ``norm_forward``, the rule (what a compiler
    sees and partitions itself)."""
    if _eager(x) and x.is_contiguous() and x.numel():
        kdtype = kernel_dtype(x, casting, weight, ndtype)
        if _needs_grad(x, weight, bias):
            return NormFunction.apply(x, weight, bias, (grouping, eps, center, None, None, [],
                                                        None, None, (casting, offset, kdtype)))
        xn = x.to(kdtype)
        x_hat = run(backends.plan(xn, grouping, center, False), xn, None, None, eps,
                    keep_stats=False)[0]
        return scale_and_cast(x_hat, x.dtype, weight, offset, casting, bias)
    x_hat = apply_norm(x.to(ndtype), grouping, None, None, eps, center, keep_stats=False)[0]
    return scale_and_cast(x_hat, x.dtype, weight, offset, casting, bias)


def add_norm(x, residual, normalized_ndim, weight, bias, eps, center, memory_saving,
             cast=None):
    """``(norm(x + residual), x + residual)`` over the last ``normalized_ndim`` dims
    (arguments already validated by ``normkit.functional.add_layer_norm`` /
    ``add_rms_norm``); ``memory_saving=None`` follows ``backends.memory_saving``.
    ``cast = (casting, offset)``: an RMSNorm with a model's casting rule; one pass only
    where the rule's ``x_hat`` is in ``x``'s dtype (the kernels cast it once, as the rule
    does), else the add then ``cast_norm``: either way the norm saves ``h`` in its own
    dtype and its statistics."""
    grouping = G.layer(tuple(x.shape), normalized_ndim)
    if memory_saving is None:
        memory_saving = backends.memory_saving_enabled()
    if not (tracing() or transformed()):
        xv = x.reshape(grouping.view)                              # M, K
        rows = G.layer(tuple(xv.shape), 1)
        backend = backends.select(xv, rows, center)
        # one pass each way where the backend says it pays (add_one_pass: the CPU
        # executor's plan.add_forward, the GPU's fused_add_forward), in plain eager mode;
        # the memory-saving backward on any
        one_pass = getattr(backend, "add_one_pass", None)
        one_pass = (one_pass is not None and plain_eager(xv) and plain_eager(residual)
                    and (cast is None or _x_hat_in_x_dtype(x, cast[0])) and one_pass(xv))
        plan = backends.plan(xv, rows, center) if one_pass else None
        if (memory_saving and cast is None) or one_pass:
            w = None if weight is None else weight.reshape(-1)
            b = None if bias is None else bias.reshape(-1)
            y, h = AddNormFunction.apply(xv, residual.reshape(grouping.view), w, b, eps,
                                         center, bool(memory_saving),
                                         (rows, backend, plan, one_pass, cast))
            if y.shape != x.shape:
                y, h = y.view(x.shape), h.view(x.shape)
            return y, h
    # traced (compile, export, ONNX), transformed, or no one-pass route: the add, then
    # the norm
    h = x + residual
    if cast is not None:
        return cast_norm(h, grouping, weight, bias, eps, center, *cast,
                         normalize_dtype(h, cast[0])), h
    return apply_norm(h, grouping, weight, bias, eps, center)[0], h


def _x_hat_in_x_dtype(x, casting) -> bool:
    """Whether the rule ``casting`` normalizes in fp32 and casts ``x_hat`` to ``x``'s dtype
    before anything else (``llama``), or ``x`` is in the dtype it normalizes in (fp32
    ``gemma``, fp32/fp64 ``t5``): then a kernel's one cast of ``x_hat`` is the rule's."""
    ndtype = normalize_dtype(x, casting)
    return torch.promote_types(x.dtype, torch.float32) == ndtype and (
        casting == "llama" or x.dtype == ndtype)


# ---------------------------------------------------------------------------- public operators

PUBLIC = {
    "layer_norm": "layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, "
                  "Tensor? bias=None, float eps=1e-05) -> Tensor",
    "rms_norm": "rms_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, "
                "float? eps=None) -> Tensor",
    "group_norm": "group_norm(Tensor input, int num_groups, Tensor? weight=None, "
                  "Tensor? bias=None, float eps=1e-05) -> Tensor",
    "instance_norm": "instance_norm(Tensor input, Tensor(a!)? running_mean=None, "
                     "Tensor(b!)? running_var=None, Tensor? weight=None, Tensor? bias=None, "
                     "bool use_input_stats=True, float momentum=0.1, float eps=1e-05) -> Tensor",
    "batch_norm": "batch_norm(Tensor input, Tensor(a!)? running_mean, Tensor(b!)? running_var, "
                  "Tensor? weight=None, Tensor? bias=None, bool training=False, "
                  "float momentum=0.1, float eps=1e-05) -> Tensor",
    "batch_norm_act": "batch_norm_act(Tensor input, Tensor(a!)? running_mean, "
                      "Tensor(b!)? running_var, Tensor? weight=None, Tensor? bias=None, "
                      "bool training=False, float momentum=0.1, float eps=1e-05, *, "
                      "str activation=\"relu\", float negative_slope=0.01) -> Tensor",
    "batch_renorm": "batch_renorm(Tensor input, Tensor(a!) running_mean, Tensor(b!) running_var, "
                    "Tensor? weight=None, Tensor? bias=None, bool training=False, "
                    "float momentum=0.1, float eps=1e-05, float r_max=3.0, float d_max=5.0) "
                    "-> Tensor",
    "normalize": "normalize(Tensor x, int[] dims, float eps=1e-05, Tensor? weight=None, "
                 "Tensor? bias=None, bool center=True) -> Tensor",
    "add_layer_norm": "add_layer_norm(Tensor x, Tensor residual, SymInt[] normalized_shape, "
                      "Tensor? weight=None, Tensor? bias=None, float eps=1e-05) "
                      "-> (Tensor, Tensor)",
    "add_rms_norm": "add_rms_norm(Tensor x, Tensor residual, SymInt[] normalized_shape, "
                    "Tensor? weight=None, float? eps=None) -> (Tensor, Tensor)",
}


def register_public(functions) -> None:
    """Register ``normkit.functional``'s ops (``{name: function}``, the names of
    ``PUBLIC``) as ``torch.ops.normkit.NAME`` with a CompositeImplicitAutograd kernel:
    called once by ``normkit.functional`` itself, so that this module needs nothing above it."""
    for name, schema in PUBLIC.items():
        _lib.define(schema)
        _lib.impl(name, functions[name], "CompositeImplicitAutograd")


# under torch.autocast("cuda"), the dtypes torch's norms give (normkit.autocast)
from normkit import autocast as _autocast  # noqa: E402

_autocast.register(_lib, _forward_op)
