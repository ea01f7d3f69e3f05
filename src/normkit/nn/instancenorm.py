"""InstanceNorm layers: one mean and variance per (sample, channel), over the positions."""

from __future__ import annotations

import warnings

import torch
from torch import fx, nn

from normkit import functional as F
from normkit.nn._base import NormBase, fx_leaf

__all__ = ["InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d"]


class _InstanceNorm(NormBase):
    _no_batch_dim: int = 0

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=False,
                 track_running_stats=False, device=None, dtype=None, *, bias=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype, bias=bias)

    def _check_input_dim(self, input) -> None:
        ok = (self._no_batch_dim, self._no_batch_dim + 1)
        if input.dim() not in ok:
            raise ValueError(f"expected {ok[0]}D or {ok[1]}D input (got {input.dim()}D input "
                             f"of size {list(input.shape)}) for {type(self).__name__}")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # checkpoints from before torch 0.4 carry running stats that this layer does not track
        version = local_metadata.get("version", None)
        if version is None and not self.track_running_stats:
            keys = [prefix + n for n in ("running_mean", "running_var") if prefix + n in state_dict]
            if keys:
                error_msgs.append(
                    f"Unexpected running stats buffer(s) {' and '.join(repr(k) for k in keys)} "
                    f"for {type(self).__name__} with track_running_stats=False: remove them "
                    f"from the state_dict, or build the layer with track_running_stats=True "
                    f"if they are needed")
                for k in keys:
                    state_dict.pop(k)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if isinstance(input, fx.Proxy):          # torch.fx traces: one call_module node
            return fx_leaf(self, input)
        self._check_input_dim(input)
        feature_dim = input.dim() - self._no_batch_dim
        if input.size(feature_dim) != self.num_features:
            if self.affine:
                raise ValueError(
                    f"expected input's size at dim={feature_dim} to match num_features "
                    f"({self.num_features}), but got: {input.size(feature_dim)}; build "
                    f"{type(self).__name__}({input.size(feature_dim)}) for this input")
            warnings.warn(
                f"input's size at dim={feature_dim} does not match num_features. You can "
                f"silence this warning by not passing in num_features, which is not used "
                f"because affine=False", stacklevel=2)
        unbatched = input.dim() == self._no_batch_dim
        x = input.unsqueeze(0) if unbatched else input
        y = F.instance_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                            self.training or not self.track_running_stats,
                            self.momentum if self.momentum is not None else 0.0, self.eps)
        return y.squeeze(0) if unbatched else y


_IN_DOC = r"""Instance normalization over ``(N, C, {spatial})`` or ``(C, {spatial})``
    (Ulyanov et al., 2016).

    .. math:: y = \frac{{x - \mathrm{{E}}[x]}}{{\sqrt{{\mathrm{{Var}}[x] + \epsilon}}}} * \gamma + \beta

    Mean and *biased* variance per sample and channel, over {spatial}. With
    ``track_running_stats`` the running estimates (batch mean of the per-instance mean and
    unbiased variance) are updated in training and normalize in eval.

    Args:
        num_features: C, the number of channels.
        eps: added to the variance inside the square root. Default: 1e-5.
        momentum: weight of the new batch in the running estimates. Default: 0.1.
        affine: learnable per-channel weight (init 1) and bias (init 0). Default: False.
        track_running_stats: keep running estimates for eval. Default: False.
        bias: with ``affine``, whether to learn the bias (keyword-only). Default: True.

    Shape:
        Input and output: ``(N, C, {spatial})`` or ``(C, {spatial})``.

    Example::

        >>> m = {name}(3, affine=True)
        >>> y = m(torch.randn({example}))
"""


class InstanceNorm1d(_InstanceNorm, nn.InstanceNorm1d):
    __doc__ = _IN_DOC.format(spatial="L", name="InstanceNorm1d", example="4, 3, 10")
    _no_batch_dim = 2


class InstanceNorm2d(_InstanceNorm, nn.InstanceNorm2d):
    __doc__ = _IN_DOC.format(spatial="H, W", name="InstanceNorm2d", example="4, 3, 8, 8")
    _no_batch_dim = 3


class InstanceNorm3d(_InstanceNorm, nn.InstanceNorm3d):
    __doc__ = _IN_DOC.format(spatial="D, H, W", name="InstanceNorm3d", example="2, 3, 4, 8, 8")
    _no_batch_dim = 4
