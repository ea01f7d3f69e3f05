"""The study's networks: small CNNs, with the normalization layer as the only variable.

``make_norm`` is the one place that maps a method name to a layer. The layers are
``normkit.nn``'s -- the study exists to run normkit's own layers; if ``normkit.nn`` cannot
be imported the study fails with that error instead of quietly training ``torch.nn``.

Two networks, one per dataset (shapes per sample)::

    Conv1dNet, MNIST-1D 1 x 40             SmallCNN, digits 1 x 8 x 8
    conv k5, 1 -> 32     32 x 40   norm    conv 3x3, 1 -> 16     16 x 8 x 8   norm
    conv k3/2, 32 -> 32  32 x 20   norm    conv 3x3, 16 -> 32    32 x 8 x 8   norm, max-pool
    conv k3/2, 32 -> 32  32 x 10   norm    conv 3x3, 32 -> 64    64 x 4 x 4   norm, max-pool
    global average pool, linear 32 -> 10   conv 3x3, 64 -> 64    64 x 2 x 2   norm
                                           global average pool, linear 64 -> 10

each norm followed by ReLU. In both, BatchNorm's statistic for one channel in the last
block comes from few numbers per image (10 positions, 4 pixels), so a batch of two gives
20 or 8 -- the regime in which the GroupNorm paper sees BatchNorm fail (7 x 7 maps at two
images per GPU in ResNet-50).

How each method normalizes an activation of shape (N, C, *S), S = (L,) or (H, W):

============  ==============================================  ==================
method        layer                                            one statistic per
============  ==============================================  ==================
none          identity (the convolutions keep their bias)      --
batch         ``BatchNorm1d/2d(C)``                            channel, over N, S
batchrenorm   ``BatchRenorm1d/2d(C, ...)``                     channel, over N, S
group         ``GroupNorm(min(8, C), C)``                       sample x group of C/8
layer         ``LayerNorm([C, *S])``                            sample, over C, S
instance      ``InstanceNorm1d/2d(C, affine=True)``             sample x channel
rms           ``RMSNorm([C, *S])``                              sample, over C, S
============  ==============================================  ==================

LayerNorm and RMSNorm take ``normalized_shape = (C, *S)``: that is the LayerNorm paper's
definition (all hidden units of a layer, per sample) and what ``torch.nn.LayerNorm`` does
when given the trailing dims; its affine is per element. The GroupNorm paper's "LN"
baseline is instead GroupNorm with one group (per-channel affine); the two share the same
statistics and differ only in the affine. InstanceNorm gets ``affine=True`` so that every
method has a learnable scale and shift.

BatchRenorm's clipping limits grow during training (``r_max`` 1 -> 3, ``d_max`` 0 -> 5,
Ioffe 2017). Its defaults are the paper's step counts (5000 steps of plain BatchNorm, then
ramps over 40k and 25k steps), longer than most runs here, which would make it BatchNorm
for the whole run; the study scales them to the run: plain BatchNorm for the first 1/8 of
the steps, then both limits ramp up over the next 1/4, and stay at their final values for
the last 5/8.
"""

from __future__ import annotations

import torch
from torch import nn

import normkit.nn as nk

__all__ = ["METHODS", "BATCH_DEPENDENT", "GROUPS", "available_methods", "layer_source", "make_norm",
           "renorm_schedule", "build_model", "Conv1dNet", "SmallCNN"]

# order used in tables and plots
METHODS = ("none", "batch", "batchrenorm", "group", "layer", "instance", "rms")
# methods whose output for one sample depends on the other samples of its batch
BATCH_DEPENDENT = ("batch", "batchrenorm")
GROUPS = 8  # GroupNorm's number of groups (capped at C)


def layer_source() -> str:
    """Where :func:`make_norm` takes its layers from (recorded in results.json)."""
    return nk.__name__


def available_methods() -> tuple:
    """The methods the study can train (every one of :data:`METHODS`)."""
    return METHODS


