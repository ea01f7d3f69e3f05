"""Finding the recipe of a model's own norm class by probing its forward, and routing the
module to it.

A module qualifies by structure (``call_signature``, ``structure``; a FrozenBatchNorm2d,
whose statistics and affine are buffers, is probed apart, ``_frozen_search``):

* its ``forward`` takes the input and at most a gate: ``forward(self, x)``,
  ``forward(self, x, gate)`` or ``forward(self, x, gate=None)`` (any names; no other
  argument, no ``*args`` / ``**kwargs``), since the routed forward must accept every call
  the module accepts;
* no child, no buffer in the state_dict (FalconMamba's unused non-persistent ``weight``
  buffer is allowed: the probe runs with it); parameters among ``weight`` and ``bias``,
  floating point; a positive epsilon attribute (``variance_epsilon``, ``eps``, ``epsilon``, ...).

``find`` then runs the module's own forward on probe inputs (random weight and bias
swapped in, then restored), with the gate omitted and given where the signature allows,
against the recipes of ``normkit.conversion.recipes``:

1. fp32 inputs and parameters: LayerNorm or RMSNorm, over the last dim, the weight's dims
   or groups (of a ``group_size``, or ``n_groups`` of the last dim), offset 0 or 1, gate
   before or after (silu or sigmoid): the recipe must agree within fp32 rounding on every
   call (the math);
2. bf16 inputs with bf16 and with fp32 parameters, for the survivors of 1 under each
   casting: the output dtype must be the module's; the recipe differing from the module's
   output in the fewest elements wins if at most 1 % differ (the same casts); else, of the
   recipes no less accurate than the module against the module's own forward in float64
   (a module that computes in bf16 what normkit computes with fp32 statistics), the one
   differing in the fewest elements (an fp32 output of bf16 inputs differs from the
   module's by fp32 rounding in many elements, under the right casting too).

The module then keeps its object, parameters and state_dict; its class becomes a routed
subclass (made once per class and signature) whose ``forward`` has the module's
parameter names and defaults and runs ``recipes.run`` with the recipe kept on the
instance (``_normkit_recipe``). Results are cached per class, parameter shapes and plain
instance attributes.
"""

from __future__ import annotations

import inspect
import itertools
import math

import torch
from torch import nn

from normkit.conversion import recipes
from normkit.conversion.classes import derived_class
from normkit.conversion.recipes import Recipe

__all__ = ["EPS_NAMES", "call_signature", "structure", "find", "route_recipe", "elementwise"]

EPS_NAMES = ("variance_epsilon", "eps", "epsilon", "layer_norm_eps", "norm_eps",
             "rms_norm_eps", "layer_norm_epsilon")
_GROUP_NAMES = ("group_size", "n_groups", "num_groups", "groups")
_WIDTH_NAMES = ("normalized_shape", "hidden_size", "dim", "head_dim", "num_features")
_GATES = [(where, act) for where in ("before", "after") for act in ("silu", "sigmoid")]
_CACHE: dict = {}
_BF16_SHARE = 0.01


