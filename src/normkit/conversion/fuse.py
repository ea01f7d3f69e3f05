r"""Fusing a residual add into the norm after it: ``convert(model, fuse_residual=True)``.

A pre-norm transformer block (transformers' ``LlamaDecoderLayer`` and its many copies)
adds a branch to the residual stream and normalizes the sum at once::

    hidden_states = residual + hidden_states      # h = a + b
    residual = hidden_states                      # the stream goes on with h
    hidden_states = self.post_attention_layernorm(hidden_states)

``normkit.functional.add_rms_norm`` / ``add_layer_norm`` compute the pair :math:`(y, h) =
(\mathrm{norm}(a + b),\ a + b)` in one call (one kernel each way on CUDA, where the sum is
written once and read no extra time; ``h = a + b`` then the norm elsewhere).

The pattern is found in the *source* of the module's ``forward``: three consecutive
statements ``H = A + B; R = H; H = self.N(H)`` (names only; ``N`` a child that
``convert`` made a normkit ``RMSNorm`` or ``LayerNorm``), in any block of the function.
The three become one, ``H, R = self._normkit_add_norm(self.N, A, B)``; the rest of the
function is the same syntax tree, compiled with the original file name, line numbers and
globals (read, never written). Decorators that keep the function in their closure
(transformers' ``deprecate_kwarg``) are rebuilt around the new function. The module gets
a class derived for it with that ``forward`` and ``_normkit_add_norm = add_norm``;
nothing global is patched, and ``revert`` gives the class back.

``add_norm`` decides per call, and falls back to ``h = A + B; y = self.N(h)`` (the
unfused code) whenever the fused call could differ:

* ``A``, ``B`` not tensors of one dtype, device and shape (``A + B`` would broadcast or
  promote), the norm not (any more) a plain normkit ``RMSNorm``/``LayerNorm``, or the
  norm with hooks (a fused call would bypass them);
* an RMSNorm casting rule the fused op cannot reproduce: it normalizes :math:`h` with
  fp32 statistics (fp64 for fp64) and casts :math:`\hat h` once to :math:`h`'s dtype, so
  it serves ``casting="torch"`` (the weight inside), ``"llama"`` in fp32/bf16/fp16
  (whose rule is exactly that cast, then ``w *``), and fp32 inputs of ``"gemma"``,
  fp32/fp64 of ``"t5"`` (no cast at all); Gemma's rule in bf16/fp16 multiplies by ``1 + w`` in fp32 before its
  cast, and ``"llama"``/``"gemma"`` normalize an fp64 input in fp32: those stay unfused.

The memory-saving backward is never used here (it recomputes :math:`\hat h` from the
output, which changes gradients by rounding), so forward and backward are the unfused
model's, bit for bit on CPU, where ``add_*`` is the add followed by the same norm op.
On CUDA the fused kernels round as their own reductions do; they are checked against
torch within the tolerances of ``tests/test_gpu_kernels.py``, not bit for bit.
"""

from __future__ import annotations

import __future__
import ast
import functools
import inspect
import operator
import textwrap
import types

import torch
from torch.nn.modules import module as torch_module

import normkit.nn as nknn
from normkit import functional as nF
from normkit.conversion.classes import derived_class
from normkit.rms_casting import normalize_dtype, scale_and_cast

__all__ = ["add_norm", "candidates", "fuse", "is_fused", "unfuse"]

_HELPER = "_normkit_add_norm"
_FORWARDS: dict = {}
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# the ``from __future__`` flags a recompiled function keeps from the original
_FUTURE_FLAGS = functools.reduce(operator.or_, (getattr(__future__, f).compiler_flag
                                                for f in __future__.all_feature_names))


def _fusable_norm(norm) -> bool:
    """A normkit RMSNorm / LayerNorm running its own class's forward, without hooks of
    its own or global ones (``register_module_forward_hook``)."""
    kind = type(norm)
    if isinstance(norm, nknn.RMSNorm):
        plain = kind.forward is nknn.RMSNorm.forward
    elif isinstance(norm, nknn.LayerNorm):
        plain = kind.forward is nknn.LayerNorm.forward
    else:
        return False
    hooks = [getattr(norm, h) for h in _HOOKS] + [getattr(torch_module, "_global" + h)
                                                  for h in _HOOKS]
    return plain and "forward" not in vars(norm) and not any(hooks)


