"""Output stores: every output formula written once, stored plainly or streamed.

An output of the kernels is ``dst[i] = formula(a_1[i], .., a_n[i], s_1, .., s_m)`` over a
contiguous span, for arrays ``a`` and scalars ``s``. Each formula is a plain Python
function of numbers (the six below), registered with ``register_jitable(inline="always")``
(which returns the function itself), so jitted code calls it inlined: the plain loops of
small planes (``planes``) do. ``span_store(formula)`` makes from it the one
driver the rows and NCHW planes kernels call, ``store(dst, arrays, scalars, prefetch,
stream)``, in place of a plain loop, a streamed twin and a prefetching walk per formula:

* plain: a loop of ``half.store(dst, i, formula(half.load(a, i).., s..))``, which LLVM
  vectorizes;
* streamed (``stream`` true): the same formula evaluated on whole 64-byte vectors and
  stored with LLVM's ``!nontemporal`` (``vmovntps``/``vmovntpd``), plain stores at the
  unaligned ends. The vector code is built by calling the *same* Python function on LLVM
  values (``_Values``: one IR instruction per operator, in the order Python evaluates
  them, no contraction into FMAs), and half precision is widened and narrowed on the
  vectors by the IR of ``half.load`` / ``half.store`` (``half.widen``, ``half.narrow``),
  so it performs the same IEEE operations in the same order as the plain loop: the same
  bits;
* prefetch: for float32/float64 the span is written in pieces of
  ``tuning.PREFETCH_PIECE`` elements, each followed by a prefetch into L2 of the same
  piece of the two arrays in ``prefetch`` (rows or planes ahead; empty arrays: none).

Half precision takes the whole span in one piece, plain or streamed, and prefetches
nothing (``tuning.rows_ahead``): its pace is the conversion in registers, and chunking
cost it.

The channels_last formulas (per-channel coefficients, rows of C elements) go through
``rows_store(formula)`` instead, the same plain and streamed code walked a row at a time
over a whole range of rows in one call.

A kernel that streamed anything calls ``fence()`` before it returns: non-temporal stores
are weakly ordered.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils
from numba.core import types as nbt
from numba.extending import intrinsic, overload, register_jitable

from normkit.backends.cpu.half import is_half, load, narrow, store, widen
from normkit.backends.cpu.tuning import PREFETCH_PIECE

__all__ = ["add", "affine_per_channel", "affine_per_element", "affine_scalar",
           "dx_per_channel", "dx_rows_planes", "fence", "prefetch", "prefetch_lines", "rows_store",
           "span_store", "where"]


# ---- the output formulas ----------------------------------------------------------------

@register_jitable(inline="always")
def add(x, r):
    """The residual add of ``add_layer_norm`` / ``add_rms_norm``: ``h = x + r``, and in
    their backward ``dh = dh + gh`` (the norm's gradient, rounded, plus h's own, as
    ``x + r`` rounds: the bits of the add followed by the norm)."""
    return x + r


@register_jitable(inline="always")
def affine_per_element(x, w, b, mean_hi, mean_lo, rstd):
    """Rows forward: ``y = ((x - mean_hi) - mean_lo) * (rstd * w) + b``, the row's mean
    as ``moments.split_mean`` gives it, w and b per element."""
    return ((x - mean_hi) - mean_lo) * (rstd * w) + b


@register_jitable(inline="always")
def affine_scalar(x, mean_hi, mean_lo, scale, shift):
    """NCHW planes forward: ``y = ((x - mean_hi) - mean_lo) * scale + shift`` with
    ``scale = rstd * w[c]`` and ``shift = b[c]`` of the plane's channel (the mean as
    ``moments.split_mean`` gives it; given statistics: ``(mean, 0)``)."""
    return ((x - mean_hi) - mean_lo) * scale + shift


@register_jitable(inline="always")
def affine_per_channel(x, mean, scale, shift):
    """channels_last forward: ``y = (x - mean) * scale + shift``, all per-channel rows.
    (Folding the mean into the shift would round ``x * scale`` at the scale of the
    offset: 1.5 ulps of the input at an offset of 1e3, against 0.5.)"""
    return (x - mean) * scale + shift


@register_jitable(inline="always")
def dx_rows_planes(g, x, w, mean, rstd, c_var, c_mean):
    """Rows and NCHW planes backward, ``w`` per element (rows) or the plane's ``w[c]``::

        xhat = (x - mean) * rstd
        dx   = (g * w - c_mean - xhat * c_var) * rstd

    with ``c_var = mean(g * w * xhat)`` and ``c_mean = mean(g * w)`` over the group."""
    return (g * w - c_mean - ((x - mean) * rstd) * c_var) * rstd


@register_jitable(inline="always")
def dx_per_channel(g, x, mean, scale_g, scale_x, offset):
    """channels_last backward, the same dx with its coefficients per (n, c) folded::

        dx = g * scale_g - (x - mean) * scale_x - offset
        scale_g = rstd * w,  scale_x = rstd^2 * c_var,  offset = rstd * c_mean
    """
    return g * scale_g - (x - mean) * scale_x - offset


# ---- selects (the activations' formulas, ``act_stores``) -------------------------------

def where(c, a, b):
    """``a if c else b``: in jitted code a select; on the LLVM values of the streamed
    stores (``_Values``) a vector select."""
    if isinstance(c, _Values):
        return c.select(a, b)
    return a if c else b


@intrinsic
def _select(typingctx, c, a, b):
    """LLVM's ``select``: no branch (nor the phi of an inlined ``a if c else b``)."""
    if not (isinstance(c, nbt.Boolean) and isinstance(a, nbt.Float) and a == b):
        return None

    def codegen(context, builder, sig, args):
        return builder.select(args[0], args[1], args[2])
    return a(c, a, b), codegen


