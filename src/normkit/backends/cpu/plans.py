"""What a CPU normalization runs, decided once per shape: one class per kernel family.

``normkit.backends.plan`` builds a plan the first time a (grouping, dtype, layout,
centering, fixed statistics, thread count) is seen and keeps it. The decisions live
here: the family's kernel for each direction (an entry of ``entries``), the sizes, block
and prefetch choices, the thread split, the work of each stage and its scratch
(``args.Work``). Each decision an entry reads is an attribute named as the entry's
parameter (``args.constants`` copies them by name). ``native.build`` hands them to the
C++ ``Plan`` (``native.cpp``), which runs every call: a plan *is* that object; these
classes only make it.

``Rows``          LayerNorm/RMSNorm on contiguous (M, K)
``Planes``        Batch/Instance/GroupNorm on contiguous NCHW planes
``Columns``       BatchNorm on rows of channels: channels_last, and (N, C)
``ChannelsLast``  Instance/GroupNorm on channels_last (the per-(n, c) family)
"""

from __future__ import annotations

import numpy as np
import torch

from normkit.backends._memory import HUGE_MIN_BYTES, huge_pages_advised
from normkit.backends.cpu import args, entries, tuning
from normkit.backends.cpu.args import Work, float_bits
from normkit.backends.torch_ops import stat_dtype

__all__ = ["Rows", "Planes", "Columns", "ChannelsLast", "compile_entry", "protos",
           "storage_proto"]

# storage dtype seen by the kernels for each torch dtype (see ``half``)
_STORAGE = {torch.float64: np.float64, torch.float32: np.float32, torch.bfloat16: np.uint16,
            torch.float16: np.int16}
_NP_STAT = {torch.float64: np.float64, torch.float32: np.float32}


def storage_proto(dtype):
    """An empty array of the storage dtype the kernels see for ``dtype`` (16-bit floats as
    integers, ``half``)."""
    return np.empty(0, _STORAGE[dtype])


def protos(dtype):
    """``(proto, sproto)``: empty arrays of the storage and the statistics dtype of the
    kernels of a ``dtype`` input (what ``args.callback`` compiles for)."""
    return storage_proto(dtype), np.empty(0, _NP_STAT[stat_dtype(dtype)])


def compile_entry(name: str, dtypes) -> str:
    """Compile (or load from numba's cache) the kernel entry ``name`` of ``entries`` for
    the input dtypes named ``dtypes`` (``python -m normkit.backends.cpu``: compiling is
    what was asked for, so without the first compilation's notice); a BatchNorm entry both
    without and with an activation (``args.callback``'s ``fused``)."""
    args.quiet()
    for dtype in dtypes:
        for fused in (False, True):
            args.callback(getattr(entries, name), *protos(getattr(torch, dtype)), fused)
    return name


class _Family:
    """What every family shares: sizes, dtypes, threads, the statistics' shape, the
    parameters' defaults, whether outputs stream or are advised huge pages."""

    #: whether the kernels read rows of channels (channels_last memory), not contiguous
    rows_of_channels = False
    #: whether the family's BatchNorm kernels apply an activation (``act_stores``)
    takes_activation = False

    def __init__(self, x, grouping, center, fixed, params, act=None):
        if act is not None and not (self.takes_activation and grouping.kind == "batch"):
            raise ValueError(f"{type(self).__name__}: an activation is fused into BatchNorm "
                             f"on NCHW planes or rows of channels only, not into "
                             f"{grouping.kind!r} plans; apply {act.name} after the norm")
        self.grouping, self.center, self.fixed = grouping, bool(center), bool(fixed)
        # the activation, as the entries read it: its code (0: none), and leaky_relu's
        # slope as the bits of its float64 (args.float_bits)
        self.activation = act
        self.act = 0 if act is None else act.code
        self.slope = float_bits(0.0 if act is None else act.slope)
        self.sdtype = stat_dtype(x.dtype)
        self.proto, self.sproto = protos(x.dtype)
        self.itemsize = x.element_size()
        self.threads = tuning.threads(x)
        self.stat_shape = grouping.stat_shape
        self.params = params                                       # elements per weight
        nbytes = x.numel() * self.itemsize
        self.huge = nbytes >= HUGE_MIN_BYTES and huge_pages_advised()
        self.stream_bytes = tuning.STREAM_BYTES
        self.stream_fresh = tuning.STREAM_FRESH


class Rows(_Family):
    """LayerNorm / RMSNorm over the rows of a contiguous (M, K) view: forward over the
    rows; backward over one chunk of rows per thread, each with its partial dw, db."""

    def __init__(self, x, grouping, center, fixed, act=None):
        self.m, self.k = grouping.view
        super().__init__(x, grouping, center, fixed, self.k, act)
        self.ahead = tuning.rows_ahead(self.k, self.itemsize)
        self.chunks = self.threads
        self.forward_entry, self.backward_entry = entries.rows_forward, entries.rows_backward
        self.forward_work = Work(self.m)
        self.backward_work = Work(self.chunks, True,
                                  scratch=2 * self.chunks * self.k * self.sproto.itemsize)


