"""Argument checks of the functional ops: the exception types torch raises for the same
mistake, with the values and the fix in the message (a binding's "incompatible function
arguments" or an AttributeError on ``None`` says neither)."""

from __future__ import annotations

import numbers
import operator

import torch

_CHANNEL_PARAMS = ("running_mean", "running_var", "weight", "bias")


def _size(shape) -> list:
    return [int(s) for s in shape]


def _check_floating(input, op):
    """The norms take floating-point input only, as torch's (whose kernels raise
    NotImplementedError for other dtypes): an integer, bool or complex tensor would come
    back truncated or with its imaginary part dropped."""
    if not input.is_floating_point():
        raise NotImplementedError(
            f"{op} takes floating-point input (float64, float32, bfloat16 or float16), got "
            f"{input.dtype}: convert it first, e.g. input.float()")


def _check_channels(op, input, running_mean=None, running_var=None, weight=None, bias=None):
    """A floating input (``_check_floating``) whose C = input.shape[1] matches every given
    per-channel tensor's element count. (Named parameters, not ``**params``: a keyword dict
    per call costs on a small tensor.)"""
    _check_floating(input, op)
    c = input.shape[1]
    for name, p in zip(_CHANNEL_PARAMS, (running_mean, running_var, weight, bias)):
        if p is not None and p.numel() != c:
            raise RuntimeError(
                f"{name} should contain {c} elements not {p.numel()} (the input has {c} "
                f"channels at dim 1); pass a {name} with {c} elements or fix the input's "
                f"channel count")
        if p is not None and not p.is_floating_point():
            _refuse_dtype(op, name, p)
    return c


def _refuse_dtype(op, name, p):
    """An integer or bool parameter, which torch refuses ("mixed dtype"): normkit takes one
    of another floating dtype than the input's (docs/architecture.md), not of these."""
    raise RuntimeError(f"{op}: {name} must be floating point, got {p.dtype}; convert it, "
                       f"e.g. {name}.float()")


def _check_vectors(input, weight, bias):
    """group_norm's and instance_norm's per-channel weight and bias are vectors (torch's
    refuses others; a (2, 2) weight would pass for four channels' by its element count)."""
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.dim() != 1:
            raise RuntimeError(
                f"Expected {name} to be a vector of size equal to the number of channels in "
                f"input, but got {name} of shape {_size(p.shape)} and input of shape "
                f"{_size(input.shape)}; pass a {name} of shape ({input.shape[1]},)")


def _check_flag(op, name, value):
    """A bool argument (``training``, ``use_input_stats``) that is a bool, as torch's
    binding requires: 1, None or 'x' would otherwise count by their truth."""
    if type(value) is not bool:
        raise TypeError(f"{op}(): argument '{name}' must be bool, not "
                        f"{type(value).__name__} ({value!r}); pass True or False")


def _check_running(op, running_mean, running_var):
    """Both running statistics or neither, a ValueError as torch's; one alone would be
    ignored or fail deep in a kernel."""
    if (running_mean is None) != (running_var is None):
        given, missing = (("running_mean", "running_var") if running_var is None else
                          ("running_var", "running_mean"))
        raise ValueError(f"running_mean and running_var must either both be None or neither "
                         f"be None: {op} got {given} but {missing}=None; pass both (a "
                         f"layer's buffers), or neither to normalize with the batch's "
                         f"statistics only")


def _momentum(op, momentum, allowed="a number") -> float:
    """``momentum`` as the float the kernels take: a number, or a one-element tensor as
    torch's ops take it; anything else a TypeError naming it (torch's type)."""
    if type(momentum) is float:
        return momentum
    if isinstance(momentum, torch.Tensor) and momentum.numel() == 1:
        return float(momentum)
    if not isinstance(momentum, numbers.Real):
        raise TypeError(f"{op}: momentum must be {allowed}, got {type(momentum).__name__} "
                        f"{momentum!r}; the usual value is 0.1")
    return float(momentum)


def _index(value):
    """``value`` as an int (a NumPy or 0-d tensor int too), or None: a bool, or no int
    (torch's bindings refuse both where they take an int)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _dims(op, dims, nd) -> tuple:
    """``dims`` (an int, or an iterable of ints) as a tuple of dims of an ``nd``-D input,
    each named once; a TypeError or ValueError with the values and the fix otherwise."""
    out = (_index(dims),)                          # one int
    if out == (None,):
        try:
            out = tuple(_index(d) for d in dims)   # a sequence, set, range, array, tensor
        except TypeError:
            out = (None,)
    if None in out:
        raise TypeError(f"{op}: dims must be an int or a sequence of ints, got {dims!r}; "
                        f"pass e.g. dims=(0, 2, 3)")
    if not out or any(not -nd <= d < nd for d in out):
        raise ValueError(f"{op}: dims must be a non-empty set of dims of a {nd}D input "
                         f"(between {-nd} and {nd - 1}), got {out}")
    for d in out:
        same = [e for e in out if e % nd == d % nd]
        if len(same) > 1:
            raise ValueError(f"{op}: dims {out} name dim {d % nd} of the {nd}D input more "
                             f"than once ({', '.join(map(str, same))}); give each dim once")
    return out
