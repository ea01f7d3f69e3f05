"""The kernels' arguments, declared once: where Python, numba and C++ meet.

The C++ executor calls every kernel through one C signature, ``void(int64 *a, double eps)``.
Each argument has a name and one slot of ``a``, the same in every kernel (``SLOTS``):

``TENSORS``   addresses of contiguous memory, filled by the node per call: the input and
              output (storage dtype), parameters and statistics (statistics dtype),
              ``scratch``, the call's scratch of ``Work.scratch`` bytes (its layout is
              written at the entry that uses it, ``entries``), and the residual-add norms'
              residual ``r``, sum ``h`` and its gradient ``gh`` (0: none)
``PER_CALL``  filled by the node per call: ``from_var`` (fixed statistics come as a
              variance), ``stream`` (non-temporal stores), ``stage``, and the range of work
              items ``[lo, hi)``
``CONSTANTS`` per plan: sizes, flags and tuning choices, filled by name from the plan's
              attributes of the same names (``constants``); ``act``, the code of
              the activation a BatchNorm applies (``normkit.activation.CODES``, 0:
              none), and ``slope``, leaky_relu's slope as the int64 of its float64
              bits (``float_bits``; ``address.float_of_bits`` reads it back, exactly)
              -- read only by a callback compiled ``fused``: without an activation the
              callback passes None for both, so that the kernels compile without its code

An entry's parameters are its declaration (``entries``): ``callback`` compiles it as a
numba ``cfunc`` generated from those names -- ``entry(a[slot of name1], a[slot of
name2], ..., eps, proto, sproto)`` -- and a parameter that is not a slot, or a constant
the plan lacks, is an error when the plan is built. The C++ side takes its slots from
``SLOTS`` too (``native.cpp``'s ``set_slots``, given this table when the extension is
loaded), and refuses a table that lacks one of its names.
"""

from __future__ import annotations

import functools
import inspect
import struct
import sys
import threading
from typing import NamedTuple

from numba import cfunc, types
from numba.core.compiler_lock import global_compiler_lock

from normkit._numba_cache import can_cache

__all__ = ["SLOTS", "TENSORS", "PER_CALL", "CONSTANTS", "Work", "callback", "constants",
           "float_bits", "parameters", "quiet", "compiled", "cached", "NOTICE_AFTER_S"]

TENSORS = ("x", "y", "w", "b", "mean", "rstd", "var", "g", "dx", "dw", "db", "scratch", "r", "h",
           "gh")
PER_CALL = ("from_var", "stream", "stage", "lo", "hi")
CONSTANTS = ("m", "k", "n", "c", "s", "groups", "center", "fixed", "ahead", "block",
             "block_bwd", "small", "rows", "run", "parts", "sn", "cg", "count", "per_sample",
             "chunks", "act", "slope")
SLOTS = {name: slot for slot, name in enumerate(TENSORS + PER_CALL + CONSTANTS)}

#: the constants of a BatchNorm's activation, None in a callback compiled without one
_ACTIVATION = ("act", "slope")
#: the callback's own arguments, after the slots: eps (a double), and the storage and
#: statistics dtypes as empty arrays (compile-time constants of each callback)
_TAIL = ("eps", "proto", "sproto")
_SIGNATURE = types.void(types.CPointer(types.int64), types.float64)


class Work(NamedTuple):
    """How one direction of a plan runs (``native.cpp``'s ``run_stages``): stage 0 over
    ``first`` work items (0: none), stage 1 once on one thread where ``merge``, stage 2
    over ``last`` items (0: none); ``scratch`` bytes of scratch per call."""

    first: int
    merge: bool = False
    last: int = 0
    scratch: int = 0


def float_bits(value: float) -> int:
    """The int64 whose bits are the float64 ``value``: a float constant in an int64 slot.
    (Not a 1-element tensor by address: the C++ plan would have to keep it alive; not the
    value rounded to an integer scale: leaky_relu's slope is any float.)"""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


@functools.cache
def parameters(entry) -> tuple:
    """The slot names an entry reads, in order (its parameters before ``_TAIL``; read
    from its signature once per entry)."""
    names = tuple(inspect.signature(entry.py_func).parameters)
    if names[-len(_TAIL):] != _TAIL:
        raise TypeError(f"{entry.__name__}: a kernel entry ends with the parameters "
                        f"{_TAIL}, got {names}")
    unknown = [n for n in names[:-len(_TAIL)] if n not in SLOTS]
    if unknown:
        raise TypeError(f"{entry.__name__}: parameters {unknown} are not declared slots; "
                        f"declare them in normkit.backends.cpu.args")
    return names[:-len(_TAIL)]


