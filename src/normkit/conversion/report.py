"""The report that ``convert`` and ``revert`` return."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

__all__ = ["ConversionReport"]


@dataclass
class ConversionReport:
    """What ``convert``/``revert`` did, module by module.

    Attributes
    ----------
    model : nn.Module
        The converted model (the same object, unless the root itself was swapped).
    swapped : list of (name, old type name, new type name)
        Modules replaced by another object (a normkit layer on ``convert``).
    routed : list of (name, type name, how)
        Modules kept in place whose norm computation now runs on normkit's ops (their
        class is a routed subclass; ``revert`` restores the class).
    left : list of (name, type name, reason)
        Norm-like modules left as they were, with the reason.
    """

    model: nn.Module
    swapped: list = field(default_factory=list)
    routed: list = field(default_factory=list)
    left: list = field(default_factory=list)

    @property
    def skipped(self) -> list:
        """The former name of ``left``."""
        return self.left

    def __str__(self) -> str:
        lines = [f"swapped {len(self.swapped)} module(s), routed {len(self.routed)}, "
                 f"left {len(self.left)}"]
        lines += [f"  swapped {n or '<root>'}: {a} -> {b}" for n, a, b in self.swapped]
        lines += [f"  routed {n or '<root>'} ({t}): {how}" for n, t, how in self.routed]
        lines += [f"  left {n or '<root>'} ({t}): {why}" for n, t, why in self.left]
        return "\n".join(lines)
