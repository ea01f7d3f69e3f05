r"""Where an RMSNorm casts: the rules of torch.nn.RMSNorm and of the language models.

Every rule first normalizes, :math:`\hat{x} = x / \sqrt{\mathrm{mean}(x^2) + \epsilon}`
(``normkit``'s hand-derived op), then scales by :math:`s = \text{offset} + w` and casts;
they differ only in the order of the cast and the multiply, which changes bf16 and fp16
results by up to one unit in the last place:

========  ==================================================  =========================
casting   output                                              used by
========  ==================================================  =========================
torch     ``(x_hat * s).to(x.dtype)``, one fused op             ``torch.nn.RMSNorm``
llama     ``s * x_hat.to(x.dtype)``                             Llama, Qwen2/3, Mistral,
                                                              Mixtral, Phi3
gemma     ``(x_hat * (offset + w.float())).to(x.dtype)``        Gemma, Gemma2 (offset 1)
t5        ``s * x_hat.to(w.dtype)`` if w is fp16/bf16,          ``T5LayerNorm``
          else ``s * x_hat``
========  ==================================================  =========================

For ``llama``, ``gemma`` and ``t5`` the normalization runs in fp32 on ``x.float()``, as
those models do (``t5`` in fp64 for an fp64 input); the cast and the multiply are torch
ops, so autograd differentiates them and normkit's backward differentiates
:math:`\hat{x}`: :math:`\partial L/\partial x = \mathrm{rstd}\,(\hat g - \hat x\,
\mathrm{mean}(\hat g\,\hat x))` with :math:`\hat g` the gradient reaching
:math:`\hat x`.
"""

from __future__ import annotations

import torch

__all__ = ["CASTINGS", "check_casting", "normalize_dtype", "scale_and_cast"]

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


def scale_and_cast(x_hat, input_dtype, weight, offset, casting):
    """Apply ``casting``'s rule to the normalized ``x_hat`` (fp32, or fp64 for ``t5``)."""
    if weight is None:
        return x_hat.to(input_dtype) if casting != "t5" else x_hat
    if casting == "llama":
        scale = weight if not offset else offset + weight
        return scale * x_hat.to(input_dtype)                        # cast, then multiply
    if casting == "gemma":
        scale = weight.float() if not offset else offset + weight.float()
        return (x_hat * scale).to(input_dtype)                      # multiply, then cast
    scale = weight if not offset else offset + weight               # t5
    if weight.dtype in _HALF:
        x_hat = x_hat.to(weight.dtype)
    return scale * x_hat