def renorm_schedule(total_steps: int) -> dict:
    """BatchRenorm's warm-up scaled to a run of ``total_steps`` (see the module docstring)."""
    ramp = max(1, total_steps // 4)
    return dict(warmup_steps=total_steps // 8, r_max_steps=ramp, d_max_steps=ramp)


def make_norm(method: str, channels: int, spatial: tuple, total_steps: int = 1000) -> nn.Module:
    """The normalization layer for ``method`` after a convolution with ``channels`` output
    channels and output size ``spatial`` (``(L,)`` or ``(H, W)``); ``total_steps`` (the
    run's length) only sets BatchRenorm's warm-up."""
    spatial = tuple(spatial)
    if len(spatial) not in (1, 2):
        raise ValueError(f"spatial must be (L,) or (H, W), got {spatial}")
    d = f"{len(spatial)}d"
    if method == "none":
        return nn.Identity()
    if method == "batch":
        return getattr(nk, f"BatchNorm{d}")(channels)
    if method == "batchrenorm":
        return getattr(nk, f"BatchRenorm{d}")(channels, **renorm_schedule(total_steps))
    if method == "group":
        return nk.GroupNorm(min(GROUPS, channels), channels)
    if method == "layer":
        return nk.LayerNorm([channels, *spatial])
    if method == "instance":
        return getattr(nk, f"InstanceNorm{d}")(channels, affine=True)
    if method == "rms":
        return nk.RMSNorm([channels, *spatial])
    raise ValueError(f"unknown normalization method {method!r}; choose from {', '.join(METHODS)}")


def _conv_bias(method: str) -> bool:
    # a convolution followed by a centering norm has a redundant bias; RMSNorm does not
    # center and has no bias of its own, so it keeps the convolution's
    return method in ("none", "rms")


class Conv1dNet(nn.Module):
    """Three 1-D convolutions (k5; k3 stride 2; k3 stride 2; 32 channels), each followed by
    ``make_norm(method, ...)`` and ReLU; global average pooling and a linear layer.

    With ``keep_pre_activation = True`` each forward stores the input of the last ReLU --
    the normalized activation, or the convolution's output without normalization -- in
    ``pre_activation`` (N, 32, L/4): the layer whose distribution the study follows over
    training."""

    WIDTH = 32

    def __init__(self, method: str, n_classes: int = 10, in_channels: int = 1, length: int = 40,
                 total_steps: int = 1000):
        super().__init__()
        self.method = method
        w, bias = self.WIDTH, _conv_bias(method)
        l1, l2, l3 = length, (length + 1) // 2, (length + 3) // 4
        self.conv1 = nn.Conv1d(in_channels, w, 5, padding=2, bias=bias)
        self.norm1 = make_norm(method, w, (l1,), total_steps)
        self.conv2 = nn.Conv1d(w, w, 3, stride=2, padding=1, bias=bias)
        self.norm2 = make_norm(method, w, (l2,), total_steps)
        self.conv3 = nn.Conv1d(w, w, 3, stride=2, padding=1, bias=bias)
        self.norm3 = make_norm(method, w, (l3,), total_steps)
        self.head = nn.Linear(w, n_classes)
        self.keep_pre_activation = False
        self.pre_activation = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm1(self.conv1(x)))  # N,32,L
        h = torch.relu(self.norm2(self.conv2(h)))  # N,32,L/2
        z = self.norm3(self.conv3(h))              # N,32,L/4
        if self.keep_pre_activation:
            self.pre_activation = z.detach()
        return self.head(torch.relu(z).mean(dim=2))  # N,10


class SmallCNN(nn.Module):
    """Four 3x3 convolutions, each followed by ``make_norm(method, ...)`` and ReLU."""

    def __init__(self, method: str, n_classes: int = 10, in_channels: int = 1, size: int = 8,
                 total_steps: int = 1000):
        super().__init__()
        self.method = method
        blocks = []
        # (out channels, spatial size of the conv output, pool after)
        plan = [(16, size, False), (32, size, True), (64, size // 2, True), (64, size // 4, False)]
        c_in = in_channels
        for c_out, s, pool in plan:
            blocks += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=_conv_bias(method)),
                       make_norm(method, c_out, (s, s), total_steps), nn.ReLU()]
            if pool:
                blocks.append(nn.MaxPool2d(2))
            c_in = c_out
        self.features = nn.Sequential(*blocks)
        self.head = nn.Linear(c_in, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)                # N,64,2,2
        return self.head(h.mean(dim=(2, 3)))  # N,10


def build_model(method: str, spatial: tuple, n_classes: int, total_steps: int) -> nn.Module:
    """The study's CNN for inputs of one channel of size ``spatial``: :class:`Conv1dNet`
    for signals ``(L,)``, :class:`SmallCNN` for square images ``(H, W)``."""
    if len(spatial) == 1:
        return Conv1dNet(method, n_classes, length=spatial[0], total_steps=total_steps)
    return SmallCNN(method, n_classes, size=spatial[0], total_steps=total_steps)
