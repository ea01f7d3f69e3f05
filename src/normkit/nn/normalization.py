"""Per-sample layers: LayerNorm, GroupNorm and RMSNorm (no batch statistics, so training
and eval agree)."""

from __future__ import annotations

import numbers

import torch
from torch import fx, nn

from normkit import backends
from normkit import functional as F
from normkit.grouping import view_strides
from normkit.nn._base import check_eps, fx_leaf, init_affine, reset_affine
from normkit.nn._kept import KeptPlan
from normkit.rms_casting import check_casting

__all__ = ["LayerNorm", "GroupNorm", "RMSNorm"]


def _as_shape(normalized_shape, cls_name) -> tuple:
    if isinstance(normalized_shape, numbers.Integral):
        normalized_shape = (normalized_shape,)
    shape = tuple(int(s) for s in normalized_shape)
    if not shape or any(s < 0 for s in shape):
        raise ValueError(f"{cls_name}: normalized_shape must be a non-empty list of sizes "
                         f"(the trailing dims of the input), got {normalized_shape!r}")
    return shape


class LayerNorm(KeptPlan, nn.LayerNorm):
    r"""Layer normalization over the trailing ``normalized_shape`` dims (Ba et al., 2016).

    .. math:: y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} * \gamma + \beta

    Mean and *biased* variance per sample (per token) over the last
    ``len(normalized_shape)`` dims; elementwise affine over those dims. It uses the same
    statistics in training and eval.

    Args:
        normalized_shape: the trailing shape to normalize over (int or list).
        eps: added to the variance inside the square root. Default: 1e-5.
        elementwise_affine: learnable weight (init 1) and bias (init 0). Default: True.
        bias: with ``elementwise_affine``, whether to learn the bias. Default: True.

    Shape:
        Input and output: ``(*, *normalized_shape)``.

    Example::

        >>> m = LayerNorm(768)
        >>> y = m(torch.randn(2, 197, 768))   # per token, as in a ViT / SigLIP tower
    """

    __constants__ = ["normalized_shape", "eps", "elementwise_affine"]

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
                 device=None, dtype=None):
        factory_kwargs = {"device": device, "dtype": dtype}
        nn.Module.__init__(self)          # (see NormBase)
        self.normalized_shape = _as_shape(normalized_shape, type(self).__name__)
        check_eps(eps, type(self).__name__)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        init_affine(self, self.normalized_shape, elementwise_affine, bias, factory_kwargs)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        reset_affine(self)

    def _build(self, x):
        """(node, None) of the plan for ``x`` (``KeptPlan``), None for an input the full path
        must check (its trailing dims or the parameters' shapes are not normalized_shape)."""
        k, shape = len(self.normalized_shape), self.normalized_shape
        params = self._own_params()
        if (params is None or x.dim() < k or tuple(x.shape[x.dim() - k:]) != shape
                or any(p is not None and p.shape != shape for p in params)):
            return None
        return backends.plan(x, F._layer(x.shape, k), True, False), None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        y = self._affine_call(input)
        if y is not None:
            return y
        if isinstance(input, fx.Proxy):          # torch.fx traces: one call_module node
            return fx_leaf(self, input)
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, bias={self.bias is not None}")


class GroupNorm(KeptPlan, nn.GroupNorm):
    r"""Group normalization (Wu & He, 2018) over ``(N, C, *)``.

    .. math:: y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} * \gamma + \beta

    The C channels are split into ``num_groups`` groups of C / G; mean and *biased*
    variance per sample and group, over its channels and all positions. The affine is
    per channel. G = 1 is LayerNorm over (C, *); G = C is InstanceNorm.

    Args:
        num_groups: G; must divide ``num_channels``.
        num_channels: C.
        eps: added to the variance inside the square root. Default: 1e-5.
        affine: learnable per-channel weight (init 1) and bias (init 0). Default: True.
        bias: with ``affine``, whether to learn the bias (keyword-only). Default: True.

    Shape:
        Input and output: ``(N, C, *)``.

    Example::

        >>> m = GroupNorm(2, 6)
        >>> y = m(torch.randn(4, 6, 10, 10))
    """

    __constants__ = ["num_groups", "num_channels", "eps", "affine"]
    _rows_of_channels = True                          # (KeptPlan: channels_last takes a node)

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, device=None,
                 dtype=None, *, bias=True):
        factory_kwargs = {"device": device, "dtype": dtype}
        nn.Module.__init__(self)          # (see NormBase)
        if num_groups <= 0 or num_channels % num_groups != 0:
            divisors = [d for d in range(1, num_channels + 1) if num_channels % d == 0]
            raise ValueError(f"num_channels ({num_channels}) must be divisible by num_groups "
                             f"({num_groups}); valid num_groups for {num_channels} channels: "
                             f"{divisors}")
        check_eps(eps, type(self).__name__)
        self.num_groups = num_groups
        self.num_channels = num_channels
        self.eps = eps
        self.affine = affine
        init_affine(self, num_channels, affine, bias, factory_kwargs)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        reset_affine(self)

    def _build(self, x):
        """(node, None) of the plan for ``x`` (``KeptPlan``), None for an input the full path
        must check (fewer than 2 dims, channels not num_channels, one value per group,
        num_groups no int)."""
        params = self._own_params()
        if (params is None or x.dim() < 2 or type(self.num_groups) is not int
                or x.shape[1] != self.num_channels
                or any(p is not None and p.numel() != self.num_channels for p in params)
                or F._one_value_per_group(x, self.num_groups)):
            return None
        grouping = F._group(x.shape, self.num_groups)
        if view_strides(x.shape, x.stride(), grouping.view) is None:
            return None, None      # (channels_last strides that do not view as the groups)
        return backends.plan(x, grouping, True, False), None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        y = self._affine_call(input)
        if y is not None:
            return y
        if isinstance(input, fx.Proxy):          # torch.fx traces: one call_module node
            return fx_leaf(self, input)
        return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.num_groups}, {self.num_channels}, eps={self.eps}, "
                f"affine={self.affine}, bias={self.bias is not None}")