@overload(where, inline="always")
def _where_impl(c, a, b):
    return lambda c, a, b: _select(c, a, b)


# ---- streamed (non-temporal) stores -----------------------------------------------------

class _Values:
    """LLVM values (scalars or vectors) under Python's arithmetic operators: a formula
    called on these builds one IR instruction per operator, in evaluation order."""

    def __init__(self, builder, value):
        self.builder, self.value = builder, value

    def _op(self, other, name):
        return _Values(self.builder, getattr(self.builder, name)(self.value, other.value))

    def __add__(self, other):
        return self._op(other, "fadd")

    def __sub__(self, other):
        return self._op(other, "fsub")

    def __mul__(self, other):
        return self._op(other, "fmul")

    def __lt__(self, other):
        return _Values(self.builder, self.builder.fcmp_ordered("<", self.value, other.value))

    def __gt__(self, other):
        return _Values(self.builder, self.builder.fcmp_ordered(">", self.value, other.value))

    def select(self, a, b):
        """``a`` where this mask holds, else ``b`` (``where``)."""
        return _Values(self.builder, self.builder.select(self.value, a.value, b.value))


def _streamed_codegen(formula, n_arrays, n_scalars):
    """Codegen of ``streamed(dst, arrays, scalars)``: dst[i] = formula(arrays[i].., scalars..)
    for contiguous 1-d arrays of one length, the 64-byte-aligned interior of dst in vectors
    with non-temporal stores, the unaligned ends element by element with plain ones. Half
    precision (dst and any of the arrays) is widened to float32 and narrowed back as
    ``half.load`` and ``half.store`` do it, on whole vectors."""
    def codegen(context, builder, sig, args):
        i64, i32 = ir.IntType(64), ir.IntType(32)
        dst_t, arrays_t = sig.args[0], sig.args[1]
        dst = context.make_array(dst_t)(context, builder, args[0])
        arrays = [context.make_array(t)(context, builder, v) for t, v in
                  zip(arrays_t.types, cgutils.unpack_tuple(builder, args[1], n_arrays))]
        scalars = cgutils.unpack_tuple(builder, args[2], n_scalars)
        out, srcs = dst.data, [(a.data, t.dtype) for a, t in zip(arrays, arrays_t.types)]
        size = context.get_abi_sizeof(context.get_data_type(dst_t.dtype))
        lanes = 64 // size                                         # a cache line a store
        n = builder.extract_value(dst.shape, 0)

        def compute(vals, scals):
            return formula(*(_Values(builder, v) for v in (*vals, *scals))).value

        def one_by_one(start, count):
            with cgutils.for_range(builder, count) as loop:
                i = builder.add(start, loop.index)
                vals = [widen(builder, builder.load(builder.gep(p, [i])), t) for p, t in srcs]
                builder.store(narrow(builder, compute(vals, scalars), dst_t.dtype),
                              builder.gep(out, [i]))

        head = builder.and_(builder.neg(builder.ptrtoint(out, i64)), ir.Constant(i64, 63))
        head = builder.udiv(head, ir.Constant(i64, size))         # elements to alignment
        head = builder.select(builder.icmp_unsigned("<", head, n), head, n)
        one_by_one(ir.Constant(i64, 0), head)
        zeros = ir.Constant(ir.VectorType(i32, lanes), None)

        def splat(v):
            vt = ir.VectorType(v.type, lanes)
            v = builder.insert_element(ir.Constant(vt, ir.Undefined), v, ir.Constant(i32, 0))
            return builder.shuffle_vector(v, v, zeros)

        def vector_at(p, off):
            vt = ir.VectorType(p.type.pointee, lanes)
            return builder.bitcast(builder.gep(p, [off]), vt.as_pointer())
        vscalars = [splat(v) for v in scalars]
        nontemporal = builder.module.add_metadata([ir.Constant(i32, 1)])
        blocks = builder.udiv(builder.sub(n, head), ir.Constant(i64, lanes))
        with cgutils.for_range(builder, blocks) as loop:
            off = builder.add(head, builder.mul(loop.index, ir.Constant(i64, lanes)))
            vals = [widen(builder, builder.load(vector_at(p, off),
                                                align=context.get_abi_sizeof(p.type.pointee)),
                          t) for p, t in srcs]
            st = builder.store(narrow(builder, compute(vals, vscalars), dst_t.dtype),
                               vector_at(out, off), align=64)
            st.set_metadata("nontemporal", nontemporal)
        done = builder.add(head, builder.mul(blocks, ir.Constant(i64, lanes)))
        one_by_one(done, builder.sub(n, done))
        return context.get_dummy_value()
    return codegen


