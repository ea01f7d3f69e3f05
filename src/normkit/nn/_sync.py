r"""Batch normalization over the global batch of every rank of a process group.

One rank sees ``n_r`` values of each channel; the statistics have to be those of all
``n = sum(n_r)`` values, as if the batches of every rank were concatenated. Two
collectives per training step do it, on any ``torch.distributed`` backend (gloo on CPU,
nccl on CUDA, ...):

Forward: one all-gather of the per-rank moments
    Each rank packs ``(n_r, mean_r, m2_r)`` (``m2 = sum((x - mean)**2)``, per channel) into
    one float64 vector of ``1 + 2C`` numbers. After the all-gather every rank merges the
    ``W`` triples with ``normkit.stats.merge_rows`` (Chan, Golub & LeVeque), pairwise in
    a tree of ``ceil(log2 W)`` vectorized steps. Moments rather than sums: ranks with very
    different means merge without the cancellation of ``E[x**2] - E[x]**2``, and a rank
    with ``n_r = 0`` is an exact no-op of the merge. An all-reduce of sums cannot carry
    the counts and the deviations at once, hence the all-gather (its payload is tiny).
    The merge runs in float64 so that counts above 2**24 stay exact.

Backward: one all-reduce of the two reductions
    With ``xhat = (x - mean) * rstd`` and ``dxhat = g * weight`` the input gradient of
    ``normkit.reference`` is::

        dx = rstd * (dxhat - c2 - xhat * c1),  c2 = mean(dxhat),  c1 = mean(dxhat * xhat)

    where the means now run over the *global* batch. Each rank computes its local sums
    ``sum(dxhat)`` and ``sum(dxhat * xhat)``, one all-reduce (SUM) of both gives the
    global sums, and dividing by the global ``n`` gives ``c2`` and ``c1``. Summing the
    local contributions is exact because every rank normalizes with the same global
    ``mean`` and ``rstd``: the global loss is the sum of the ranks' losses, and its
    gradient with respect to the shared statistics is the sum of their partial ones.

    ``dweight = sum(g * xhat)`` and ``dbias = sum(g)`` stay local (the rank's share);
    DistributedDataParallel all-reduces parameter gradients as it does for every layer.

Saved for backward: the input, the weight, the global ``mean`` and ``rstd`` (fp32; fp64
for fp64 inputs) and the global count. ``xhat`` is recomputed.

Both directions go through normkit's dispatch and its one Python autograd Function for
norms, ``normkit.autograd.NormFunction``: the local moments and the normalization with
the global statistics run on the backend ``normkit.backends.select`` picks (the fused
kernels on CPU), and the backward is ``normkit.backends.torch_ops.backward`` -- the one
formula of every norm -- with the two sums all-reduced in the middle (``reduce_sums``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from normkit import backends
from normkit import grouping as G
from normkit.autograd import NormFunction, view_as
from normkit.functional import update_running
from normkit.stats import merge_rows

__all__ = ["gather_moments", "sync_batch_norm"]

_COMM_DTYPE = torch.float64


def gather_moments(count, mean, m2, process_group, world_size):
    """All-gather one rank's ``(count, mean, m2)`` (``count`` a Python number, ``mean`` and
    ``m2`` of shape ``(C,)``) and return the merged global ``(count, mean, m2)`` in
    float64: ``count`` a Python float, ``mean`` and ``m2`` of shape ``(C,)``."""
    c = mean.numel()
    packed = torch.cat([mean.new_full((1,), float(count), dtype=_COMM_DTYPE),
                        mean.to(_COMM_DTYPE), m2.to(_COMM_DTYPE)])       # 1 + 2C
    parts = [torch.empty_like(packed) for _ in range(world_size)]
    dist.all_gather(parts, packed, group=process_group)
    table = torch.stack(parts)                                          # W, 1 + 2C
    n, mean_all, m2_all = merge_rows(table[:, :1], table[:, 1:1 + c], table[:, 1 + c:])
    return float(n), mean_all, m2_all


def _sync_forward(x, weight, bias, running_mean, running_var, eps, momentum, process_group,
                  world_size):
    """``y`` of batch normalization with statistics merged across the ranks of
    ``process_group``, recorded by ``normkit.autograd.NormFunction`` with the backward's
    two sums all-reduced; the running statistics, if given, are updated in place with the
    global mean and the global unbiased variance (``var * n / (n - 1)``, ``n`` the global
    count). Every rank must call it (a rank with no samples too), in the same order."""
    grouping = G.batch(x.shape)
    xv = view_as(x, grouping.view)                                      # N, C, S
    n_local = grouping.group_size
    with torch.no_grad():
        mean, var = backends.group_moments(xv, grouping)                # 1, C, 1 each
    # a rank with no samples has zero moments: an exact no-op of the merge
    n, mean64, m264 = gather_moments(n_local, mean.reshape(-1), var.reshape(-1) * n_local,
                                     process_group, world_size)
    if n <= 1:
        raise ValueError(
            f"Expected more than 1 value per channel across all ranks when training, got "
            f"{n:.0f} in total (input size on this rank {list(x.shape)}); use larger "
            f"batches, eval mode, or a batch-independent norm (GroupNorm, LayerNorm)")
    var64 = m264 / n                                                    # biased, C
    mean = mean64.to(var.dtype).view(grouping.stat_shape)               # 1, C, 1
    rstd = torch.rsqrt(var64 + eps).to(var.dtype).view(grouping.stat_shape)
    if running_mean is not None:
        update_running(running_mean, running_var, mean64, var64, momentum, n / (n - 1))

    def global_means(sum_g, sum_gx):
        # the two reductions of the backward: local sums, summed over the ranks
        sums = torch.cat([sum_g.reshape(-1), sum_gx.reshape(-1)])       # 2C
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=process_group)
        return (s.view(grouping.stat_shape) / n for s in sums.chunk(2))

    return NormFunction.apply(x, weight, bias, (grouping, eps, True, mean, rstd, [], None,
                                                global_means))


def sync_batch_norm(input, running_mean, running_var, weight=None, bias=None, momentum=0.1,
                    eps=1e-5, process_group=None, world_size=None):
    r"""Training-mode batch normalization over the global batch of ``process_group``.

    .. math:: y = \gamma \cdot \frac{x - \mu_c}{\sqrt{\sigma_c^2 + \epsilon}} + \beta

    :math:`\mu_c` and the biased :math:`\sigma^2_c` are taken over N and all spatial
    positions of *every* rank's input; the running statistics, if given, are updated in
    place with the global mean and the global unbiased variance. Equivalent to
    ``normkit.functional.batch_norm(cat(inputs of all ranks), ..., training=True)`` on
    the slice of this rank. ``process_group=None`` is the default (world) group.
    """
    if process_group is None:
        process_group = dist.group.WORLD
    if world_size is None:
        world_size = dist.get_world_size(process_group)
    c = input.shape[1]
    for name, p in (("running_mean", running_mean), ("running_var", running_var),
                    ("weight", weight), ("bias", bias)):
        if p is not None and p.numel() != c:
            raise ValueError(f"{name} should contain {c} elements not {p.numel()} (input has "
                             f"{c} channels at dim 1)")
    return _sync_forward(input, weight, bias, running_mean, running_var, eps, momentum,
                         process_group, world_size)
