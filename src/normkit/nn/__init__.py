"""Layers with ``torch.nn``'s exact constructor signatures, defaults, attributes and
state_dict keys, running normkit's functional ops."""

from normkit.nn.batchnorm import BatchNorm1d, BatchNorm2d, BatchNorm3d
from normkit.nn.instancenorm import InstanceNorm1d, InstanceNorm2d, InstanceNorm3d
from normkit.nn.normalization import GroupNorm, LayerNorm, RMSNorm

__all__ = [
    "BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
    "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d",
    "LayerNorm", "GroupNorm", "RMSNorm",
]
