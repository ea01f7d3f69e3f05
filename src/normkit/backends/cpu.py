"""Fused CPU kernels (numba): the fast path of every normalization on CPU.

Same interface as ``normkit.backends.torch_ops`` (``supports``, ``forward``,
``backward``); the dispatch in ``normkit.backends`` tries this module first and skips it
when numba (the ``fast`` extra) is missing.

Memory is shared with torch, never copied: a detached CPU tensor's ``.numpy()`` is a view
of its storage. Half-precision inputs are viewed as 16-bit integers and converted in
registers -- bfloat16 as the top half of a float32, float16 by the F16C instructions LLVM
emits for ``fpext``/``fptrunc`` -- bfloat16 seen as ``uint16``, float16 as ``int16``, so
that each kernel compiles (on first use) one specialization per dtype with the conversion
fixed in it. Statistics are float32 (float64 for float64 inputs), merged across blocks in
float64.

Kernel families, each a serial loop over a range of independent work items, run on one
range per thread by ``_launch`` (``normkit.backends._parallel``: torch's OpenMP team):

``_rows_*``   LayerNorm / RMSNorm on a contiguous (M, K) view: one row per iteration.
              Forward: two passes over the row (mean, then squared deviations) while it
              sits in L1, a third writes y. Backward: rows split in one chunk per thread,
              each chunk keeping its own partial dweight/dbias, summed afterwards.
``_units_*``  Batch/Instance/GroupNorm on contiguous NCHW, viewed (N, C, S): one *unit*
              (the set of (n, c) planes sharing a statistic: a channel for BatchNorm, a
              (sample, group) for GroupNorm, a plane for InstanceNorm) per iteration.
              Each plane's moments come from a two-pass over the plane (the first of a
              unit) or one pass shifted by the running mean (the others), merged across
              planes by Chan's formula; the unit is then normalized while still in L2,
              so x is read from memory once. BatchNorm is ``_channels_fwd`` and
              ``_channels_bwd``: blocks of channels walked sample by sample, so that
              the planes read in a row are adjacent in memory.
``_cl_*``     the same three on channels_last, viewed (N, S*C): rows of C channels.
              Per-(n, c) moments over blocks of rows (sums shifted by a mean already
              known, read as runs of rows into lanes, Chan merge across blocks), merged
              into the grouping's statistics in float64 by ``_cl_stats`` (one serial
              call, which also makes the coefficients), then one pass applies
              per-(n, c) coefficients.

Backward everywhere: with ``dxhat = g * w``, ``c1 = mean(dxhat * xhat)`` and
``c2 = mean(dxhat)`` over the group (``c2 = 0`` without centering, both 0 for fixed
statistics), ``dx = rstd * (dxhat - c2 - xhat * c1)``; ``xhat`` is recomputed from the
saved x, mean and rstd. ``dweight = sum(g * xhat)`` and ``dbias = sum(g)`` are written
per thread or per (n, c) plane and reduced afterwards, so no two iterations write the
same memory.

Large float32/float64 outputs of every family are written with non-temporal stores
when their memory is already mapped (the ``*_nt`` intrinsics, which compute the output
in vectors and stream each, the same bits as the plain loops; see ``_stream_out``);
half-precision and small outputs store plainly. The rows and NCHW units kernels
prefetch the row or plane about 8 KiB ahead while writing the output (``_rows_ahead``).

Compiled kernels are cached on disk (``cache=True``, in ``__pycache__`` next to this
file or ``NUMBA_CACHE_DIR``); see ``docs/performance.md`` for the first-call cost.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
from llvmlite import ir
from numba import njit
from numba.core import cgutils
from numba.core import types as nbt
from numba.extending import intrinsic, overload, register_jitable

from normkit.backends import _memory
from normkit.backends._memory import empty_like as _empty_like
from normkit.backends._parallel import launch as _launch
from normkit.backends.torch_ops import stat_dtype

# strict IEEE arithmetic (so that the shifted sums below are not re-associated away); the
# scalar reductions alone are marked re-associable by ``_acc``, which lets LLVM vectorize
# them
_JIT = dict(cache=True, nogil=True)

# storage dtype seen by the kernels for each torch dtype
_STORAGE = {
    torch.float64: torch.float64,
    torch.float32: torch.float32,
    torch.bfloat16: torch.uint16,   # the bits, told apart by the integer type: each
    torch.float16: torch.int16,     # 16-bit format compiles a kernel of its own
}
_KINDS = ("layer", "batch", "instance", "group")
_BLOCK_BYTES = 256 * 1024  # channels_last reductions: rows of C per block of lane sums
_RUN_LANES = 512           # channels_last reductions: elements per run of lanes


# ---------------------------------------------------------------------------------------
# half precision in registers
# ---------------------------------------------------------------------------------------

@intrinsic
def _bf16_to_f32(typingctx, h):
    """uint16 bits of a bfloat16 -> float32 (the bits are the float32's top half)."""
    def codegen(context, builder, sig, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())
    return nbt.float32(h), codegen


@intrinsic
def _f32_to_bf16(typingctx, f):
    """float32 -> uint16 bits of a bfloat16, rounded to nearest even; NaN -> 0x7FC0."""
    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        bits = builder.bitcast(args[0], i32)
        lsb = builder.and_(builder.lshr(bits, ir.Constant(i32, 16)), ir.Constant(i32, 1))
        rounded = builder.add(bits, builder.add(lsb, ir.Constant(i32, 0x7FFF)))
        hi = builder.trunc(builder.lshr(rounded, ir.Constant(i32, 16)), ir.IntType(16))
        isnan = builder.fcmp_unordered("uno", args[0], args[0])
        return builder.select(isnan, ir.Constant(ir.IntType(16), 0x7FC0), hi)
    return nbt.uint16(nbt.float32), codegen


@intrinsic
def _f16_to_f32(typingctx, h):
    """int16 bits of a float16 -> float32."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return nbt.float32(h), codegen


@intrinsic
def _f32_to_f16(typingctx, f):
    """float32 -> int16 bits of a float16, rounded to nearest even."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return nbt.int16(nbt.float32), codegen


@intrinsic
def _acc(typingctx, acc, v):
    """``acc + v`` marked re-associable: a reduction LLVM may split into vector lanes."""
    if acc != v:
        return None

    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1], flags=("reassoc", "nsz"))
    return acc(acc, v), codegen


def _ld(a, i):
    """``a[i]`` as the compute type (float32; float64 for float64 storage). ``uint16``
    storage holds bfloat16 bits, ``int16`` storage float16 bits."""


def _st(a, i, v):
    """``a[i] = v`` converted to the storage type."""


def _as(a, v):
    """``v`` as the dtype of the float array ``a``."""


@overload(_ld)
def _ld_impl(a, i):
    if a.dtype == nbt.uint16:
        return lambda a, i: _bf16_to_f32(a[i])
    if a.dtype == nbt.int16:
        return lambda a, i: _f16_to_f32(a[i])
    return lambda a, i: a[i]


@overload(_st)
def _st_impl(a, i, v):
    if a.dtype == nbt.uint16:
        def st_bf16(a, i, v):
            a[i] = _f32_to_bf16(np.float32(v))
        return st_bf16
    if a.dtype == nbt.int16:
        def st_f16(a, i, v):
            a[i] = _f32_to_f16(np.float32(v))
        return st_f16

    def st(a, i, v):
        a[i] = v
    return st


@overload(_as)
def _as_impl(a, v):
    if a.dtype == nbt.float64:
        return lambda a, v: np.float64(v)
    return lambda a, v: np.float32(v)


# ---------------------------------------------------------------------------------------
# streaming (non-temporal) output
# ---------------------------------------------------------------------------------------

# Large float32/float64 outputs are written with non-temporal stores, which skip reading
# each destination line into the cache before overwriting it (a third of the memory
# traffic of a one-input elementwise op). See ``_stream_out`` for when. Each output
# formula has an intrinsic of its own that computes it in 64-byte vectors and stores each
# with LLVM's ``!nontemporal`` (``vmovntps``/``vmovntpd``), the same IEEE operations in the
# same order as the plain ``*_span`` loop (no contraction into FMAs), so the same bits.
# (Computing a chunk into an L1 buffer and streaming the buffer, as before, cost an extra
# store and load per element: 6.2-7.3 ms against 5.2-5.3 for the fused loop on a 100 MiB
# plane affine, a copy_ 6.6-6.9.)