class RMSNorm(KeptPlan, nn.RMSNorm):
    r"""Root-mean-square normalization (Zhang & Sennrich, 2019): LayerNorm without
    centering.

    .. math:: y = \frac{x}{\sqrt{\mathrm{mean}(x^2) + \epsilon}} * (\text{offset} + \gamma)

    Args:
        normalized_shape: the trailing shape to normalize over (int or list).
        eps: added inside the square root; None uses the compute dtype's epsilon
            (``normkit.functional.rms_eps``: float32's for half inputs, as torch's kernel).
            Default: None.
        elementwise_affine: learnable weight (init 1). Default: True.
        offset: keyword-only; the layer scales by ``offset + weight`` and initializes the
            weight to ``1 - offset`` (Gemma stores the weight as an offset from 1:
            ``offset=1.0``, weight init 0). Default: 0.0.
        casting: keyword-only; where the cast to the output dtype happens: ``"torch"``
            (this class's own), ``"llama"``, ``"gemma"``, ``"t5"`` (see
            ``normkit.rms_casting``). Default: ``"torch"``.

    Shape:
        Input and output: ``(*, *normalized_shape)``.

    Example::

        >>> m = RMSNorm(4096)
        >>> y = m(torch.randn(2, 16, 4096))
    """

    __constants__ = ["normalized_shape", "eps", "elementwise_affine"]

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None,
                 dtype=None, *, offset=0.0, casting="torch"):
        factory_kwargs = {"device": device, "dtype": dtype}
        nn.Module.__init__(self)          # (see NormBase)
        self.normalized_shape = _as_shape(normalized_shape, type(self).__name__)
        check_eps(eps, type(self).__name__, allow_none=True)
        check_casting(casting, offset, True if elementwise_affine else None)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.offset = offset
        self.casting = casting
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, **factory_kwargs))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.constant_(self.weight, 1.0 - self.offset)   # offset + weight = 1

    def _build(self, x):
        """(node, eps) of the plan for ``x`` (``KeptPlan``; eps None: the dtype's), None
        for an input the full path must check, or that it handles (an offset, a model's
        casting)."""
        k, shape = len(self.normalized_shape), self.normalized_shape
        w = self._parameters.get("weight")
        if (self.offset or self.casting != "torch" or x.dim() < k
                or tuple(x.shape[x.dim() - k:]) != shape or (w is not None and w.shape != shape)):
            return None
        return backends.plan(x, F._layer(x.shape, k), False, False), F.rms_eps(x.dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self._plain_call(input) and "weight" in self._parameters:
            found = self._kept(input, "_plan", self._build)
            if found is not None:
                eps = found[1] if self.eps is None else self.eps
                y = self._call_plan(input, found, eps, self._parameters["weight"], None)
                if y is not None:
                    return y
        if isinstance(input, fx.Proxy):          # torch.fx traces: one call_module node
            return fx_leaf(self, input)
        return F.rms_norm(input, self.normalized_shape, self.weight, self.eps,
                          offset=self.offset, casting=self.casting)

    def extra_repr(self) -> str:
        extra = "" if self.offset == 0 else f", offset={self.offset}"
        extra += "" if self.casting == "torch" else f", casting={self.casting!r}"
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}{extra}")


for _layer in (LayerNorm, GroupNorm, RMSNorm):
    _layer._plain_classes = (_layer,)                 # exact classes keep a node: KeptPlan
del _layer
