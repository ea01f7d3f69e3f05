"""Layers that keep their plan's C++ node and call it with their own tensors.

Inside a model, the Python between a layer's call and its kernel (the grouping, the
checks, the plan lookup) costs several times what it costs alone: the neighbouring ops
evict what it touches (docs/performance.md, "Between convolutions"). So an exact normkit
layer keeps, per input (shape, strides, dtype, device, threads, plan epoch), the C++
node of the plan that input gets (``normkit.backends.cpu.native``) and calls it directly
with its own parameters and buffers.

The full path (``normkit.functional``) runs instead for anything else: traced calls, a
tensor subclass or a dispatch mode, a non-contiguous input (but channels_last for
BatchNorm and GroupNorm), a subclass of the layer (parametrized layers are one), an input whose plan
has no node (CUDA, strides no kernel family reads), one the layer's checks refuse (it raises
there, with its message), and parameters or buffers of another size or device than the
node's (after ``.to()`` or ``param.data = ...``: ``_fit``, checked per call). ``normkit.backends.clear_plans`` and
``native.switch`` start a new plan epoch, which drops the kept nodes; copies and pickles
leave them behind (``__getstate__``).
"""

from __future__ import annotations

import torch

from normkit import backends

__all__ = ["KeptNode"]

_SLOTS = ("_node", "_eval_node", "_train_node")


class KeptNode:
    """Mixin of the layers above: ``_kept`` keeps what ``build`` makes of an input,
    ``_plain_call`` says whether a call may use it, ``_own_params`` reads the parameters
    past ``Module.__getattr__`` (about 0.7 us a read)."""

    #: the exact classes that may keep a node (set per layer module)
    _plain_classes: tuple = ()

    def __getstate__(self):
        state = super().__getstate__()
        for slot in _SLOTS:                 # C++ plans of this process: built again on use
            state.pop(slot, None)
        return state

    #: whether a node may read channels_last memory (BatchNorm's and GroupNorm's)
    _rows_of_channels = False

    def _plain_call(self, x) -> bool:
        """Whether this call may take a kept node: eager, a plain contiguous tensor (or,
        for a ``_rows_of_channels`` layer, one whose channels are adjacent in memory:
        channels_last), no dispatch mode, an exact normkit class."""
        return not (torch.compiler.is_compiling() or type(x) is not torch.Tensor
                    or type(self) not in self._plain_classes
                    or torch._C._len_torch_dispatch_stack()
                    or not (x.is_contiguous()
                            or (self._rows_of_channels and x.dim() > 2 and x.stride(1) == 1)))

    def _kept(self, x, slot, build, *args):
        """``build(x, *args)`` -- ``(node, extra)``, the node None where the plan has none
        -- kept in ``slot`` per (shape, strides, dtype, device, threads, plan epoch); None
        (not kept) where ``build`` gives None: an input the full path must see, to raise
        its error."""
        key = (x.shape, x.stride(), x.dtype, x.device, torch.get_num_threads(),
               backends.plan_epoch)
        kept = self.__dict__.get(slot)
        if kept is not None and kept[0] == key:
            return kept[1]
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

    @staticmethod
    def _needs_graph(x, w, b) -> bool:
        """Whether a gradient is to be recorded for this call."""
        return torch.is_grad_enabled() and (x.requires_grad
                                            or (w is not None and w.requires_grad)
                                            or (b is not None and b.requires_grad))

    def _affine_node_call(self, x):
        """``y`` of a layer with ``weight``, ``bias``, ``eps`` and a ``_build`` from its
        kept node (LayerNorm, GroupNorm), or None: the full path runs."""
        if not self._plain_call(x):
            return None
        params = self._own_params()
        if params is None:
            return None
        return self._call_node(x, self._kept(x, "_node", self._build), self.eps, *params,
                               self._param_count)

    @staticmethod
    def _fit(n, *tensors) -> bool:
        """Whether each tensor (or None) has ``n`` elements on the CPU: what a node takes
        besides its input, whose shape, strides, dtype and device the kept key fixes
        (after ``param.data = ...`` or ``.to()`` they may not; the full path then runs and
        reports)."""
        for t in tensors:
            if t is not None and (t.numel() != n or t.device.type != "cpu"):
                return False
        return True

    def _call_node(self, x, found, eps, w, b, n):
        """``y`` of the kept node ``found`` (batch statistics, none kept: the per-sample
        layers), or None where there is none or ``w``, ``b`` do not have its ``n``
        elements (``_fit``)."""
        if found is None or found[0] is None or not self._fit(n, w, b):
            return None
        node = found[0]
        if self._needs_graph(x, w, b):
            return node.apply(x, w, b, eps, None, None, None, False)[0]
        return node.forward(x, w, b, eps, None, None, False, False)[0]
