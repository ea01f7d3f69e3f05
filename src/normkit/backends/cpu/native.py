"""The small-call path: a plan's kernels behind a C++ autograd node (``native.cpp``).

On a small tensor a normalization's cost is the Python around its kernel, most of it the
Python ``autograd.Function`` and the plan's calls inside it (``docs/performance.md``, "A
C++ autograd node, measured"). So for a plan, this module compiles the plan's two kernels
as C callbacks (``numba.cfunc``, each a thin wrapper around the entry in ``entries`` that
the Python plan calls: the same code, compiled with the entry inlined, so the same
results to rounding -- the re-associable reductions of ``half.accumulate`` may be split
into lanes otherwise) and hands their addresses, with the plan's constant arguments and
its split of the work (``_work``), to a ``Plan`` of the C++ extension. Its ``apply`` runs
a ``torch::autograd::Function``: allocation with ATen, the forward kernel, the saved
tensors and, on backward, the backward kernel, with no Python in between; its
``forward`` does the same without a graph (no gradient to record, eval BatchNorm). A
threaded plan's kernels run in ranges on torch's OpenMP team, opened from C++
(``_parallel.team_addresses``), the ranges of the Python launch.

Where it runs (``node`` gives None otherwise, and the Python plan runs): a contiguous
input in the ``rows`` and ``planes`` families (LayerNorm/RMSNorm; Batch/Instance/GroupNorm
on NCHW), or a channels_last input (BatchNorm: ``columns``, also (N, C); Instance/GroupNorm
with batch statistics: ``channels_last``), whose plan neither streams its output
(``tuning.stream_out``: from the last level cache's size, where the kernel's time dwarfs a
call's) nor asks for huge pages (``NORMKIT_HUGE_PAGES=1``), serial or threaded on torch's
OpenMP runtime (a threaded plan without one, on normkit's thread pool, stays in Python). A
double backward (``create_graph=True``) goes from the C++ node to
``torch.ops.normkit.norm_backward``, whose autograd differentiates the formula, as on the
Python path.

The extension is compiled with ``torch.utils.cpp_extension.load`` the first time it is
needed on a machine (a C++ compiler and ninja, about 35 s; cached in torch's extension
folder, ``TORCH_EXTENSIONS_DIR``, and loaded in milliseconds after);
``python -m normkit.backends.cpu`` compiles it ahead of time (``make setup`` does).
Without a compiler the build fails once, with a warning, and every call takes the Python
path. ``NORMKIT_NATIVE=0`` in the environment switches the path off.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path

from numba import cfunc, types

from normkit.backends import _parallel
from normkit.backends.cpu import entries

__all__ = ["extension", "node", "enabled", "switch", "threads_in_cpp"]

SIGNATURE = types.void(types.CPointer(types.int64), types.float64)
STAGE, SUMS, LO, HI = 20, 21, 22, 23    # native.cpp: kStage, kSums, kLo, kHi

# The kernels' argument arrays (native.cpp): forward a = (x, y, w, b, mean, rstd, var,
# from_var, constants...), backward a = (g, x, dx, w, mean, rstd, dw, db, constants...);
# a[SUMS]: a threaded planes backward's (2, N, C) sums (0: none), or the columns' scratch;
# a[STAGE]: the columns' stage; a[LO], a[HI]: the range of work items of this call (one
# thread's, or all of them).
# proto and sproto, empty arrays of the storage and statistics dtypes, are compile-time
# constants of each callback (closure variables; numba's cache keys on them).


def _rows(proto, sproto):
    """constants (M, K, center, ahead) forward, (M, K, center, ahead, chunks) backward."""
    @cfunc(SIGNATURE, cache=True)
    def forward(a, eps):
        entries.rows_forward((a[0], a[1], a[2], a[3], a[4], a[5], a[6]), a[8], a[9], proto,
                             sproto, eps, a[10] != 0, (False, a[11]), a[LO], a[HI])

    @cfunc(SIGNATURE, cache=True)
    def backward(a, eps):
        entries.rows_backward((a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]), a[8], a[9],
                              a[12], proto, sproto, a[10] != 0, (False, a[11]), a[LO], a[HI])

    return forward, backward


def _channels_small(proto, sproto):
    """constants (N, C, S, fixed) forward, (N, C, S, center, fixed) backward."""
    @cfunc(SIGNATURE, cache=True)
    def forward(a, eps):
        entries.channels_small((a[0], a[1], a[2], a[3], a[4], a[5], a[6]), (a[8], a[9], a[10]),
                               proto, sproto, eps, a[11] != 0, a[7] != 0, a[LO], a[HI])

    @cfunc(SIGNATURE, cache=True)
    def backward(a, eps):
        entries.channels_small_backward((a[0], a[1], a[2], a[3], a[4], a[5], a[SUMS], a[7],
                                         a[6]), (a[8], a[9], a[10]), proto, sproto, a[11] != 0,
                                        a[12] != 0, a[LO], a[HI])

    return forward, backward


def _planes_small(proto, sproto):
    """constants (N, C, S, groups, fixed) forward, (N, C, S, groups, center, fixed)
    backward."""
    @cfunc(SIGNATURE, cache=True)
    def forward(a, eps):
        entries.planes_small((a[0], a[1], a[2], a[3], a[4], a[5], a[6]), (a[8], a[9], a[10]),
                             a[11], proto, sproto, eps, a[12] != 0, a[7] != 0, a[LO], a[HI])

    @cfunc(SIGNATURE, cache=True)
    def backward(a, eps):
        entries.planes_small_backward((a[0], a[1], a[2], a[3], a[4], a[5], a[SUMS], a[7],
                                       a[6]), (a[8], a[9], a[10]), a[11], proto, sproto,
                                      a[12] != 0, a[13] != 0, a[LO], a[HI])

    return forward, backward


def _channels(proto, sproto):
    """constants (N, C, S, fixed, block) forward, (N, C, S, block, center, fixed)
    backward."""
    @cfunc(SIGNATURE, cache=True)
    def forward(a, eps):
        entries.channels_forward((a[0], a[1], a[2], a[3], a[4], a[5], a[6]),
                                 (a[8], a[9], a[10]), proto, sproto, eps, a[11] != 0,
                                 a[7] != 0, a[12], False, a[LO], a[HI])

    @cfunc(SIGNATURE, cache=True)
    def backward(a, eps):
        entries.channels_backward((a[0], a[1], a[2], a[3], a[4], a[5], a[SUMS], a[7], a[6]),
                                  (a[8], a[9], a[10]), proto, sproto, a[11], a[12] != 0,
                                  a[13] != 0, False, a[LO], a[HI])

    return forward, backward


def _planes(proto, sproto):
    """constants (N, C, S, groups, fixed, ahead) forward, (N, C, S, groups, center, fixed,
    ahead) backward."""
    @cfunc(SIGNATURE, cache=True)
    def forward(a, eps):
        entries.planes_forward((a[0], a[1], a[2], a[3], a[4], a[5], a[6]), (a[8], a[9], a[10]),
                               a[11], proto, sproto, eps, a[12] != 0, a[7] != 0,
                               (False, a[13]), a[LO], a[HI])

    @cfunc(SIGNATURE, cache=True)
    def backward(a, eps):
        entries.planes_backward((a[0], a[1], a[2], a[3], a[4], a[5], a[SUMS], a[7], a[6]),
                                (a[8], a[9], a[10]), a[11], proto, sproto, a[12] != 0,
                                a[13] != 0, (False, a[14]), a[LO], a[HI])

    return forward, backward


def _channels_fixed(proto, sproto):
    """constants (N, C, S, ahead, small) forward (eval BatchNorm over the N * C planes);
    the backward of ``_channels``, with its constants."""
    @cfunc(SIGNATURE, cache=True)
    def forward(a, eps):
        entries.channels_fixed((a[0], a[1], a[2], a[3], a[4], a[5], a[6]), (a[8], a[9], a[10]),
                               proto, sproto, eps, a[7] != 0, a[12] != 0, (False, a[11]),
                               a[LO], a[HI])

    return forward, _kernels(_channels, proto, sproto)[1]


def _channels_fixed_small(proto, sproto):
    """``_channels_fixed``'s forward, the backward of ``_channels_small``."""
    return (_kernels(_channels_fixed, proto, sproto)[0],
            _kernels(_channels_small, proto, sproto)[1])


