r"""Where a model's norm casts: the rules of torch.nn.RMSNorm and of the language models.

Every rule first normalizes, :math:`\hat{x} = x / \sqrt{\mathrm{mean}(x^2) + \epsilon}`
(``normkit``'s hand-derived op; a model's LayerNorm recipe centers too), then scales by
:math:`s = \text{offset} + w`, adds a bias where the model has one, and casts; they differ
only in the order of the cast and the multiply, which changes bf16 and fp16 results by up
to one unit in the last place:

========  ==================================================  =========================
casting   output                                              used by
========  ==================================================  =========================
torch     ``(x_hat * s).to(x.dtype)``, one fused op             ``torch.nn.RMSNorm``
llama     ``s * x_hat.to(x.dtype) + b``                         Llama, Qwen2/3, Mistral,
                                                              Mixtral, Phi3; DeBERTa (b)
gemma     ``(x_hat * (offset + w.float()) + b.float())``        Gemma, Gemma2 (offset 1);
          ``.to(x.dtype)``                                    Cohere's LayerNorm
t5        ``s * x_hat.to(w.dtype) + b`` if w is fp16/bf16,      ``T5LayerNorm``
          else ``s * x_hat + b``
========  ==================================================  =========================

For ``llama``, ``gemma`` and ``t5`` the normalization runs in fp32 on ``x.float()``, as
those models do (``t5`` in fp64 for an fp64 input). In eager mode the rule is part of one
op (``normkit.ops.cast_norm``, recorded by ``normkit.autograd.NormFunction``) that keeps
for backward only ``x`` in its own dtype, the fp32 statistics and the weight: ``x_hat``
is recomputed by the forward's kernel, and ``scale_and_cast_backward`` runs the torch ops
autograd runs through ``scale_and_cast``, in the same order and dtypes, so the gradients
are those of the composed ops bit for bit. Writing ``c`` for ``x_hat`` as the rule
multiplies it (cast to ``x.dtype`` for ``llama``) and ``g`` for the gradient reaching the
rule's sum ``s * c + b`` (cast to its dtype for ``gemma``):

.. math:: \frac{\partial L}{\partial w} = \textstyle\sum_{\text{rows}} g\, c, \qquad
          \frac{\partial L}{\partial b} = \textstyle\sum_{\text{rows}} g, \qquad
          \hat g = \frac{\partial L}{\partial \hat x} = g\, s

and normkit's backward of :math:`\hat{x}`: :math:`\partial L/\partial x = \mathrm{rstd}
\,(\hat g - \hat x\, \mathrm{mean}(\hat g\,\hat x))` (minus :math:`\mathrm{mean}(\hat g)`
when centered).
"""

from __future__ import annotations

import torch

__all__ = ["CASTINGS", "affine", "check_casting", "kernel_dtype", "normalize_dtype",
           "scale_and_cast", "scale_and_cast_backward"]

CASTINGS = ("torch", "llama", "gemma", "t5")
_HALF = (torch.float16, torch.bfloat16)


def check_casting(casting, offset, weight) -> None:
    """``casting`` must be one of ``CASTINGS``; a nonzero ``offset`` needs a weight."""
    if casting not in CASTINGS:
        raise ValueError(f"rms_norm casting must be one of {CASTINGS}, got casting={casting!r}; "
                         f"'torch' is torch.nn.RMSNorm's rule, 'llama'/'gemma'/'t5' the models'")
    if isinstance(offset, bool) or not isinstance(offset, (int, float)):
        raise TypeError(f"rms_norm offset must be a number (Gemma stores w - 1 and uses "
                        f"offset=1.0), got {type(offset).__name__}")
    if offset and weight is None:
        raise ValueError(f"rms_norm offset={offset} scales by offset + weight, but weight is "
                         f"None; pass a weight or offset=0.0")


def normalize_dtype(x, casting):
    """The dtype the model normalizes in: fp32 (``t5``: at least fp32)."""
    if casting == "t5" and x.dtype == torch.float64:
        return torch.float64
    return torch.float32


