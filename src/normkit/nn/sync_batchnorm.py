"""SyncBatchNorm: BatchNorm whose training statistics cover the batches of every rank."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import fx, nn

from normkit import functional as F
from normkit import ops
from normkit.backends import torch_ops
from normkit.nn._base import fx_leaf
from normkit.nn._sync import sync_batch_norm
from normkit.nn.batch_renorm import _BatchRenorm
from normkit.nn.batchnorm import _BatchNorm

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm, nn.modules.batchnorm._BatchNorm):
    r"""Batch normalization over the global batch of a process group (Ioffe & Szegedy,
    2015), on any ``torch.distributed`` backend -- gloo on CPU included.

    .. math:: y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} * \gamma + \beta

    In training, mean and *biased* variance are taken per channel over N and all spatial
    positions of the inputs of *all* ranks of ``process_group``, exactly as a
    single-process BatchNorm over their concatenation: each rank's ``(count, mean, M2)``
    is all-gathered and merged with the Chan update (``normkit.stats.merge_moments``),
    and the two reductions of the backward are all-reduced (see ``normkit.nn._sync``).
    Ranks may hold different batch sizes, zero included. The running estimates are
    updated with the global mean and the global *unbiased* variance, the same on every
    rank. In eval the running estimates normalize and nothing is communicated.

    Without synchronization -- eval mode, ``torch.distributed`` not initialized, or a
    group of one rank -- it is plain BatchNorm, as ``torch.nn.SyncBatchNorm``. Unlike
    torch's, it accepts CPU tensors, and it raises a ``ValueError`` in training when a
    multi-rank run is expected (a ``process_group`` was given, or the ``WORLD_SIZE``
    environment variable set by ``torchrun`` is above 1) but ``init_process_group`` was
    never called, instead of silently normalizing each rank's batch alone.

    Every rank of the group must run the forward (and, when the input requires a
    gradient, the backward) of every SyncBatchNorm layer in the same order, also a rank
    whose batch is empty. ``weight`` and ``bias`` gradients are each rank's share;
    DistributedDataParallel averages them as for any other layer.

    Args:
        num_features: C from an input of size ``(N, C, *)``.
        eps: added to the variance inside the square root. Default: 1e-5.
        momentum: weight of the new batch in the running estimates, or None for a
            cumulative average. Default: 0.1.
        affine: learnable per-channel weight (init 1) and bias (init 0). Default: True.
        track_running_stats: keep running estimates for eval. Default: True.
        process_group: the ranks whose batches are normalized together. Default: None,
            the whole world.
        bias: with ``affine``, whether to learn the bias (keyword-only). Default: True.
        activation, negative_slope: an activation applied to the output, as
            ``BatchNorm2d``'s (keyword-only; after the synchronized normalization,
            not fused into it). Default: None.

    Shape:
        Input and output: ``(N, C, *)``, at least 2D.

    Example::

        >>> m = SyncBatchNorm(3)             # plain BatchNorm until a group is initialized
        >>> y = m(torch.randn(8, 3, 5, 5))
        >>> net = SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(
        ...     torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)))
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_group=None, device=None, dtype=None, *,
                 bias=True, activation=None, negative_slope=0.01):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype, bias=bias, activation=activation,
                         negative_slope=negative_slope)
        self.process_group = process_group

    def _check_input_dim(self, input) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, *) (got {input.dim()}D input "
                             f"of size {list(input.shape)}) for SyncBatchNorm; add a batch "
                             f"dim with unsqueeze(0)")
        if input.shape[1] == 0:
            raise ValueError(f"SyncBatchNorm needs at least one channel at dim 1, got input "
                             f"of size {list(input.shape)}")

    def _sync_group(self):
        """``(process_group, world_size)`` to synchronize over in this training step, or
        ``None`` when there is nothing to synchronize with."""
        if not (dist.is_available() and dist.is_initialized()):
            expected = os.environ.get("WORLD_SIZE", "1")
            if self.process_group is not None or (expected.isdigit() and int(expected) > 1):
                raise ValueError(
                    f"SyncBatchNorm is training in a multi-process run (process_group="
                    f"{self.process_group!r}, WORLD_SIZE={expected}) but torch.distributed "
                    f"is not initialized; call torch.distributed.init_process_group(...) "
                    f"in every process before the first forward")
            return None
        group = dist.group.WORLD if self.process_group is None else self.process_group
        world_size = dist.get_world_size(group)
        return (group, world_size) if world_size > 1 else None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if isinstance(input, fx.Proxy):          # torch.fx traces: one call_module node
            return fx_leaf(self, input)
        self._check_input_dim(input)
        factor = self._exponential_average_factor()
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None
        sync = self._sync_group() if self.training else None
        act = self.__dict__.get("_act")
        if sync is None and act is not None:
            return F.batch_norm_act(input, running_mean, running_var, self.weight, self.bias,
                                    use_batch_stats, factor, self.eps, activation=act.name,
                                    negative_slope=act.slope)
        if sync is None:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                use_batch_stats, factor, self.eps)
        if ops.tracing():
            raise ValueError(
                f"{type(self).__name__} cannot be traced by torch.compile / torch.export while "
                f"it synchronizes {sync[1]} ranks (its collectives run outside the graph); "
                f"compile or export the model in eval mode, or before "
                f"init_process_group, where it is plain BatchNorm")
        group, world_size = sync
        y = sync_batch_norm(input, running_mean, running_var, self.weight, self.bias, factor,
                            self.eps, group, world_size)
        return y if act is None else torch_ops.activate(y, act)    # (after, not fused)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group=None) -> nn.Module:
        """Replace every BatchNorm layer in ``module`` -- ``torch.nn.BatchNorm1d/2d/3d``
        (and their subclasses, ``torch.nn.SyncBatchNorm`` included) and normkit's
        ``BatchNorm1d/2d/3d`` -- by a normkit ``SyncBatchNorm`` over ``process_group``.

        The new layers take over the same parameter and buffer objects (values,
        ``requires_grad``, device and dtype kept) and the ``training`` flag. Returns
        ``module`` with its children converted, or a new layer if ``module`` itself is a
        BatchNorm. BatchRenorm layers are left as they are: their statistics are not
        BatchNorm's.

        Example::

            >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
            >>> net = SyncBatchNorm.convert_sync_batchnorm(net)
            >>> type(net[1]).__name__
            'SyncBatchNorm'
        """
        out = module
        is_bn = isinstance(module, (nn.modules.batchnorm._BatchNorm, _BatchNorm))
        if is_bn and not isinstance(module, _BatchRenorm):
            ref = next((t for t in (module.weight, module.running_mean) if t is not None), None)
            act = module.__dict__.get("_act")          # (normkit's: a fused activation)
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, process_group,
                      device=None if ref is None else ref.device,
                      dtype=None if ref is None else ref.dtype,
                      bias=module.bias is not None,
                      activation=None if act is None else act.name,
                      negative_slope=act.slope if act is not None and
                      act.name == "leaky_relu" else 0.01)
            if "_normkit_fused_activation" in module.__dict__:   # (revert gives it back)
                out.__dict__["_normkit_fused_activation"] = True
            if module.affine:
                out.weight = module.weight
                out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return out
