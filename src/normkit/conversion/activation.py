r"""Fusing an activation into the BatchNorm before it: ``convert(model, fuse_activation=True)``.

A convolutional block writes BatchNorm's output, then its activation reads it and
writes again, and the backward adds a pass of its own. A normkit BatchNorm with an
``activation`` (``normkit.functional.batch_norm(..., activation=...)``) applies it in the
same call: the activation in the store, its derivative folded into the backward.

Two places where a BatchNorm's output goes straight into an activation module are found:

* **``nn.Sequential`` neighbours**: ``Sequential(..., BatchNorm2d, ReLU, ...)``. The
  BatchNorm gets the activation and the activation module becomes a ``FusedActivation``
  (an identity that keeps the original for ``revert``) -- only where that module is the
  Sequential's own (not registered anywhere else in the model), so nothing else calls it;
* **statements of a module's ``forward``**, in its source (the analysis of
  ``normkit.conversion.fuse``): ``Y = self.BN(X)`` directly followed by ``Z =
  self.ACT(Y)`` (each statement possibly alone under ``if self.BN is not None:`` /
  ``if self.ACT is not None:``, as transformers' MobileNetV2 writes it), or
  ``self.ACT(self.BN(X))`` in an expression. The activation call becomes ``Z = Y`` (or is
  dropped when ``Z`` is ``Y``); the activation module itself stays, so that its other
  calls (a ResNet block's ``self.relu`` after the residual add) run as before. The module
  gets a class derived for it with that ``forward``, as ``fuse_residual`` does.

Either way only a plain normkit ``BatchNorm1d/2d/3d`` without an activation yet, called
once in that forward and registered once in the model, without hooks, and an activation
module without hooks that computes ``relu``, ``relu6``, ``leaky_relu`` or ``silu`` (torch's
``ReLU``, ``ReLU6``, ``LeakyReLU``, ``SiLU``; another parameter-free class -- transformers'
``SiLUActivation`` -- where it equals one of them on a probe input) are fused; the pairs
found but left, and why, are in the report. ``Y`` must be ``Z``, or read nowhere else in
the forward (it would hold the activated value). ``revert`` gives back the activation
modules and the classes; the BatchNorm layers go back to torch's without an activation.
"""

from __future__ import annotations

import ast

import torch
from torch import nn
from torch.nn.modules import module as torch_module

import normkit.nn as nknn
from normkit.activation import Activation
from normkit.conversion import fuse
from normkit.conversion.classes import derived_class, qualified

__all__ = ["FusedActivation", "activation_of", "fuse_activations", "is_fused", "unfuse"]

_BATCH_NORMS = (nknn.BatchNorm1d, nknn.BatchNorm2d, nknn.BatchNorm3d)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_EXACT = {nn.ReLU: lambda m: Activation("relu"), nn.ReLU6: lambda m: Activation("relu6"),
          nn.SiLU: lambda m: Activation("silu"),
          nn.LeakyReLU: lambda m: Activation("leaky_relu", float(m.negative_slope))}
_PROBED = {"relu": torch.relu, "relu6": torch.nn.functional.relu6,
           "silu": torch.nn.functional.silu}
_FORWARDS: dict = {}
_NO_PAIR = "no BatchNorm call directly followed by an activation call in its forward"


class FusedActivation(nn.Identity):
    """What an activation module of an ``nn.Sequential`` becomes once the BatchNorm before
    it applies it: an identity that keeps the original (not as a child: the state_dict
    keys stay the model's) for ``normkit.revert``."""

    def __init__(self, original: nn.Module, into: str):
        super().__init__()
        self.__dict__["original"] = original
        self.into = into

    def extra_repr(self) -> str:
        return f"{type(self.original).__name__} fused into {self.into}"


def _hooked(module) -> bool:
    return any(getattr(module, h) for h in _HOOKS) or any(
        getattr(torch_module, "_global" + h) for h in _HOOKS)


