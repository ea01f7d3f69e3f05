"""BatchNorm layers: one mean and variance per channel, over the batch and all positions."""

from __future__ import annotations

import torch
from torch import fx, nn

from normkit import backends, ops
from normkit import functional as F
from normkit import grouping as G
from normkit._checks import _momentum
from normkit.activation import resolve
from normkit.nn._base import NormBase, fx_leaf
from normkit.nn._kept import KeptPlan

__all__ = ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d"]


class _BatchNorm(KeptPlan, NormBase):
    _accepted_dims: tuple = ()
    _rows_of_channels = True

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, device=None, dtype=None, *, bias=True,
                 activation=None, negative_slope=0.01):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device,
                         dtype, bias=bias)
        self._act = resolve(activation, negative_slope, type(self).__name__)
        self._negative_slope = negative_slope

    # the activation applied in the layer's own call (normkit.activation): set by the
    # constructor, by normkit.convert when it fuses a following activation module, or by
    # hand; changing it drops the kept plans (the plan applies it)
    @property
    def activation(self):
        """The fused activation's name (``"relu"``, ``"relu6"``, ``"leaky_relu"``,
        ``"silu"``), or None."""
        act = self.__dict__.get("_act")
        return None if act is None else act.name

    @activation.setter
    def activation(self, value):
        self._act = resolve(value, self.negative_slope, type(self).__name__)
        self._drop_plans()

    @property
    def negative_slope(self) -> float:
        """``leaky_relu``'s slope for negative inputs (torch's default 0.01)."""
        return self.__dict__.get("_negative_slope", 0.01)

    @negative_slope.setter
    def negative_slope(self, value):
        self._act = resolve(self.activation, value, type(self).__name__)
        self._negative_slope = value
        self._drop_plans()

    def _drop_plans(self):
        for slot in ("_train_plan", "_eval_plan"):
            self.__dict__.pop(slot, None)

    def extra_repr(self) -> str:
        act = self.__dict__.get("_act")
        if act is None:
            return super().extra_repr()
        slope = f", negative_slope={act.slope}" if act.name == "leaky_relu" else ""
        return f"{super().extra_repr()}, activation={act.name!r}{slope}"

    def _check_input_dim(self, input) -> None:
        if input.dim() not in self._accepted_dims:
            want = " or ".join(f"{d}D" for d in self._accepted_dims)
            raise ValueError(f"expected {want} input (got {input.dim()}D input of size "
                             f"{list(input.shape)}) for {type(self).__name__}")

    def _build(self, x, fixed):
        """``(plan, unbias)`` of the plan for ``x`` (``KeptPlan._kept``; the plan None: the
        full path runs), or None for an input the full path must see (another dimension
        count or channel count: it raises torch's error, or runs where nothing is per
        channel)."""
        if x.dim() not in self._accepted_dims or x.shape[1] != self.num_features:
            return None
        grouping = G.batch(x.shape)
        n = grouping.group_size
        # (none for channels_last strides that do not view as (N, C, S))
        viewable = G.view_strides(x.shape, x.stride(), grouping.view) is not None
        plan = (backends.plan(x, grouping, True, fixed, self.__dict__.get("_act"))
                if n > 1 and viewable else None)
        return plan, n / (n - 1) if n > 1 else 0.0

    def _own_tensors(self):
        """``(weight, bias, running_mean, running_var)`` from the module's own dicts (past
        ``Module.__getattr__``), or None where the running statistics are missing or a
        parameter was taken out of them (the full path runs)."""
        buffers, params = self._buffers, self._own_params()
        running_mean, running_var = buffers.get("running_mean"), buffers.get("running_var")
        if running_mean is None or running_var is None or params is None:
            return None
        return (*params, running_mean, running_var)

    def _train_call(self, x, factor):
        """Training with running statistics: the kept plan of this input, with the running
        update inside the call (``normkit.ops.run``). None where the full path runs (see
        ``_eval_call``)."""
        if not self._plain_call(x):
            return None
        kept, own = self._kept(x, "_train_plan", self._build, False), self._own_tensors()
        if kept is None or kept[0] is None or own is None or not self.eps > 0:
            return None
        (plan, unbias), (w, b, running_mean, running_var) = kept, own
        return ops.run(plan, x, w, b, self.eps, None, None, False, None,
                       (running_mean, running_var, factor, unbias))[0]

    def _eval_call(self, x):
        """Eval without a gradient: the kept plan (``normkit.nn._kept``) called with the
        layer's running statistics as fixed ones. None where the full path runs: grad,
        no running statistics, or any case ``_kept`` lists."""
        if torch.is_grad_enabled() or not self._plain_call(x):
            return None
        kept, own = self._kept(x, "_eval_plan", self._build, True), self._own_tensors()
        if kept is None or kept[0] is None or own is None or self.eps < 0:
            return None
        w, b, running_mean, running_var = own
        return ops.run(kept[0], x, w, b, self.eps, running_mean, None, False, running_var)[0]

    def _exponential_average_factor(self) -> float:
        """The momentum of this step; with ``momentum=None`` the running statistics are the
        cumulative average of all batches (factor ``1 / num_batches_tracked``)."""
        momentum = self.momentum
        factor = 0.0 if momentum is None else _momentum(type(self).__name__, momentum,
                                                        "a number or None")
        if self.training and self.track_running_stats:
            tracked = self.num_batches_tracked       # (a buffer: each read costs ~1 us)
            if tracked is not None:
                tracked.add_(1)
                if momentum is None:
                    factor = 1.0 / float(tracked)
        return factor

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            y = self._eval_call(input)
            if y is not None:
                return y
        if isinstance(input, fx.Proxy):          # torch.fx traces: one call_module node
            return fx_leaf(self, input)
        self._check_input_dim(input)
        factor = self._exponential_average_factor()
        if self.training and self.track_running_stats:
            y = self._train_call(input, factor)
            if y is not None:
                return y
        # buffers and parameters read once: each goes through Module.__getattr__
        running_mean, running_var = self.running_mean, self.running_var
        # batch statistics in training, and in eval when there are no running statistics
        use_batch_stats = self.training or (running_mean is None and running_var is None)
        track = not self.training or self.track_running_stats
        act = self.__dict__.get("_act")
        if act is not None:
            return F.batch_norm_act(input, running_mean if track else None,
                                    running_var if track else None, self.weight, self.bias,
                                    use_batch_stats, factor, self.eps, activation=act.name,
                                    negative_slope=act.slope)
        return F.batch_norm(input,
                            running_mean if track else None,
                            running_var if track else None,
                            self.weight, self.bias, use_batch_stats, factor, self.eps)


