r"""Routing: a module keeps its class's code, and its norm calls run on normkit's ops.

A subclass of a torch norm class that overrides ``forward`` (BiT's GroupNorm followed by
an activation, timm's ``BatchNormAct2d``) stays in place; its class becomes a routed
subclass whose methods are the very same code objects, re-bound to a copy of their
module's globals in which

* ``torch.nn.functional.{batch_norm, layer_norm, group_norm, instance_norm, rms_norm}``
  (imported by name) are ``normkit.functional``'s ops of the same signature, and
* the modules ``torch``, ``torch.nn`` and ``torch.nn.functional`` are copies of
  themselves whose ``functional`` has those five ops replaced.

Everything else the method does (an activation, a permute, the running-statistics
bookkeeping) runs unchanged. Nothing global is patched: other modules of the same class,
other threads, and the rest of the program see torch's functions, and the routed method
is an ordinary Python function with plain globals, which torch.compile traces like the
original. The globals are a snapshot taken when the class is first routed.

LayerNorm subclasses over one channel dim are recognised by what their forward does on
a probe input: channels-last (transformers' ``ConvNextLayerNorm``'s default) is
``layer_norm`` over the last dim; channels-first (``ConvNextLayerNorm(...,
data_format="channels_first")``, timm's ``LayerNorm2d``) is the layer norm over dim 1
with the per-channel affine

.. math:: y_{n,c,\dots} = \gamma_c\,\frac{x_{n,c,\dots} - \mu_{n,\dots}}
          {\sqrt{\sigma^2_{n,\dots} + \epsilon}} + \beta_c

run as ``layer_norm`` of the channels-last view (``_channels_first_forward``). Their
forward is replaced by that one call.

The same routing serves a convolution subclass whose methods call the norm ops (weight
standardization, ``normkit.convert``'s step 4).
"""

from __future__ import annotations

import inspect
import types

import torch
import torch.nn.functional as TF
from torch import nn

from normkit import functional as nF
from normkit.conversion.classes import derived_class

__all__ = ["route", "route_layer_norm", "unroute", "is_routed"]

_ROUTES = {TF.batch_norm: nF.batch_norm, TF.layer_norm: nF.layer_norm,
           TF.group_norm: nF.group_norm, TF.instance_norm: nF.instance_norm,
           TF.rms_norm: nF.rms_norm}
_BY_ID = {id(f): g for f, g in _ROUTES.items()}
_NAMES = frozenset(f.__name__ for f in _ROUTES)
_MODULES: dict = {}


def _module_copy(module, replacements):
    copy = types.ModuleType(module.__name__, module.__doc__)
    copy.__dict__.update(vars(module))
    copy.__dict__.update(replacements)
    return copy


def _routed_modules():
    """id(torch module) -> its routed copy, built once."""
    if not _MODULES:
        functional = _module_copy(TF, {f.__name__: g for f, g in _ROUTES.items()})
        torch_nn = _module_copy(nn, {"functional": functional})
        torch_copy = _module_copy(torch, {"nn": torch_nn})
        _MODULES.update({id(TF): functional, id(nn): torch_nn, id(torch): torch_copy})
    return _MODULES