def _streamed(formula):
    """The intrinsic ``streamed(dst, arrays, scalars)`` of ``formula``: typed for
    contiguous 1-d arrays, float32 or float64 all of dst's dtype, or a half-precision dst
    with arrays of its dtype or float32 (the scalars cast to the compute type)."""
    @intrinsic
    def streamed(typingctx, dst, arrays, scalars):
        if not (isinstance(arrays, nbt.BaseTuple) and isinstance(scalars, nbt.BaseTuple)):
            return None
        if not isinstance(dst, nbt.Array) or dst.dtype not in (nbt.float32, nbt.float64,
                                                                nbt.uint16, nbt.int16):
            return None
        compute = nbt.float32 if is_half(dst) else dst.dtype
        if not all(isinstance(a, nbt.Array) and a.ndim == 1 and a.layout == "C"
                   and a.dtype in (dst.dtype, compute) for a in (dst, *arrays.types)):
            return None
        sig = nbt.none(dst, arrays, nbt.Tuple([compute] * len(scalars)))
        return sig, _streamed_codegen(formula, len(arrays), len(scalars))
    return streamed


@intrinsic
def fence(typingctx):
    """A full memory fence (``mfence``): orders the non-temporal stores before it with
    whatever the thread does next."""
    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return nbt.none(), codegen


# ---- prefetch -------------------------------------------------------------------------

@intrinsic
def prefetch(typingctx, a, i):
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


