"""The study's network: one small CNN, with the normalization layer as the only variable.

``make_norm`` is the one place that maps a method name to a layer. It takes the layers
from ``normkit.nn`` when that module provides them (same constructor signatures as
``torch.nn``) and otherwise from ``torch.nn``; :func:`layer_source` says which, and the
study records it in ``results.json``.

Architecture, for 1 x 8 x 8 digits (shapes per sample)::

    conv 3x3, 1 -> 16     16 x 8 x 8    norm, ReLU
    conv 3x3, 16 -> 32    32 x 8 x 8    norm, ReLU, max-pool 2
    conv 3x3, 32 -> 64    64 x 4 x 4    norm, ReLU, max-pool 2
    conv 3x3, 64 -> 64    64 x 2 x 2    norm, ReLU
    global average pool   64
    linear 64 -> 10

The last block works on 2 x 2 maps on purpose: BatchNorm's statistic for one channel there
comes from ``4 * N`` numbers, so a batch of two images gives eight -- the regime in which
the GroupNorm paper sees BatchNorm fail (7 x 7 maps at two images per GPU in ResNet-50).

How each method normalizes a (N, C, H, W) activation here:

============  ==============================================  ==================
method        layer                                            one statistic per
============  ==============================================  ==================
none          identity (the convolutions keep their bias)      --
batch         ``BatchNorm2d(C)``                               channel, over N, H, W
batchrenorm   ``BatchRenorm2d(C, ...)`` (if normkit.nn has it)  channel, over N, H, W
group         ``GroupNorm(min(8, C), C)``                       sample x group of C/8
layer         ``LayerNorm([C, H, W])``                          sample, over C, H, W
instance      ``InstanceNorm2d(C, affine=True)``                sample x channel
rms           ``RMSNorm([C, H, W])``                            sample, over C, H, W
============  ==============================================  ==================

LayerNorm and RMSNorm take ``normalized_shape = (C, H, W)``: that is the LayerNorm paper's
definition (all hidden units of a layer, per sample) and what ``torch.nn.LayerNorm`` does
when given the trailing three dims; its affine is per element (C * H * W weights). The
GroupNorm paper's "LN" baseline is instead GroupNorm with one group (per-channel affine);
the two share the same statistics and differ only in the affine. InstanceNorm gets
``affine=True`` so that every method has a learnable scale and shift.

BatchRenorm's clipping limits grow during training (``r_max`` 1 -> 3, ``d_max`` 0 -> 5,
Ioffe 2017). Its defaults are the paper's step counts (5000 steps of plain BatchNorm, then
ramps over 40k and 25k steps), longer than any run here, which would make it BatchNorm for
the whole run; the study scales them to the run: plain BatchNorm for the first 1/8 of the
steps, then both limits ramp up over the next 1/4, and stay at their final values for the
last 5/8.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["METHODS", "available_methods", "layer_source", "make_norm", "renorm_schedule", "SmallCNN"]

# order used in tables and plots
METHODS = ("none", "batch", "batchrenorm", "group", "layer", "instance", "rms")

_NEEDED = ("BatchNorm2d", "GroupNorm", "LayerNorm", "InstanceNorm2d", "RMSNorm")
GROUPS = 8  # GroupNorm's number of groups (capped at C)


def _normkit_nn():
    """``normkit.nn`` if it is importable and has every layer the study needs, else None."""
    try:
        import normkit.nn as nk
    except Exception:  # an unfinished normkit.nn must not break the study
        return None
    return nk if all(hasattr(nk, name) for name in _NEEDED) else None


def layer_source() -> str:
    """``"normkit.nn"`` or ``"torch.nn"``: where :func:`make_norm` takes its layers from."""
    return "normkit.nn" if _normkit_nn() is not None else "torch.nn"


def available_methods() -> tuple:
    """The methods this installation can train: BatchRenorm only once normkit.nn has it."""
    nk = _normkit_nn()
    has_renorm = nk is not None and hasattr(nk, "BatchRenorm2d")
    return tuple(m for m in METHODS if m != "batchrenorm" or has_renorm)


def renorm_schedule(total_steps: int) -> dict:
    """BatchRenorm's warm-up scaled to a run of ``total_steps`` (see the module docstring)."""
    ramp = max(1, total_steps // 4)
    return dict(warmup_steps=total_steps // 8, r_max_steps=ramp, d_max_steps=ramp)


def make_norm(method: str, channels: int, spatial: tuple, total_steps: int = 1000) -> nn.Module:
    """The normalization layer for ``method`` after a convolution with ``channels`` output
    channels and output size ``spatial = (H, W)``; ``total_steps`` (the run's length) only
    sets BatchRenorm's warm-up."""
    lib = _normkit_nn() or nn
    if method == "none":
        return nn.Identity()
    if method == "batch":
        return lib.BatchNorm2d(channels)
    if method == "batchrenorm":
        nk = _normkit_nn()
        if nk is None or not hasattr(nk, "BatchRenorm2d"):
            raise ValueError("method 'batchrenorm' needs normkit.nn.BatchRenorm2d, which this "
                             "installation does not have; leave it out of --methods")
        return nk.BatchRenorm2d(channels, **renorm_schedule(total_steps))
    if method == "group":
        return lib.GroupNorm(min(GROUPS, channels), channels)
    if method == "layer":
        return lib.LayerNorm([channels, *spatial])
    if method == "instance":
        return lib.InstanceNorm2d(channels, affine=True)
    if method == "rms":
        return lib.RMSNorm([channels, *spatial])
    raise ValueError(f"unknown normalization method {method!r}; choose from {', '.join(METHODS)}")


class SmallCNN(nn.Module):
    """Four 3x3 convolutions, each followed by ``make_norm(method, ...)`` and ReLU."""

    def __init__(self, method: str, n_classes: int = 10, in_channels: int = 1, size: int = 8,
                 total_steps: int = 1000):
        super().__init__()
        self.method = method
        # a convolution followed by a centering norm has a redundant bias; RMSNorm does not
        # center and has no bias of its own, so it keeps the convolution's
        conv_bias = method in ("none", "rms")
        blocks = []
        # (out channels, spatial size of the conv output, pool after)
        plan = [(16, size, False), (32, size, True), (64, size // 2, True), (64, size // 4, False)]
        c_in = in_channels
        for c_out, s, pool in plan:
            blocks += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=conv_bias),
                       make_norm(method, c_out, (s, s), total_steps), nn.ReLU()]
            if pool:
                blocks.append(nn.MaxPool2d(2))
            c_in = c_out
        self.features = nn.Sequential(*blocks)
        self.head = nn.Linear(c_in, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)                # N,64,2,2
        return self.head(h.mean(dim=(2, 3)))  # N,10
