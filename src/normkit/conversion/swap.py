"""Swapping a torch.nn normalization layer for its normkit twin and back.

A swap moves the very same ``Parameter`` and buffer objects into the twin, so values,
device, dtype, ``requires_grad``, an optimizer built on ``model.parameters()`` and any
tensor already shared elsewhere stay valid. The training flag and the hooks carry over.

A subclass of a torch norm class that keeps the torch ``forward`` and adds no parameter,
buffer or child (transformers' ``PoolFormerGroupNorm``) is swapped the same way, into a
subclass of the normkit twin made for it (same ``__name__``) that carries its extra class
and instance attributes; ``revert`` rebuilds the torch layer and gives it back its class
and attributes.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as torch_module

import normkit.nn as nknn
from normkit.conversion.classes import derived_class

__all__ = ["PAIRS", "MODULE_STATE", "table", "carry_module_state", "twin", "torch_base",
           "plain_subclass_reason", "swap_subclass", "revert_subclass"]


def _bias(m, affine):
    """``bias=False`` where it matters (affine without a bias), else nothing: torch before
    2.13 has no ``bias`` argument in BatchNorm, InstanceNorm and GroupNorm."""
    return {"bias": False} if affine and m.bias is None else {}


def _bn_args(m):
    return dict(num_features=m.num_features, eps=m.eps, momentum=m.momentum, affine=m.affine,
                track_running_stats=m.track_running_stats, **_bias(m, m.affine))


def _ln_args(m):
    return dict(normalized_shape=m.normalized_shape, eps=m.eps,
                elementwise_affine=m.elementwise_affine, bias=m.bias is not None)


def _gn_args(m):
    return dict(num_groups=m.num_groups, num_channels=m.num_channels, eps=m.eps,
                affine=m.affine, **_bias(m, m.affine))


def _rms_args(m):
    args = dict(normalized_shape=m.normalized_shape, eps=m.eps,
                elementwise_affine=m.elementwise_affine)
    if isinstance(m, nknn.RMSNorm):
        if m.offset != 0 or m.casting != "torch":
            raise ValueError(f"offset={m.offset}, casting={m.casting!r} has no torch.nn.RMSNorm "
                             f"twin")
    return args


# torch class -> (normkit class, constructor arguments read off an instance)
PAIRS = [
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

# what every nn.Module keeps in its __dict__ (parameters, buffers, hooks, flags)
MODULE_STATE = frozenset(vars(nn.Module()))
# its hooks: the dicts of every kind (forward, backward, state_dict, load_state_dict, their
# pre/post, kwargs and always-called sets) and `_is_full_backward_hook`, which says which
# kind the backward ones are
_HOOKS = tuple(sorted(name for name in MODULE_STATE if "hook" in name))


def table():
    """The (torch class, normkit class, args) pairs, SyncBatchNorm included."""
    pairs = list(PAIRS)
    pairs.append((nn.SyncBatchNorm, nknn.SyncBatchNorm,
                  lambda m: dict(_bn_args(m), process_group=m.process_group)))
    return pairs


def carry_module_state(source, target):
    """Training flag and hooks of ``source`` onto ``target``. The hook dicts are shared, not
    copied, so that the handles the hooks were registered with remove them from ``target``."""
    target.train(source.training)
    for attr in _HOOKS:
        if attr in vars(source):
            object.__setattr__(target, attr, getattr(source, attr))
            _rebind(getattr(target, attr), source, target)


def _rebind(hooks, source, target):
    """The hooks torch holds bound to ``source`` by a weak reference (load_state_dict pre
    hooks: a ``_WrappedHook``) bound to ``target``: ``source`` is dropped after the swap,
    and a hook still bound to it raised "You are trying to call the hook of a dead
    Module!"."""
    wrapped = getattr(torch_module, "_WrappedHook", None)
    if wrapped is None or not isinstance(hooks, dict):
        return
    for key, hook in list(hooks.items()):
        if isinstance(hook, wrapped) and hook.with_module and hook.module() is source:
            hooks[key] = wrapped(hook.hook, target)


def twin(module, cls, args):
    """Build ``cls(**args)`` without allocating, then move ``module``'s tensors into it."""
    new = cls(**args, device="meta")
    for name, _ in list(new.named_parameters(recurse=False)):
        setattr(new, name, getattr(module, name))
    for name, _ in list(new.named_buffers(recurse=False)):
        new._buffers[name] = module._buffers[name]
    carry_module_state(module, new)
    return new


def torch_base(kind, pairs):
    """The nearest class of ``pairs`` in ``kind``'s MRO (None when there is none)."""
    sources = {src: (src, dst, args) for src, dst, args in pairs}
    for klass in kind.__mro__:
        if klass in sources:
            return sources[klass]
    return None


def _own_state(cls, a):
    """The names a freshly built ``cls(**a)`` holds in its ``__dict__``."""
    return set(vars(cls(**a, device="meta")))


def plain_subclass_reason(module, src, args):
    """Why the subclass ``module`` of ``src`` cannot be swapped like ``src`` itself (None
    when it can): it overrides ``forward`` or holds state a plain ``src`` lacks."""
    if type(module).forward is not src.forward:
        return "overrides forward"
    plain = src(**args(module), device="meta")
    if set(module._parameters) != set(plain._parameters) or \
            set(module._buffers) != set(plain._buffers) or module._modules:
        return "holds parameters, buffers or children that torch's class lacks"
    return None


def _carried(source, dst):
    """Class attributes of ``source``'s own classes that ``dst`` lacks (kept reachable)."""
    names = {}
    for klass in reversed(source.__mro__):
        if klass.__module__.startswith("torch.") or klass is object:
            continue
        for name, value in vars(klass).items():
            if not (name.startswith("__") and name.endswith("__")) and not hasattr(dst, name):
                names[name] = value
    return names


def swap_subclass(module, src, dst, args):
    """The normkit twin of a plain subclass of ``src``, in a class made for it that
    carries its extra class attributes; its extra instance attributes are copied."""
    a = args(module)
    new = twin(module, swapped_class(type(module), src, dst), a)
    torch_state = _own_state(src, a)
    new.__dict__.update({k: v for k, v in vars(module).items() if k not in torch_state})
    return new


def swapped_class(kind, src, dst):
    """The normkit class ``dst`` made for ``kind``, a plain subclass of ``src``."""
    return derived_class("swapped", kind, (dst,),
                         lambda: dict(_carried(kind, dst), _normkit_source=(kind, src)),
                         (swapped_class, kind, src, dst))


def revert_subclass(module, pairs):
    """The torch layer of the subclass ``module`` was swapped from, with its attributes."""
    kind, src = type(module)._normkit_source
    dst, args = next((d, a) for s, d, a in pairs if s is src)
    a = args(module)
    new = twin(module, src, a)
    new.__class__ = kind
    normkit_state = _own_state(dst, a)
    new.__dict__.update({k: v for k, v in vars(module).items() if k not in normkit_state})
    return new
