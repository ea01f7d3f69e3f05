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
    fused : list of (name, type name, how)
        With ``fuse_residual=True``: one entry per add fused into the norm call after it
        (``revert``: one per module whose class was given back).
    unfused : list of (name, type name, reason)
        With ``fuse_residual=True``: modules with normkit norm children in which no add
        was fused, with the reason.
    activations_fused : list of (name, type name, how)
        With ``fuse_activation=True``: one entry per BatchNorm that now applies the
        activation after it (the module whose forward or ``nn.Sequential`` holds the
        pair; ``revert``: one per module or activation given back).
    activations_left : list of (name, type name, reason)
        With ``fuse_activation=True``: the BatchNorm-then-activation pairs found but left
        unfused, with the reason.
    """

    model: nn.Module
    swapped: list = field(default_factory=list)
    routed: list = field(default_factory=list)
    left: list = field(default_factory=list)
    fused: list = field(default_factory=list)
    unfused: list = field(default_factory=list)
    activations_fused: list = field(default_factory=list)
    activations_left: list = field(default_factory=list)

    def __getattr__(self, name):
        # (only where the normal lookup failed) a model's attribute asked of the report:
        # say what convert returns rather than a bare AttributeError
        if not name.startswith("__") and hasattr(self.__dict__.get("model"), name):
            raise AttributeError(
                f"a ConversionReport has no {name!r}: convert changes the model in place "
                f"and returns this report; use the model itself, or report.model.{name}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __call__(self, *args, **kwargs):
        raise TypeError("a ConversionReport is not a model: convert changes the model in "
                        "place and returns this report; call the model itself, or "
                        "report.model(...)")

    @property
    def skipped(self) -> list:
        """The former name of ``left``."""
        return self.left

    def __str__(self) -> str:
        lines = [f"swapped {len(self.swapped)} module(s), routed {len(self.routed)}, "
                 f"left {len(self.left)}"]
        if self.fused or self.unfused:
            lines[0] += f", fused {len(self.fused)} residual add(s), unfused {len(self.unfused)}"
        if self.activations_fused or self.activations_left:
            lines[0] += (f", fused {len(self.activations_fused)} activation(s), left "
                         f"{len(self.activations_left)} pair(s)")
        lines += [f"  swapped {n or '<root>'}: {a} -> {b}" for n, a, b in self.swapped]
        lines += [f"  routed {n or '<root>'} ({t}): {how}" for n, t, how in self.routed]
        lines += [f"  left {n or '<root>'} ({t}): {why}" for n, t, why in self.left]
        lines += [f"  fused {n or '<root>'} ({t}): {how}" for n, t, how in self.fused]
        lines += [f"  unfused {n or '<root>'} ({t}): {why}" for n, t, why in self.unfused]
        lines += [f"  activation fused {n or '<root>'} ({t}): {how}"
                  for n, t, how in self.activations_fused]
        lines += [f"  activation left {n or '<root>'} ({t}): {why}"
                  for n, t, why in self.activations_left]
        return "\n".join(lines)