@register_jitable(inline="always")
def prefetch_lines(a, i0, i1):
    """``prefetch`` the cache lines of a[i0:i1] (clipped to a)."""
    for i in range(i0, min(i1, a.shape[0]), max(1, 64 // a.itemsize)):
        prefetch(a, i)


# ---- tuples of arrays, element by element -----------------------------------------------

# The drivers and the helpers below are inlined into the kernel (numba IR inlining): each
# array passed to a call costs a reference-count increment and decrement (atomic
# operations), which the kernels would otherwise pay per row of C or per piece. The plain
# loop itself is the exception: LLVM vectorizes it only when it is compiled on its own.

def _load_each(arrays, i):
    """``(load(a, i) for a in arrays)`` as a tuple."""


def _slice_each(arrays, i0, i1):
    """``(a[i0:i1] for a in arrays)`` as a tuple."""


# Written out per length (the formulas take one to six arrays): a recursion over
# arrays[1:] would build a tuple of arrays per element or piece.
_LOADS = {
    1: lambda arrays, i: (load(arrays[0], i),),
    2: lambda arrays, i: (load(arrays[0], i), load(arrays[1], i)),
    3: lambda arrays, i: (load(arrays[0], i), load(arrays[1], i), load(arrays[2], i)),
    4: lambda arrays, i: (load(arrays[0], i), load(arrays[1], i), load(arrays[2], i),
                          load(arrays[3], i)),
    5: lambda arrays, i: (load(arrays[0], i), load(arrays[1], i), load(arrays[2], i),
                          load(arrays[3], i), load(arrays[4], i)),
    6: lambda arrays, i: (load(arrays[0], i), load(arrays[1], i), load(arrays[2], i),
                          load(arrays[3], i), load(arrays[4], i), load(arrays[5], i)),
    7: lambda arrays, i: (load(arrays[0], i), load(arrays[1], i), load(arrays[2], i),
                          load(arrays[3], i), load(arrays[4], i), load(arrays[5], i),
                          load(arrays[6], i)),
}
_SLICES = {
    1: lambda arrays, i0, i1: (arrays[0][i0:i1],),
    2: lambda arrays, i0, i1: (arrays[0][i0:i1], arrays[1][i0:i1]),
    3: lambda arrays, i0, i1: (arrays[0][i0:i1], arrays[1][i0:i1], arrays[2][i0:i1]),
}


def _apply(formula):
    """``formula`` (registered where it is defined: see the module docstring) of one tuple
    of its arguments, ``apply(t) = formula(*t)`` written out for its number of arguments,
    both inlined: a call per element that numba does not inline keeps LLVM from
    vectorizing the loop (and numba inlines no ``*args`` call)."""
    f = formula
    calls = {
        2: lambda t: f(t[0], t[1]),
        4: lambda t: f(t[0], t[1], t[2], t[3]),
        5: lambda t: f(t[0], t[1], t[2], t[3], t[4]),
        6: lambda t: f(t[0], t[1], t[2], t[3], t[4], t[5]),
        7: lambda t: f(t[0], t[1], t[2], t[3], t[4], t[5], t[6]),
        8: lambda t: f(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7]),
        9: lambda t: f(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8]),
        11: lambda t: f(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], t[10]),
        12: lambda t: f(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], t[10],
                        t[11]),
    }
    return register_jitable(inline="always")(calls[formula.__code__.co_argcount])


@overload(_load_each, inline="always")
def _load_each_impl(arrays, i):
    return _LOADS.get(len(arrays))


@overload(_slice_each, inline="always")
def _slice_each_impl(arrays, i0, i1):
    return _SLICES.get(len(arrays))


# ---- the drivers ---------------------------------------------------------------------