def _streamed_map(n_inputs, expr):
    """Codegen of ``f(dst, in_1..in_n, s_1..s_m)``: dst[i] = expr(in_1[i].., s_1..) for
    contiguous 1-d arrays of one float dtype and length, the 64-byte-aligned interior of
    dst written in vectors with non-temporal stores, the unaligned ends element by
    element with plain ones. expr(builder, inputs, scalars) builds the value from scalars
    or vectors alike."""
    def codegen(context, builder, sig, args):
        i64, i32 = ir.IntType(64), ir.IntType(32)
        arrays = [context.make_array(t)(context, builder, v)
                  for t, v in zip(sig.args[:1 + n_inputs], args[:1 + n_inputs])]
        dst, srcs = arrays[0].data, [a.data for a in arrays[1:]]
        scalars = list(args[1 + n_inputs:])
        dty = context.get_data_type(sig.args[0].dtype)
        size = context.get_abi_sizeof(dty)
        lanes = 64 // size
        n = builder.extract_value(arrays[0].shape, 0)

        def one(i):
            vals = [builder.load(builder.gep(p, [i])) for p in srcs]
            builder.store(expr(builder, vals, scalars), builder.gep(dst, [i]))

        def each(start, count):
            with cgutils.for_range(builder, count) as loop:
                one(builder.add(start, loop.index))

        head = builder.and_(builder.neg(builder.ptrtoint(dst, i64)), ir.Constant(i64, 63))
        head = builder.udiv(head, ir.Constant(i64, size))         # elements to alignment
        head = builder.select(builder.icmp_unsigned("<", head, n), head, n)
        each(ir.Constant(i64, 0), head)
        vt = ir.VectorType(dty, lanes)
        zeros = ir.Constant(ir.VectorType(i32, lanes), None)

        def splat(v):
            v = builder.insert_element(ir.Constant(vt, ir.Undefined), v, ir.Constant(i32, 0))
            return builder.shuffle_vector(v, v, zeros)
        vscalars = [splat(v) for v in scalars]
        nontemporal = builder.module.add_metadata([ir.Constant(i32, 1)])
        blocks = builder.udiv(builder.sub(n, head), ir.Constant(i64, lanes))
        with cgutils.for_range(builder, blocks) as loop:
            off = builder.add(head, builder.mul(loop.index, ir.Constant(i64, lanes)))
            vals = [builder.load(builder.bitcast(builder.gep(p, [off]), vt.as_pointer()),
                                 align=size) for p in srcs]
            st = builder.store(expr(builder, vals, vscalars),
                               builder.bitcast(builder.gep(dst, [off]), vt.as_pointer()),
                               align=64)
            st.set_metadata("nontemporal", nontemporal)
        done = builder.add(head, builder.mul(blocks, ir.Constant(i64, lanes)))
        each(done, builder.sub(n, done))
        return context.get_dummy_value()
    return codegen


def _streamed_sig(arrays, n_scalars):
    """The signature of a ``_streamed_map`` intrinsic, or None (a typing error) unless the
    arrays are contiguous 1-d float32 or float64 arrays of one dtype."""
    if not all(isinstance(a, nbt.Array) and a.ndim == 1 and a.layout == "C"
               and a.dtype == arrays[0].dtype for a in arrays):
        return None
    dt = arrays[0].dtype
    if dt not in (nbt.float32, nbt.float64):
        return None
    return nbt.none(*arrays, *([dt] * n_scalars))


@intrinsic
def _plane_affine_nt(typingctx, ys, xs, x0, mr, sc, sh):
    """``_plane_affine_span`` with non-temporal stores: ys = ((xs - x0) - mr) * sc + sh."""
    sig = _streamed_sig([ys, xs], 4)
    return sig and (sig, _streamed_map(1, lambda b, v, s: b.fadd(
        b.fmul(b.fsub(b.fsub(v[0], s[0]), s[1]), s[2]), s[3])))


@intrinsic
def _row_affine_nt(typingctx, ys, xs, ws, bs, x0, mr, rs):
    """``_row_affine_span`` with non-temporal stores: ys = ((xs - x0) - mr) * (rs * ws)
    + bs."""
    sig = _streamed_sig([ys, xs, ws, bs], 3)
    return sig and (sig, _streamed_map(3, lambda b, v, s: b.fadd(
        b.fmul(b.fsub(b.fsub(v[0], s[0]), s[1]), b.fmul(s[2], v[1])), v[2])))


@intrinsic
def _row_dx_nt(typingctx, ds, gs, xs, ws, mu, rs, c1, c2):
    """``_row_dx_span`` with non-temporal stores: ds = (gs * ws - c2 - xhat * c1) * rs,
    xhat = (xs - mu) * rs."""
    sig = _streamed_sig([ds, gs, xs, ws], 4)
    return sig and (sig, _streamed_map(3, lambda b, v, s: b.fmul(b.fsub(
        b.fsub(b.fmul(v[0], v[2]), s[3]), b.fmul(b.fmul(b.fsub(v[1], s[0]), s[1]), s[2])),
        s[1])))


@intrinsic
def _plane_dx_nt(typingctx, ds, gs, xs, mu, rs, wc, k1, k2):
    """``_plane_dx_span`` with non-temporal stores: ds = (gs * wc - k2 - xhat * k1) * rs,
    xhat = (xs - mu) * rs."""
    sig = _streamed_sig([ds, gs, xs], 5)
    return sig and (sig, _streamed_map(2, lambda b, v, s: b.fmul(b.fsub(
        b.fsub(b.fmul(v[0], s[2]), s[4]), b.fmul(b.fmul(b.fsub(v[1], s[0]), s[1]), s[3])),
        s[1])))


@intrinsic
def _cl_affine_nt(typingctx, ys, xs, mu, sc, sh):
    """A row of ``_cl_affine`` with non-temporal stores: ys = (xs - mu) * sc + sh, all
    per-channel rows."""
    sig = _streamed_sig([ys, xs, mu, sc, sh], 0)
    return sig and (sig, _streamed_map(4, lambda b, v, s: b.fadd(
        b.fmul(b.fsub(v[0], v[1]), v[2]), v[3])))


@intrinsic
def _cl_dx_nt(typingctx, ds, gs, xs, mu, k1, k2, k3):
    """A row of ``_cl_bwd_apply`` with non-temporal stores: ds = gs * k1 - (xs - mu) * k2
    - k3, all per-channel rows."""
    sig = _streamed_sig([ds, gs, xs, mu, k1, k2, k3], 0)
    return sig and (sig, _streamed_map(6, lambda b, v, s: b.fsub(
        b.fsub(b.fmul(v[0], v[3]), b.fmul(b.fsub(v[1], v[2]), v[4])), v[5])))


@intrinsic
def _fence(typingctx):
    """A full memory fence (``mfence``): orders the non-temporal stores before it with
    whatever the thread does next (they are weakly ordered otherwise)."""
    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return nbt.none(), codegen