def call_signature(module):
    """``(input name, gate name or None, gate default or inspect.Parameter.empty)`` of
    ``module.forward``, or why it does not qualify (a str)."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return "its forward has no signature to check"
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not params or len(params) > 2 or any(p.kind not in kinds for p in params):
        names = ", ".join(str(p) for p in params)
        return (f"its forward takes ({names}), more than an input and a gate, so no "
                f"replacement accepts every call it accepts")
    if params[0].default is not inspect.Parameter.empty:
        return "its forward's input has a default"
    if len(params) == 1:
        return params[0].name, None, inspect.Parameter.empty
    gate = params[1]
    if gate.default not in (None, inspect.Parameter.empty):
        return f"its forward's second argument {gate.name} defaults to {gate.default!r}"
    return params[0].name, gate.name, gate.default


def structure(module):
    """``(eps attribute name, weight, bias)`` of a norm-shaped ``module``, or why not."""
    if module._modules:
        return "it holds child modules"
    if set(module._buffers) - module._non_persistent_buffers_set:
        return ("it holds buffers in its state_dict, which a recipe would not read "
                "(only non-persistent ones are allowed: the probe runs with their values)")
    extra = set(module._parameters) - {"weight", "bias"}
    if extra:
        return f"it holds parameters {sorted(extra)} besides weight and bias"
    weight, bias = module._parameters.get("weight"), module._parameters.get("bias")
    for p in (weight, bias):
        if p is not None and (not p.is_floating_point() or p.dim() == 0):
            return "its weight or bias is not a floating tensor"
    for name in EPS_NAMES:
        eps = vars(module).get(name)
        if isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps > 0:
            return name, weight, bias
    return f"it has no positive epsilon attribute (one of {', '.join(EPS_NAMES)})"


def _width(module, weight):
    if weight is not None:
        return tuple(weight.shape)
    for name in _WIDTH_NAMES:
        v = vars(module).get(name)
        if isinstance(v, int) and v > 1:
            return (v,)
        if isinstance(v, (tuple, list)) and v and all(isinstance(s, int) and s > 0 for s in v):
            return tuple(v)
    return (24,)


def _groups(module, last):
    found = set()
    for name in _GROUP_NAMES:
        v = vars(module).get(name)
        if isinstance(v, int) and not isinstance(v, bool) and 1 <= v and last % v == 0:
            found |= {v, last // v}
    return [None] + sorted(g for g in found if 1 < g < last)


def _key(module, weight, bias):
    plain = (int, float, str, bool, type(None))
    attrs = tuple(sorted((k, v) for k, v in vars(module).items()
                         if isinstance(v, plain) and k != "training"))
    return (type(module), None if weight is None else (tuple(weight.shape), weight.dtype),
            None if bias is None else tuple(bias.shape), attrs)


class _Probe:
    """The module's forward on probe inputs, its parameters swapped for random ones."""

    def __init__(self, module, gate_name, gate_default, weight, bias):
        self.module = module
        gen = torch.Generator().manual_seed(0)
        shape = (2, 3) + _width(module, weight)
        self.x = torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 0.5
        self.g = torch.randn(shape, generator=gen, dtype=torch.float64)
        self.params = {n: torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5 + 0.3
                       for n, p in (("weight", weight), ("bias", bias)) if p is not None}
        self.calls = ([False] if gate_name is None else [True] if
                      gate_default is inspect.Parameter.empty else [False, True])

    def forward(self, fn, x_dtype, p_dtype, gated):
        """``fn(module, x, gate)`` with the module's parameters in ``p_dtype``."""
        module = self.module
        saved = dict(module._parameters)
        try:
            for n, p in self.params.items():
                module._parameters[n] = nn.Parameter(p.to(p_dtype), requires_grad=False)
            with torch.no_grad():
                x = self.x.to(x_dtype)
                return fn(module, x, self.g.to(x_dtype) if gated else None)
        finally:
            module._parameters.update(saved)

    def own(self, x_dtype, p_dtype, gated):
        return self.forward(lambda m, x, g: m.forward(x) if g is None else m.forward(x, g),
                            x_dtype, p_dtype, gated)

    def recipe(self, recipe, x_dtype, p_dtype, gated):
        return self.forward(lambda m, x, g: recipes.run(m, recipe, x, g), x_dtype, p_dtype,
                            gated)


def _candidates(module, eps_name, weight, gated):
    width = _width(module, weight)
    dims = sorted({1, len(width)})
    groups = _groups(module, width[-1])
    offsets = (0.0, 1.0) if weight is not None else (0.0,)
    gates = _GATES if gated else [None]
    for center, d, group, offset, gate, l2 in itertools.product(
            (False, True), dims, groups, offsets, gates, (False, True)):
        if group is not None and d != 1 or l2 and (center or weight is not None):
            continue
        yield Recipe(center, eps_name, d, group, "gemma", offset, gate, l2)