def activation_of(module):
    """The ``Activation`` ``module`` computes, or the reason it is none a BatchNorm can
    apply (a str)."""
    kind = type(module)
    if kind in _EXACT:
        return _EXACT[kind](module)
    if isinstance(module, nn.Identity) or not isinstance(module, nn.Module):
        return "not an activation"
    if any(True for _ in module.parameters()) or any(True for _ in module.buffers()) or \
            module._modules:
        return f"{qualified(kind)} has parameters, buffers or children"
    probe = torch.linspace(-8.0, 8.0, 33, dtype=torch.float64)
    try:
        with torch.no_grad():
            out = module(probe.clone())
    except Exception as err:           # noqa: BLE001 -- any module: the reason is reported
        return f"{qualified(kind)} fails on a probe input ({type(err).__name__})"
    for name, fn in _PROBED.items():
        if isinstance(out, torch.Tensor) and out.shape == probe.shape and \
                torch.equal(out, fn(probe)):
            return Activation(name)
    return f"{qualified(kind)} computes none of relu, relu6, leaky_relu, silu"


def _fusable_norm(bn) -> str | None:
    """Why the normkit BatchNorm ``bn`` cannot take an activation, or None."""
    if type(bn) not in _BATCH_NORMS:
        return f"{qualified(type(bn))} is not a normkit BatchNorm1d/2d/3d"
    if bn.activation is not None:
        return f"it applies {bn.activation!r} already"
    if "forward" in vars(bn) or _hooked(bn):
        return "the BatchNorm has hooks or its own forward (a fused call would change what they see)"
    return None


def _fusable_act(act_module):
    """``Activation`` of ``act_module``, or the reason it cannot be fused."""
    act = activation_of(act_module)
    if not isinstance(act, str) and ("forward" in vars(act_module) or _hooked(act_module)):
        return "the activation module has hooks or its own forward"
    return act


def _set(bn, act):
    if act.name == "leaky_relu":
        bn.negative_slope = act.slope
    bn.activation = act.name
    bn.__dict__["_normkit_fused_activation"] = True      # (revert: given back to a module)


def _how(bn_attr, act_attr, act_module, act):
    slope = f", negative_slope={act.slope}" if act.name == "leaky_relu" else ""
    return (f"{bn_attr}, then {act_attr} ({type(act_module).__name__}) -> "
            f"{bn_attr}.activation={act.name!r}{slope}")


# ---------------------------------------------------------------- nn.Sequential neighbours

def _sequential_pairs(model, counts, report):
    for name, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential) or type(seq).forward is not nn.Sequential.forward:
            continue
        items = list(seq._modules.items())
        for (bn_attr, bn), (act_attr, act_module) in zip(items, items[1:]):
            if not isinstance(bn, _BATCH_NORMS) or act_module is None:
                continue
            act = _fusable_act(act_module)
            if isinstance(act, str) and act == "not an activation":
                continue
            where = f"{name}.{bn_attr}" if name else bn_attr
            reason = act if isinstance(act, str) else _fusable_norm(bn)
            if reason is None and counts.get(id(act_module), 0) > 1:
                reason = f"{act_attr} is registered elsewhere in the model too (shared)"
            if reason is None and counts.get(id(bn), 0) > 1:
                reason = f"{bn_attr} is registered elsewhere in the model too (shared)"
            pair = f"{bn_attr}, then {act_attr}"
            if reason is not None:
                report.activations_left.append((where, qualified(type(seq)), f"{pair}: {reason}"))
                continue
            _set(bn, act)
            seq._modules[act_attr] = FusedActivation(act_module, bn_attr)
            report.activations_fused.append((where, qualified(type(seq)),
                                             _how(bn_attr, act_attr, act_module, act)))


# ---------------------------------------------------------------- a forward's statements

def _self_call(value, self_name, attrs):
    """``(attribute, argument)`` of ``self.A(arg)`` with ``A`` in ``attrs``, else None."""
    if isinstance(value, ast.Call) and not value.keywords and len(value.args) == 1 and \
            isinstance(value.func, ast.Attribute) and fuse._name(value.func.value) == self_name \
            and value.func.attr in attrs and not isinstance(value.args[0], ast.Starred):
        return value.func.attr, value.args[0]
    return None


