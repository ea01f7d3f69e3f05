r"""Recipes: a model's own norm class written as ``normkit.functional`` calls.

transformers' models define many norm classes of their own as plain ``nn.Module``s that
spell the math out in torch ops (``x.pow(2).mean(-1)``, ``torch.rsqrt``): LayerNorms without
bias computed in fp32 (Cohere), without parameters, RMSNorms without weight (Llama 4's
q/k norm), over groups of the last dim, gated (Mamba2's ``forward(hidden_states,
gate=None)``), per-head q/k norms with a ``(heads, head_dim)`` weight. A ``Recipe`` is one
point of the space these classes live in, and ``run`` computes it:

.. math::
    h = \text{up}(x) \odot a(g)\ \text{(gate before)}, \qquad
    \hat h = \frac{h - \mu}{\sqrt{\sigma^2 + \epsilon}}\ \text{(or } \frac{h}{\sqrt{
    \mathrm{mean}(h^2) + \epsilon}} \text{)}, \qquad
    y = \text{cast}\big(\text{affine}(\hat h) \odot a(g)\ \text{(gate after)}\big)

* ``center``: LayerNorm (:math:`\mu`, biased :math:`\sigma^2`) or RMSNorm (:math:`\mu = 0`,
  :math:`\sigma^2 = \mathrm{mean}(h^2)`), by ``normkit.functional.layer_norm`` /
  ``rms_norm`` without affine parameters: one mean and variance per row of the last
  ``dims`` dims, or per ``group`` consecutive elements of the last dim; ``l2``: the
  projection onto the unit sphere :math:`h / \sqrt{\sum h^2 + \epsilon}` (nGPT's
  ``L2Norm``), which is ``rms_norm`` with :math:`\epsilon / n`, divided by
  :math:`\sqrt n`;
* ``casting``: where the model casts (see ``normkit.rms_casting``): ``"torch"`` normalizes
  ``x`` in its own dtype with the weight and bias inside the op; ``"llama"`` normalizes
  ``x.float()``, casts :math:`\hat h` to ``x.dtype``, then ``(offset + w) * . + b``;
  ``"gemma"`` multiplies and adds in fp32 and casts once at the end; ``"t5"`` casts
  :math:`\hat h` to a half weight's dtype only. ``offset`` is 0 or 1 (Gemma stores
  :math:`w - 1`);
* ``gate``: ``None``, or ``("before" | "after", "silu" | "sigmoid")``: the model's gating
  order, ``norm(x * silu(gate))`` (Mamba2) or ``norm(x) * silu(gate)`` (Qwen3-Next), the
  gate taken in fp32 and the product cast to ``x.dtype`` at the end; a ``gate`` of None
  at the call skips it, as the models do.

``frozen_eps`` (a number) is the other kind: a FrozenBatchNorm2d (DETR's and its
descendants'), batch normalization in eval whose statistics and affine are buffers, run
as ``normkit.functional.batch_norm(training=False)``; its epsilon is often a constant in
the forward, found by the probe.

The weight (and bias) broadcast over the normalized dims, so a ``(heads, head_dim)``
weight with ``dims=1`` is a per-head norm, and a weight of the whole last dim with
``group`` is a grouped norm. The normalization is normkit's op with its hand-derived
backward; the casts, the affine and the gate are the torch ops the models use, in the
models' order (``normkit.rms_casting.affine``). Without a gate, groups or the L2 form, a
``llama``/``gemma``/``t5`` recipe is one op, ``normkit.ops.cast_norm``, whose backward
keeps ``x`` in its own dtype, the statistics and the weight (not the fp32 copies the
composed ops keep) and gives the composed ops' gradients bit for bit; otherwise autograd
differentiates the torch ops as in the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from normkit import functional as nF
from normkit import grouping as G
from normkit import ops
from normkit.rms_casting import affine

__all__ = ["Recipe", "run", "describe"]

@dataclass(frozen=True)
class Recipe:
    """One norm class's math (module docstring); ``eps`` is read from the module's
    ``eps_name`` attribute at every call, the affine from ``weight`` / ``bias``."""

    center: bool
    eps_name: str
    dims: int = 1
    group: int | None = None
    casting: str = "llama"
    offset: float = 0.0
    gate: tuple | None = None
    l2: bool = False
    frozen_eps: float | None = None


def _act(name, g):
    return torch.nn.functional.silu(g) if name == "silu" else torch.sigmoid(g)


def _normalized(h, recipe, eps, weight=None, bias=None):
    """:math:`\\hat h` (or, with ``weight``/``bias`` given, the affine inside the op)."""
    if recipe.group is not None:
        shape = h.shape
        hg = h.reshape(*shape[:-1], shape[-1] // recipe.group, recipe.group)
        flat = Recipe(recipe.center, recipe.eps_name, l2=recipe.l2)
        return _normalized(hg, flat, eps).reshape(shape)
    shape = h.shape[h.dim() - recipe.dims:]
    if recipe.center:
        return nF.layer_norm(h, shape, weight, bias, eps)
    if recipe.l2:                  # x / sqrt(sum x^2 + eps) = rms_norm(x, eps / n) / sqrt(n)
        n = math.prod(shape)
        return nF.rms_norm(h, shape, None, eps / n) * (1.0 / math.sqrt(n))
    return nF.rms_norm(h, shape, weight, eps)


def _frozen_batch_norm(module, recipe, x):
    """Batch normalization with the statistics and affine of ``module``'s buffers (a
    FrozenBatchNorm2d: ``weight``, ``bias``, ``running_mean``, ``running_var``), in the
    dtype ``x * weight`` promotes to, as the models' ``x * scale + bias``."""
    b = module._buffers
    eps = recipe.frozen_eps if recipe.eps_name is None else getattr(module, recipe.eps_name)
    x = x.to(torch.promote_types(x.dtype, b["weight"].dtype))
    return nF.batch_norm(x, b["running_mean"], b["running_var"], b["weight"], b["bias"],
                         False, 0.0, eps)