def _same(got, want):
    return (isinstance(want, torch.Tensor) and got.shape == want.shape and
            got.dtype == want.dtype and
            torch.allclose(got, want, rtol=1e-5, atol=1e-5 * max(1.0, float(want.abs().max()))))


def _half_verdict(probe, recipe):
    """(differing elements, or None if the dtype differs; accurate enough) over the bf16
    probes."""
    diff, accurate = 0, True
    for p_dtype, gated in itertools.product((torch.bfloat16, torch.float32), probe.calls):
        want = probe.own(torch.bfloat16, p_dtype, gated)
        got = probe.recipe(recipe, torch.bfloat16, p_dtype, gated)
        if got.dtype != want.dtype or got.shape != want.shape:
            return None, False
        diff += int((got != want).sum())
        truth = probe.own(torch.float64, torch.float64, gated).double()
        own_err = float((want.double() - truth).abs().max())
        accurate &= float((got.double() - truth).abs().max()) <= 2 * own_err + 1e-6
    return diff, accurate


def _search(module, eps_name, weight, bias, sig):
    probe = _Probe(module, sig[1], sig[2], weight, bias)
    wants, failure = {}, None
    for gated in probe.calls:
        try:
            wants[gated] = probe.own(torch.float32, torch.float32, gated)
        except Exception as err:  # noqa: BLE001 -- foreign code failing on a probe input
            failure = f"its forward failed on a probe input ({type(err).__name__}: {err})"
    if failure is not None and wants.keys() != {True}:
        return failure
    # a gate that defaults to None but is needed (the forward fails without it): the
    # model always passes one, so the recipe is checked on gated calls only
    probe.calls = list(wants)
    math_ok = []
    for recipe in _candidates(module, eps_name, weight, sig[1] is not None):
        try:
            if all(_same(probe.recipe(recipe, torch.float32, torch.float32, gated), want)
                   for gated, want in wants.items()):
                math_ok.append(recipe)
        except (RuntimeError, ValueError, TypeError):
            continue
    if not math_ok:
        return ("its forward computes none of normkit's LayerNorm/RMSNorm recipes (over "
                "the last dim, the weight's dims or groups; offset 0/1; gate before or "
                "after) on probe inputs")
    best, best_diff, fallback, fallback_diff = None, math.inf, None, math.inf
    for base, casting in itertools.product(math_ok, ("llama", "gemma", "t5", "torch")):
        recipe = Recipe(base.center, eps_name, base.dims, base.group, casting, base.offset,
                        base.gate, base.l2)
        try:
            diff, accurate = _half_verdict(probe, recipe)
        except (RuntimeError, ValueError, TypeError):
            continue
        if diff is not None and diff < best_diff:
            best, best_diff = recipe, diff
        if accurate and diff < fallback_diff:
            fallback, fallback_diff = recipe, diff
    if best is not None and best_diff <= _BF16_SHARE * 2 * len(probe.calls) * probe.x.numel():
        return best
    if fallback is not None:
        return fallback
    return ("its forward computes a normkit recipe in fp32, but in bf16 it rounds "
            "neither like one of normkit's castings nor less accurately than normkit")


_FROZEN = ("weight", "bias", "running_mean", "running_var")
_FROZEN_EPS = (1e-5, 0.0, 1e-3, 1e-6, 1e-12)