def _unguarded(stmt, self_name):
    """``(assignment, guard attribute)``: ``stmt`` itself, or the one statement under ``if
    self.A is not None:`` (no else), with ``A``; ``(stmt, None)`` for anything else."""
    if isinstance(stmt, ast.If) and not stmt.orelse and len(stmt.body) == 1:
        test = stmt.test
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and \
                isinstance(test.ops[0], ast.IsNot) and isinstance(test.left, ast.Attribute) and \
                fuse._name(test.left.value) == self_name and \
                isinstance(test.comparators[0], ast.Constant) and \
                test.comparators[0].value is None:
            return stmt.body[0], test.left.attr
        return stmt, "?"
    return stmt, None


def _uses(fn_def, self_name):
    """How often each ``self.A`` (but in a guard ``self.A is not None``) and each plain
    name is read in the function."""
    attrs, names = {}, {}
    guards = {id(node.left) for node in ast.walk(fn_def)
              if isinstance(node, ast.Compare) and len(node.ops) == 1 and
              isinstance(node.ops[0], ast.IsNot) and isinstance(node.comparators[0], ast.Constant)
              and node.comparators[0].value is None}
    for node in ast.walk(fn_def):
        if isinstance(node, ast.Attribute) and fuse._name(node.value) == self_name and \
                id(node) not in guards:
            attrs[node.attr] = attrs.get(node.attr, 0) + 1
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            names[node.id] = names.get(node.id, 0) + 1
    return attrs, names


class _Nested(ast.NodeTransformer):
    """``self.ACT(self.BN(X))`` becomes ``self.BN(X)``; nested functions keep their code."""

    def __init__(self, self_name, bns, acts, ok):
        self.self_name, self.bns, self.acts, self.ok, self.sites = \
            self_name, bns, acts, ok, []

    def visit_Call(self, node):
        self.generic_visit(node)
        outer = _self_call(node, self.self_name, self.acts)
        inner = outer and _self_call(outer[1], self.self_name, self.bns)
        if inner and self.ok(inner[0], outer[0]):
            self.sites.append((node.lineno, inner[0], outer[0]))
            return outer[1]
        return node

    def _keep(self, node):
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = _keep


def _activation_rewrite(bns, acts, left):
    """The rewrite (``fuse.rewritten_forward``) that drops the activation call after each
    BatchNorm call in ``bns`` (attribute names); sites ``(bn attribute, act attribute)``;
    the pairs found but not fused appended to ``left`` as ``(bn, act, reason)``."""
    def rewrite(fn_def, self_name):
        attrs, names = _uses(fn_def, self_name)

        def ok(bn_attr, act_attr, y=None, z=None):
            reason = None
            if attrs.get(bn_attr, 0) != 1:
                reason = f"self.{bn_attr} appears {attrs.get(bn_attr, 0)} times in the forward"
            elif y is not None and y != z and names.get(y, 0) != 1:
                reason = f"`{y}`, the BatchNorm's output, is read elsewhere in the forward"
            if reason is not None:
                left.append((bn_attr, act_attr, reason))
            return reason is None

        sites = []
        for block in fuse._blocks(fn_def):
            drop = []
            for i in range(len(block) - 1):
                first, guard1 = _unguarded(block[i], self_name)
                second, guard2 = _unguarded(block[i + 1], self_name)
                a1, a2 = fuse._assign(first), fuse._assign(second)
                bn = a1 and _self_call(a1[1], self_name, bns)
                act = a2 and _self_call(a2[1], self_name, acts)
                if not (bn and act and fuse._name(act[1]) == a1[0]):
                    continue
                if guard1 not in (None, bn[0]) or guard2 not in (None, act[0]):
                    left.append((bn[0], act[0], "a statement is under a condition other than "
                                 "`if self.<module> is not None:`"))
                    continue
                if ok(bn[0], act[0], a1[0], a2[0]):
                    sites.append((block[i].lineno, bn[0], act[0]))
                    copy = ast.Assign([ast.Name(a2[0], ast.Store())], ast.Name(a1[0], ast.Load()))
                    drop.append((i + 1, None if a1[0] == a2[0] else copy))
            for j, replacement in reversed(drop):
                if replacement is None:
                    del block[j]
                else:
                    block[j] = ast.copy_location(replacement, block[j])
            if not block:
                block.append(ast.Pass())
        nested = _Nested(self_name, bns, acts, ok)
        fn_def.body = [nested.visit(stmt) for stmt in fn_def.body]
        sites = sorted(sites + nested.sites)
        if not sites:
            return _NO_PAIR
        return [site[1:] for site in sites]
    return rewrite