def add_norm(norm, a, b):
    """``(norm(a + b), a + b)``, one ``add_rms_norm`` / ``add_layer_norm`` call where that
    equals the unfused code, else the unfused code itself."""
    same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
        a.dtype == b.dtype and a.device == b.device and a.shape == b.shape
    if not (same and _fusable_norm(norm)):
        h = a + b
        return norm(h), h
    if isinstance(norm, nknn.LayerNorm):
        return nF.add_layer_norm(a, b, norm.normalized_shape, norm.weight, norm.bias,
                                 norm.eps, memory_saving=False)
    eps = norm.eps if norm.eps is not None else torch.finfo(a.dtype).eps
    casting, offset, weight = norm.casting, norm.offset, norm.weight
    if casting == "torch":                               # the weight inside, as rms_norm
        weight = weight if not offset else offset + weight
        return nF.add_rms_norm(a, b, norm.normalized_shape, weight, eps, memory_saving=False)
    # the fused op's statistics are fp32 (fp64 for fp64); its x_hat is cast to a's dtype
    model_dtype = normalize_dtype(a, casting)
    if torch.promote_types(a.dtype, torch.float32) != model_dtype or \
            (casting != "llama" and a.dtype != model_dtype):
        h = a + b             # e.g. Gemma's bf16 rule scales in fp32, then casts: not one op
        return norm(h), h
    x_hat, h = nF.add_rms_norm(a, b, norm.normalized_shape, None, eps, memory_saving=False)
    return scale_and_cast(x_hat, a.dtype, weight, offset, casting), h


# ---------------------------------------------------------------- the source pattern


def _name(node):
    return node.id if isinstance(node, ast.Name) else None


