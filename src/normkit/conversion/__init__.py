"""``normkit.convert(model)`` and ``normkit.revert(model)``: run a model's normalizations
on normkit, in place, and back.

``convert`` looks at every module and does the first that applies:

1. **swap** a module whose type is exactly a torch.nn norm class for its normkit twin
   (``swap``); likewise a subclass that keeps torch's ``forward`` and adds no tensor or
   child (the twin's class carries its extra attributes);
2. **route** a subclass that overrides ``forward``: a LayerNorm over one dim whose forward
   is channels-first or channels-last layer normalization on a probe input gets normkit's
   op as its forward; otherwise the ``torch.nn.functional`` norm calls in its methods run
   on normkit's ops, the rest of its code unchanged (``route``);
3. **swap** a language model's RMSNorm (a ``weight``, an epsilon, and a forward that
   computes one of the RMSNorm casting rules on probe inputs) for ``normkit.nn.RMSNorm``
   with that rule (``llm``);
4. **route** a convolution subclass whose methods call those norm ops: a weight-
   standardized convolution (BiT's ``WeightStandardizedConv2d``, timm's ``StdConv2d``)
   standardizes its weight with ``batch_norm`` over (1, out_channels, fan_in) on every
   call, where torch's kernel takes several times normkit's (``route``);
5. otherwise, if the module is norm-like (a torch norm subclass, or a class whose name
   contains ``Norm``), **leave** it and say why in the report.

With ``fuse_residual=True`` it then **fuses** each add that directly precedes a norm call
in a forward (``h = a + b; r = h; h = self.norm(h)`` in a decoder layer, ``self.norm(a +
b)`` in a post-norm block) into one ``add_rms_norm`` / ``add_layer_norm`` call, where that
equals the unfused code (``fuse``).

With ``fuse_activation=True`` it also fuses each activation module that directly follows
a normkit BatchNorm -- ``nn.Sequential`` neighbours, and ``y = self.bn(x); y =
self.relu(y)`` in a forward -- into the BatchNorm (``activation``), where the activation
module is used nowhere else or its one call can be dropped from the forward
(``activation``).

``revert`` undoes each: swapped modules are rebuilt as the original class around the same
tensors, routed and fused ones get their class back.
"""

from __future__ import annotations

import itertools
import warnings

try:
    import torch
    from torch import nn
except ModuleNotFoundError as error:   # (an optional dependency)
    from normkit._extras import needs

    raise needs(error, "normkit.convert") from None

import normkit.nn as nknn
from normkit.conversion import activation, emulate, fuse, llm, route, swap
from normkit.folding import FoldedBatchNorm
from normkit.conversion.classes import qualified
from normkit.conversion.report import ConversionReport

__all__ = ["convert", "revert", "ConversionReport"]

_TORCH_BASES = tuple(src for src, _, _ in swap.PAIRS) + (nn.modules.batchnorm._NormBase,)
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NORMKIT_BASES = tuple(dst for _, dst, _ in swap.PAIRS) + (nknn._base.NormBase,)


# the reason given for a module named like a norm that normalizes nothing
NO_NORMALIZATION = ("it computes no normalization: on a probe input each output element "
                    "depends on its own input element only (an elementwise affine), so "
                    "there is nothing for normkit to run")


def _norm_like(module) -> bool:
    """A torch norm layer, or a class named like one; not torch's weight and spectral norm
    parametrizations (``_WeightNorm``), which rescale weights, not activations."""
    kind = type(module)
    return isinstance(module, _TORCH_BASES) or ("Norm" in kind.__name__ and
                                                not kind.__module__.startswith("torch.nn.utils"))