def _forward_pairs(model, counts, report):
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Sequential) or is_fused(module) or fuse.is_fused(module):
            continue
        children = dict(module.named_children())
        bns = {a for a, m in children.items() if isinstance(m, _BATCH_NORMS)}
        acts = {}
        for a, m in children.items():
            act = _fusable_act(m)
            if not (isinstance(act, str) and act == "not an activation"):
                acts[a] = act
        if not bns or not acts:
            continue
        if "forward" in vars(module):
            continue
        kind = type(module)
        result, left = _act_forward(kind, frozenset(bns), frozenset(acts))
        where = name or "<root>"
        for bn_attr, act_attr, reason in left:
            report.activations_left.append((where, qualified(kind),
                                            f"{bn_attr}, then {act_attr}: {reason}"))
        if isinstance(result, str):
            if result != _NO_PAIR:            # (the source could not be read, say)
                report.activations_left.append((where, qualified(kind), result))
            continue
        sites = result[1]
        checked = []
        for bn_attr, act_attr in sites:
            bn, act_module, act = children[bn_attr], children[act_attr], acts[act_attr]
            reason = act if isinstance(act, str) else _fusable_norm(bn)
            if reason is None and counts.get(id(bn), 0) > 1:
                reason = f"{bn_attr} is registered elsewhere in the model too (shared)"
            checked.append((bn_attr, act_attr, reason))
        refused = [c for c in checked if c[2] is not None]
        if refused:     # the forward fuses every site or none: leave them all
            for bn_attr, act_attr, reason in checked:
                why = reason or (f"its forward fuses it together with {refused[0][0]}, "
                                 f"which cannot be")
                report.activations_left.append((where, qualified(kind),
                                                f"{bn_attr}, then {act_attr}: {why}"))
            continue
        for bn_attr, act_attr, _ in checked:
            _set(children[bn_attr], acts[act_attr])
            report.activations_fused.append((where, qualified(kind),
                                             _how(bn_attr, act_attr, children[act_attr],
                                                  acts[act_attr])))
        module.__class__ = act_class(kind, frozenset(bns), frozenset(acts))


def _act_forward(kind, bns, acts):
    """``(result, left)``: ``(forward, sites)`` of ``kind`` fusing its BatchNorms ``bns``
    with its activations ``acts`` (attribute names), or why not (a str), and the pairs
    left; parsed once per class and children."""
    key = (kind, bns, acts)
    if key not in _FORWARDS:
        left = []
        _FORWARDS[key] = (fuse.rewritten_forward(kind, _activation_rewrite(bns, set(acts), left)),
                          left)
    return _FORWARDS[key]


def act_class(kind, bns, acts):
    """The class of ``kind`` whose forward calls its BatchNorms ``bns`` without the
    activation modules ``acts`` after them (the BatchNorms apply them)."""
    forward, sites = _act_forward(kind, bns, acts)[0]
    role = "act_" + "_".join(sorted({f"{bn}_{act}" for bn, act in sites}))
    return derived_class(role, kind, (kind,),
                         lambda: {"forward": forward, "_normkit_act_fused_from": kind},
                         (act_class, kind, bns, acts))


def fuse_activations(report) -> None:
    """Fuse the activation modules after the normkit BatchNorm layers of ``report.model``
    (see above), recording each pair in ``report.activations_fused`` or
    ``report.activations_left``."""
    counts: dict = {}
    for _, m in report.model.named_modules(remove_duplicate=False):
        counts[id(m)] = counts.get(id(m), 0) + 1
    _sequential_pairs(report.model, counts, report)
    _forward_pairs(report.model, counts, report)


def is_fused(module) -> bool:
    """Whether ``module``'s class is one this fusion derived."""
    return "_normkit_act_fused_from" in vars(type(module))


def unfuse(module) -> str:
    """Give a module its own class back; returns that class's name."""
    module.__class__ = type(module)._normkit_act_fused_from
    return type(module).__qualname__