def _columns(proto, sproto):
    """constants (M, C, rows, run) forward, (M, C, rows, run, center, fixed) backward;
    a[STAGE]: the stage (``columns``), a[SUMS]: the (2, chunks, C) float64 scratch."""
    @cfunc(SIGNATURE, cache=True)
    def forward(a, eps):
        entries.columns_forward((a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[SUMS]),
                                (a[8], a[9], a[10], a[11]), proto, sproto, eps, a[7] != 0,
                                False, a[STAGE], a[LO], a[HI])

    @cfunc(SIGNATURE, cache=True)
    def backward(a, eps):
        entries.columns_backward((a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[SUMS]),
                                 (a[8], a[9], a[10], a[11]), proto, sproto, a[12] != 0,
                                 a[13] != 0, False, a[STAGE], a[LO], a[HI])

    return forward, backward


def _channels_last(proto, sproto):
    """constants (N, C, S, parts, block, run, sn, cg) and per_sample forward, (N, .., cg)
    and (count, center, fixed) backward; a[STAGE], a[SUMS] as for ``_columns``
    (``entries.cl_forward``)."""
    @cfunc(SIGNATURE, cache=True)
    def forward(a, eps):
        entries.cl_forward((a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[SUMS]),
                           (a[8], a[9], a[10], a[11]), (a[12], a[13]), (a[14], a[15]), proto,
                           sproto, eps, a[16] != 0, a[STAGE], a[LO], a[HI])

    @cfunc(SIGNATURE, cache=True)
    def backward(a, eps):
        entries.cl_backward((a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[SUMS]),
                            (a[8], a[9], a[10], a[11]), (a[12], a[13]), (a[14], a[15]),
                            float(a[16]), proto, sproto, a[17] != 0, a[18] != 0, a[STAGE],
                            a[LO], a[HI])

    return forward, backward