def span_store(formula, streamed=True):
    """The driver ``store(dst, arrays, scalars, prefetch, stream)`` of ``formula`` (a
    jitable function): ``dst[i] = formula(*arrays[i], *scalars)`` over a span (one to
    three arrays), streamed when ``stream`` (and ``streamed``: else ``stream`` is
    ignored), with the lines of the two arrays of ``prefetch`` (the x and g ahead; an
    empty array: none) fetched piece by piece meanwhile (see the module docstring)."""
    apply = _apply(formula)
    streamed = _streamed(formula) if streamed else None

    def plain_loop(dst, arrays, scalars):
        for i in range(dst.shape[0]):
            store(dst, i, apply(_load_each(arrays, i) + scalars))

    # compiled on its own, not inlined into the driver: LLVM vectorizes the loop only there
    plain = register_jitable(plain_loop)

    def driver(dst, arrays, scalars, prefetch, stream):
        """``formula`` stored over dst."""

    @overload(driver, inline="always")
    def _driver_impl(dst, arrays, scalars, prefetch, stream):
        if is_half(dst):                            # whole span, nothing to prefetch
            def half_span(dst, arrays, scalars, prefetch, stream):
                if stream and streamed is not None:
                    streamed(dst, arrays, scalars)
                else:
                    plain(dst, arrays, scalars)
            return half_span

        def pieces(dst, arrays, scalars, prefetch, stream):
            n = dst.shape[0]
            ahead_a, ahead_b = prefetch                            # once, not per piece
            if stream and streamed is not None:
                for i0 in range(0, n, PREFETCH_PIECE):
                    i1 = min(n, i0 + PREFETCH_PIECE)
                    streamed(dst[i0:i1], _slice_each(arrays, i0, i1), scalars)
                    prefetch_lines(ahead_a, i0, i1)
                    prefetch_lines(ahead_b, i0, i1)
            else:
                for i0 in range(0, n, PREFETCH_PIECE):
                    i1 = min(n, i0 + PREFETCH_PIECE)
                    plain(dst[i0:i1], _slice_each(arrays, i0, i1), scalars)
                    prefetch_lines(ahead_a, i0, i1)
                    prefetch_lines(ahead_b, i0, i1)
        return pieces

    driver.__name__ = driver.__qualname__ = f"store_{formula.__name__}"
    driver.__doc__ = f"``{formula.__name__}`` stored over a span: see ``span_store``."
    return driver


def rows_store(formula, streamed=True):
    """The driver ``store(dst, row_arrays, channel_arrays, c_, r0, r1, stream,
    scalars=())`` of a per-channel ``formula`` over the rows [r0, r1) of C elements of one
    channels_last sample: ``dst[r*C + c] = formula(*row_arrays[r*C + c],
    *channel_arrays[c], *scalars)``, a row at a time, streamed when ``stream`` (and
    ``streamed``). One call walks a whole range of rows: a call per row of C elements
    would cost more than the row (see ``span_store``)."""
    apply = _apply(formula)
    streamed = _streamed(formula) if streamed else None

    @register_jitable
    def plain_rows(dst, row_arrays, channel_arrays, c_, r0, r1, scalars):
        for r in range(r0, r1):
            d = dst[r * c_:(r + 1) * c_]                               # C
            arrays = _slice_each(row_arrays, r * c_, (r + 1) * c_) + channel_arrays
            for c in range(c_):
                store(d, c, apply(_load_each(arrays, c) + scalars))

    def driver(dst, row_arrays, channel_arrays, c_, r0, r1, stream, scalars=()):
        """``formula`` stored over rows."""

    @overload(driver)
    def _driver_impl(dst, row_arrays, channel_arrays, c_, r0, r1, stream, scalars=()):
        if streamed is None:
            def plain_only(dst, row_arrays, channel_arrays, c_, r0, r1, stream, scalars=()):
                plain_rows(dst, row_arrays, channel_arrays, c_, r0, r1, scalars)
            return plain_only

        def each_row(dst, row_arrays, channel_arrays, c_, r0, r1, stream, scalars=()):
            if not stream:
                plain_rows(dst, row_arrays, channel_arrays, c_, r0, r1, scalars)
                return
            for r in range(r0, r1):
                streamed(dst[r * c_:(r + 1) * c_],
                         _slice_each(row_arrays, r * c_, (r + 1) * c_) + channel_arrays,
                         scalars)
        return each_row

    driver.__name__ = driver.__qualname__ = f"store_rows_{formula.__name__}"
    return driver


store_add = span_store(add)
store_affine_per_element = span_store(affine_per_element)
store_affine_scalar = span_store(affine_scalar)
store_dx_rows_planes = span_store(dx_rows_planes)
store_affine_per_channel = rows_store(affine_per_channel)
store_dx_per_channel = rows_store(dx_per_channel)
