"""Layers that keep their plan and call it with their own tensors.

Inside a model, the Python between a layer's call and its kernel (the grouping, the
checks, the plan lookup) costs several times what it costs alone: the neighbouring ops
evict what it touches (docs/performance.md, "Between convolutions"). So an exact normkit
layer keeps, per input (shape, strides, dtype, device, threads, plan epoch), the plan
that input gets (``normkit.backends.plan``; on the CPU the C++ executor) and calls it
through the one call path, ``normkit.ops.run``, with its own parameters and buffers.

The full path (``normkit.functional``) runs instead for anything else: traced calls or
``torch.func`` transforms, a tensor subclass, a nested tensor or a dispatch mode, a
non-contiguous input (but channels_last for BatchNorm and GroupNorm), a subclass of the
layer (parametrized layers are one), an input the layer's checks refuse (it raises there,
with its message). Parameters or buffers of another size or device than the plan's (after
``param.data = ...``) are the plan's error, which says what it expected.
``normkit.backends.clear_plans`` starts a new plan epoch, which drops the kept plans;
copies and pickles leave them behind (``__getstate__``).
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad

from normkit import backends, ops
from normkit.nn._base import refuse_script

__all__ = ["KeptPlan"]

_SLOTS = ("_plan", "_eval_plan", "_train_plan")


class KeptPlan:
    """Mixin of the layers above: ``_kept`` keeps what ``_build`` makes of an input,
    ``_plain_call`` says whether a call may use it, ``_own_params`` reads the parameters
    past ``Module.__getattr__`` (about 0.7 us a read)."""

    #: the exact classes that may keep a node (set per layer module)
    _plain_classes: tuple = ()
    __prepare_scriptable__ = refuse_script

    def __getstate__(self):
        state = super().__getstate__()
        for slot in _SLOTS:                 # plans of this process: built again on use
            state.pop(slot, None)
        return state

    #: whether a kept plan may read channels_last memory (BatchNorm's and GroupNorm's)
    _rows_of_channels = False

    def _plain_call(self, x) -> bool:
        """Whether this call may take a kept plan: eager, a plain contiguous tensor (or,
        for a ``_rows_of_channels`` layer, one whose channels are adjacent in memory:
        channels_last), no dispatch mode, no autocast, no ``torch.func`` transform
        nor tracer (``normkit.autograd.transformed``), an exact normkit class."""
        return not (torch.compiler.is_compiling() or type(x) is not torch.Tensor
                    or x.is_nested                           # (a strided nested tensor)
                    or type(self) not in self._plain_classes
                    or torch._C._len_torch_dispatch_stack()
                    or torch._C._is_any_autocast_enabled()          # (normkit.autocast)
                    # autograd.transformed() inline (a call frame less per layer call):
                    or torch._C._functorch.maybe_current_level() is not None
                    or forward_ad._current_level >= 0 or torch._C._is_tracing()
                    or not (x.is_contiguous()
                            or (self._rows_of_channels and x.dim() > 2 and x.stride(1) == 1)))

    def _kept(self, x, slot, build, *args):
        """``build(x, *args)`` -- ``(plan, extra)``, the plan None where the full path runs
        -- kept in ``slot`` per (shape, strides, dtype, device, threads, plan epoch); None
        (not kept) where ``build`` gives None: an input the full path must see, to raise
        its error."""
        key = (x.shape, x.stride(), x.dtype, x.device, torch.get_num_threads(),
               backends.plan_epoch)
        kept = self.__dict__.get(slot)
        if kept is not None and kept[0] == key:
            return kept[1]
        if not x.is_floating_point():       # (the full path raises, with torch's error type)
            return None
        found = build(x, *args)
        if found is not None:
            self.__dict__[slot] = (key, found)
        return found

    def _own_params(self):
        """``(weight, bias)`` from the module's own dict, or None where one of them was
        taken out of it (the full path runs and reports)."""
        params = self._parameters
        if "weight" not in params or "bias" not in params:
            return None
        return params["weight"], params["bias"]

    def _affine_call(self, x):
        """``y`` of a layer with ``weight``, ``bias``, ``eps`` and a ``_build`` from its
        kept plan (LayerNorm, GroupNorm), or None: the full path runs."""
        if not self._plain_call(x):
            return None
        params = self._own_params()
        if params is None:
            return None
        return self._call_plan(x, self._kept(x, "_plan", self._build), self.eps, *params)

    @staticmethod
    def _call_plan(x, found, eps, w, b):
        """``y`` of the kept plan ``found`` (batch statistics, none kept: the per-sample
        layers), or None where there is none. The plan checks every tensor it is given
        besides the input, whose shape, strides, dtype and device the kept key fixes: a
        weight of another size or device (after ``param.data = ...``) is an error that
        says what it expected."""
        if found is None or found[0] is None:
            return None
        return ops.run(found[0], x, w, b, eps, None, None, False)[0]