def _assign(stmt):
    """``(target name, value)`` of ``NAME = value``, else None."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and _name(stmt.targets[0]):
        return stmt.targets[0].id, stmt.value
    return None


def _norm_call(value, self_name):
    """``(attribute, argument name)`` of ``self.N(NAME)``, else None."""
    if isinstance(value, ast.Call) and not value.keywords and len(value.args) == 1 and \
            isinstance(value.func, ast.Attribute) and _name(value.func.value) == self_name \
            and _name(value.args[0]):
        return value.func.attr, value.args[0].id
    return None


def _blocks(node):
    """Every statement list in the function, not those of nested functions or classes."""
    for field in ("body", "orelse", "finalbody", "handlers", "cases"):
        block = getattr(node, field, None)
        if isinstance(block, list):
            if block and isinstance(block[0], ast.stmt):
                yield block
            for child in block:
                if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                          ast.Lambda)):
                    yield from _blocks(child)


def _windows(fn_def, norms):
    """``(block, index, hidden, residual, a, b, attr)`` of each ``H = A + B; R = H;
    H = self.N(H)`` with ``N`` in ``norms``, and the reasons the near misses are not."""
    self_name = fn_def.args.args[0].arg if fn_def.args.args else None
    found, misses = [], []
    for block in _blocks(fn_def):
        for i in range(1, len(block) - 1):
            save, call = _assign(block[i]), _assign(block[i + 1])
            if not (save and call and _name(save[1])):
                continue
            residual, hidden = save[0], save[1].id
            target = _norm_call(call[1], self_name)
            if not (target and target[1] == hidden and call[0] == hidden and target[0] in norms
                    and residual != hidden):
                continue
            add = _assign(block[i - 1])
            if add and add[0] == hidden and isinstance(add[1], ast.BinOp) and \
                    isinstance(add[1].op, ast.Add) and _name(add[1].left) and \
                    _name(add[1].right):
                found.append((block, i - 1, hidden, residual, add[1].left.id,
                              add[1].right.id, target[0]))
            else:
                misses.append(f"before {target[0]}, `{ast.unparse(block[i - 1])[:80]}` is not "
                              f"`{hidden} = a + b` of two names")
    return found, misses


def _rewrite(found):
    """Replace each window by ``H, R = self._normkit_add_norm(self.N, A, B)`` (last
    first, so the indices of a block stay valid)."""
    for block, i, hidden, residual, a, b, attr in sorted(found, key=lambda w: -w[1]):
        self_name = block[i + 2].value.func.value.id
        call = ast.Call(ast.Attribute(ast.Name(self_name, ast.Load()), _HELPER, ast.Load()),
                        [ast.Attribute(ast.Name(self_name, ast.Load()), attr, ast.Load()),
                         ast.Name(a, ast.Load()), ast.Name(b, ast.Load())], [])
        stmt = ast.Assign([ast.Tuple([ast.Name(hidden, ast.Store()),
                                      ast.Name(residual, ast.Store())], ast.Store())], call)
        block[i:i + 3] = [ast.copy_location(stmt, block[i])]


# ---------------------------------------------------------------- the new forward


def _chain(fn):
    """``fn`` and the functions its decorators wrap, outermost first."""
    chain = [fn]
    while isinstance(getattr(chain[-1], "__wrapped__", None), types.FunctionType):
        chain.append(chain[-1].__wrapped__)
    return chain


def _compiled(inner, norms):
    """The fused version of the plain function ``inner`` and the attributes it fuses, or
    the reason there is none."""
    if inner.__code__.co_freevars:
        return f"its forward is a closure (free variables {inner.__code__.co_freevars})"
    try:
        lines, first = inspect.getsourcelines(inner)
    except (OSError, TypeError) as err:
        return f"the source of its forward is not available ({err})"
    tree = ast.parse(textwrap.dedent("".join(lines)))
    fn_def = tree.body[0]
    if not isinstance(fn_def, ast.FunctionDef) or fn_def.name != inner.__name__:
        return "the source of its forward is not a plain def"
    found, misses = _windows(fn_def, norms)
    if not found:
        return "; ".join(misses) if misses else (
            "no residual add directly before a norm call (`h = a + b; r = h; "
            "h = self.norm(h)`) in its forward")
    _rewrite(found)
    fn_def.decorator_list = []
    for arg in fn_def.args.posonlyargs + fn_def.args.args + fn_def.args.kwonlyargs + \
            [fn_def.args.vararg, fn_def.args.kwarg]:
        if arg is not None:
            arg.annotation = None            # kept from the original, never re-evaluated
    fn_def.returns = None
    ast.increment_lineno(tree, first - 1)
    code = compile(ast.fix_missing_locations(tree), inner.__code__.co_filename, "exec",
                   flags=inner.__code__.co_flags & _FUTURE_FLAGS, dont_inherit=True)
    local = {}           # the function is defined here, its globals are the original's
    exec(code, inner.__globals__, local)    # noqa: S102 -- its own source, rewritten
    new = local[fn_def.name]
    new.__defaults__, new.__kwdefaults__ = inner.__defaults__, inner.__kwdefaults__
    new.__annotations__ = dict(inner.__annotations__)
    new.__qualname__, new.__doc__, new.__module__ = inner.__qualname__, inner.__doc__, \
        inner.__module__
    return new, sorted({w[-1] for w in found})


def _rewrapped(wrapper, old, new):
    """``wrapper`` rebuilt with its closure cell holding ``old`` now holding ``new``."""
    cells = wrapper.__closure__ or ()

    def holds(cell):
        try:
            return cell.cell_contents is old
        except ValueError:                     # an empty cell
            return False

    if not any(holds(c) for c in cells):
        return None
    closure = tuple(types.CellType(new) if holds(c) else c for c in cells)
    rebuilt = types.FunctionType(wrapper.__code__, wrapper.__globals__, wrapper.__name__,
                                 wrapper.__defaults__, closure)
    rebuilt.__kwdefaults__ = wrapper.__kwdefaults__
    rebuilt.__dict__.update(vars(wrapper))
    rebuilt.__wrapped__ = new
    rebuilt.__qualname__, rebuilt.__doc__ = wrapper.__qualname__, wrapper.__doc__
    return rebuilt


def _fused_forward(kind, norms):
    """``(forward, attributes fused)`` for instances of ``kind`` whose children ``norms``
    are normkit norms, or the reason there is none."""
    forward = kind.forward
    if not isinstance(forward, types.FunctionType):
        return "its forward is not a Python function"
    chain = _chain(forward)
    result = _compiled(chain[-1], norms)
    if isinstance(result, str):
        return result
    new, attrs = result
    for wrapper, old in zip(reversed(chain[:-1]), reversed(chain[1:])):
        new = _rewrapped(wrapper, old, new)
        if new is None:
            return (f"its forward is wrapped by {wrapper.__qualname__}, which does not keep "
                    f"the function in its closure")
    return new, attrs


def candidates(model):
    """``(name, module, norm attribute names)`` of the modules with normkit norm children."""
    for name, module in model.named_modules():
        if isinstance(module, (nknn.RMSNorm, nknn.LayerNorm)):
            continue
        norms = {n for n, child in module.named_children()
                 if isinstance(child, (nknn.RMSNorm, nknn.LayerNorm))}
        if norms:
            yield name, module, norms


def fuse(module, norms):
    """Give ``module`` a class whose forward fuses the residual adds before ``norms``;
    returns the fused attribute names, or the reason nothing was fused (a str)."""
    if is_fused(module):
        return []
    if "forward" in vars(module):
        return "its forward is set on the instance"
    kind, norms = type(module), frozenset(norms)
    if (kind, norms) not in _FORWARDS:              # parsed and compiled once per class
        _FORWARDS[kind, norms] = _fused_forward(kind, norms)
    result = _FORWARDS[kind, norms]
    if isinstance(result, str):
        return result
    forward, attrs = result
    module.__class__ = derived_class(f"fused_{'_'.join(attrs)}", kind, (kind,),
                                     lambda: {"forward": forward, _HELPER: staticmethod(add_norm),
                                              "_normkit_fused_from": kind})
    return attrs


def is_fused(module) -> bool:
    return "_normkit_fused_from" in vars(type(module))


def unfuse(module) -> str:
    """Give a fused module its own class back; returns that class's name."""
    module.__class__ = type(module)._normkit_fused_from
    return type(module).__qualname__