_KERNELS = {}


def _kernels(family, proto, sproto):
    """The (forward, backward) callbacks of a family for a storage and statistics dtype,
    compiled once (or loaded from numba's cache)."""
    key = (family.__name__, proto.dtype, sproto.dtype)
    found = _KERNELS.get(key)
    if found is None:
        found = _KERNELS[key] = family(proto, sproto)
    return found


ROW_CHUNKS, PLANE_SUMS, STAGED = 1, 2, 3    # native.cpp: Partials


def _work(plan):
    """(forward units, backward units, threads, partials, partial rows[, stage-0 units[,
    forward stage-0 units]]) of a plan, as its Python ``run`` splits the work (``plans``):
    rows over M forward and over one chunk per thread backward, each chunk with its (K,)
    partial gradients; planes over their units both ways, a threaded backward leaving
    (2, N, C) sums; columns in stages, over their chunks of rows and then over the rows,
    both ways (``columns``); channels_last in stages over (sample, range of positions)
    items, its forward per sample in stage 0 alone where ``plan.per_sample`` (no stage 2
    units)."""
    if plan.cpp_family == "rows":
        return [plan.m, plan.threads, plan.threads, ROW_CHUNKS, plan.threads]
    if plan.cpp_family == "columns":
        return [plan.mcr[0], plan.mcr[0], plan.threads, STAGED, plan.chunks]
    if plan.cpp_family == "channels_last":                 # (scratch: see entries.cl_*)
        units = plan.n * plan.parts
        if plan.per_sample:
            return [0, units, plan.threads, STAGED, units + 2 * plan.n, units, plan.n]
        return [units, units, plan.threads, STAGED, units + 2 * plan.n, units]
    return [plan.forward_units, plan.units, plan.threads, PLANE_SUMS, plan.n]


def _family(plan):
    """(callback family, forward constants, backward constants, zero the gradients) of a
    Python plan (``plans``), or None where the family has no callbacks."""
    if plan.cpp_family == "rows":
        consts = [plan.m, plan.k, int(plan.center), plan.ahead]
        return _rows, consts, consts + [plan.threads], True
    if plan.cpp_family == "columns":
        consts = list(plan.mcr)
        return _columns, consts, consts + [int(plan.center), int(plan.fixed)], False
    if plan.cpp_family == "channels_last":
        consts = [plan.n, plan.c, plan.s, plan.parts, *plan.blocks, *plan.unit]
        return (_channels_last, consts + [int(plan.per_sample)],
                consts + [plan.grouping.group_size, int(plan.center), int(plan.fixed)], False)
    if plan.cpp_family != "planes":
        return None
    ncs, center, fixed = list(plan.ncs), int(plan.center), int(plan.fixed)
    if plan.plane_order:
        family = _channels_fixed_small if plan.small else _channels_fixed
        backward = ncs + [center, fixed] if plan.small else ncs + [plan.block_bwd, center,
                                                                    fixed]
        return family, ncs + [plan.ahead, int(plan.small)], backward, False
    if plan.by_channel and plan.small:
        return _channels_small, ncs + [fixed], ncs + [center, fixed], False
    if plan.small:
        return (_planes_small, ncs + [plan.groups, fixed], ncs + [plan.groups, center, fixed],
                False)
    if plan.by_channel:
        return (_channels, ncs + [fixed, plan.block], ncs + [plan.block_bwd, center, fixed],
                False)
    return (_planes, ncs + [plan.groups, fixed, plan.ahead],
            ncs + [plan.groups, center, fixed, plan.ahead], False)