def _frozen_search(module, sig):
    """The frozen batch-norm recipe of a module holding ``_FROZEN`` as its only buffers
    (1-D, one size), its epsilon an attribute or a constant found by the probe."""
    buffers = module._buffers
    c = buffers["weight"].numel()
    if sig[1] is not None or any(b is None or not b.is_floating_point() or b.dim() != 1 or
                                 b.numel() != c for b in buffers.values()):
        return "it holds FrozenBatchNorm buffers, but not as 1-D tensors of one size"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, c, 3, 5, generator=gen) * 2 + 0.5
    probe = {n: torch.randn(c, generator=gen) * 0.5 + (1.0 if n == "running_var" else 0.2)
             for n in _FROZEN}
    probe["running_var"] = probe["running_var"].abs() + 0.1
    eps_attr = next((n for n in EPS_NAMES if isinstance(vars(module).get(n), float)), None)
    saved = dict(buffers)
    like = saved["weight"]
    x = x.to("cpu" if like.is_meta else like.device, like.dtype)  # (a meta model: the CPU)
    try:
        buffers.update({n: v.to(x) for n, v in probe.items()})
        with torch.no_grad():
            want = module.forward(x)
            for eps in ([None] if eps_attr else []) + list(_FROZEN_EPS):
                recipe = Recipe(True, eps_attr if eps is None else None,
                                frozen_eps=getattr(module, eps_attr) if eps is None else eps)
                if _same(recipes.run(module, recipe, x), want):
                    return recipe
    except Exception as err:  # noqa: BLE001 -- foreign code failing on a probe input
        return f"its forward failed on a probe input ({type(err).__name__}: {err})"
    finally:
        buffers.update(saved)
    return "it holds FrozenBatchNorm buffers, but its forward is not batch_norm in eval"


def elementwise(module, sig) -> bool:
    """Whether ``module.forward`` computes no statistics at all: on a probe input, changing
    one element changes no other output element (MobileBERT's ``NoNorm``, ``x * w + b``)."""
    if sig[1] is not None and sig[2] is inspect.Parameter.empty:
        return False
    found = structure(module)
    weight = found[1] if isinstance(found, tuple) else module._parameters.get("weight")
    x = torch.randn((2,) + _width(module, weight), generator=torch.Generator().manual_seed(0))
    if weight is not None:       # the weight's dtype and device (a meta model's: the CPU)
        x = x.to("cpu" if weight.is_meta else weight.device, weight.dtype)
    bumped = x.clone()
    bumped.view(-1)[0] += 1.0
    try:
        with torch.no_grad():
            y, yb = module.forward(x), module.forward(bumped)
    except Exception:  # noqa: BLE001 -- foreign code failing on a probe input
        return False
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return False
    changed = (y != yb).view(-1)
    return bool(changed[0]) and not bool(changed[1:].any())


def find(module, sig):
    """The ``Recipe`` ``module`` computes, or why none (a str); ``sig`` from
    ``call_signature``."""
    if set(module._buffers) == set(_FROZEN) and not module._parameters and \
            not module._modules:
        return _frozen_search(module, sig)
    found = structure(module)
    if isinstance(found, str):
        return found
    eps_name, weight, bias = found
    key = _key(module, weight, bias)
    if key not in _CACHE:
        _CACHE[key] = _search(module, eps_name, weight, bias, sig)
    return _CACHE[key]


def _forward_for(sig):
    """A forward with the module's own parameter names and defaults running its recipe."""
    x, gate, default = sig
    args = f"{x}, {gate}" if gate else x
    call = f"{x}, {gate}" if gate else f"{x}, None"
    namespace = {"_run": recipes.run}
    exec(f"def forward(self, {args}):\n"                              # noqa: S102
         f"    return _run(self, self._normkit_recipe, {call})\n", namespace)
    forward = namespace["forward"]
    if gate and default is not inspect.Parameter.empty:
        forward.__defaults__ = (default,)
    return forward


def recipe_class(kind, sig):
    """The routed class of ``kind`` whose forward, of signature ``sig``, runs the
    instance's recipe."""
    role = "recipe_" + "_".join(n for n in sig[:2] if n) + ("_opt" if sig[1] and sig[2] is None
                                                             else "")
    return derived_class(role, kind, (kind,),
                         lambda: dict(forward=_forward_for(sig), _normkit_routed_from=kind),
                         (recipe_class, kind, sig))


def route_recipe(module, recipe, sig):
    """Give ``module`` the routed class running ``recipe``; returns how (for the report)."""
    routed = recipe_class(type(module), sig)
    module.__dict__["_normkit_recipe"] = recipe
    module.__class__ = routed
    return f"forward is normkit's {recipes.describe(recipe)}"
