"""The one dispatch point: which implementation runs a normalization.

Every backend is a module with the same three functions, over a *view* of the input
described by a ``normkit.grouping.Grouping``:

``supports(x, grouping, center, fixed) -> bool``
    Whether this backend handles the input (device, dtype, layout, grouping kind).
``forward(x, grouping, weight, bias, eps, center, mean=None, rstd=None)``
    ``-> (y, mean, rstd, var)``. ``mean``/``rstd`` given means *fixed* statistics (eval);
    ``var`` is the biased variance (``None`` when fixed), used for running statistics.
    Statistics are fp32 (fp64 for fp64 inputs) shaped ``grouping.stat_shape``; ``y`` has
    the input's dtype and memory layout.
``backward(grad, x, mean, rstd, weight, grouping, center, fixed, needs)``
    ``-> (dx, dweight, dbias)``, each ``None`` unless asked for in ``needs``
    (three booleans). Implements the hand-derived gradient of ``normkit.reference``.
    ``dweight``/``dbias`` are in the statistics dtype, summed over
    ``grouping.param_reduce`` (for the ``dims`` grouping: not summed; the caller sums to
    the parameter's size), shaped with those dims kept or as the parameter's elements
    alone (callers reshape).

``supports_activation(x, grouping, act) -> bool`` (optional)
    Whether this backend applies ``act`` (a ``normkit.activation.Activation``: BatchNorm
    followed by an activation, fused) in its ``forward(..., act=act)`` and takes
    ``backward(..., act=act, bias=bias)``; a backend without it runs no activation, and
    ``select`` passes it by for a call that has one.

``group_moments(x, grouping) -> (mean, var)`` (optional)
    The statistics alone (SyncBatchNorm merges them across processes before it
    normalizes); a backend without it leaves them to ``torch_ops``.

``plan(x, grouping, center, fixed)`` (optional)
    An object with ``forward(x, weight, bias, eps, mean=None, rstd=None, keep_stats=True,
    var=None)`` (``keep_stats=False``: the caller wants ``y`` only; statistics may come
    back None; fixed statistics as ``mean`` and ``var``: rstd computed from var) and
    ``backward(grad, x, mean, rstd, weight, needs)`` for this grouping, dtype and layout,
    with every decision that depends only on those made once (the CPU kernels' sizes,
    blocks and threads). The CPU's plans are C++ objects that also have ``apply`` (the
    same call recorded for autograd) and take the running buffers to update
    (``normkit.backends.cpu.native``); ``normkit.ops.run`` calls every plan.

Backends are tried in order; ``torch_ops`` (a composite of torch ops, any device) always
supports everything and is the fallback. ``plan`` below is what the operators call: the
backend's plan for one (grouping, dtype, device, strides, centering, fixed statistics,
thread count), chosen and built once and then looked up, so a call on a small tensor
pays for none of the choosing (``docs/performance.md``, "Whole models and the per-call
cost").
"""

from __future__ import annotations

import importlib

import torch

from normkit._extras import broken
from normkit.backends import torch_ops

# optional fast paths, tried first; each module imports its own JIT lazily
_OPTIONAL = ("cpu", "gpu")
_loaded = None


def _candidates():
    global _loaded
    if _loaded is None:
        found = []
        for name in _OPTIONAL:
            try:
                found.append(importlib.import_module(f"normkit.backends.{name}"))
            except ImportError as error:     # not installed: quiet; broken: a warning
                broken(error, f"its {name} kernels", "normalizations there take the slower "
                       "composite torch path", "fast" if name == "cpu" else "gpu")
        _loaded = tuple(found)
    return _loaded


def fused_kernels_cover(x, grouping, center, fixed) -> bool:
    """The groupings the fused kernel families (CPU and GPU alike) implement: Layer/RMS,
    Batch, Instance and GroupNorm over a non-empty input; fixed statistics only for the
    per-channel kinds (eval BatchNorm, InstanceNorm with running stats); no centering only
    for rows (RMSNorm). Device, dtype and layout are each backend's own check."""
    return (grouping.kind in ("layer", "batch", "instance", "group") and x.numel() > 0
            and not (fixed and grouping.kind in ("layer", "group"))
            and (center or grouping.kind == "layer"))


def select(x, grouping, center=True, fixed=False, act=None):
    """Return the backend module that runs this normalization (followed by ``act``, a
    ``normkit.activation.Activation``, when given: a backend that declares it fuses it)."""
    for backend in _candidates():
        if backend.supports(x, grouping, center, fixed) and (
                act is None or getattr(backend, "supports_activation",
                                       _no_activation)(x, grouping, act)):
            return backend
    return torch_ops


def _no_activation(x, grouping, act) -> bool:
    return False


def like(t, ref):
    """``t`` laid out as ``torch.empty_like(ref)`` (what the operators' fake kernels
    promise); no copy when the strides already agree, as they do for every dense input."""
    if t.stride() == ref.stride():
        return t
    out = torch.empty_like(ref, dtype=t.dtype)
    return t if out.stride() == t.stride() else out.copy_(t)