@intrinsic
def _prefetch(typingctx, a, i):
    """Ask for the cache line of ``a[i]`` to be brought into L2 (LLVM ``llvm.prefetch``,
    read, locality 2: ``prefetcht1`` on x86); a hint, with no effect on any value."""
    if not (isinstance(a, nbt.Array) and a.ndim == 1 and isinstance(i, nbt.Integer)):
        return None

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        ptr = builder.bitcast(builder.gep(arr.data, [args[1]]), i8p)
        fn = builder.module.declare_intrinsic(
            "llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return nbt.none(a, i), codegen


@register_jitable
def _prefetch_lines(a, i0, i1):
    """``_prefetch`` the cache lines of a[i0:i1] (clipped to a)."""
    for i in range(i0, min(i1, a.shape[0]), max(1, 64 // a.itemsize)):
        _prefetch(a, i)


# Each output loop is a ``*_span`` helper over a contiguous span: called once on the whole
# span for half precision (a chunked loop costs the half-precision kernels 5-13 %), in
# pieces with prefetches between them for float32/float64, or replaced by its streaming
# twin (``*_nt``) when the output is streamed.


# ---------------------------------------------------------------------------------------
# LayerNorm / RMSNorm: rows of a contiguous (M, K) view
# ---------------------------------------------------------------------------------------

@register_jitable
def _row_affine_span(xs, ys, ws, bs, x0, mr, rs):
    """ys = ((xs - x0) - mr) * (rs * ws) + bs."""
    for i in range(xs.shape[0]):
        _st(ys, i, ((_ld(xs, i) - x0) - mr) * (rs * ws[i]) + bs[i])


@register_jitable
def _row_dx_span(gs, xs, ws, ds, mu, rs, c1, c2):
    """ds = (gs * ws - c2 - xhat * c1) * rs, xhat = (xs - mu) * rs."""
    for i in range(xs.shape[0]):
        xh = (_ld(xs, i) - mu) * rs
        _st(ds, i, (_ld(gs, i) * ws[i] - c2 - xh * c1) * rs)


# The rows kernels read a row from memory once, then work on it in L1 (statistics, then
# the output) with no memory traffic in flight, and the hardware prefetcher stops at each
# 4 KiB page. So while writing row r's output they prefetch row r + ahead
# (``_rows_ahead``), a piece of _PF_SPAN elements after each piece of output: spread out,
# not all at once (a whole 16 KiB row at once gained nothing).
_PF_SPAN = 512


def _half(a):
    """Whether the numba array type a holds half-precision bits (bfloat16 or float16)."""
    return a.dtype in (nbt.uint16, nbt.int16)


def _row_affine(xs, ys, ws, bs, x0, mr, rs, pa, nt):
    """``_row_affine_span``, streamed (``_row_affine_nt``) when nt, with the prefetch of
    pa (the same span of a row ahead; empty: none) spread over it. Half precision never
    streams nor prefetches (``_stream_out``, ``_rows_ahead``), so its kernels get the
    plain whole-span loop, and compile nothing more."""


@overload(_row_affine)
def _row_affine_impl(xs, ys, ws, bs, x0, mr, rs, pa, nt):
    if _half(xs):
        return lambda xs, ys, ws, bs, x0, mr, rs, pa, nt: _row_affine_span(
            xs, ys, ws, bs, x0, mr, rs)

    def impl(xs, ys, ws, bs, x0, mr, rs, pa, nt):
        for i0 in range(0, xs.shape[0], _PF_SPAN):
            i1 = min(xs.shape[0], i0 + _PF_SPAN)
            if nt:
                _row_affine_nt(ys[i0:i1], xs[i0:i1], ws[i0:i1], bs[i0:i1], x0, mr, rs)
            else:
                _row_affine_span(xs[i0:i1], ys[i0:i1], ws[i0:i1], bs[i0:i1], x0, mr, rs)
            _prefetch_lines(pa, i0, i1)
    return impl


def _row_dx(gs, xs, ws, ds, mu, rs, c1, c2, pg, px, nt):
    """``_row_dx_span``, streamed when nt, with the prefetch of pg and px (rows ahead of
    g and x; empty: none) spread over it; the plain loop for half precision."""


@overload(_row_dx)
def _row_dx_impl(gs, xs, ws, ds, mu, rs, c1, c2, pg, px, nt):
    if _half(xs):
        return lambda gs, xs, ws, ds, mu, rs, c1, c2, pg, px, nt: _row_dx_span(
            gs, xs, ws, ds, mu, rs, c1, c2)

    def impl(gs, xs, ws, ds, mu, rs, c1, c2, pg, px, nt):
        for i0 in range(0, xs.shape[0], _PF_SPAN):
            i1 = min(xs.shape[0], i0 + _PF_SPAN)
            if nt:
                _row_dx_nt(ds[i0:i1], gs[i0:i1], xs[i0:i1], ws[i0:i1], mu, rs, c1, c2)
            else:
                _row_dx_span(gs[i0:i1], xs[i0:i1], ws[i0:i1], ds[i0:i1], mu, rs, c1, c2)
            _prefetch_lines(pg, i0, i1)
            _prefetch_lines(px, i0, i1)
    return impl


@njit(**_JIT)
def _rows_fwd(x, y, w, b, eps, center, mean, rstd, var, nt, ahead, lo, hi):
    """y = (x - mean) * rstd * w + b per row; mean = 0 and var = mean(x**2) without
    centering. x, y: (M, K) storage; w, b: (K,) stat dtype; mean, rstd, var: (M,);
    nt: stream y (``_stream_out``); ahead: prefetch row r + ahead while on row r, 0 for
    none (``_rows_ahead``)."""
    m, k = x.shape
    inv_k = _as(mean, 1.0 / k)
    for r in range(lo, hi):
        xr = x[r]                                                  # K
        yr = y[r]                                                  # K
        pa = x[r + ahead] if ahead and r + ahead < hi else xr[:0]   # to prefetch
        # statistics of x - x0, x0 the row's first element: the shifted values are small
        # and exact for data far from 0 with a small spread
        x0 = _ld(xr, 0) if center else _as(mean, 0.0)
        mr = _as(mean, 0.0)                                        # mean - x0
        if center:
            s = _as(mean, 0.0)
            for i in range(k):
                s = _acc(s, _ld(xr, i) - x0)
            mr = s * inv_k
        q = _as(mean, 0.0)
        for i in range(k):                                         # second pass, from L1
            d = (_ld(xr, i) - x0) - mr
            q = _acc(q, d * d)
        v = q * inv_k
        rs = _as(mean, 1.0 / math.sqrt(v + eps))
        mean[r] = x0 + mr
        rstd[r] = rs
        var[r] = v
        _row_affine(xr, yr, w, b, x0, mr, rs, pa, nt)
    if nt:
        _fence()


@njit(**_JIT)
def _rows_bwd(g, x, w, mean, rstd, center, dx, dwp, dbp, nt, ahead, lo, hi):
    """dx = rstd * (g*w - c2 - xhat*c1) per row, c1 = mean(g*w*xhat), c2 = mean(g*w);
    dwp[t], dbp[t]: thread chunk t's partial sums of g*xhat and g (zero on entry);
    nt: stream dx (``_stream_out``); ahead: as in ``_rows_fwd``, for x and g."""
    m, k = x.shape
    parts = dwp.shape[0]
    chunk = (m + parts - 1) // parts
    inv_k = _as(mean, 1.0 / k)
    for t in range(lo, hi):
        dwt = dwp[t]                                               # K
        dbt = dbp[t]                                               # K
        r_end = min(m, (t + 1) * chunk)
        for r in range(t * chunk, r_end):
            xr, gr, dxr = x[r], g[r], dx[r]                        # K each
            pf = ahead and r + ahead < r_end                       # rows to prefetch
            pg, px = (g[r + ahead], x[r + ahead]) if pf else (gr[:0], xr[:0])
            mu, rs = mean[r], rstd[r]
            c1 = _as(mean, 0.0)
            c2 = _as(mean, 0.0)
            for i in range(k):
                gi = _ld(gr, i)
                xh = (_ld(xr, i) - mu) * rs
                dxh = gi * w[i]
                c1 = _acc(c1, dxh * xh)
                c2 = _acc(c2, dxh)
                dwt[i] += gi * xh
                dbt[i] += gi
            c1 *= inv_k
            c2 = c2 * inv_k if center else _as(mean, 0.0)
            _row_dx(gr, xr, w, dxr, mu, rs, c1, c2, pg, px, nt)    # x, g from L1/L2
    if nt:
        _fence()


# ---------------------------------------------------------------------------------------
# Batch/Instance/GroupNorm on contiguous NCHW, viewed (N, C, S)
# ---------------------------------------------------------------------------------------

@register_jitable
def _plane_moments(xb, x0, inv_s, sdt):
    """(mean - x0, M2) of the plane xb: (S,) by two-pass, in the dtype of sdt's array
    (the plane stays in L1 for the second pass)."""
    s = _as(sdt, 0.0)
    for i in range(xb.shape[0]):
        s = _acc(s, _ld(xb, i) - x0)
    bm = s * inv_s
    q = _as(sdt, 0.0)
    for i in range(xb.shape[0]):                                   # from L1
        d = (_ld(xb, i) - x0) - bm
        q = _acc(q, d * d)
    return bm, q


@register_jitable
def _plane_sums(xb, x0, mr, inv_s, sdt):
    """(mean - x0, M2) of the plane xb: (S,) in one pass, given mr, the mean - x0 of the
    planes before it in its unit or channel (float64): the sums of d = x - k and d*d with
    the shift k = x0 + mr, M2 = sum(d*d) - sum(d)^2 / S. With k that close to the plane's
    mean the cancellation costs a few roundings of M2 (a second pass from L1, as in
    ``_plane_moments``, measured 10-20 % slower on 32x256x56x56: it does not overlap
    with the memory stream; a shift by x0 alone lost up to 1e-4 relative on outliers)."""
    k = _as(sdt, x0 + mr)
    s = _as(sdt, 0.0)
    q = _as(sdt, 0.0)
    for i in range(xb.shape[0]):
        d = _ld(xb, i) - k
        s = _acc(s, d)
        q = _acc(q, d * d)
    bm = s * inv_s
    return (np.float64(k) - x0) + bm, q - s * bm


@register_jitable
def _chan(cnt, mean, m2, n_b, mean_b, m2_b):
    """Chan's merge of (cnt, mean, M2) with a block of n_b elements (float64)."""
    tot = cnt + n_b
    delta = mean_b - mean
    return tot, mean + delta * n_b / tot, m2 + (m2_b + delta * delta * cnt * n_b / tot)


@register_jitable
def _plane_merge(xb, x0, inv_s, sdt, cnt, mr, m2):
    """(cnt, mr, m2) with the plane xb: (S,) Chan-merged in (float64; mr = mean - x0):
    the first plane of a unit or channel (cnt == 0) by two-pass, the others in one pass
    shifted by the running mean."""
    if cnt == 0.0:
        bm, q = _plane_moments(xb, x0, inv_s, sdt)
    else:
        bm, q = _plane_sums(xb, x0, mr, inv_s, sdt)
    return _chan(cnt, mr, m2, xb.shape[0], bm, q)


@register_jitable
def _plane_affine_span(xs, ys, x0, mr, sc, sh):
    """ys = ((xs - x0) - mr) * sc + sh."""
    for i in range(xs.shape[0]):
        _st(ys, i, ((_ld(xs, i) - x0) - mr) * sc + sh)


def _plane_affine(xb, yb, x0, mr, sc, sh, nt, pa):
    """yb = ((xb - x0) - mr) * sc + sh over a plane (S,), streamed
    (``_plane_affine_nt``) when nt, with the prefetch of pa (the same span of a plane
    ahead; empty: none) spread over it, as ``_row_affine`` does (and as plainly for half
    precision)."""


@overload(_plane_affine)
def _plane_affine_impl(xb, yb, x0, mr, sc, sh, nt, pa):
    if _half(xb):
        return lambda xb, yb, x0, mr, sc, sh, nt, pa: _plane_affine_span(xb, yb, x0, mr, sc,
                                                                         sh)

    def impl(xb, yb, x0, mr, sc, sh, nt, pa):
        for i0 in range(0, xb.shape[0], _PF_SPAN):
            i1 = min(xb.shape[0], i0 + _PF_SPAN)
            if nt:
                _plane_affine_nt(yb[i0:i1], xb[i0:i1], x0, mr, sc, sh)
            else:
                _plane_affine_span(xb[i0:i1], yb[i0:i1], x0, mr, sc, sh)
            _prefetch_lines(pa, i0, i1)
    return impl


@register_jitable
def _plane_dx_span(gs, xs, ds, mu, rs, wc, k1, k2):
    """ds = (gs * wc - k2 - xhat * k1) * rs, xhat = (xs - mu) * rs."""
    for i in range(xs.shape[0]):
        xh = (_ld(xs, i) - mu) * rs
        _st(ds, i, (_ld(gs, i) * wc - k2 - xh * k1) * rs)


def _plane_dx(gb, xb, dxb, mu, rs, wc, k1, k2, nt, pg, px):
    """dxb = (gb * wc - k2 - xhat * k1) * rs over a plane (S,), streamed when nt, with
    the prefetch of pg and px (planes ahead of g and x; empty: none) spread over it; the
    plain loop for half precision."""


@overload(_plane_dx)
def _plane_dx_impl(gb, xb, dxb, mu, rs, wc, k1, k2, nt, pg, px):
    if _half(xb):
        return lambda gb, xb, dxb, mu, rs, wc, k1, k2, nt, pg, px: _plane_dx_span(
            gb, xb, dxb, mu, rs, wc, k1, k2)

    def impl(gb, xb, dxb, mu, rs, wc, k1, k2, nt, pg, px):
        for i0 in range(0, xb.shape[0], _PF_SPAN):
            i1 = min(xb.shape[0], i0 + _PF_SPAN)
            if nt:
                _plane_dx_nt(dxb[i0:i1], gb[i0:i1], xb[i0:i1], mu, rs, wc, k1, k2)
            else:
                _plane_dx_span(gb[i0:i1], xb[i0:i1], dxb[i0:i1], mu, rs, wc, k1, k2)
            _prefetch_lines(pg, i0, i1)
            _prefetch_lines(px, i0, i1)
    return impl


@register_jitable
def _plane_ahead(a, n, c, ahead, first, last):
    """The plane ``ahead`` planes after a[n, c] (a: (N, C, S), planes counted n * C + c)
    if it lies in [first, last] (the next units of this thread's range), else an empty
    one."""
    f = n * a.shape[1] + c + ahead
    if f < first or f > last:
        return a[0, 0, :0]
    return a[f // a.shape[1], f % a.shape[1]]


@njit(**_JIT)
def _units_fwd(x, y, w, b, eps, groups, fixed, mean, rstd, var, nt, ahead, lo, hi):
    """Instance/GroupNorm: normalize each unit (sample, group) of x: (N, C, S), i.e.
    C/groups adjacent planes. mean, rstd, var: (N * groups,), read (fixed) or written;
    nt: stream y; ahead: while writing plane p's output, prefetch plane p + ahead if it
    belongs to a later unit of the range (``_units_ahead``; as the rows kernels do)."""
    n_, c_, s_ = x.shape
    cg = c_ // groups
    inv_s = _as(mean, 1.0 / s_)
    for u in range(lo, hi):
        n, c0 = u // groups, (u % groups) * cg
        x0 = _ld(x[n, c0], 0)                                      # shift of the unit
        if fixed:
            mr, rs = _as(mean, mean[u] - x0), rstd[u]
        else:
            cnt, mr64, m2 = 0.0, 0.0, 0.0                          # float64 merge
            for c in range(c0, c0 + cg):
                cnt, mr64, m2 = _plane_merge(x[n, c], x0, inv_s, mean, cnt, mr64, m2)
            v = m2 / cnt
            mr = _as(mean, mr64)
            rs = _as(mean, 1.0 / math.sqrt(v + eps))
            mean[u], rstd[u], var[u] = x0 + mr64, rs, v
        for c in range(c0, c0 + cg):                               # unit still in L2
            pa = _plane_ahead(x, n, c, ahead, n * c_ + c0 + cg, hi * cg - 1)
            _plane_affine(x[n, c], y[n, c], x0, mr, rs * w[c], b[c], nt, pa)
    if nt:
        _fence()


@njit(**_JIT)
def _channels_fwd(x, y, w, b, eps, cb, fixed, mean, rstd, var, nt, lo, hi):
    """BatchNorm on contiguous NCHW, x: (N, C, S): the channels [lo, hi) in blocks of cb.
    The planes (n, c0..c0+cb) of a block lie side by side in memory, so each pass walks
    them sample by sample as one stream of cb planes (a channel alone is N planes at a
    stride of C*S: the prefetcher would restart every plane): plane moments by two-pass
    (in L1) for the first sample, in one pass shifted by the running channel mean for the
    others (``_plane_sums``), Chan-merged per channel, then the block normalized from
    L2/L3.
    mean, rstd, var: (C,), read (fixed) or written; nt: stream y."""
    n_, c_, s_ = x.shape
    inv_s = _as(mean, 1.0 / s_)
    pm = np.empty(cb)                                              # channel mean - x0
    pq = np.empty(cb)                                              # channel M2
    mr_ = np.empty(cb, dtype=mean.dtype)                           # channel mean - x0
    for c0 in range(lo, hi, cb):
        c1 = min(hi, c0 + cb)
        if fixed:
            for c in range(c0, c1):
                mr_[c - c0] = mean[c] - _ld(x[0, c], 0)
        else:
            pm[:] = 0.0
            pq[:] = 0.0
            for n in range(n_):                                    # cb planes in a row
                for c in range(c0, c1):                            # x[0, c, 0]: the shift
                    _, pm[c - c0], pq[c - c0] = _plane_merge(
                        x[n, c], _ld(x[0, c], 0), inv_s, mean, n * s_, pm[c - c0],
                        pq[c - c0])
            for c in range(c0, c1):
                v = pq[c - c0] / (n_ * s_)
                mr_[c - c0] = pm[c - c0]
                rstd[c] = 1.0 / math.sqrt(v + eps)
                mean[c], var[c] = _ld(x[0, c], 0) + pm[c - c0], v
        for n in range(n_):                                        # block from L2/L3
            for c in range(c0, c1):
                _plane_affine(x[n, c], y[n, c], _ld(x[0, c], 0), mr_[c - c0],
                              rstd[c] * w[c], b[c], nt, x[0, 0, :0])
    if nt:
        _fence()


@njit(**_JIT)
def _channels_bwd(g, x, w, mean, rstd, cb, center, fixed, dx, sg, sgx, nt, lo, hi):
    """BatchNorm backward on contiguous NCHW, x, g: (N, C, S): the channels [lo, hi) in
    blocks of cb, walked sample by sample as ``_channels_fwd`` does: per-plane sums of g
    and g*xhat, the channel's coefficients, then dx from L2/L3. sg[n, c] = sum(g),
    sgx[n, c] = sum(g * xhat) over each plane (dbias and dweight before the sum over n);
    nt: stream dx."""
    n_, c_, s_ = x.shape
    k1_ = np.empty(cb, dtype=mean.dtype)
    k2_ = np.empty(cb, dtype=mean.dtype)
    cnt = n_ * s_
    for c0 in range(lo, hi, cb):
        c1 = min(hi, c0 + cb)
        for n in range(n_):                                        # cb planes in a row
            for c in range(c0, c1):
                xb, gb = x[n, c], g[n, c]                          # S
                mu, rs = mean[c], rstd[c]
                a = _as(mean, 0.0)
                q = _as(mean, 0.0)
                for i in range(s_):
                    gi = _ld(gb, i)
                    a = _acc(a, gi)
                    q = _acc(q, gi * ((_ld(xb, i) - mu) * rs))
                sg[n, c], sgx[n, c] = a, q
        for c in range(c0, c1):
            e1, e2 = 0.0, 0.0
            for n in range(n_):
                e1 += sgx[n, c]
                e2 += sg[n, c]
            k1_[c - c0] = 0.0 if fixed else w[c] * e1 / cnt
            k2_[c - c0] = w[c] * e2 / cnt if center and not fixed else 0.0
        for n in range(n_):                                        # block from L2/L3
            for c in range(c0, c1):
                _plane_dx(g[n, c], x[n, c], dx[n, c], mean[c], rstd[c], w[c], k1_[c - c0],
                          k2_[c - c0], nt, g[0, 0, :0], x[0, 0, :0])
    if nt:
        _fence()


@njit(**_JIT)
def _units_bwd(g, x, w, mean, rstd, groups, center, fixed, dx, sg, sgx, nt, ahead, lo,
               hi):
    """Instance/GroupNorm: dx of each unit (sample, group) of x: (N, C, S);
    sg[n, c] = sum(g), sgx[n, c] = sum(g * xhat) over each plane (dbias and dweight
    before the sum over n); nt: stream dx; ahead: as in ``_units_fwd``, for x and g."""
    n_, c_, s_ = x.shape
    cg = c_ // groups
    cnt = cg * s_
    for u in range(lo, hi):
        n, c0 = u // groups, (u % groups) * cg
        mu, rs = mean[u], rstd[u]
        e1, e2 = 0.0, 0.0
        for c in range(c0, c0 + cg):
            xb, gb = x[n, c], g[n, c]                              # S
            a = _as(mean, 0.0)
            q = _as(mean, 0.0)
            for i in range(s_):
                gi = _ld(gb, i)
                a = _acc(a, gi)
                q = _acc(q, gi * ((_ld(xb, i) - mu) * rs))
            sg[n, c], sgx[n, c] = a, q
            e1 += w[c] * q
            e2 += w[c] * a
        k1 = _as(mean, 0.0 if fixed else e1 / cnt)
        k2 = _as(mean, e2 / cnt if center and not fixed else 0.0)
        for c in range(c0, c0 + cg):                               # unit still in L2
            pg = _plane_ahead(g, n, c, ahead, n * c_ + c0 + cg, hi * cg - 1)
            px = _plane_ahead(x, n, c, ahead, n * c_ + c0 + cg, hi * cg - 1)
            _plane_dx(g[n, c], x[n, c], dx[n, c], mu, rs, w[c], k1, k2, nt, pg, px)
    if nt:
        _fence()


# ---------------------------------------------------------------------------------------
# the same on channels_last, viewed (N, S*C)
# ---------------------------------------------------------------------------------------

# The reductions below read a block of rows as runs of rg rows, i.e. rg*C consecutive
# elements accumulated into rg*C lanes (lane j holds channel j % C), folded to channels
# per block: one sequential stream per input, read once (the moments' first block twice).
# Measured in development on 32x256x56x56 fp32, 2 threads (medians of 11, three rounds,
# noisy VM): the moments in one shifted pass, runs of 2 rows, blocks of 256 rows: 3.3-5.4
# ms (a torch x.sum() 1.5-4.0); the earlier two-pass over 64-row blocks in runs of 8
# rows: 4.0-6.1 ms (its second pass, from L2, does not overlap with memory). The
# backward sums with runs of 2 rows and 256-row blocks 7.4-8.5 ms against 9.5-10.9 with
# runs of 8 and 64-row blocks (three 8 KiB lane arrays crowd L1). Vector accumulators
# held in registers (a numba vector type, channel chunks walked down the rows) were no
# faster for the moments (5.7-9.2 ms): the column walk defeats the prefetcher. The
# affine passes go a row at a time.

@register_jitable
def _fold(lanes, out, c_, rg):
    """out[c] = the sum over r < rg of lanes[r*C + c]."""
    out[:] = lanes[:c_]
    for r in range(1, rg):
        lr = lanes[r * c_:(r + 1) * c_]
        for c in range(c_):
            out[c] += lr[c]


@register_jitable
def _cl_range_moments(x, n, c_, s_begin, s_end, rb, rg, am, a2, bs, bq, bk, bc, bc2):
    """Per-channel mean and M2 (float64, written to am, a2: (C,)) of the rows
    [s_begin, s_end) of sample n of x: (N, S*C), over blocks of rb rows Chan-merged in
    float64. Per block the sums of d = x - k and d*d accumulate in rg*C lanes of the
    statistics dtype (mean = k + sum(d)/n, M2 = sum(d*d) - sum(d)^2/n), the shift k being
    a mean already known: the block's own (from a first pass of plain sums, read again
    from L2) for the first block, the running mean of the blocks before for the others,
    which then take a single pass. With k that close to the block's mean the
    cancellation stays at a few roundings of M2 even for an outlier or an offset far from
    zero (a shift by one of the block's values, tried, lost up to 1e-4 relative on a
    30-sigma outlier). bs, bq, bk: (rg*C,), bc, bc2: (C,) scratch of the statistics
    dtype."""
    xn = x[n]                                                      # S*C
    am[:] = 0.0
    a2[:] = 0.0
    cnt = 0.0
    for s0 in range(s_begin, s_end, rb):
        s1 = min(s_end, s0 + rb)
        nbk = s1 - s0
        if cnt == 0.0:                                             # the block's own mean
            bs[:] = 0.0
            for g0 in range(s0, s1, rg):
                xs = xn[g0 * c_:min(s1, g0 + rg) * c_]             # <= rg*C
                for j in range(xs.shape[0]):
                    bs[j] += _ld(xs, j)
            _fold(bs, bc, c_, rg)
            inv = _as(bc, 1.0 / nbk)
            for c in range(c_):
                bc[c] *= inv
        else:                                                      # the running mean
            for c in range(c_):
                bc[c] = am[c]
        for r in range(rg):                                        # the shift, per lane
            bk[r * c_:(r + 1) * c_] = bc
        bs[:] = 0.0
        bq[:] = 0.0
        for g0 in range(s0, s1, rg):
            xs = xn[g0 * c_:min(s1, g0 + rg) * c_]
            for j in range(xs.shape[0]):
                d = _ld(xs, j) - bk[j]
                bs[j] += d
                bq[j] += d * d
        _fold(bs, bc, c_, rg)
        _fold(bq, bc2, c_, rg)
        tot = cnt + nbk                                            # Chan merge
        fa, fb = nbk / tot, cnt * nbk / tot
        for c in range(c_):
            sd = np.float64(bc[c])
            delta = np.float64(bk[c]) + sd / nbk - am[c]
            am[c] += delta * fa
            a2[c] += (np.float64(bc2[c]) - sd * sd / nbk) + delta * delta * fb
        cnt = tot


def _cl_affine(xn, yn, c_, s0, s1, mu, sc, sh, nt):
    """y = (x - mu) * sc + sh over the rows [s0, s1) of one sample (S*C), a row at a time;
    mu, sc, sh: (C,) per-channel coefficients; streamed (``_cl_affine_nt``) when nt.
    (Folding the mean into the shift, y = x * sc + (sh - mu * sc), saves a load per
    element, about 10 % of this pass, but rounds x * sc: an error of 1.5 ulps of the
    input at an offset of 1e3, against 0.5.)"""


@register_jitable
def _cl_affine_plain(xn, yn, c_, s0, s1, mu, sc, sh, nt):
    for r in range(s0, s1):
        xs, ys = xn[r * c_:(r + 1) * c_], yn[r * c_:(r + 1) * c_]      # C
        for c in range(c_):
            _st(ys, c, (_ld(xs, c) - mu[c]) * sc[c] + sh[c])


@overload(_cl_affine)
def _cl_affine_impl(xn, yn, c_, s0, s1, mu, sc, sh, nt):
    if _half(xn):
        return _cl_affine_plain

    def impl(xn, yn, c_, s0, s1, mu, sc, sh, nt):
        if not nt:
            _cl_affine_plain(xn, yn, c_, s0, s1, mu, sc, sh, nt)
            return
        for r in range(s0, s1):
            _cl_affine_nt(yn[r * c_:(r + 1) * c_], xn[r * c_:(r + 1) * c_], mu, sc, sh)
    return impl


@njit(**_JIT)
def _cl_moments(x, c_, parts, rb, rg, sdt, pmean, pm2, lo, hi):
    """Per-(n, c) mean and M2 of x: (N, S*C) over each of ``parts`` ranges of S.
    pmean, pm2: (N, parts, C) float64; range p holds the rows [p*len, (p+1)*len) with
    len = ceil(S / parts). sdt: an empty array of the statistics dtype."""
    s_ = x.shape[1] // c_
    plen = (s_ + parts - 1) // parts
    bs = np.empty(rg * c_, dtype=sdt.dtype)
    bq = np.empty(rg * c_, dtype=sdt.dtype)
    bk = np.empty(rg * c_, dtype=sdt.dtype)
    bc = np.empty(c_, dtype=sdt.dtype)
    bc2 = np.empty(c_, dtype=sdt.dtype)
    for t in range(lo, hi):
        n, p = t // parts, t % parts
        _cl_range_moments(x, n, c_, p * plen, min(s_, (p + 1) * plen), rb, rg, pmean[n, p],
                          pm2[n, p], bs, bq, bk, bc, bc2)


@njit(**_JIT)
def _cl_sample_fwd(x, y, w, b, eps, c_, groups, rb, rg, mean, rstd, var, nt, lo, hi):
    """Instance/GroupNorm on channels_last, one sample per iteration: statistics of each
    (sample, group), then the sample normalized while it is still in L3 (x read from
    memory once). x, y: (N, S*C); mean, rstd, var: (N * groups,)."""
    s_ = x.shape[1] // c_
    cg = c_ // groups
    am = np.empty(c_)                                              # float64
    a2 = np.empty(c_)
    bs = np.empty(rg * c_, dtype=mean.dtype)
    bq = np.empty(rg * c_, dtype=mean.dtype)
    bk = np.empty(rg * c_, dtype=mean.dtype)
    bc = np.empty(c_, dtype=mean.dtype)
    bc2 = np.empty(c_, dtype=mean.dtype)
    mu = np.empty(c_, dtype=mean.dtype)
    sc = np.empty(c_, dtype=mean.dtype)
    for n in range(lo, hi):
        _cl_range_moments(x, n, c_, 0, s_, rb, rg, am, a2, bs, bq, bk, bc, bc2)
        for g in range(groups):                                    # Chan merge of channels
            gm, m2 = 0.0, 0.0
            for j in range(cg):
                c = g * cg + j
                delta = am[c] - gm
                gm += delta / (j + 1)
                m2 += a2[c] + delta * delta * s_ * j / (j + 1)
            v = m2 / (cg * s_)
            rs = 1.0 / math.sqrt(v + eps)
            u = n * groups + g
            mean[u], rstd[u], var[u] = gm, rs, v
            for j in range(cg):
                c = g * cg + j
                mu[c] = gm
                sc[c] = rs * w[c]
        _cl_affine(x[n], y[n], c_, 0, s_, mu, sc, b, nt)
    if nt:
        _fence()


@njit(**_JIT)
def _cl_apply(x, y, c_, parts, mu, sc, sh, nt, lo, hi):
    """y = (x - mu) * sc + sh with per-(n, c) coefficients (N, C); x, y: (N, S*C); nt:
    stream y."""
    s_ = x.shape[1] // c_
    plen = (s_ + parts - 1) // parts
    for t in range(lo, hi):
        n, p = t // parts, t % parts
        _cl_affine(x[n], y[n], c_, p * plen, min(s_, (p + 1) * plen), mu[n], sc[n], sh[n],
                   nt)
    if nt:
        _fence()


@njit(**_JIT)
def _cl_bwd_sums(g, x, c_, parts, rb, rg, mu, rs, psg, psgx, lo, hi):
    """Per-(n, c) partial sums of g and g * xhat over each range of S; x, g: (N, S*C),
    mu, rs: (N, C); psg, psgx: (N, parts, C) float64. Per block of rb rows the sums of g
    and g * (x - mu) accumulate in rg*C lanes of the statistics dtype, then go to float64
    (the second times rstd)."""
    s_ = x.shape[1] // c_
    plen = (s_ + parts - 1) // parts
    a = np.empty(rg * c_, dtype=mu.dtype)
    q = np.empty(rg * c_, dtype=mu.dtype)
    ml = np.empty(rg * c_, dtype=mu.dtype)                         # mean per lane
    ac = np.empty(c_, dtype=mu.dtype)
    for t in range(lo, hi):
        n, p = t // parts, t % parts
        xn, gn, mur, rsr = x[n], g[n], mu[n], rs[n]
        sg, sgx = psg[n, p], psgx[n, p]                            # C, float64
        sg[:] = 0.0
        sgx[:] = 0.0
        for r in range(rg):
            ml[r * c_:(r + 1) * c_] = mur
        s_end = min(s_, (p + 1) * plen)
        for s0 in range(p * plen, s_end, rb):
            a[:] = 0.0
            q[:] = 0.0
            for g0 in range(s0, min(s_end, s0 + rb), rg):
                lo_, hi_ = g0 * c_, min(s_end, g0 + rg) * c_
                xs, gs = xn[lo_:hi_], gn[lo_:hi_]                  # <= rg*C
                for j in range(xs.shape[0]):
                    gi = _ld(gs, j)
                    a[j] += gi
                    q[j] += gi * (_ld(xs, j) - ml[j])
            _fold(a, ac, c_, rg)
            for c in range(c_):
                sg[c] += ac[c]
            _fold(q, ac, c_, rg)
            for c in range(c_):
                sgx[c] += ac[c] * rsr[c]


def _cl_dx_rows(gn, xn, dxn, c_, r0, r1, mur, k1r, k2r, k3r, nt):
    """dx = g * k1 - (x - mu) * k2 - k3 over the rows [r0, r1) of one sample (S*C), a row
    at a time; streamed (``_cl_dx_nt``) when nt."""


@register_jitable
def _cl_dx_plain(gn, xn, dxn, c_, r0, r1, mur, k1r, k2r, k3r, nt):
    for r in range(r0, r1):
        lo_, hi_ = r * c_, (r + 1) * c_
        xs, gs, ds = xn[lo_:hi_], gn[lo_:hi_], dxn[lo_:hi_]        # C
        for c in range(c_):
            _st(ds, c, _ld(gs, c) * k1r[c] - (_ld(xs, c) - mur[c]) * k2r[c] - k3r[c])


@overload(_cl_dx_rows)
def _cl_dx_rows_impl(gn, xn, dxn, c_, r0, r1, mur, k1r, k2r, k3r, nt):
    if _half(xn):
        return _cl_dx_plain

    def impl(gn, xn, dxn, c_, r0, r1, mur, k1r, k2r, k3r, nt):
        if not nt:
            _cl_dx_plain(gn, xn, dxn, c_, r0, r1, mur, k1r, k2r, k3r, nt)
            return
        for r in range(r0, r1):
            lo_, hi_ = r * c_, (r + 1) * c_
            _cl_dx_nt(dxn[lo_:hi_], gn[lo_:hi_], xn[lo_:hi_], mur, k1r, k2r, k3r)
    return impl


@njit(**_JIT)
def _cl_bwd_apply(g, x, dx, c_, parts, mu, k1, k2, k3, nt, lo, hi):
    """dx = g * k1 - (x - mu) * k2 - k3 with per-(n, c) coefficients (N, C), a row at a
    time (four rows at once measured slower in development: 0.90 against 0.77 cycles per
    element in cache; x * k2 with the mean folded into k3 would round x * k2, costly for
    data far from zero); nt: stream dx."""
    s_ = x.shape[1] // c_
    plen = (s_ + parts - 1) // parts
    for t in range(lo, hi):
        n, p = t // parts, t % parts
        _cl_dx_rows(g[n], x[n], dx[n], c_, p * plen, min(s_, (p + 1) * plen), mu[n], k1[n],
                    k2[n], k3[n], nt)
    if nt:
        _fence()


# Between the passes, per-(n, c) partials become the grouping's statistics and per-(n, c)
# coefficients in one serial call (NumPy took 0.5-1 ms per op for the same on 32 x 256).
# A statistic index is u = n * sn + c // cg: (sn, cg) = (0, 1) for BatchNorm (one per
# channel), (C, 1) for InstanceNorm, (G, C/G) for GroupNorm.

@register_jitable
def _unit_of(c_, cg):
    """c // cg for every channel (an integer division per element costs more than the
    rest of these loops)."""
    uc = np.empty(c_, dtype=np.intp)
    for c in range(c_):
        uc[c] = c // cg
    return uc


@njit(**_JIT)
def _cl_expand(stat, sn, cg, out):
    """out[n, c] = stat[n * sn + c // cg]: per-unit statistics to per-(n, c), (N, C)."""
    uc = _unit_of(out.shape[1], cg)
    for n in range(out.shape[0]):
        for c in range(out.shape[1]):
            out[n, c] = stat[n * sn + uc[c]]


@njit(**_JIT)
def _cl_stats(pmean, pm2, s_, sn, cg, eps, w, b, mean, rstd, var, mu, sc, sh):
    """The grouping's mean, rstd and var (U,) and the forward coefficients mu, sc, sh
    (N, C) from per-range partial moments pmean, pm2 (N, parts, C; range p of
    ``_cl_moments`` holds min(len, S - p*len) rows). Each merge is the exact Chan form
    in float64: mean = sum(n_i mean_i) / n, M2 = sum(M2_i + n_i (mean_i - mean)^2),
    first over the ranges of each (n, c), then over the (n, c) of each unit."""
    n_, parts, c_ = pmean.shape
    plen = (s_ + parts - 1) // parts
    mnc = np.empty((n_, c_))
    m2nc = np.empty((n_, c_))
    for n in range(n_):
        for c in range(c_):
            acc = 0.0
            for p in range(parts):
                acc += pmean[n, p, c] * max(0, min(plen, s_ - p * plen))
            m = acc / s_
            q = 0.0
            for p in range(parts):
                d = pmean[n, p, c] - m
                q += pm2[n, p, c] + max(0, min(plen, s_ - p * plen)) * d * d
            mnc[n, c], m2nc[n, c] = m, q
    u_ = mean.shape[0]
    uc = _unit_of(c_, cg)
    um = np.zeros(u_)
    uq = np.zeros(u_)
    cnt = np.zeros(u_)
    for n in range(n_):
        for c in range(c_):
            u = n * sn + uc[c]
            um[u] += mnc[n, c] * s_
            cnt[u] += s_
    for u in range(u_):
        um[u] /= cnt[u]
    for n in range(n_):
        for c in range(c_):
            u = n * sn + uc[c]
            d = mnc[n, c] - um[u]
            uq[u] += m2nc[n, c] + s_ * d * d
    for u in range(u_):
        v = uq[u] / cnt[u]
        mean[u], var[u], rstd[u] = um[u], v, 1.0 / math.sqrt(v + eps)
    _cl_coefs(mean, rstd, sn, uc, w, b, mu, sc, sh)


@register_jitable
def _cl_coefs(mean, rstd, sn, uc, w, b, mu, sc, sh):
    """mu = mean, sc = rstd * w (in float64, then rounded), sh = b, per (n, c); uc:
    ``_unit_of``."""
    for n in range(mu.shape[0]):
        for c in range(mu.shape[1]):
            u = n * sn + uc[c]
            mu[n, c] = mean[u]
            sc[n, c] = np.float64(rstd[u]) * np.float64(w[c])
            sh[n, c] = b[c]


@njit(**_JIT)
def _cl_coefs_fixed(mean, rstd, sn, cg, w, b, mu, sc, sh):
    """``_cl_coefs`` for given statistics (BatchNorm in eval)."""
    _cl_coefs(mean, rstd, sn, _unit_of(mu.shape[1], cg), w, b, mu, sc, sh)


@njit(**_JIT)
def _cl_grad_coefs(psg, psgx, rstd, w, sn, cg, count, center, fixed, k1, k2, k3, dw, db):
    """The backward coefficients k1 = rstd w, k2 = rstd^2 c1, k3 = rstd c2 (N, C) of
    ``_cl_bwd_apply`` and dweight, dbias (C,) from the per-range sums psg = sum(g),
    psgx = sum(g xhat) (N, parts, C), with c1 = sum(w g xhat) / count and
    c2 = sum(w g) / count over each unit (float64; both 0 for fixed statistics, c2 0
    without centering)."""
    n_, parts, c_ = psg.shape
    u_ = rstd.shape[0]
    uc = _unit_of(c_, cg)
    sg = np.zeros((n_, c_))
    sgx = np.zeros((n_, c_))
    for n in range(n_):
        for p in range(parts):
            for c in range(c_):
                sg[n, c] += psg[n, p, c]
                sgx[n, c] += psgx[n, p, c]
    a1 = np.zeros(u_)
    a2 = np.zeros(u_)
    if not fixed:
        for n in range(n_):
            for c in range(c_):
                u = n * sn + uc[c]
                a1[u] += np.float64(w[c]) * sgx[n, c]
                a2[u] += np.float64(w[c]) * sg[n, c]
        for u in range(u_):
            a1[u] /= count
            a2[u] = a2[u] / count if center else 0.0
    for n in range(n_):
        for c in range(c_):
            u = n * sn + uc[c]
            r = np.float64(rstd[u])
            k1[n, c] = r * np.float64(w[c])
            k2[n, c] = r * r * a1[u]
            k3[n, c] = r * a2[u]
    for c in range(c_):
        tw, tb = 0.0, 0.0
        for n in range(n_):
            tw += sgx[n, c]
            tb += sg[n, c]
        dw[c], db[c] = tw, tb


# ---------------------------------------------------------------------------------------
# the backend interface
# ---------------------------------------------------------------------------------------

def _np(t):
    """Zero-copy NumPy view of a CPU tensor's storage (16-bit floats as integers)."""
    t = t.detach()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(_STORAGE[t.dtype])
    return t.numpy()


_SERIAL_BELOW = 1 << 16   # elements: below this, handing work to a thread costs more


def _last_level_cache_bytes(default=32 << 20):
    """The largest CPU cache's size (Linux sysfs), else ``default``."""
    sizes = []
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in os.listdir(base):
            if entry.startswith("index"):
                with open(os.path.join(base, entry, "size")) as f:
                    text = f.read().strip()
                scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
                sizes.append(int(text.rstrip("KMG")) * scale)
    except (OSError, ValueError):
        return default
    return max(sizes, default=default)


# outputs of at least this many bytes are written with non-temporal stores
_STREAM_BYTES = _last_level_cache_bytes()


_AHEAD_BYTES = 8 << 10  # rows and units kernels: prefetch about this far ahead


def _rows_ahead(k, itemsize):
    """Rows ahead that ``_rows_fwd``/``_rows_bwd`` prefetch while writing a row's output:
    about 8 KiB ahead (at least the next row) for float32/float64, 0 (none) for half
    precision, whose pace is the conversion in registers (bf16 forward 32768x768 3-25 %
    slower with it). Measured through ``normkit.functional`` on 2 threads, no-mmap, five
    interleaved rounds, time with / without: LayerNorm 8192x4096 forward 0.86-0.90,
    forward+backward 0.86-0.92; 32768x768 forward 0.98-1.09, forward+backward 0.91-0.98;
    RMSNorm 0.81-1.01. Before spreading the prefetch over the output pass, a whole 16 KiB
    row prefetched at once gained nothing (the backward lost 5 %)."""
    if itemsize < 4:
        return 0
    return max(1, _AHEAD_BYTES // (k * itemsize))


def _units_ahead(itemsize, s):
    """Planes ahead that ``_units_fwd``/``_units_bwd`` prefetch while writing a plane's
    output (planes of the next units only): about 8 KiB ahead, at least the next plane,
    for float32/float64; 0 (none) for half precision, as ``_rows_ahead``. Measured
    through ``normkit.functional`` on 32x256x56x56 fp32 (2 threads, no-mmap, four
    interleaved rounds, time with / without): InstanceNorm forward 0.78-0.87,
    forward+backward 0.88-0.96; GroupNorm(32) forward 0.95-1.01, forward+backward
    0.92-1.00 (prefetching the whole next unit of 8 planes instead: 0.96-1.04 and
    0.98-1.09)."""
    return _rows_ahead(s, itemsize)                                # a plane is a row of S


def _stream_out(t) -> bool:
    """Whether a fused kernel streams its output t (non-temporal stores): a float32 or
    float64 output larger than the last-level cache, which would be out of cache by the
    end of the op anyway, and whose memory is already mapped (``_memory.resident``: a
    block the allocator reuses). Streaming skips the read of each destination line that
    a plain store costs. A freshly mapped output is different: each page is zeroed when
    it faults in, which leaves its lines in cache; there streaming through a staging
    buffer measured 11-25 % slower than plain stores, and the fused streaming below
    0.89-1.05 x (LayerNorm, GroupNorm, channels_last BatchNorm forward, default
    allocator, three rounds), so such an output stores plainly.

    Every float32/float64 output of the fused kernels goes through it. Computed and
    stored in one loop (the ``*_nt`` intrinsics), streaming pays everywhere; measured
    through ``normkit.functional`` on 2 threads, no-mmap, three alternating runs of the
    two versions, normkit / torch before -> with it: LayerNorm 8192x4096 forward
    0.79-0.91 -> 0.65-0.79 and GroupNorm 32x256x56x56 forward 1.12-1.22 -> 0.79-0.91
    (before: a chunk computed into an L1 buffer, then streamed), channels_last BatchNorm
    forward 1.01-1.15 -> 0.76-0.80 and forward+backward 1.10-1.18 -> 0.84-0.92, NCHW
    BatchNorm forward 1.32-1.48 -> 1.22-1.24 x a copy (before: plain stores).
    Half-precision outputs store plainly: their kernels' pace is the conversion in
    registers (LayerNorm bf16 8192x4096 forward 6.7 -> 8.4 ms streamed through the buffer).
    """
    return (t.element_size() >= 4 and t.numel() * t.element_size() >= _STREAM_BYTES
            and _memory.resident(t))


def _threads(x):
    return 1 if x.numel() < _SERIAL_BELOW else max(1, torch.get_num_threads())


def _ncs(xv, grouping):
    """The (N, C, S) view of a batch/instance/group view."""
    v = grouping.view
    return xv.view(v[0], v[1] * v[2], v[3]) if grouping.kind == "group" else xv


def _layout(xv, grouping):
    """``"rows"`` (contiguous (M, K)), ``"nchw"``, ``"cl"`` (channels_last) or None."""
    if grouping.kind == "layer":
        return "rows" if xv.is_contiguous() else None
    x3 = _ncs(xv, grouping)
    if x3.is_contiguous() and x3.shape[2] > 1:
        return "nchw"
    if x3.transpose(1, 2).is_contiguous():
        return "cl"
    return None


def supports(x, grouping, center=True, fixed=False) -> bool:
    if (x.device.type != "cpu" or x.dtype not in _STORAGE or grouping.kind not in _KINDS
            or x.numel() == 0 or (fixed and grouping.kind in ("layer", "group"))
            or (not center and grouping.kind != "layer")):
        return False
    try:
        xv = x.view(grouping.view)
    except RuntimeError:
        return False
    return _layout(xv, grouping) is not None


def _params(weight, bias, n, sdtype):
    w = torch.ones(n, dtype=sdtype) if weight is None else weight.detach().reshape(n).to(sdtype)
    b = torch.zeros(n, dtype=sdtype) if bias is None else bias.detach().reshape(n).to(sdtype)
    return w.contiguous(), b.contiguous()


def _stats_nc(t, grouping, n, c):
    """Statistics shaped ``grouping.stat_shape`` broadcast to per-(n, c) (N, C) arrays."""
    if grouping.kind == "group":
        g = grouping.view[1]
        return t.reshape(n, g, 1).expand(n, g, c // g).reshape(n, c)
    return t.reshape(-1, c).expand(n, c).contiguous()


def _unit_stats(t_nc, by_channel):
    """Per-unit statistics of the NCHW kernels from per-(n, c) ones: (C,) or (N * C,)."""
    return (t_nc[0] if by_channel else t_nc.reshape(-1)).contiguous()


def forward(x, grouping, weight, bias, eps, center=True, mean=None, rstd=None):
    nt = _threads(x)
    sdtype = stat_dtype(x.dtype)
    fixed = mean is not None
    y = _empty_like(x)                                             # keeps channels_last
    layout = _layout(x, grouping)
    shape = grouping.stat_shape
    if layout == "rows":
        m, k = grouping.view
        w, b = _params(weight, bias, k, sdtype)
        mean, rstd, var = (torch.empty(m, dtype=sdtype) for _ in range(3))
        _launch(_rows_fwd, m, nt, _np(x), _np(y), _np(w), _np(b), float(eps), bool(center),
                _np(mean), _np(rstd), _np(var), _stream_out(y),
                _rows_ahead(k, x.element_size()))
        return y, mean.view(shape), rstd.view(shape), var.view(shape)

    x3, y3 = _ncs(x, grouping), _ncs(y, grouping)
    n, c, s = x3.shape
    w, b = _params(weight, bias, c, sdtype)
    groups = {"batch": c, "instance": c, "group": grouping.view[1]}[grouping.kind]
    if layout == "nchw":
        by_channel = grouping.kind == "batch"
        units = c if by_channel else n * groups
        if fixed:
            mean_u = _stats_nc(mean.to(sdtype), grouping, n, c)
            rstd_u = _stats_nc(rstd.to(sdtype), grouping, n, c)
            mean_u, rstd_u = _unit_stats(mean_u, by_channel), _unit_stats(rstd_u, by_channel)
            var_u = torch.empty(units, dtype=sdtype)
        else:
            mean_u, rstd_u, var_u = (torch.empty(units, dtype=sdtype) for _ in range(3))
        if by_channel:
            cb = _channel_block(n * s * x.element_size())
            _launch(_channels_fwd, units, nt, _np(x3), _np(y3), _np(w), _np(b), float(eps), cb,
                    fixed, _np(mean_u), _np(rstd_u), _np(var_u), _stream_out(y))
        else:
            _launch(_units_fwd, units, nt, _np(x3), _np(y3), _np(w), _np(b), float(eps), groups,
                    fixed, _np(mean_u), _np(rstd_u), _np(var_u), _stream_out(y),
                    _units_ahead(x.element_size(), s))
        if fixed:
            return y, mean, rstd, None
        return y, mean_u.view(shape), rstd_u.view(shape), var_u.view(shape)

    # channels_last: per-(n, c) moments, merged to the grouping's statistics in float64
    xt, yt = _cl_flat(x3), _cl_flat(y3)                            # N, S*C
    rb, rg = _cl_blocks(c, x.element_size())
    if not fixed and grouping.kind != "batch" and n >= nt:
        # one sample per iteration, normalized while in cache
        mean_u, rstd_u, var_u = (torch.empty(n * groups, dtype=sdtype) for _ in range(3))
        _launch(_cl_sample_fwd, n, nt, xt, yt, _np(w), _np(b), float(eps), c, groups, rb, rg,
                _np(mean_u), _np(rstd_u), _np(var_u), _stream_out(y))
        return y, mean_u.view(shape), rstd_u.view(shape), var_u.view(shape)
    parts = _parts(n, s, nt)
    st = _NP_STAT[sdtype]
    sn, cg = _unit_index(grouping, c)
    mu, sc, sh = (np.empty((n, c), dtype=st) for _ in range(3))
    if fixed:
        mean_f = _np(mean.to(sdtype).reshape(-1).contiguous())
        rstd_f = _np(rstd.to(sdtype).reshape(-1).contiguous())
        _cl_coefs_fixed(mean_f, rstd_f, sn, cg, _np(w), _np(b), mu, sc, sh)
        var = None
    else:
        pmean = np.empty((n, parts, c))
        pm2 = np.empty((n, parts, c))
        _launch(_cl_moments, n * parts, nt, xt, c, parts, rb, rg, np.empty(0, st), pmean, pm2)
        mean, rstd, var = (torch.empty(shape, dtype=sdtype) for _ in range(3))
        _cl_stats(pmean, pm2, s, sn, cg, float(eps), _np(w), _np(b), _np(mean).reshape(-1),
                  _np(rstd).reshape(-1), _np(var).reshape(-1), mu, sc, sh)
    _launch(_cl_apply, n * parts, nt, xt, yt, c, parts, mu, sc, sh, _stream_out(y))
    return y, mean, rstd, var


def _unit_index(grouping, c):
    """(sn, cg) of the statistic index u = n * sn + c // cg (see ``_cl_stats``)."""
    if grouping.kind == "batch":
        return 0, 1
    if grouping.kind == "instance":
        return c, 1
    g = grouping.view[1]
    return g, c // g


_NP_STAT = {torch.float64: np.float64, torch.float32: np.float32}


def _cl_flat(t3):
    """The (N, S*C) NumPy view of a channels_last (N, C, S) tensor (no copy)."""
    a = _np(t3).transpose(0, 2, 1)                                 # N, S, C contiguous
    return a.reshape(a.shape[0], -1)


def _cl_blocks(c, itemsize):
    """Rows of C channels per block of lane sums (about ``_BLOCK_BYTES``) and per run of
    lanes (about ``_RUN_LANES`` elements); the block is a whole number of runs."""
    rg = max(1, _RUN_LANES // c)
    return max(1, _BLOCK_BYTES // (c * itemsize) // rg) * rg, rg


_CHANNEL_BLOCK_BYTES = 4 << 20  # BatchNorm NCHW: bytes of x per block of channels (L3)


def _channel_block(channel_bytes):
    """Channels per block of ``_channels_fwd``: about ``_CHANNEL_BLOCK_BYTES`` of x."""
    return max(1, _CHANNEL_BLOCK_BYTES // channel_bytes)


def _parts(n, s, nt):
    """Ranges of S per sample so that there are at least 2 work items per thread."""
    return max(1, min(s, -(-2 * nt // n)))


def backward(grad, x, mean, rstd, weight, grouping, center, fixed, needs):
    nt = _threads(x)
    sdtype = mean.dtype
    layout = _layout(x, grouping)
    if layout == "rows":
        grad = grad.contiguous()
        m, k = grouping.view
        w, _ = _params(weight, None, k, sdtype)
        dx = _empty_like(x)
        dwp = np.zeros((nt, k), dtype=_NP_STAT[sdtype])
        dbp = np.zeros((nt, k), dtype=_NP_STAT[sdtype])
        _launch(_rows_bwd, nt, nt, _np(grad), _np(x), _np(w), _np(mean.reshape(m)),
                _np(rstd.reshape(m)), bool(center), _np(dx), dwp, dbp, _stream_out(dx),
                _rows_ahead(k, x.element_size()))
        dw = torch.from_numpy(dwp.sum(0)).view(1, k) if needs[1] else None
        db = torch.from_numpy(dbp.sum(0)).view(1, k) if needs[2] else None
        return (dx if needs[0] else None), dw, db

    x3 = _ncs(x, grouping)
    n, c, s = x3.shape
    pshape = grouping.param_view
    w, _ = _params(weight, None, c, sdtype)
    groups = {"batch": c, "instance": c, "group": grouping.view[1]}[grouping.kind]
    if layout == "nchw":
        g3 = grad.reshape(n, c, s).contiguous()
        dx = _empty_like(x3)
        by_channel = grouping.kind == "batch"
        units = c if by_channel else n * groups
        if grouping.kind == "group":
            mean_u, rstd_u = mean.reshape(n * groups), rstd.reshape(n * groups)
        else:
            mean_u = _unit_stats(_stats_nc(mean, grouping, n, c), by_channel)
            rstd_u = _unit_stats(_stats_nc(rstd, grouping, n, c), by_channel)
        sg = np.empty((n, c), dtype=_NP_STAT[sdtype])
        sgx = np.empty((n, c), dtype=_NP_STAT[sdtype])
        if by_channel:
            cb = _channel_block(2 * n * s * x.element_size())      # x and g
            _launch(_channels_bwd, units, nt, _np(g3), _np(x3), _np(w), _np(mean_u), _np(rstd_u),
                    cb, bool(center), bool(fixed), _np(dx), sg, sgx, _stream_out(dx))
        else:
            _launch(_units_bwd, units, nt, _np(g3), _np(x3), _np(w), _np(mean_u), _np(rstd_u),
                    groups, bool(center), bool(fixed), _np(dx), sg, sgx, _stream_out(dx),
                    _units_ahead(x.element_size(), s))
        sg64, sgx64 = sg.astype(np.float64), sgx.astype(np.float64)
    else:
        g3 = grad.reshape(n, c, s)
        if not g3.transpose(1, 2).is_contiguous():
            g3 = g3.transpose(1, 2).contiguous().transpose(1, 2)
        gt, xt = _cl_flat(g3), _cl_flat(x3)                       # N, S*C
        rb, rg = _cl_blocks(c, x.element_size())
        parts = _parts(n, s, nt)
        st = _NP_STAT[sdtype]
        sn, cg = _unit_index(grouping, c)
        mean_f, rstd_f = _np(mean.reshape(-1)), _np(rstd.reshape(-1))
        mu, rs_nc = np.empty((n, c), dtype=st), np.empty((n, c), dtype=st)
        _cl_expand(mean_f, sn, cg, mu)
        _cl_expand(rstd_f, sn, cg, rs_nc)
        psg = np.empty((n, parts, c))
        psgx = np.empty((n, parts, c))
        _launch(_cl_bwd_sums, n * parts, nt, gt, xt, c, parts, rb, rg, mu, rs_nc, psg, psgx)
        k1, k2, k3 = (np.empty((n, c), dtype=st) for _ in range(3))
        dwa, dba = np.empty(c, dtype=st), np.empty(c, dtype=st)
        _cl_grad_coefs(psg, psgx, rstd_f, _np(w), sn, cg, float(grouping.group_size),
                       bool(center), bool(fixed), k1, k2, k3, dwa, dba)
        dx = _empty_like(x3)
        _launch(_cl_bwd_apply, n * parts, nt, gt, xt, _cl_flat(dx), c, parts, mu, k1, k2, k3,
                _stream_out(dx))
        dw = torch.from_numpy(dwa).view(pshape) if needs[1] else None
        db = torch.from_numpy(dba).view(pshape) if needs[2] else None
        return (dx.view(grouping.view) if needs[0] else None), dw, db
    dw = db = None
    if needs[1]:
        dw = torch.from_numpy(sgx64.reshape(n, c).sum(0).astype(_NP_STAT[sdtype])).view(pshape)
    if needs[2]:
        db = torch.from_numpy(sg64.reshape(n, c).sum(0).astype(_NP_STAT[sdtype])).view(pshape)
    return (dx.view(grouping.view) if needs[0] else None), dw, db