def _convert_one(name, module, report):
    """The replacement of ``module`` (None: kept, maybe routed), recording what happened."""
    kind = type(module)
    pairs = swap.table()
    found = swap.torch_base(kind, pairs)
    if route.is_routed(module) or fuse.is_fused(module) or activation.is_fused(module) or \
            isinstance(module, (_NORMKIT_BASES, activation.FusedActivation)):
        return None
    if found is not None:
        src, dst, args = found
        try:
            if kind is src:
                return swap.twin(module, dst, args(module))
            reason = swap.plain_subclass_reason(module, src, args)
            if reason is None:
                return swap.swap_subclass(module, src, dst, args)
        except ValueError as err:  # e.g. eps=0, which normkit refuses
            report.left.append((name, qualified(kind), str(err)))
            return None
        how = route.route_layer_norm(module) if isinstance(module, nn.LayerNorm) else None
        how = how or route.route(module, src) or _emulated(module)
        if isinstance(how, tuple):
            report.left.append((name, qualified(kind), f"subclass of {qualified(src)} that "
                                f"{reason} without calling torch.nn.functional's norm ops, "
                                f"and {how[0]}"))
        else:
            report.routed.append((name, qualified(kind), how))
        return None
    conv = next((c for c in _CONVS if isinstance(module, c)), None)
    if conv is not None and kind is not conv:
        how = route.route(module, conv)
        if how is not None:
            report.routed.append((name, qualified(kind), how))
        return None
    if isinstance(module, _TORCH_BASES):
        report.left.append((name, qualified(kind), "a torch norm class normkit has no twin for "
                            "(a lazy layer: run one forward first, then convert)"))
        return None
    eps_name = llm.rms_structure(module)
    if not (_norm_like(module) or eps_name is not None):
        return None
    if module._modules:
        # a block named like a norm (diffusers' AdaGroupNorm): its own norm calls routed,
        # its children visited as any module is
        how = route.route(module, nn.Module)
        if how is not None:
            report.routed.append((name, qualified(kind), how))
        return None
    sig = emulate.call_signature(module)
    if eps_name is not None and isinstance(sig, tuple) and sig[1] is None:
        rule = llm.probe_rule(module, eps_name)      # a swap only for forward(self, x)
        if isinstance(rule, tuple):
            return llm.swap_rms(module, eps_name, rule, sig[0])
    how = route.route(module, nn.Module) or _emulated(module, sig)
    if isinstance(how, tuple):
        report.left.append((name, qualified(kind), f"norm-like, but {how[0]}"))
    else:
        report.routed.append((name, qualified(kind), how))
    return None


def _emulated(module, sig=None):
    """Route ``module`` to the recipe its forward computes: how (a str), or (why not,)."""
    sig = emulate.call_signature(module) if sig is None else sig
    if isinstance(sig, str):
        return (sig,)
    recipe = emulate.find(module, sig)
    if isinstance(recipe, str):
        if emulate.elementwise(module, sig):
            return (NO_NORMALIZATION,)
        return (recipe,)
    return emulate.route_recipe(module, recipe, sig)


def _revert_one(name, module, report):
    pairs = [(dst, src, args) for src, dst, args in swap.table()]
    kind = type(module)
    if fuse.is_fused(module):
        report.fused.append((name, qualified(kind), f"class {fuse.unfuse(module)} restored"))
        return None
    if activation.is_fused(module):
        report.activations_fused.append((name, qualified(kind),
                                         f"class {activation.unfuse(module)} restored"))
        return None
    if isinstance(module, activation.FusedActivation):       # (listed as swapped back)
        return module.original
    if isinstance(module, FoldedBatchNorm) and module.from_fusion:   # (fold, then revert)
        module.give_back()
        report.activations_fused.append((name, qualified(kind), "its activation given back "
                                         "to the module it was fused from"))
        return None
    if route.is_routed(module):
        report.routed.append((name, qualified(kind), f"class {route.unroute(module)} restored"))
        return None
    source = vars(kind).get("_normkit_source")
    if source is not None and issubclass(kind, nknn.RMSNorm) and len(source) == 2 and \
            isinstance(source[1], str):
        return llm.revert_rms(module)
    if source is not None:
        return swap.revert_subclass(module, [(s, d, a) for d, s, a in pairs])
    exact = {src: (dst, args) for src, dst, args in pairs}
    if getattr(module, "activation", None) is not None and \
            not module.__dict__.get("_normkit_fused_activation"):
        report.left.append((name, qualified(kind), (
            f"it applies activation={module.activation!r}, set on the layer itself, which "
            f"torch's {kind.__name__} has no place for; set activation=None first")))
        return None
    if kind in exact:
        dst, args = exact[kind]
        try:
            return swap.twin(module, dst, args(module))
        except ValueError as err:
            report.left.append((name, qualified(kind), str(err)))
    return None