class BackendPlan:
    """The plan of a backend without its own: its ``forward`` and ``backward`` with the
    grouping bound (output laid out as ``torch.empty_like(x)``, as the plans promise);
    ``act``: the activation applied to the output (its backward then takes the bias)."""

    def __init__(self, backend, grouping, center, fixed, act=None):
        self.backend, self.grouping = backend, grouping     # (x viewed inside)
        self.center, self.fixed, self.act = center, fixed, act
        self._act = {} if act is None else {"act": act}

    def forward(self, x, weight, bias, eps, mean=None, rstd=None, keep_stats=True, var=None):
        if mean is not None:
            mean, rstd = torch_ops.fixed_stats(self.grouping, mean, rstd, var, eps)
        view = self.grouping.view
        y, mean, rstd, var = self.backend.forward(x.reshape(view), self.grouping, weight, bias,
                                                  eps, self.center, mean, rstd, **self._act)
        out = y.reshape(x.shape)
        if out._base is not None:  # a view of the backend's output: an alias autograd does not
            out = torch.ops.aten._unsafe_view(y, x.shape)   # track, so y += r stays allowed
        return like(out, x), mean, rstd, var

    def backward(self, grad, x, mean, rstd, weight, needs, bias=None):
        view = self.grouping.view
        extra = {} if self.act is None else {"act": self.act, "bias": bias}
        dx, dw, db = self.backend.backward(grad.reshape(view), x.reshape(view), mean, rstd,
                                           weight, self.grouping, self.center, self.fixed,
                                           needs, **extra)
        return (None if dx is None else dx.reshape(x.shape)), dw, db


_PLANS = {}
_PLANS_MAX = 4096          # distinct shapes kept; a model has tens, dynamic shapes more


def plan(x, grouping, center=True, fixed=False, act=None):
    """The plan that runs this normalization of ``x`` (cached; see above): ``x`` is the
    grouping's view, or any shape that views as it without a copy; the plan then takes
    inputs of that shape and strides and gives outputs of that shape. ``act`` (a
    ``normkit.activation.Activation``): the plan applies it to its output, and its
    ``backward`` takes the forward's bias."""
    key = (grouping, x.shape, x.stride(), x.dtype, x.device, center, fixed,
           torch.get_num_threads(), act)
    found = _PLANS.get(key)
    if found is None:
        backend = select(x.view(grouping.view), grouping, center, fixed, act)
        maker = getattr(backend, "plan", None)
        if maker is None:
            found = BackendPlan(backend, grouping, center, fixed, act)
        else:
            found = (maker(x, grouping, center, fixed) if act is None
                     else maker(x, grouping, center, fixed, act))
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = found
    return found


def update_running(running_mean, running_var, mean, var, momentum, unbias=1.0) -> None:
    """BatchNorm's running statistics, in place, in the buffers' dtype::

        running_mean = (1 - momentum) * running_mean + momentum * mean
        running_var  = (1 - momentum) * running_var  + momentum * (var * unbias)

    by the backend of the buffers where it has its own (``update_running`` returning
    True: the CPU kernels' one jitted loop), else by torch's foreach ops. Eager only: a
    traced graph keeps the torch ops (see ``normkit.functional.update_running``)."""
    for backend in _candidates():
        own = getattr(backend, "update_running", None)
        if own is not None and own(running_mean, running_var, mean, var, momentum, unbias):
            return
    torch_ops.update_running(running_mean, running_var, mean, var, momentum, unbias)


#: counts ``clear_plans`` calls: a caller that keeps a plan's node across calls (the eval
#: BatchNorm layers) keys it on this, so that it is dropped with the plans
plan_epoch = 0


def clear_plans() -> None:
    """Forget every plan: the next call of each shape chooses and builds its plan again
    (after changing a number in ``normkit.backends.cpu.tuning``, say)."""
    global plan_epoch
    _PLANS.clear()
    plan_epoch += 1


def group_moments(x, grouping):
    """Per-group ``(mean, biased var)`` of the view ``x`` in the statistics dtype, on the
    backend that runs this grouping (``torch_ops`` where it has no moments of its own)."""
    return getattr(select(x, grouping), "group_moments", torch_ops.group_moments)(x, grouping)


# the memory-saving backward of the residual-add norms (normkit.functional.add_layer_norm,
# add_rms_norm): process-wide, like torch's global flags
_memory_saving = False


class memory_saving:
    """Opt in to the memory-saving backward of ``add_layer_norm`` and ``add_rms_norm``.

    That backward keeps the *output* ``y`` instead of the normalized input and recomputes
    ``xhat = (y - bias) / weight``, so the input can be freed when the next layer keeps
    ``y`` anyway. It needs every weight element nonzero: with a zero anywhere the op
    keeps its input as usual (checked at each forward). In half precision ``xhat`` then
    carries ``y``'s rounding (about 3 significant digits in bfloat16).

    ``memory_saving(True)`` switches it on from now on; ``with memory_saving(True):``
    only inside the block (the previous setting comes back on exit). A per-call
    ``memory_saving=`` keyword of the op overrides it.
    """

    def __init__(self, enabled: bool = True):
        global _memory_saving
        self.previous = _memory_saving
        _memory_saving = bool(enabled)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        global _memory_saving
        _memory_saving = self.previous
        return False


def memory_saving_enabled() -> bool:
    """Whether ``memory_saving`` is switched on."""
    return _memory_saving
