"""BatchNorm's running statistics, updated in one jitted loop for both buffers.

``running = (1 - momentum) * running + momentum * value`` in the buffers' dtype, with the
variance's value unbiased first (``var * unbias``, ``unbias = n / (n - 1)``): the same
operations, in the same order, as the torch ops of ``normkit.backends.torch_ops``, in one
call instead of four small tensor ops.
"""

from __future__ import annotations

from numba import njit

from normkit.backends.cpu.rows import JIT

__all__ = ["running_update"]


@njit(**JIT)
def running_update(running, values, keep, momentum, unbias, scratch):
    """running = (running, value) pairs of (C,) arrays; running = running * keep (rounded
    to the buffer's dtype), then += momentum * value; the scalars are of the buffers'
    dtype, ``scratch`` a (C,) array of it for the unbiased variance."""
    running_mean, running_var = running
    mean, var = values
    for c in range(running_mean.shape[0]):
        scratch[c] = var[c] * unbias                               # rounded, as torch's
        running_mean[c] *= keep
        running_mean[c] += momentum * mean[c]
        running_var[c] *= keep
        running_var[c] += momentum * scratch[c]
