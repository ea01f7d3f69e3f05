"""``normkit.convert(model)`` and ``normkit.revert(model)``: swap torch's normalization
layers for normkit's twins and back, in place.

A swap moves the very same ``Parameter`` and buffer objects into the twin, so values,
device, dtype, ``requires_grad``, an optimizer built on ``model.parameters()`` and any
tensor already shared elsewhere stay valid. The training flag and forward/backward hooks
carry over too.

Only modules whose type is *exactly* one of the mapped classes are swapped. A subclass
may change the forward (transformers' ``ConvNextLayerNorm`` permutes channels first), so
subclasses stay in place and are listed in the report as skipped, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

import normkit.nn as nknn

__all__ = ["convert", "revert", "ConversionReport"]


@dataclass
class ConversionReport:
    """What ``convert``/``revert`` did.

    Attributes
    ----------
    model : nn.Module
        The converted model (the same object, unless the root itself was swapped).
    swapped : list of (name, old type name, new type name)
    skipped : list of (name, type name, reason)
    """

    model: nn.Module
    swapped: list = field(default_factory=list)
    skipped: list = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"swapped {len(self.swapped)} module(s), skipped {len(self.skipped)}"]
        lines += [f"  swapped {n or '<root>'}: {a} -> {b}" for n, a, b in self.swapped]
        lines += [f"  skipped {n or '<root>'} ({t}): {why}" for n, t, why in self.skipped]
        return "\n".join(lines)


def _bn_args(m):
    return dict(num_features=m.num_features, eps=m.eps, momentum=m.momentum, affine=m.affine,
                track_running_stats=m.track_running_stats, bias=m.bias is not None)


def _ln_args(m):
    return dict(normalized_shape=m.normalized_shape, eps=m.eps,
                elementwise_affine=m.elementwise_affine, bias=m.bias is not None)


def _gn_args(m):
    return dict(num_groups=m.num_groups, num_channels=m.num_channels, eps=m.eps,
                affine=m.affine, bias=m.bias is not None)


def _rms_args(m):
    return dict(normalized_shape=m.normalized_shape, eps=m.eps,
                elementwise_affine=m.elementwise_affine)


# torch class -> (normkit class, constructor arguments read off an instance)
_PAIRS = [
    (nn.BatchNorm1d, nknn.BatchNorm1d, _bn_args),
    (nn.BatchNorm2d, nknn.BatchNorm2d, _bn_args),
    (nn.BatchNorm3d, nknn.BatchNorm3d, _bn_args),
    (nn.InstanceNorm1d, nknn.InstanceNorm1d, _bn_args),
    (nn.InstanceNorm2d, nknn.InstanceNorm2d, _bn_args),
    (nn.InstanceNorm3d, nknn.InstanceNorm3d, _bn_args),
    (nn.LayerNorm, nknn.LayerNorm, _ln_args),
    (nn.GroupNorm, nknn.GroupNorm, _gn_args),
    (nn.RMSNorm, nknn.RMSNorm, _rms_args),
]


def _twin(module, cls, args):
    """Build ``cls(**args)`` without allocating, then move ``module``'s tensors into it."""
    twin = cls(**args, device="meta")
    for name, _ in list(twin.named_parameters(recurse=False)):
        setattr(twin, name, getattr(module, name))
    for name, _ in list(twin.named_buffers(recurse=False)):
        twin._buffers[name] = module._buffers[name]
    twin.train(module.training)
    for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                 "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks"):
        if hasattr(module, attr):
            getattr(twin, attr).update(getattr(module, attr))
    return twin


def _qual(kind) -> str:
    return f"{kind.__module__.split('.')[0]}.nn.{kind.__name__}"


def _swap(model, table, bases, direction):
    report = ConversionReport(model)
    exact = {src: (dst, args) for src, dst, args in table}

    def replace(name, module):
        kind = type(module)
        if kind in exact:
            dst, args = exact[kind]
            try:
                return _twin(module, dst, args(module))
            except ValueError as err:  # e.g. eps=0, which normkit refuses
                report.skipped.append((name, kind.__qualname__, str(err)))
                return None
        if isinstance(module, bases):
            report.skipped.append(
                (name, f"{kind.__module__}.{kind.__qualname__}",
                 f"subclass of a {direction} normalization layer; it may override forward "
                 f"(e.g. permute channels), so it was left in place"))
        return None

    root = replace("", model)
    if root is not None:
        report.swapped.append(("", _qual(type(model)), _qual(type(root))))
        report.model = root
        return report
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            new = replace(full, child)
            if new is not None:
                setattr(parent, child_name, new)
                report.swapped.append((full, _qual(type(child)), _qual(type(new))))
    return report


def _table():
    table = list(_PAIRS)
    sync = getattr(nknn, "SyncBatchNorm", None)
    if sync is not None:
        table.append((nn.SyncBatchNorm, sync,
                      lambda m: dict(_bn_args(m), process_group=m.process_group)))
    return table


def convert(model: nn.Module) -> ConversionReport:
    """Replace every torch.nn normalization layer in ``model`` by its normkit twin, in place.

    Returns a ``ConversionReport``; ``report.model`` is the converted model (``model``
    itself unless ``model`` is a single normalization layer).

    Example::

        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
        >>> print(convert(net))
        swapped 1 module(s), skipped 0
          swapped 1: torch.nn.LayerNorm -> normkit.nn.LayerNorm
    """
    bases = tuple(src for src, _, _ in _PAIRS) + (nn.modules.batchnorm._NormBase,)
    return _swap(model, _table(), bases, "torch")


def revert(model: nn.Module) -> ConversionReport:
    """Replace every normkit normalization layer in ``model`` by its torch.nn twin."""
    table = [(dst, src, args) for src, dst, args in _table()]
    bases = tuple(src for src, _, _ in table) + (nknn._base.NormBase,)
    return _swap(model, table, bases, "normkit")
