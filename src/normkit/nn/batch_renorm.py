"""Batch Renormalization layers (Ioffe, 2017): BatchNorm for small or non-i.i.d. batches."""

from __future__ import annotations

import torch
from torch import fx

from normkit import functional as F
from normkit.nn._base import fx_leaf
from normkit.nn.batchnorm import DIM_DOC, _BatchNorm

__all__ = ["BatchRenorm1d", "BatchRenorm2d", "BatchRenorm3d"]


def _ramp(step, start, length):
    """0 before ``start``, rising linearly to 1 over ``length`` steps, 1 after."""
    if step < start:
        return 0.0
    return 1.0 if length <= 0 else min(1.0, (step - start) / length)


class _BatchRenorm(_BatchNorm):

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, device=None, dtype=None, *, bias=True,
                 r_max=3.0, d_max=5.0, warmup_steps=5000, r_max_steps=40000,
                 d_max_steps=25000):
        if not track_running_stats:
            raise ValueError(f"{type(self).__name__} needs running statistics (r and d compare "
                             f"the batch statistics with them), got track_running_stats=False; "
                             f"use BatchNorm with track_running_stats=False instead")
        if not r_max >= 1.0 or not d_max >= 0.0:
            raise ValueError(f"{type(self).__name__} needs r_max >= 1 and d_max >= 0, got "
                             f"r_max={r_max}, d_max={d_max}; r_max=1, d_max=0 is BatchNorm")
        bad = {k: v for k, v in (("warmup_steps", warmup_steps), ("r_max_steps", r_max_steps),
                                 ("d_max_steps", d_max_steps)) if v < 0}
        if bad:
            raise ValueError(f"{type(self).__name__}: step counts must be >= 0, got {bad}")
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype, bias=bias)
        self.r_max, self.d_max = float(r_max), float(d_max)
        self.warmup_steps = warmup_steps
        self.r_max_steps, self.d_max_steps = r_max_steps, d_max_steps

    @property
    def activation(self):
        """None: Batch Renormalization applies no activation of its own."""
        return None

    @activation.setter
    def activation(self, value):
        if value is not None:               # (BatchNorm's fused activation: not here)
            raise ValueError(f"{type(self).__name__} applies no activation in its own call, "
                             f"got activation={value!r}; apply it after the layer "
                             f"(torch.nn.functional.relu(m(x)))")

    def limits(self, step=None):
        """``(r_max, d_max)`` in force at training step ``step`` (default: the next batch,
        ``num_batches_tracked``): ``(1, 0)`` for the first ``warmup_steps`` batches, then
        rising linearly to ``(r_max, d_max)`` over ``r_max_steps`` and ``d_max_steps``."""
        if step is None:
            step = int(self.num_batches_tracked)
        r = 1.0 + (self.r_max - 1.0) * _ramp(step, self.warmup_steps, self.r_max_steps)
        d = self.d_max * _ramp(step, self.warmup_steps, self.d_max_steps)
        return r, d

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if isinstance(input, fx.Proxy):          # torch.fx traces: one call_module node
            return fx_leaf(self, input)
        self._check_input_dim(input)
        r_max, d_max = self.limits() if self.training else (1.0, 0.0)  # step before counting
        factor = self._exponential_average_factor()
        return F.batch_renorm(input, self.running_mean, self.running_var, self.weight,
                              self.bias, self.training, factor, self.eps, r_max, d_max)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, r_max={self.r_max}, d_max={self.d_max}, "
                f"warmup_steps={self.warmup_steps}, r_max_steps={self.r_max_steps}, "
                f"d_max_steps={self.d_max_steps}")


_BRN_DOC = r"""Batch Renormalization over a {ndim}D input ``(N, C{spatial})`` (Ioffe, 2017).

    .. math::
        y = \gamma \cdot \Big(\frac{{x - \mu_B}}{{\sigma_B}} \cdot r + d\Big) + \beta,\quad
        r = \mathrm{{clip}}_{{[1/r_{{max}}, r_{{max}}]}}\Big(\frac{{\sigma_B}}{{\sigma}}\Big),\quad
        d = \mathrm{{clip}}_{{[-d_{{max}}, d_{{max}}]}}\Big(\frac{{\mu_B - \mu}}{{\sigma}}\Big)

    BatchNorm normalizes with the statistics of the batch (:math:`\mu_B` and the *biased*
    :math:`\sigma_B^2 + \epsilon`, per channel over N{over}), which are noise when
    batches are small or correlated, and differ from the running statistics it uses in
    eval. Batch Renormalization corrects them toward the running ones
    (:math:`\mu` = ``running_mean``, :math:`\sigma = \sqrt{{\texttt{{running\_var}} + \epsilon}}`)
    by ``r`` and ``d``, treated as constants in the backward. Unclipped, the training
    output would be the eval output; ``r_max = 1, d_max = 0`` is BatchNorm. The running
    estimates are updated as BatchNorm's (``momentum``, variance stored *unbiased*), so
    the state_dict is a BatchNorm state_dict; the paper's moving average of
    :math:`\sigma` is replaced by torch's of the variance. In eval it is BatchNorm with
    the running estimates.

    Warm-up: running estimates start at (0, 1), far from the data, so the clipping
    limits grow with training, counted by ``num_batches_tracked``: ``(r_max, d_max) =
    (1, 0)`` for the first ``warmup_steps`` batches, then each rises linearly to its
    final value over ``r_max_steps`` and ``d_max_steps`` batches. The defaults are the
    paper's (5000 steps, then ``r_max`` 1 -> 3 over 40k and ``d_max`` 0 -> 5 over 25k);
    scale them to the length of your training. ``limits(step)`` gives the values in
    force at a step.

    Args:
        num_features: C, the number of channels.
        eps: added to the variance inside the square root. Default: 1e-5.
        momentum: weight of the new batch in the running estimates, or None. Default: 0.1.
        affine: learnable per-channel weight (init 1) and bias (init 0). Default: True.
        track_running_stats: must be True (kept for BatchNorm's signature).
        bias: with ``affine``, whether to learn the bias (keyword-only). Default: True.
        r_max, d_max: final clipping limits (keyword-only). Default: 3.0, 5.0.
        warmup_steps, r_max_steps, d_max_steps: the warm-up schedule above
            (keyword-only). Default: 5000, 40000, 25000.

    Shape:
        Input and output: ``{shape}``.

    Example::

        >>> m = {name}(3, warmup_steps=100, r_max_steps=1000, d_max_steps=500)
        >>> y = m(torch.randn({example}))
        >>> m.limits(600)
        (2.0, 5.0)
"""


class BatchRenorm1d(_BatchRenorm):
    __doc__ = _BRN_DOC.format(name="BatchRenorm1d", **DIM_DOC[1])
    _accepted_dims = (2, 3)


class BatchRenorm2d(_BatchRenorm):
    __doc__ = _BRN_DOC.format(name="BatchRenorm2d", **DIM_DOC[2])
    _accepted_dims = (4,)


class BatchRenorm3d(_BatchRenorm):
    __doc__ = _BRN_DOC.format(name="BatchRenorm3d", **DIM_DOC[3])
    _accepted_dims = (5,)