_BN_DOC = r"""Batch normalization over a {ndim}D input ``(N, C{spatial})`` (Ioffe & Szegedy, 2015).

    .. math:: y = \frac{{x - \mathrm{{E}}[x]}}{{\sqrt{{\mathrm{{Var}}[x] + \epsilon}}}} * \gamma + \beta

    Mean and variance are taken per channel over N{over}. In training the *biased*
    variance normalizes and the running estimates are updated with
    ``running = (1 - momentum) * running + momentum * batch_stat``, the variance stored
    *unbiased*; ``momentum=None`` makes them a cumulative average. In eval the running
    estimates normalize (the batch's, if ``track_running_stats=False``).

    Args:
        num_features: C, the number of channels.
        eps: added to the variance inside the square root. Default: 1e-5.
        momentum: weight of the new batch in the running estimates, or None. Default: 0.1.
        affine: learnable per-channel weight (init 1) and bias (init 0). Default: True.
        track_running_stats: keep running estimates for eval. Default: True.
        bias: with ``affine``, whether to learn the bias (keyword-only). Default: True.
        activation: ``"relu"``, ``"relu6"``, ``"leaky_relu"`` or ``"silu"`` applied to the
            output in the same call (keyword-only; ``normkit.functional.batch_norm_act``'s
            ``activation``); ``normkit.convert(model, fuse_activation=True)`` sets it where
            an activation module follows. Default: None.
        negative_slope: ``leaky_relu``'s slope (keyword-only). Default: 0.01.

    Shape:
        Input and output: ``{shape}`` (same shape, dtype and memory format).

    Example::

        >>> m = {name}(3)
        >>> y = m(torch.randn({example}))
"""


#: the docstring fields of the 1d/2d/3d variants (shared with BatchRenorm)
DIM_DOC = {
    1: dict(ndim="2D or 3", spatial=", [L]", over=" (and L)", shape="(N, C) or (N, C, L)",
            example="8, 3"),
    2: dict(ndim="4", spatial=", H, W", over=", H and W", shape="(N, C, H, W)",
            example="8, 3, 5, 5"),
    3: dict(ndim="5", spatial=", D, H, W", over=", D, H and W", shape="(N, C, D, H, W)",
            example="4, 3, 2, 5, 5"),
}


class BatchNorm1d(_BatchNorm, nn.BatchNorm1d):
    __doc__ = _BN_DOC.format(name="BatchNorm1d", **DIM_DOC[1])
    _accepted_dims = (2, 3)


class BatchNorm2d(_BatchNorm, nn.BatchNorm2d):
    __doc__ = _BN_DOC.format(name="BatchNorm2d", **DIM_DOC[2])
    _accepted_dims = (4,)


class BatchNorm3d(_BatchNorm, nn.BatchNorm3d):
    __doc__ = _BN_DOC.format(name="BatchNorm3d", **DIM_DOC[3])
    _accepted_dims = (5,)


_BatchNorm._plain_classes = (BatchNorm1d, BatchNorm2d, BatchNorm3d)   # see KeptPlan