def run(module, recipe, x, gate=None):
    """``recipe`` on ``x`` with ``module``'s epsilon, weight and bias (module docstring)."""
    if recipe.frozen_eps is not None:
        return _frozen_batch_norm(module, recipe, x)
    eps = getattr(module, recipe.eps_name)
    weight = module._parameters.get("weight")
    bias = module._parameters.get("bias")
    dtype = x.dtype
    gated = recipe.gate is not None and gate is not None
    if recipe.casting == "torch" and not gated and not recipe.offset and recipe.group is None \
            and not recipe.l2:
        inside = weight is None or weight.shape == x.shape[x.dim() - recipe.dims:]
        y = _normalized(x, recipe, eps, *((weight, bias) if inside else ()))
        if not inside:
            y = y * weight if bias is None else y * weight + bias
        return y
    if recipe.casting != "torch" and not gated and recipe.group is None and not recipe.l2:
        # the casts and the affine in the one op that keeps x in its own dtype
        return ops.cast_norm(x, G.layer(tuple(x.shape), recipe.dims), weight, bias, eps,
                             recipe.center, recipe.casting, recipe.offset, torch.float32)
    h = x.float() if recipe.casting != "torch" else x
    if gated and recipe.gate[0] == "before":
        h = h * _act(recipe.gate[1], gate.float())
    x_hat = _normalized(h, recipe, eps)
    if recipe.casting == "torch":
        y = x_hat.to(dtype)
        if weight is not None:
            y = (recipe.offset + weight if recipe.offset else weight) * y
        y = y if bias is None else y + bias
    else:
        y = affine(x_hat, dtype, weight, recipe.offset, recipe.casting, bias)
    if gated and recipe.gate[0] == "after":
        return (y * _act(recipe.gate[1], gate.float())).to(dtype)
    return y.to(dtype) if recipe.casting == "gemma" else y


def describe(recipe) -> str:
    """One line for the report: ``rms_norm over groups of 16, fp32, gate before (silu)``."""
    if recipe.frozen_eps is not None:
        return "batch_norm in eval with the buffers' statistics and affine (frozen)"
    what = "layer_norm" if recipe.center else "rms_norm"
    what += " as the L2 norm (eps / n, then / sqrt(n))" if recipe.l2 else ""
    where = (f" over groups of {recipe.group}" if recipe.group else
             f" over the last {recipe.dims} dims" if recipe.dims > 1 else "")
    how = {"torch": "in the input dtype", "llama": "fp32, cast then affine",
           "gemma": "fp32 affine, then cast", "t5": "fp32, t5 casting"}[recipe.casting]
    extra = f", offset {recipe.offset:g}" if recipe.offset else ""
    if recipe.gate is not None:
        extra += f", gate {recipe.gate[0]} ({recipe.gate[1]})"
    return f"{what}{where}, {how}{extra}"
