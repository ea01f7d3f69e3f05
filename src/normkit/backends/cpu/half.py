"""Loads and stores of every storage type, half precision converted in registers.

The kernels see a tensor's storage as a NumPy array: float64 and float32 as themselves,
bfloat16 as ``uint16`` and float16 as ``int16`` (the bits, told apart by the integer
type, so that each 16-bit format compiles a kernel of its own with its conversion fixed
in it). ``load`` gives the compute type (float32; float64 for float64 storage),
``store`` converts back: bfloat16 is the top half of a float32 (rounded to nearest even
on the way back, NaN kept), float16 goes through the F16C instructions LLVM emits for
``fpext``/``fptrunc``.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import types as nbt
from numba.extending import intrinsic, overload

__all__ = ["accumulate", "copy", "is_half", "like", "load", "narrow", "store", "widen"]


def _const(value, elem, v):
    """The constant v of the IR type elem, a vector of v where ``value`` is a vector."""
    if isinstance(value.type, ir.VectorType):
        return ir.Constant(ir.VectorType(elem, value.type.count), [v] * value.type.count)
    return ir.Constant(elem, v)


def _shaped(value, elem):
    """The IR type elem, as a vector of ``value``'s length where ``value`` is a vector."""
    if isinstance(value.type, ir.VectorType):
        return ir.VectorType(elem, value.type.count)
    return elem


def widen(builder, bits, dtype):
    """IR: the 16-bit storage ``bits`` (a value or a vector) of the numba type dtype
    (uint16: bfloat16, int16: float16) as float32; other dtypes pass through. bfloat16
    bits are the float32's top half; float16 goes through ``fpext`` (F16C)."""
    if dtype == nbt.uint16:
        i32 = ir.IntType(32)
        wide = builder.shl(builder.zext(bits, _shaped(bits, i32)), _const(bits, i32, 16))
        return builder.bitcast(wide, _shaped(bits, ir.FloatType()))
    if dtype == nbt.int16:
        return builder.fpext(builder.bitcast(bits, _shaped(bits, ir.HalfType())),
                             _shaped(bits, ir.FloatType()))
    return bits


def narrow(builder, value, dtype):
    """IR: the float32 ``value`` (a value or a vector) as the storage bits of dtype:
    bfloat16 rounded to nearest even, NaN -> 0x7FC0; float16 by ``fptrunc``, rounded to
    nearest even; other dtypes pass through."""
    if dtype == nbt.uint16:
        i32, i16 = ir.IntType(32), ir.IntType(16)
        bits = builder.bitcast(value, _shaped(value, i32))
        lsb = builder.and_(builder.lshr(bits, _const(bits, i32, 16)), _const(bits, i32, 1))
        rounded = builder.add(bits, builder.add(lsb, _const(bits, i32, 0x7FFF)))
        hi = builder.trunc(builder.lshr(rounded, _const(bits, i32, 16)), _shaped(bits, i16))
        isnan = builder.fcmp_unordered("uno", value, value)
        return builder.select(isnan, _const(bits, i16, 0x7FC0), hi)
    if dtype == nbt.int16:
        half = builder.fptrunc(value, _shaped(value, ir.HalfType()))
        return builder.bitcast(half, _shaped(value, ir.IntType(16)))
    return value


def _converter(dtype, to_float):
    """The intrinsic of one conversion of one element: storage bits of dtype <-> float32."""
    @intrinsic
    def convert(typingctx, v):
        def codegen(context, builder, sig, args):
            return (widen if to_float else narrow)(builder, args[0], dtype)
        return (nbt.float32(v) if to_float else dtype(nbt.float32)), codegen
    return convert


_bf16_to_f32, _f32_to_bf16 = _converter(nbt.uint16, True), _converter(nbt.uint16, False)
_f16_to_f32, _f32_to_f16 = _converter(nbt.int16, True), _converter(nbt.int16, False)


@njit(inline="always")
def copy(dst, src):
    """``dst[i] = src[i]`` over dst, written as a loop: an array assignment (``dst[:] =
    src``) compiles numba's shape-mismatch error with it, about 2 s on an empty cache."""
    for i in range(dst.shape[0]):
        dst[i] = src[i]


#: the most elements a reduction adds in its dtype (float32 for float32 and half data):
#: longer sums are added run by run in float64, so that no vector lane of a sum over a
#: whole plane grows long; a row or plane of up to this many elements is one run
#: (docs/architecture.md, "Long sums").
SUM_RUN = 4096


@intrinsic
def accumulate(typingctx, acc, v):
    """``acc + v`` marked re-associable: a reduction LLVM may split into vector lanes.

    The kernels compile with strict IEEE arithmetic (so that shifted sums are not
    re-associated away); only the scalar reductions written with this may be, in runs
    of at most ``SUM_RUN`` elements."""
    if acc != v:
        return None

    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1], flags=("reassoc", "nsz"))
    return acc(acc, v), codegen


def is_half(a):
    """Whether the numba array type ``a`` holds half-precision bits (bfloat16 or float16)."""
    return a.dtype in (nbt.uint16, nbt.int16)


def load(a, i):
    """``a[i]`` as the compute type (float32; float64 for float64 storage)."""


def store(a, i, v):
    """``a[i] = v`` converted to the storage type."""


def like(a, v):
    """``v`` as the dtype of the float array ``a`` (the statistics dtype of a kernel)."""


@overload(load)
def _load_impl(a, i):
    if a.dtype == nbt.uint16:
        return lambda a, i: _bf16_to_f32(a[i])
    if a.dtype == nbt.int16:
        return lambda a, i: _f16_to_f32(a[i])
    return lambda a, i: a[i]


@overload(store)
def _store_impl(a, i, v):
    if a.dtype == nbt.uint16:
        def store_bf16(a, i, v):
            a[i] = _f32_to_bf16(np.float32(v))
        return store_bf16
    if a.dtype == nbt.int16:
        def store_f16(a, i, v):
            a[i] = _f32_to_f16(np.float32(v))
        return store_f16

    def store_float(a, i, v):
        a[i] = v
    return store_float


@overload(like)
def _like_impl(a, v):
    if a.dtype == nbt.float64:
        return lambda a, v: np.float64(v)
    return lambda a, v: np.float32(v)
