"""normkit's operators under ``torch.autocast("cuda")``: the dtypes torch gives.

Torch's CUDA autocast runs ``layer_norm``, ``rms_norm`` and ``group_norm`` in fp32 (its
"fp32" list: fp16/bf16 tensor arguments cast to fp32, so the output is fp32) and leaves
``batch_norm`` and ``instance_norm`` alone (on no list: they run in the input's dtype).
``torch.ops.normkit.norm_forward`` gets the same rule at the ``AutocastCUDA`` key:
groupings ``layer`` (LayerNorm, RMSNorm) and ``group`` cast their floating tensor
arguments other than fp64 to fp32, as ``cached_cast(at::kFloat, ...)`` does; ``batch``
and ``instance`` pass through. ``normkit.ops.norm_forward`` leaves its eager shortcut
while an autocast is on, so eager calls meet the rule too. The residual-add ops
(``add_layer_norm``, ``add_rms_norm``) are not covered: torch has no such op.
"""

from __future__ import annotations

import torch

FP32_KINDS = ("layer", "group")


def autocast_inputs(x, weight, bias, kind):
    """``(x, weight, bias)`` as torch's autocast hands them to the op of grouping ``kind``:
    fp32 for ``FP32_KINDS`` (each floating tensor other than fp64), unchanged otherwise."""
    if kind not in FP32_KINDS:
        return x, weight, bias
    return tuple(t.float() if t is not None and t.is_floating_point()
                 and t.dtype != torch.float64 else t for t in (x, weight, bias))


def autocast_kernel(key: str, op):
    """The kernel of ``op`` (``torch.ops.normkit.norm_forward.default``) for dispatch key
    ``key`` (``"AutocastCUDA"``): the inputs cast by ``autocast_inputs``, then ``op``
    below that key."""
    below = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

    def norm_forward(x, weight, bias, kind, view, reduce, param_view, eps, center, mean=None,
                     rstd=None, activation=None, negative_slope=0.0):
        with torch._C._ExcludeDispatchKeyGuard(below):
            x, weight, bias = autocast_inputs(x, weight, bias, kind)
            return op(x, weight, bias, kind, view, reduce, param_view, eps, center, mean, rstd,
                      activation, negative_slope)
    return norm_forward


def register(lib, op) -> None:
    """Register the rule for CUDA in ``lib``, the ``normkit`` library of ``normkit.ops``
    that defines ``op`` (``norm_forward``); ``normkit.ops`` calls this once (no import of
    it here: ops imports this module)."""
    lib.impl("norm_forward", autocast_kernel("AutocastCUDA", op), "AutocastCUDA")


__all__ = ["FP32_KINDS", "autocast_inputs", "autocast_kernel", "register"]
