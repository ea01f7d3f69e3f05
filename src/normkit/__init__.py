"""normkit: normalization for deep learning and data preprocessing.

Every normalization is one recipe -- choose the group of numbers that share statistics,
compute their mean and biased variance, standardize, then scale and shift::

    y = weight * (x - mean) / sqrt(var + eps) + bias

The methods differ only in the group (see ``normkit.grouping``). ``import normkit`` needs
only NumPy; the torch-facing parts (``normkit.functional``, ``normkit.nn``,
``normkit.convert``, ``normkit.fold``) import torch when first used. When torch is already
imported, ``import normkit`` also registers the operators ``torch.ops.normkit.*``
(``normkit.ops``, and ``normkit.functional``'s ops), so that a program saved by
``torch.export.save`` loads; otherwise ``import normkit.functional``.
"""

from __future__ import annotations

import sys as _sys

__version__ = "0.1.0"

if "torch" in _sys.modules:
    from normkit import functional as _functional  # noqa: F401  (registers torch.ops.normkit.*)

__all__ = ["__version__", "convert", "revert", "fold", "stats"]


def __getattr__(name):
    # torch is an optional dependency: load the torch-facing parts on first use
    if name in ("convert", "revert", "ConversionReport"):
        from normkit import conversion as _convert_module

        return getattr(_convert_module, name)
    if name in ("fold", "FoldReport"):
        from normkit import folding as _fold_module

        return getattr(_fold_module, name)
    if name in ("functional", "nn", "reference", "stats", "grouping", "preprocessing", "backends",
                "conversion", "folding", "ops"):
        import importlib

        return importlib.import_module(f"normkit.{name}")
    raise AttributeError(f"module 'normkit' has no attribute {name!r}")