def constants(plan, *entries) -> list:
    """The argument array's base for ``plan``: every constant the entries read, from the
    plan's attribute of that name (ints; booleans as 0/1), the other slots 0."""
    base = [0] * len(SLOTS)
    for entry in entries:
        for name in parameters(entry):
            if name in CONSTANTS:
                if not hasattr(plan, name):
                    raise TypeError(f"{type(plan).__name__} has no {name!r}, which "
                                    f"{entry.__name__} reads")
                base[SLOTS[name]] = int(getattr(plan, name))
    return base


_CALLBACKS = {}

#: a compilation still running after this many seconds (not a load from numba's cache)
#: prints ``_NOTICE`` on standard error, once per process
NOTICE_AFTER_S = 1.0
_NOTICE = "normkit: compiling the CPU kernels of this kind of call (1-11 s each, {}"
_CACHED = ("once per install: cached on disk); `python -m normkit.backends.cpu` compiles "
           "them ahead")
_UNCACHED = ("in each process: numba finds no writable folder to cache them; set "
             "NUMBA_CACHE_DIR)")
_noticed = threading.Event()


def quiet() -> None:
    """No compilation notice in this process (it compiles ahead, on purpose)."""
    _noticed.set()


def _notice() -> None:
    if not _noticed.is_set():
        _noticed.set()
        notice = _NOTICE.format(_CACHED if can_cache(__file__) else _UNCACHED)
        print(notice, file=sys.stderr, flush=True)


def callback(entry, proto, sproto, fused=False):
    """``entry`` as a C callback ``void(int64 *a, double eps)`` for one storage and
    statistics dtype (compiled once per process, or loaded from numba's cache): its body
    is generated from the entry's parameters, one slot read each. An entry that reads
    ``act`` is compiled twice: ``fused``, with the activation of the ``act`` and
    ``slope`` slots, or without one (None in their place: ``act_stores``), which compiles
    in about half the time, its loops exactly those of no activation. A compilation says
    so on standard error (``NOTICE_AFTER_S``), once per process. Threads take numba's
    compiler lock for it, as numba's own calls do: one compiles, the others then find it."""
    key = _key(entry, proto, sproto, fused)
    found = _CALLBACKS.get(key)
    if found is None:
        with global_compiler_lock:
            found = _CALLBACKS.get(key)
            if found is None:
                timer = threading.Timer(NOTICE_AFTER_S, _notice)
                timer.daemon = True
                timer.start()
                try:
                    body = _body(entry, proto, sproto, fused)
                    found = cfunc(_SIGNATURE, cache=can_cache(__file__))(body)
                finally:
                    timer.cancel()
                _CALLBACKS[key] = found
    return found


def compiled(entry, proto, sproto, fused=False) -> bool:
    """Whether ``callback`` of these arguments is made in this process already."""
    return _key(entry, proto, sproto, fused) in _CALLBACKS


def cached(entry, proto, sproto, fused=False) -> bool:
    """Whether numba's cache holds ``callback`` of these arguments (what it looks up);
    True where this numba's modules lack that lookup (nothing is then compiled aside:
    ``compiling``). Under numba's compiler lock: loading refreshes numba's typing
    registries, which another thread's load or compilation may be walking."""
    try:
        from numba.core.caching import FunctionCache
        from numba.core.registry import cpu_target
    except ImportError:
        return True
    if not can_cache(__file__):               # nowhere to cache: every callback compiles
        return False
    with global_compiler_lock:
        return FunctionCache(_body(entry, proto, sproto, fused)).load_overload(
            _SIGNATURE, cpu_target.target_context) is not None


def _key(entry, proto, sproto, fused):
    return entry.__name__, proto.dtype, sproto.dtype, fused and "act" in parameters(entry)


def _body(entry, proto, sproto, fused):
    """The Python function ``callback`` compiles: ``entry`` called with one slot each."""
    fused = _key(entry, proto, sproto, fused)[-1]
    reads = ", ".join("None" if name in _ACTIVATION and not fused else f"a[{SLOTS[name]}]"
                      for name in parameters(entry))
    name = entry.__name__ + ("_fused" if fused else "")
    source = (f"def make(proto, sproto):\n"
              f"    def {name}(a, eps):\n"
              f"        entry({reads}, eps, proto, sproto)\n"
              f"    return {name}\n")
    # (compiled as this file, and under this module's name: numba's cache needs both)
    namespace = {"entry": entry, "__name__": __name__}
    exec(compile(source, __file__, "exec"), namespace)
    return namespace["make"](proto, sproto)
