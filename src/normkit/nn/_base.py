"""Shared pieces of the normkit layers: argument checks, the running-statistics base, their
call while torch.fx traces, and their refusal of TorchScript."""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["check_eps", "fx_leaf", "init_affine", "refuse_script", "reset_affine",
           "NormBase"]


def check_eps(eps, cls_name: str, allow_none: bool = False):
    """``eps`` must be a positive finite number: it keeps ``rsqrt(var + eps)`` finite for
    constant groups."""
    if eps is None and allow_none:
        return
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) \
            or eps <= 0:
        raise ValueError(
            f"{cls_name}: eps must be a positive finite number (it is added to the variance "
            f"before the square root so that a constant group is not divided by zero), got "
            f"eps={eps!r}; the usual value is 1e-5")


def fx_leaf(layer, input):
    """``layer(input)`` while ``torch.fx`` traces (``input`` an fx ``Proxy``): one
    ``call_module`` node, as fx records torch.nn's norms (its leaf modules), so that the
    traced module calls the layer itself and computes, and updates running statistics, as
    eager does. (fx would otherwise trace into the layer's Python, whose checks on the
    input's shape it cannot follow.) The layer must be a submodule of the traced one."""
    tracer = input.tracer
    name = tracer.path_of_module(layer)
    if not name:
        raise TypeError(
            f"torch.fx cannot trace a normkit {type(layer).__name__} as the root module (each "
            f"normkit layer is recorded as one call of the module that holds it); trace a "
            f"module that holds it, e.g. torch.fx.symbolic_trace(nn.Sequential(layer))")
    return tracer.create_proxy("call_module", name, (input,), {})


def refuse_script(layer):
    """The layers' ``__prepare_scriptable__``, which ``torch.jit.script`` calls on every
    module before compiling it: a normkit layer cannot be compiled (its forward calls
    kernels from Python), so the error says so and what to do, in place of TorchScript's
    error from deep inside the layer. (Handing torch a torch.nn twin instead would put it
    into the caller's eager model too: torch writes the prepared modules back.)"""
    raise RuntimeError(
        f"torch.jit.script cannot compile normkit's {type(layer).__name__} (its forward calls "
        f"compiled kernels from Python). Script a reverted copy -- scripted = "
        f"copy.deepcopy(model); normkit.revert(scripted); torch.jit.script(scripted) -- or "
        f"use torch.export or torch.compile, which take normkit's layers")


def init_affine(module, shape, affine, bias, factory_kwargs) -> None:
    """Register ``weight`` and ``bias`` as torch does: Parameters of ``shape`` when
    ``affine`` (the bias only with ``bias``), otherwise ``None`` so that the attribute
    exists and the state_dict has no key."""
    if affine:
        module.weight = nn.Parameter(torch.empty(shape, **factory_kwargs))
        if bias:
            module.bias = nn.Parameter(torch.empty(shape, **factory_kwargs))
        else:
            module.register_parameter("bias", None)
    else:
        module.register_parameter("weight", None)
        module.register_parameter("bias", None)


def reset_affine(module) -> None:
    """gamma = 1, beta = 0."""
    if module.weight is not None:
        nn.init.ones_(module.weight)
    if getattr(module, "bias", None) is not None:
        nn.init.zeros_(module.bias)


class NormBase(nn.Module):
    """Common base of the BatchNorm and InstanceNorm layers: parameters and running buffers
    with ``torch.nn``'s names, dtypes and initial values.

    Buffers: ``running_mean`` (zeros), ``running_var`` (ones, unbiased estimates),
    ``num_batches_tracked`` (int64 count) when ``track_running_stats``; otherwise
    registered as ``None`` so that the state_dict keys match torch's.
    """

    _version = 2
    __constants__ = ["track_running_stats", "momentum", "eps", "num_features", "affine"]
    __prepare_scriptable__ = refuse_script

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, device=None, dtype=None, *, bias=True):
        factory_kwargs = {"device": device, "dtype": dtype}
        nn.Module.__init__(self)    # (not the torch twin's __init__: this one builds it all)
        check_eps(eps, type(self).__name__)
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.affine = affine
        self.track_running_stats = track_running_stats
        init_affine(self, num_features, affine, bias, factory_kwargs)
        if track_running_stats:
            self.register_buffer("running_mean", torch.zeros(num_features, **factory_kwargs))
            self.register_buffer("running_var", torch.ones(num_features, **factory_kwargs))
            self.register_buffer(
                "num_batches_tracked",
                torch.tensor(0, dtype=torch.long,
                             **{k: v for k, v in factory_kwargs.items() if k != "dtype"}))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            self.running_mean.zero_()
            self.running_var.fill_(1)
            self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        reset_affine(self)

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, bias={self.bias is not None}, "
                f"track_running_stats={self.track_running_stats}")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # checkpoints written before version 2 have no num_batches_tracked: start it at 0
        version = local_metadata.get("version", None)
        if (version is None or version < 2) and self.track_running_stats:
            key = prefix + "num_batches_tracked"
            if key not in state_dict:
                nbt = self.num_batches_tracked
                state_dict[key] = (nbt if nbt is not None and nbt.device.type != "meta"
                                   else torch.tensor(0, dtype=torch.long))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