def threads_in_cpp() -> bool:
    """Whether a plan of the rows or planes family would run its threads from its C++ node
    (the extension loaded, torch's OpenMP runtime found): ``tuning.threads`` splits
    smaller inputs then."""
    return _parallel.backend() == "openmp" and extension() is not None


def node(plan, x):
    """The C++ ``Plan`` that runs the calls of this Python plan, built for ``x``, or None
    (see the module's docstring for where; the extension unavailable or switched off)."""
    if plan.may_stream or plan.large or (plan.threads > 1 and _parallel.backend() != "openmp"):
        return None
    found = _family(plan)
    if found is None:
        return None
    ext = extension()
    if ext is None:
        return None
    family, forward_consts, backward_consts, zero_grads = found
    forward, backward = _kernels(family, plan.proto, plan.sproto)
    g = plan.grouping
    return ext.Plan(x.new_empty(0), forward.address, backward.address, forward_consts,
                    backward_consts, list(plan.stat_shape), plan.ones, plan.zeros, zero_grads,
                    g.kind, list(g.view), list(g.reduce),
                    None if g.param_view is None else list(g.param_view), plan.center,
                    _work(plan))


def enabled() -> bool:
    """Whether the environment leaves the path on (``NORMKIT_NATIVE`` unset, or not 0)."""
    return os.environ.get("NORMKIT_NATIVE", "1").strip().lower() not in ("0", "false", "no",
                                                                           "off")


_extension = None          # the loaded module; False: unavailable or switched off


def extension():
    """The compiled C++ extension (built on first use), or None."""
    global _extension
    if _extension is None:
        _extension = _load() if enabled() else False
    return _extension or None


def switch(on: bool) -> None:
    """Turn the path on (the extension loaded at the next plan, unless ``NORMKIT_NATIVE=0``)
    or off for this process, and forget every plan so that the next calls choose again
    (tests run both paths this way)."""
    global _extension
    import normkit.backends as dispatch

    _extension = None if on else False
    dispatch.clear_plans()


def _load():
    source = Path(__file__).with_name("native.cpp")
    try:
        from torch.utils import cpp_extension

        _say_if_building(cpp_extension, source)
        with _ninja_on_path():
            ext = cpp_extension.load(name="normkit_native", sources=[str(source)],
                                     extra_cflags=["-O2"])
        team = _parallel.team_addresses()
        if team is not None:
            ext.set_team(*team)
        return ext
    except Exception as error:   # no compiler, no ninja, no headers: the composite path
        warnings.warn(
            f"normkit could not build its C++ node ({type(error).__name__}: "
            f"...{str(error)[-600:]}); normalizations take the slower composite torch path. "
            f"It needs a C++ compiler and ninja (`pip install ninja`); set NORMKIT_NATIVE=0 "
            f"to skip the attempt", RuntimeWarning, stacklevel=2)
        return False


def _say_if_building(cpp_extension, source) -> None:
    """One line on standard error before a build (none built for this source yet): what,
    how long, and how to do it ahead of time."""
    folder = Path(cpp_extension._get_build_directory("normkit_native", False))
    newer = source.stat().st_mtime
    ninja = folder / "build.ninja"
    if (ninja.exists() and str(source) in ninja.read_text()
            and any(p.stat().st_mtime >= newer for p in folder.glob("normkit_native*.so"))):
        return
    print("normkit: compiling its C++ node once for this machine (about 30-60 s); "
          "`python -m normkit.backends.cpu` does it ahead of time", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _ninja_on_path():
    """The ninja of the ``ninja`` package (the ``fast`` extra) on PATH for the build alone,
    where PATH has none (torch's build looks it up there); PATH restored after."""
    try:
        import ninja
    except ImportError:
        yield
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR in path.split(os.pathsep):
        yield
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path