def _multiplied_dtype(x_hat_dtype, input_dtype, weight, casting):
    """The dtype of ``c``, ``x_hat`` as the rule multiplies it."""
    if casting == "llama":
        return input_dtype
    if casting == "t5" and weight is not None and weight.dtype in _HALF:
        return weight.dtype
    return x_hat_dtype


def kernel_dtype(x, casting, weight, ndtype):
    """The dtype normkit's kernel may normalize ``x`` in: ``x``'s own where its output is
    already ``c`` -- the rule casts ``x_hat`` to ``x.dtype`` first (``llama``; ``t5`` with a
    weight of ``x``'s half dtype) and the kernel computes in ``ndtype`` (fp32 for a half
    input: the CPU kernels load it into fp32, normalize there and round once, as
    ``x.float()``, the fp32 kernel and the cast do: the same bits, tested), or ``x`` is in
    ``ndtype`` already; else ``ndtype`` (``x`` cast first)."""
    if x.dtype == ndtype:
        return ndtype
    if (x.device.type == "cpu" and x.dtype in _HALF and ndtype == torch.float32
            and _multiplied_dtype(ndtype, x.dtype, weight, casting) == x.dtype):
        return x.dtype
    return ndtype


def _scale(weight, offset, casting):
    if casting == "gemma":
        return weight.float() if not offset else offset + weight.float()
    return weight if not offset else offset + weight


def affine(x_hat, input_dtype, weight, offset, casting, bias=None):
    """``s * c + b`` of the rule on the normalized ``x_hat`` (fp32, fp64 for ``t5``), before
    ``gemma``'s final cast (a gate may come between: ``normkit.conversion.recipes``)."""
    y = x_hat.to(_multiplied_dtype(x_hat.dtype, input_dtype, weight, casting))
    if weight is not None:
        y = _scale(weight, offset, casting) * y
    if bias is not None:
        y = y + (bias.float() if casting == "gemma" else bias)
    return y


def scale_and_cast(x_hat, input_dtype, weight, offset, casting, bias=None):
    """Apply ``casting``'s rule to the normalized ``x_hat`` (fp32, or fp64 for ``t5``)."""
    y = affine(x_hat, input_dtype, weight, offset, casting, bias)
    return y.to(input_dtype) if casting == "gemma" else y


def scale_and_cast_backward(grad, x_hat, x_hat_dtype, input_dtype, weight, bias, offset,
                            casting, needs):
    """``(d_xhat, dweight, dbias)`` of ``scale_and_cast``, each None unless asked for in
    ``needs``: the ops autograd runs through it (each product's gradient in the product's
    dtype, summed over the broadcast dims and then cast to the input's dtype, as the
    engine does), so the same bits. ``x_hat`` (of ``x_hat_dtype``) is needed for
    ``dweight`` only; ``bias`` is read for its shape and dtype only (a meta tensor will
    do)."""
    c_dtype = _multiplied_dtype(x_hat_dtype, input_dtype, weight, casting)
    f32 = torch.float32
    s_dtype = None if weight is None else f32 if casting == "gemma" else weight.dtype
    t_dtype = c_dtype if s_dtype is None else torch.promote_types(s_dtype, c_dtype)  # s * c
    b_dtype = None if bias is None else f32 if casting == "gemma" else bias.dtype
    sum_dtype = t_dtype if b_dtype is None else torch.promote_types(t_dtype, b_dtype)
    g = grad.to(sum_dtype)                          # gemma: the backward of the last cast
    db = g.sum_to_size(bias.shape).to(b_dtype).to(bias.dtype) if needs[2] else None
    g = g.to(t_dtype)                               # (the sum's gradient to s * c)
    dw = None
    if weight is not None and needs[1]:
        c = x_hat.to(c_dtype)
        dw = (g * c).sum_to_size(weight.shape).to(s_dtype).to(weight.dtype)
    d_xhat = None
    if needs[0]:
        dc = g if weight is None else g * _scale(weight, offset, casting)
        d_xhat = dc.to(c_dtype).to(x_hat_dtype)
    return d_xhat, dw, db