def _walk(model, one):
    report = ConversionReport(model)

    def visit(name, module):
        new = one(name, module, report)
        if new is not None:
            report.swapped.append((name, qualified(type(module)), qualified(type(new))))
        return new

    root = visit("", model)
    if root is not None:
        report.model = root
        return report
    done = {}   # id of a module seen -> what replaced it (None: kept), for a module registered
    #             under several names (`self.a = self.b = norm`): one replacement, at each name
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent._modules.items()):
            if child is None:
                continue
            if id(child) not in done:   # (every module stays alive in the list above)
                done[id(child)] = visit(f"{parent_name}.{child_name}" if parent_name
                                        else child_name, child)
            new = done[id(child)]
            if new is not None:
                setattr(parent, child_name, new)
    return report


def _fuse_residual(report):
    for name, module, norms in fuse.candidates(report.model):
        kind = qualified(type(module))
        result = fuse.fuse(module, norms)
        if isinstance(result, str):
            report.unfused.append((name, kind, result))
        for add, attr in result if not isinstance(result, str) else ():
            op = "add_rms_norm" if isinstance(getattr(module, attr), nknn.RMSNorm) else \
                "add_layer_norm"
            report.fused.append((name, kind, f"{add}, then {attr} -> {op}"))


def convert(model: nn.Module, *, fuse_residual: bool = False,
            fuse_activation: bool = False) -> ConversionReport:
    """Run every normalization in ``model`` on normkit, in place: swap torch.nn norm
    layers (and their plain subclasses, and language models' RMSNorm classes) for normkit
    layers, route the norm calls of subclasses with their own forward; report the rest.

    ``fuse_residual=True`` also fuses each add that directly precedes a norm call in a
    module's forward (``h = a + b; r = h; h = self.norm(h)``, the pre-norm decoder layer;
    ``self.norm(a + b)``) into ``add_rms_norm`` / ``add_layer_norm``, where that equals the
    unfused code (see ``normkit.conversion.fuse``); ``report.fused`` lists each fused add,
    ``report.unfused`` the modules with normkit norms where none was, and why.

    ``fuse_activation=True`` also gives each converted BatchNorm the activation module
    right after it (``nn.Sequential`` neighbours; ``y = self.bn(x); y = self.act(y)`` in a
    forward): ReLU, ReLU6, LeakyReLU or SiLU, applied in the BatchNorm's own call (see
    ``normkit.conversion.activation``); ``report.activations_fused`` lists each pair,
    ``report.activations_left`` the pairs left, and why.

    Returns a ``ConversionReport``; ``report.model`` is the converted model (``model``
    itself unless ``model`` is a single normalization layer).

    Example::

        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
        >>> print(convert(net))
        swapped 1 module(s), routed 0, left 0
          swapped 1: torch.nn.LayerNorm -> normkit.nn.LayerNorm
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert expects a torch.nn.Module, got {type(model).__name__}; "
                        f"pass the model itself")
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError("convert works on eager modules, got a TorchScript module (scripted "
                        "or traced): convert the model first, then script or trace it")
    for flag, value in (("fuse_residual", fuse_residual), ("fuse_activation", fuse_activation)):
        if not isinstance(value, bool):
            raise TypeError(f"convert expects {flag} to be True or False, got {value!r}")
    report = _walk(model, _convert_one)
    if fuse_residual:
        _fuse_residual(report)
    if fuse_activation:
        activation.fuse_activations(report)
    if (report.swapped or report.routed) and _on_cuda(report.model):
        warnings.warn(
            "normkit.convert: this model is on CUDA, where each normkit norm call is bound "
            "by the host's cost of launching its Triton kernels from Python: converted models "
            "measured 1.1-3.8x slower than with torch.nn on an H200 (docs/gpu.md). For speed "
            "on a GPU keep torch.nn's norms (normkit.revert(model)) for now.", stacklevel=2)
    return report


def _on_cuda(model) -> bool:
    return any(t.is_cuda for t in itertools.chain(model.parameters(), model.buffers()))


def revert(model: nn.Module) -> ConversionReport:
    """Undo ``convert``: normkit layers become the torch (or model) classes they were
    swapped from, routed and fused modules get their class back."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"revert expects a torch.nn.Module, got {type(model).__name__}; "
                        f"pass the model itself")
    return _walk(model, _revert_one)
