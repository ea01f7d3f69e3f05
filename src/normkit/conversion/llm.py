r"""Language models' RMSNorm classes: recognised by structure and behaviour, swapped for
``normkit.nn.RMSNorm`` with the model's offset and casting rule.

transformers' ``LlamaRMSNorm``, ``GemmaRMSNorm``, ``T5LayerNorm`` and their many copies
are plain ``nn.Module``s, so they are recognised by what they are and do, not by name:

* structure: one parameter, ``weight`` (floating point); no buffer, no child; an epsilon
  attribute ``variance_epsilon`` or ``eps`` (a positive number); a ``forward`` of its own;
* behaviour: on probe inputs (random weight swapped in, fp32 and bf16 inputs, bf16 and
  fp32 weights) its ``forward`` equals one of the six rules ``casting in ("llama",
  "gemma", "t5") x offset in (0, 1)`` of ``normkit.functional.rms_norm``: the output
  dtype always; an fp32 output within fp32 rounding (the mean of squares is summed in
  another order); a bf16 output best of the six, with at most 1 % of the elements one
  bf16 unit apart (the rules differ from each other in far more).

The swap keeps the same ``Parameter`` (state_dict key ``weight``, so checkpoints load
both ways), the epsilon under the model's attribute name (an alias of ``eps``), the
class name, the hooks and the training flag; ``revert`` rebuilds an instance of the
original class around the same ``Parameter``.
"""

from __future__ import annotations

import torch
from torch import nn

import normkit.nn as nknn
from normkit import functional as nF
from normkit.conversion.classes import derived_class
from normkit.conversion.swap import MODULE_STATE, carry_module_state

__all__ = ["rms_structure", "probe_rule", "swap_rms", "revert_rms"]

_RULES = [(casting, offset) for casting in ("llama", "gemma", "t5") for offset in (0.0, 1.0)]
_PROBES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
           (torch.bfloat16, torch.float32)]


def rms_structure(module):
    """The epsilon attribute name of an RMSNorm-shaped ``module``, or None."""
    kind = type(module)
    if kind.forward is nn.Module.forward or module._buffers or module._modules:
        return None
    if set(module._parameters) != {"weight"}:
        return None
    weight = module._parameters["weight"]
    if weight is None or not weight.is_floating_point() or weight.dim() == 0:
        return None
    for name in ("variance_epsilon", "eps"):
        eps = vars(module).get(name)
        if isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps > 0:
            return name
    return None


def probe_rule(module, eps_name):
    """``(casting, offset)`` of the rule ``module.forward`` computes, or the reason none
    matched (a str)."""
    weight = module._parameters["weight"]
    eps = getattr(module, eps_name)
    shape = tuple(weight.shape)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((4,) + shape, generator=gen) * 2 + 0.25
    w = torch.randn(shape, generator=gen) * 0.5 + 0.3
    errors = {rule: 0 for rule in _RULES}
    device = "cpu" if weight.is_meta else weight.device   # (a meta model probes on the CPU)
    try:
        with torch.no_grad():
            for x_dtype, w_dtype in _PROBES:
                module._parameters["weight"] = nn.Parameter(w.to(device, w_dtype),
                                                            requires_grad=False)
                xp = x.to(device, x_dtype)
                want = module.forward(xp)
                if not isinstance(want, torch.Tensor) or want.shape != xp.shape:
                    return "its forward does not return a tensor of the input's shape"
                for casting, offset in _RULES:
                    got = nF.rms_norm(xp, shape, module._parameters["weight"], eps,
                                      offset=offset, casting=casting)
                    if got.dtype != want.dtype:
                        errors[(casting, offset)] = float("inf")
                    elif want.dtype not in (torch.float16, torch.bfloat16):
                        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                            errors[(casting, offset)] = float("inf")
                    else:
                        errors[(casting, offset)] += int((got != want).sum())
    except Exception as err:  # noqa: BLE001 -- any failure of foreign code means "no match"
        return f"its forward failed on a probe input ({type(err).__name__}: {err})"
    finally:
        module._parameters["weight"] = weight
    best = min(errors, key=errors.get)
    if errors[best] > 0.01 * x.numel() * (len(_PROBES) - 1):
        return ("its forward matches none of the RMSNorm rules (casting llama/gemma/t5, "
                "offset 0/1) on probe inputs")
    return best


def _eps_alias(eps_name):
    if eps_name == "eps":
        return {}
    return {eps_name: property(lambda self: self.eps,
                               lambda self, value: setattr(self, "eps", value),
                               doc="The model's name for eps.")}


def _named_forward(input_name):
    """``RMSNorm.forward`` under the model's name for its argument (``hidden_states``), so
    that a call by keyword still binds; nothing where the name is torch's ``input``."""
    if input_name == "input":
        return {}
    namespace = {"_forward": nknn.RMSNorm.forward}
    exec(f"def forward(self, {input_name}):\n"                             # noqa: S102
         f"    return _forward(self, {input_name})\n", namespace)
    forward = namespace["forward"]
    forward._normkit_forward_of = nknn.RMSNorm.forward      # the same code (fuse checks it)
    return {"forward": forward}


def swap_rms(module, eps_name, rule, input_name="input"):
    """The ``normkit.nn.RMSNorm`` for an RMSNorm-shaped ``module`` with ``rule``, whose
    forward takes one argument named ``input_name``."""
    casting, offset = rule
    derived = rms_class(type(module), eps_name, input_name)
    weight = module._parameters["weight"]
    new = derived(tuple(weight.shape), eps=getattr(module, eps_name), device="meta",
                  offset=offset, casting=casting)
    new.weight = weight
    carry_module_state(module, new)
    own = set(vars(new))
    new.__dict__.update({k: v for k, v in vars(module).items()
                         if k not in MODULE_STATE and k not in own and k != eps_name})
    return new


def rms_class(kind, eps_name, input_name):
    """The ``normkit.nn.RMSNorm`` class made for ``kind``: its epsilon also under
    ``eps_name``, its forward's argument named ``input_name``."""
    return derived_class(f"rms_{eps_name}_{input_name}", kind, (nknn.RMSNorm,),
                         lambda: dict(**_eps_alias(eps_name), **_named_forward(input_name),
                                      _normkit_source=(kind, eps_name)),
                         (rms_class, kind, eps_name, input_name))


def revert_rms(module):
    """An instance of the class ``module`` was swapped from, around the same weight."""
    kind, eps_name = type(module)._normkit_source
    new = kind.__new__(kind)
    nn.Module.__init__(new)
    new.weight = module.weight
    setattr(new, eps_name, module.eps)
    carry_module_state(module, new)
    own = set(vars(nknn.RMSNorm(1, device="meta")))
    new.__dict__.update({k: v for k, v in vars(module).items()
                         if k not in MODULE_STATE and k not in own})
    return new
