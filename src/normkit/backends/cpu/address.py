"""Arrays from addresses inside compiled code: how the plans hand tensors to the kernels.

A call from Python into a jitted function pays for each argument it must type: an
ndarray made from a tensor (``tensor.numpy()``, after a ``detach``) costs about a
microsecond, a tuple of arrays more, a plain integer almost nothing. On a small tensor
those microseconds are most of a normalization's cost (``docs/performance.md``, "Whole
models and the per-call cost"). So a plan passes each tensor as its address
(``tensor.data_ptr()``: the first element, storage offset included) with its sizes, and
the compiled entry (``entries``) rebuilds the array with ``at``, which costs nothing at
run time. The dtype, which an address does not carry, comes from a *prototype*: an empty
array of that dtype.

The caller keeps the tensors alive for the call and passes only contiguous memory laid
out as the shape says (the plans check both once, when the plan is built, or per call
where a tensor may come from elsewhere).
"""

from __future__ import annotations

from numba import carray, types
from numba.extending import intrinsic, register_jitable

__all__ = ["at", "float_of_bits"]


@intrinsic
def _pointer(typingctx, address, proto):
    """The integer ``address`` as a pointer to ``proto``'s dtype."""
    sig = types.CPointer(proto.dtype)(address, proto)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@register_jitable
def at(address, proto, shape):
    """The C-contiguous array of ``shape`` and ``proto``'s dtype at ``address``."""
    return carray(_pointer(address, proto), shape)


@intrinsic
def float_of_bits(typingctx, bits):
    """The float64 whose IEEE bits the int64 ``bits`` holds (a float constant of a plan
    in its int64 argument slot, ``args.constants``: exact, no tensor to keep alive)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float64))

    return types.float64(bits), codegen
