"""Which numbers share one mean and variance: the single description every method uses.

A normalization sees its input ``x`` through a *view* (a reshape that never copies a
contiguous or channels_last tensor), reduces the view over ``reduce`` dims to get one
statistic per group, and scales by parameters laid out as ``param_view`` (a shape that
broadcasts against the view). The table of ``docs/architecture.md`` in code:

==============  ==========================  ============  ====================
method          view of x                   reduce        param_view
==============  ==========================  ============  ====================
batch_norm      (N, C, S)                   (0, 2)        (1, C, 1)
instance_norm   (N, C, S)                   (2,)          (1, C, 1)
group_norm      (N, G, C/G, S)              (2, 3)        (1, G, C/G, 1)
layer_norm      (M, K)                      (1,)          (1, K)
rms_norm        (M, K), no centering        (1,)          (1, K)
normalize       x.shape                     any dims      weight as given
==============  ==========================  ============  ====================

``S`` is the product of the spatial sizes, ``K`` that of ``normalized_shape`` and ``M``
the product of the leading dims. GroupNorm with G = 1 is LayerNorm over (C, *S) with a
per-channel affine; with G = C it is InstanceNorm -- here that is literally the same
view with a different split of C.

This module is pure Python: shapes in, shapes out.
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = ["Grouping", "batch", "instance", "group", "layer", "dims", "view_strides"]


class Grouping(NamedTuple):
    """How an input is grouped for statistics (a named tuple: built and hashed on every
    call, and as a tuple that costs a third of what a frozen dataclass does).

    Attributes
    ----------
    kind : str
        ``"batch"``, ``"instance"``, ``"group"``, ``"layer"`` or ``"dims"``.
    view : tuple of int
        Shape the input is viewed as.
    reduce : tuple of int
        Dims of the view that one statistic is taken over.
    param_view : tuple of int or None
        Shape that weight and bias are viewed as to broadcast against the view
        (``None``: use them as given).
    """

    kind: str
    view: tuple
    reduce: tuple
    param_view: tuple | None

    @property
    def group_size(self) -> int:
        """Number of elements that share one statistic."""
        return math.prod([self.view[d] for d in self.reduce])  # a list: torch.compile traces it

    @property
    def stat_shape(self) -> tuple:
        """Shape of the statistics (the view with the reduced dims kept as 1)."""
        return tuple([1 if d in self.reduce else s for d, s in enumerate(self.view)])

    @property
    def param_reduce(self) -> tuple:
        """Dims of the view to sum over for the weight and bias gradients."""
        if self.param_view is None:
            return tuple(range(len(self.view)))
        return tuple([d for d, s in enumerate(self.param_view) if s == 1 and self.view[d] != 1])


def batch(shape) -> Grouping:
    """BatchNorm: one statistic per channel, over the batch and all spatial positions."""
    n, c = shape[0], shape[1]
    return Grouping("batch", (n, c, math.prod(shape[2:])), (0, 2), (1, c, 1))


def instance(shape) -> Grouping:
    """InstanceNorm: one statistic per (sample, channel), over the spatial positions."""
    n, c = shape[0], shape[1]
    return Grouping("instance", (n, c, math.prod(shape[2:])), (2,), (1, c, 1))


def group(shape, num_groups: int) -> Grouping:
    """GroupNorm: one statistic per (sample, group of C/G channels), over those channels
    and all spatial positions."""
    n, c = shape[0], shape[1]
    cg = c // num_groups
    return Grouping("group", (n, num_groups, cg, math.prod(shape[2:])), (2, 3),
                    (1, num_groups, cg, 1))


def layer(shape, normalized_ndim: int) -> Grouping:
    """LayerNorm / RMSNorm: one statistic per row of the last ``normalized_ndim`` dims."""
    k = math.prod(shape[len(shape) - normalized_ndim:])
    m = math.prod(shape[: len(shape) - normalized_ndim])
    return Grouping("layer", (m, k), (1,), (1, k))


def dims(shape, reduce_dims) -> Grouping:
    """Any set of dims (``normkit.functional.normalize``); parameters broadcast as given."""
    ndim = len(shape)
    red = sorted({d % ndim for d in reduce_dims}) if ndim else []
    return Grouping("dims", tuple(shape), tuple(red), None)


def view_strides(sizes, strides, shape):
    """The strides of ``shape`` viewing memory of ``sizes`` and ``strides`` without a copy,
    or None where no view can (``Tensor.view`` would raise): torch's own rule, runs of
    dims that are one block of memory split or merged, written out so that a caller
    asks instead of catching the error."""
    if math.prod(sizes) == 0 or not sizes:
        out, step = [], 1
        for s in reversed(shape):
            out.append(step)
            step *= max(s, 1)
        return tuple(reversed(out))
    new = [0] * len(shape)
    view_d = len(shape) - 1
    base = strides[-1]               # the stride of the run of memory being matched
    tensor_numel = view_numel = 1
    for d in range(len(sizes) - 1, -1, -1):
        tensor_numel *= sizes[d]
        if d == 0 or (sizes[d - 1] != 1 and strides[d - 1] != tensor_numel * base):
            while view_d >= 0 and (view_numel < tensor_numel or shape[view_d] == 1):
                new[view_d] = view_numel * base
                view_numel *= shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if d > 0:
                base = strides[d - 1]
                tensor_numel = view_numel = 1
    return tuple(new) if view_d == -1 else None
