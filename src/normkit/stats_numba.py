"""Chan's merge of partial statistics as a numba function, for the jitted kernels.

The same rule as ``normkit.stats.merge_moments`` (Chan, Golub and LeVeque), written once for
code compiled by numba: the CPU kernels of ``normkit.backends.cpu`` and the scalers'
kernels of ``normkit.preprocessing._kernels``. This module imports numba and NumPy only,
never torch, so the scalers stay free of torch.
"""

from __future__ import annotations

from numba.extending import register_jitable

__all__ = ["chan_merge"]


@register_jitable
def chan_merge(n_old, mean_old, m2_old, n_new, mean_new, m2_new):
    """``(n, mean, M2)`` of the union of two sets given each one's count, mean and M2
    (sum of squared deviations from its mean)::

        n     = n_old + n_new
        delta = mean_new - mean_old
        mean  = mean_old + delta * n_new / n
        M2    = M2_old + M2_new + delta^2 * n_old * n_new / n

    Exact (``mean_new``, ``m2_new``) when ``n_old`` is 0. Call it with float64 values:
    the kernels merge in float64 whatever their input dtype.
    """
    n = n_old + n_new
    delta = mean_new - mean_old
    frac = n_new / n
    return n, mean_old + delta * frac, m2_old + (m2_new + delta * delta * n_old * frac)
