"""Layers with ``torch.nn``'s exact constructor signatures, defaults, attributes and
state_dict keys, running normkit's functional ops."""

try:
    from normkit.nn.batch_renorm import BatchRenorm1d, BatchRenorm2d, BatchRenorm3d
except ModuleNotFoundError as error:   # (an optional dependency)
    from normkit._extras import needs

    raise needs(error, "normkit.nn") from None

from normkit.nn.batchnorm import BatchNorm1d, BatchNorm2d, BatchNorm3d
from normkit.nn.instancenorm import InstanceNorm1d, InstanceNorm2d, InstanceNorm3d
from normkit.nn.normalization import GroupNorm, LayerNorm, RMSNorm
from normkit.nn.sync_batchnorm import SyncBatchNorm

__all__ = [
    "BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
    "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d",
    "LayerNorm", "GroupNorm", "RMSNorm",
    "SyncBatchNorm", "BatchRenorm1d", "BatchRenorm2d", "BatchRenorm3d",
]
