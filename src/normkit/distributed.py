r"""Batch normalization over the global batch of every rank of a process group.

One rank sees ``n_r`` values of each channel; the statistics have to be those of all
``n = sum(n_r)`` values, as if the batches of every rank were concatenated. Two
collectives per training step do it, on any ``torch.distributed`` backend (gloo on CPU,
nccl on CUDA, ...):

Forward: one all-gather of the per-rank moments
    Each rank packs ``(n_r, mean_r, m2_r)`` (``m2 = sum((x - mean)**2)``, per channel) into
    one float64 vector of ``1 + 2C`` numbers. After the all-gather every rank merges the
    ``W`` triples with ``normkit.stats.merge_moments`` (Chan, Golub & LeVeque), pairwise in
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
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from normkit import grouping as G
from normkit.autograd import _view
from normkit.backends import torch_ops
from normkit.functional import _update_running
from normkit.stats import merge_moments

__all__ = ["gather_moments", "merge_rank_moments", "sync_batch_norm", "SyncBatchNormFunction"]

_COMM_DTYPE = torch.float64


def merge_rank_moments(count, mean, m2):
    """Merge per-rank moments stacked along dim 0 into the moments of their union.

    ``count`` has shape ``(W, 1)``, ``mean`` and ``m2`` ``(W, C)``. Rows are merged in
    pairs with ``normkit.stats.merge_moments`` (row ``i`` with row ``i + W // 2``) until
    one is left; an odd row out waits for the next round. Returns ``(count, mean, m2)``
    of shapes ``(1,)``, ``(C,)``, ``(C,)``.
    """
    while count.shape[0] > 1:
        half = count.shape[0] // 2
        lo, hi = slice(0, half), slice(half, 2 * half)
        merged = merge_moments(count[lo], mean[lo], m2[lo], count[hi], mean[hi], m2[hi])
        if count.shape[0] % 2:                                  # odd row out: carry it
            merged = tuple(torch.cat([t, src[-1:]]) for t, src in zip(merged, (count, mean, m2)))
        count, mean, m2 = merged
    return count[0], mean[0], m2[0]


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
    n, mean_all, m2_all = merge_rank_moments(table[:, :1], table[:, 1:1 + c], table[:, 1 + c:])
    return float(n), mean_all, m2_all


class SyncBatchNormFunction(torch.autograd.Function):
    """Batch normalization with statistics merged across the ranks of ``process_group``.

    ``forward(x, weight, bias, running_mean, running_var, eps, momentum, process_group,
    world_size) -> y``; the running statistics, if given, are updated in place with the
    global mean and the global unbiased variance (``var * n / (n - 1)``, ``n`` the global
    count). Every rank must call it (a rank with no samples too), in the same order.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum,
                process_group, world_size):
        grouping = G.batch(x.shape)
        c = x.shape[1]
        sdtype = torch_ops.stat_dtype(x.dtype)
        xv = _view(x, grouping.view)                                    # N, C, S
        n_local = grouping.group_size
        if n_local > 0:
            var, mean = torch.var_mean(xv.to(sdtype), dim=grouping.reduce, correction=0)  # C
            m2 = var * n_local
        else:                                  # no samples here: an exact no-op of the merge
            mean = m2 = torch.zeros(c, dtype=sdtype, device=x.device)
        n, mean64, m264 = gather_moments(n_local, mean, m2, process_group, world_size)
        if n <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel across all ranks when training, got "
                f"{n:.0f} in total (input size on this rank {list(x.shape)}); use larger "
                f"batches, eval mode, or a batch-independent norm (GroupNorm, LayerNorm)")
        var64 = m264 / n                                                # biased, C
        mean = mean64.to(sdtype).view(grouping.stat_shape)              # 1, C, 1
        rstd = torch.rsqrt(var64 + eps).to(sdtype).view(grouping.stat_shape)
        y, _, _, _ = torch_ops.forward(xv, grouping, weight, bias, eps, True, mean, rstd)
        if running_mean is not None:
            _update_running(running_mean, mean64, momentum)
            _update_running(running_var, var64 * (n / (n - 1)), momentum)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.count, ctx.process_group = n, process_group
        ctx.bias_dtype = None if bias is None else bias.dtype
        return _view(y, x.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x, weight, mean, rstd = ctx.saved_tensors
        grouping = G.batch(x.shape)
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        sdtype = mean.dtype
        g = grad_y.reshape(grouping.view).to(sdtype)                    # N, C, S
        xhat = (_view(x, grouping.view).to(sdtype) - mean) * rstd        # N, C, S, recomputed
        red = grouping.reduce
        dx = dw = db = None
        if need_dx:
            w = torch_ops._param(weight, grouping, sdtype)              # 1, C, 1
            dxhat = g if w is None else g * w                           # N, C, S
            # the two reductions of the backward, local sums, then summed over the ranks
            sums = torch.cat([dxhat.sum(dim=red), (dxhat * xhat).sum(dim=red)])  # 2C
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=ctx.process_group)
            c2, c1 = (s.view(grouping.stat_shape) / ctx.count for s in sums.chunk(2))
            # term 1: direct path; term 2: through the mean; term 3: through the variance
            dx = ((dxhat - c2 - xhat * c1) * rstd).to(x.dtype)
            dx = _view(dx, x.shape)
        if need_dw and weight is not None:
            dw = (g * xhat).sum(dim=red).to(weight.dtype)               # this rank's share
        if need_db and ctx.bias_dtype is not None:
            db = g.sum(dim=red).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None, None, None


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
    return SyncBatchNormFunction.apply(input, weight, bias, running_mean, running_var, eps,
                                       momentum, process_group, world_size)
