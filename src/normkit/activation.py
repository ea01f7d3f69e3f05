r"""The activations a BatchNorm can apply in its own store: their names, codes and checks.

A fused BatchNorm computes ``y = act(z)`` with ``z = w * xhat + b`` (the usual affine
output) and the activation one of

==============  =====================================  ==========================================
name            act(z)                                 act'(z) (the backward's mask or factor)
==============  =====================================  ==========================================
``relu``        ``max(z, 0)``                          ``1 if z > 0 else 0``
``relu6``       ``min(max(z, 0), 6)``                  ``1 if 0 < z < 6 else 0``
``leaky_relu``  ``z if z > 0 else slope * z``          ``1 if z > 0 else slope``
``silu``        ``z * sigmoid(z)``                     ``s * (1 + z * (1 - s))``, ``s = sigmoid(z)``
==============  =====================================  ==========================================

the derivatives at the kinks as torch's (``threshold_backward``, ``hardtanh_backward``,
``leaky_relu_backward``). Pure Python: the NumPy reference, the torch paths and the kernels
all read the names and codes from here.
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = ["Activation", "NAMES", "CODES", "resolve"]

#: the activation names, as torch.nn.functional names them
NAMES = ("relu", "relu6", "leaky_relu", "silu")
#: each activation's code in the kernels (0: none)
CODES = {name: code for code, name in enumerate(NAMES, start=1)}


class Activation(NamedTuple):
    """One activation: its name (one of ``NAMES``) and ``slope`` (``leaky_relu``'s
    negative slope; 0.0 for the others, so that equal activations compare equal)."""

    name: str
    slope: float = 0.0

    @property
    def code(self) -> int:
        return CODES[self.name]


def resolve(activation, negative_slope=0.01, where="batch_norm"):
    """The ``Activation`` of a public ``activation=`` / ``negative_slope=`` pair, or None
    for ``activation=None``; a ``ValueError`` / ``TypeError`` naming what to pass
    otherwise."""
    if activation is None:
        return None
    if not isinstance(activation, str):
        raise TypeError(f"{where}: activation must be None or one of {NAMES} (a name, as "
                        f"torch.nn.functional calls it), got {type(activation).__name__} "
                        f"{activation!r}; pass e.g. activation='relu'")
    if activation not in CODES:
        raise ValueError(f"{where}: unknown activation {activation!r}; the fused ones are "
                         f"{NAMES} (apply any other after the norm)")
    if activation != "leaky_relu":
        return Activation(activation)
    if isinstance(negative_slope, bool) or not isinstance(negative_slope, (int, float)) or \
            not math.isfinite(negative_slope):
        raise ValueError(f"{where}: negative_slope must be a finite number, got "
                         f"{negative_slope!r}; torch's default is 0.01")
    return Activation("leaky_relu", float(negative_slope))