def _names(code) -> set:
    """Every global or attribute name ``code`` and its nested code objects use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _rewired(fn):
    """``fn`` re-bound to globals with the norm ops routed, or None if it calls none."""
    names = _names(fn.__code__)
    if not names & _NAMES:
        return None
    modules = _routed_modules()
    replaced = {}
    for name in names:
        value = fn.__globals__.get(name)
        if value is None:
            continue
        if id(value) in modules and value is not modules[id(value)]:
            replaced[name] = modules[id(value)]
        elif id(value) in _BY_ID and value in _ROUTES:
            replaced[name] = _BY_ID[id(value)]
    direct = any(id(fn.__globals__[n]) in _BY_ID for n in replaced)   # from F import ...
    via_functional = "functional" in names or any(fn.__globals__[n] is TF for n in replaced)
    if not (direct or via_functional):   # e.g. torch.layer_norm: an op normkit does not route
        return None
    new = types.FunctionType(fn.__code__, {**fn.__globals__, **replaced}, fn.__name__,
                             fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__, new.__doc__ = fn.__qualname__, fn.__doc__
    return new


def _rewired_methods(kind, stop):
    """The routed versions of the methods instances of ``kind`` run, from ``kind`` up to
    and including the torch class ``stop`` (the first definition of each name wins)."""
    seen, methods = set(), {}
    for klass in kind.__mro__:
        for name, value in vars(klass).items():
            if name in seen:
                continue
            seen.add(name)
            if isinstance(value, types.FunctionType):
                new = _rewired(value)
                if new is not None:
                    methods[name] = new
        if klass is stop:
            break
    return methods


def route(module, stop):
    """Give ``module`` its routed class; returns how, or None when its methods call none
    of the five ops through ``torch.nn.functional``."""
    methods = _rewired_methods(type(module), stop)
    if not methods:
        return None
    module.__class__ = routed_class(type(module), stop, methods)
    return f"torch.nn.functional norm calls in {', '.join(sorted(methods))} run on normkit"


def routed_class(kind, stop, methods=None):
    """The routed class of ``kind``: its methods up to ``stop`` with the norm calls on
    normkit (``methods``, when already made)."""
    return derived_class("routed", kind, (kind,),
                         lambda: dict(methods or _rewired_methods(kind, stop),
                                      _normkit_routed_from=kind),
                         (routed_class, kind, stop))


def _channels_first_forward(self, input):
    # LayerNorm over dim 1 as the layer norm of the channels-last view and back, as these
    # models' own forwards do (torch's layer_norm copies the view to rows of C, and so does
    # normkit's: one copy, then the rows kernel; a reduction over dim 1 in place, strided
    # by the positions, measured 2x slower in ConvNeXt inference). The output keeps the
    # rows' memory (channels_last strides), as the models' permute back does.
    y = nF.layer_norm(input.movedim(1, -1), self.normalized_shape, self.weight, self.bias,
                      self.eps)
    return y.movedim(-1, 1)


def _channels_last_forward(self, input):
    return nF.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


# probe shapes, -1 the channels: 4-D (ConvNeXt) and 3-D (SqueezeBERT's (N, C, W))
_LAYOUTS = {"channels_first": (_channels_first_forward, ((2, -1, 3, 5), (2, -1, 5))),
            "channels_last": (_channels_last_forward, ((2, 3, 5, -1), (2, 5, -1)))}


def _probe_input(module, shape, c, gen, dtype=None):
    """A random input of ``shape`` (-1: the ``c`` channels) on the device of the probe
    parameters swapped into ``module``, in ``dtype`` (None: theirs)."""
    x = torch.randn([c if s == -1 else s for s in shape], generator=gen)
    like = next((p for p in module._parameters.values() if p is not None), None)
    if like is None:
        return x if dtype is None else x.to(dtype)
    return x.to(like.device, dtype or like.dtype)


def _agrees(module, forward, shape, c, gen):
    """Whether ``forward`` equals ``module.forward`` on a probe input of ``shape`` (None
    where ``module.forward`` refuses that shape)."""
    x = _probe_input(module, shape, c, gen) * 2 + 0.5
    try:
        want = module.forward(x)
    except (RuntimeError, ValueError, TypeError, IndexError):
        return None
    got = forward(module, x)
    tol = 32 * torch.finfo(x.dtype).eps if x.dtype != torch.float64 else 1e-9
    return (isinstance(want, torch.Tensor) and want.shape == got.shape and
            torch.allclose(got.float(), want.float(), rtol=tol, atol=tol))


def _keeps_dtype(module, forward, shape, c, gen):
    """Whether ``forward`` returns ``module.forward``'s dtype for a bf16 input on fp32
    parameters (a class that writes the formula out promotes to its weight's fp32, where
    ``layer_norm`` keeps the input's bf16)."""
    x = _probe_input(module, shape, c, gen, torch.bfloat16)
    try:
        want = module.forward(x)
    except (RuntimeError, ValueError, TypeError, IndexError):
        return True
    return isinstance(want, torch.Tensor) and want.dtype == forward(module, x).dtype


def _probe_layout(module):
    """Which layout ``module.forward`` computes on probe inputs, with random affine
    parameters swapped in for the probe (None when neither, or when its output dtype
    differs from ``layer_norm``'s on a bf16 input)."""
    (c,) = module.normalized_shape
    gen = torch.Generator().manual_seed(0)
    saved = dict(module._parameters)
    try:
        with torch.no_grad():
            for name, p in saved.items():
                if p is not None:
                    module._parameters[name] = nn.Parameter(   # (a meta model: the CPU)
                        torch.randn(p.shape, generator=gen).to("cpu" if p.is_meta else p.device,
                                                               p.dtype), requires_grad=False)
            for layout, (forward, shapes) in _LAYOUTS.items():
                verdicts = [_agrees(module, forward, shape, c, gen) for shape in shapes]
                if True in verdicts and False not in verdicts:    # equal wherever it runs
                    fp32 = all(p is None or p.dtype == torch.float32 for p in saved.values())
                    shape = shapes[verdicts.index(True)]
                    return layout if not fp32 or _keeps_dtype(module, forward, shape, c, gen) \
                        else None
    finally:
        module._parameters.update(saved)
    return None


def _one_argument(forward) -> bool:
    """Whether ``forward(self, x)`` takes exactly one argument (the replacement's)."""
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return len(params) == 1 and params[0].kind in kinds


def _named(forward, name):
    """``forward`` taking its argument under ``name`` (the module's own: ``x``), so that a
    call by keyword still binds."""
    namespace = {"_forward": forward}
    exec(f"def forward(self, {name}):\n    return _forward(self, {name})\n",  # noqa: S102
         namespace)
    return namespace["forward"]


def route_layer_norm(module):
    """Route a LayerNorm subclass over one dim whose forward is channels-first or
    channels-last layer normalization; returns how, or None."""
    if len(module.normalized_shape) != 1 or not _one_argument(type(module).forward):
        return None
    layout = _probe_layout(module)
    if layout is None:
        return None
    kind = type(module)
    name = next(iter(list(inspect.signature(kind.forward).parameters)[1:]))
    module.__class__ = layout_class(kind, layout, name)
    how = "layer_norm over dim 1" if layout == "channels_first" else "layer_norm"
    return f"{layout}: forward is normkit's {how}"


def layout_class(kind, layout, name):
    """The class of a ``kind`` LayerNorm whose forward is normkit's ``layout`` layer norm,
    taking its input as ``name``."""
    return derived_class(f"routed_{layout}_{name}", kind, (kind,),
                         lambda: dict(forward=_named(_LAYOUTS[layout][0], name),
                                      _normkit_routed_from=kind),
                         (layout_class, kind, layout, name))


def is_routed(module) -> bool:
    return "_normkit_routed_from" in vars(type(module))


def unroute(module) -> str:
    """Give a routed module its own class back; returns that class's name."""
    module.__class__ = type(module)._normkit_routed_from
    module.__dict__.pop("_normkit_recipe", None)            # (routed to a recipe)
    return type(module).__qualname__