def _ncs_shape(grouping):
    """The (N, C, S) sizes of a batch/instance/group view."""
    v = grouping.view
    return (v[0], v[1] * v[2], v[3]) if grouping.kind == "group" else tuple(v)


class _Channels(_Family):
    """Batch / Instance / GroupNorm: the (N, C, S) sizes, per-channel parameters."""

    def __init__(self, x, grouping, center, fixed, act=None):
        self.n, self.c, self.s = _ncs_shape(grouping)
        super().__init__(x, grouping, center, fixed, self.c, act)
        self.groups = {"batch": self.c, "instance": self.c,
                       "group": grouping.view[1]}[grouping.kind]


class Planes(_Channels):
    """Contiguous NCHW: per channel (BatchNorm, blocks of channels) or per (sample, group)
    of planes (Instance/GroupNorm); planes under ``tuning.SMALL_PLANE`` in plain loops;
    eval BatchNorm on several threads over the N * C planes in memory order. The
    backward's per-plane sums are added up in stage 1. BatchNorm's kernels take an
    activation (``act``)."""

    takes_activation = True

    def __init__(self, x, grouping, center, fixed, act=None):
        super().__init__(x, grouping, center, fixed, act)
        by_channel = grouping.kind == "batch"
        self.small = self.s < tuning.SMALL_PLANE
        units = self.c if by_channel else self.n * self.groups
        # (no larger than C: each kernel call allocates its per-block scratch)
        self.block = min(self.c, tuning.channel_block(self.n * self.s * self.itemsize))
        self.block_bwd = min(self.c, tuning.channel_block(2 * self.n * self.s * self.itemsize))
        self.ahead = tuning.rows_ahead(self.s, self.itemsize)
        e = entries
        if by_channel and fixed and self.threads > 1:   # (one thread: the channel loops)
            self.forward_entry, forward_units = e.channels_fixed, self.n * self.c
        else:
            self.forward_entry = {(True, True): e.channels_small, (True, False): e.channels_forward,
                                  (False, True): e.planes_small,
                                  (False, False): e.planes_forward}[by_channel, self.small]
            forward_units = units
        self.backward_entry = {(True, True): e.channels_small_backward,
                               (True, False): e.channels_backward,
                               (False, True): e.planes_small_backward,
                               (False, False): e.planes_backward}[by_channel, self.small]
        self.forward_work = Work(forward_units)
        self.backward_work = Work(units, True,
                                  scratch=2 * self.n * self.c * self.sproto.itemsize)


class Columns(_Channels):
    """BatchNorm on an (M, C) matrix of rows of channels: channels_last (M = N * S
    positions) or (N, C); chunks of rows, each direction in three stages (``columns``);
    an activation (``act``) too."""

    rows_of_channels = True
    takes_activation = True

    def __init__(self, x, grouping, center, fixed, act=None):
        super().__init__(x, grouping, center, fixed, act)
        self.m = self.n * self.s
        self.rows, self.run = tuning.cl_blocks(self.c, self.itemsize)
        self.chunks = -(-self.m // self.rows)
        scratch = 2 * self.chunks * self.c * 8                     # float64
        self.forward_entry = entries.columns_forward
        self.backward_entry = entries.columns_backward
        self.forward_work = (Work(0, False, self.m) if fixed
                             else Work(self.chunks, True, self.m, scratch))
        self.backward_work = Work(self.chunks, True, self.m, scratch)


class ChannelsLast(_Channels):
    """Instance/GroupNorm on channels_last: per-(n, c) moments over ranges of positions
    merged to the grouping's statistics in float64; with at least a sample per thread,
    the forward is one sample per work item (``channels_last``)."""

    rows_of_channels = True

    def __init__(self, x, grouping, center, fixed, act=None):
        super().__init__(x, grouping, center, fixed, act)
        self.rows, self.run = tuning.cl_blocks(self.c, self.itemsize)
        self.parts = tuning.parts(self.n, self.s, self.threads)
        self.sn, self.cg = self.groups, self.c // self.groups      # unit u = n * sn + c // cg
        self.count = grouping.group_size
        self.per_sample = not fixed and self.n >= self.threads
        units = self.n * self.parts
        scratch = 16 * units * self.c + 4 * self.n * self.c * self.sproto.itemsize
        self.forward_entry, self.backward_entry = entries.cl_forward, entries.cl_backward
        if self.per_sample:
            self.forward_work = Work(self.n)
        elif fixed:
            self.forward_work = Work(0, True, units, scratch)
        else:
            self.forward_work = Work(units, True, units, scratch)
        self.backward_work = Work(units, True, units, scratch)


FAMILIES = {"rows": Rows, "planes": Planes, "columns": Columns, "channels_last": ChannelsLast}
