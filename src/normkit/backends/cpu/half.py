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
from numba.core import types as nbt
from numba.extending import intrinsic, overload

__all__ = ["accumulate", "is_half", "like", "load", "store"]


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
def accumulate(typingctx, acc, v):
    """``acc + v`` marked re-associable: a reduction LLVM may split into vector lanes.

    The kernels compile with strict IEEE arithmetic (so that shifted sums are not
    re-associated away); only the scalar reductions written with this may be."""
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
