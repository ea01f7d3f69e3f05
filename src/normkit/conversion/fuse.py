r"""Fusing an add into the norm after it: ``convert(model, fuse_residual=True)``.

A pre-norm transformer block (transformers' ``LlamaDecoderLayer`` and its many copies)
adds a branch to the residual stream and normalizes the sum at once::

    hidden_states = residual + hidden_states      # h = a + b
    residual = hidden_states                      # the stream goes on with h
    hidden_states = self.post_attention_layernorm(hidden_states)

``normkit.functional.add_rms_norm`` / ``add_layer_norm`` compute the pair :math:`(y, h) =
(\mathrm{norm}(a + b),\ a + b)` in one call (one kernel each way on CUDA, where the sum is
written once and read no extra time; ``h = a + b`` then the norm elsewhere).

The patterns are found in the *source* of the module's ``forward``, in any block of the
function, ``H``, ``R``, ``Y`` names, ``A`` and ``B`` any expressions but constants, ``N`` a
child that ``convert`` made a normkit ``RMSNorm`` or ``LayerNorm``:

* ``H = A + B``, any number of copies ``R = H``, then ``Y = self.N(H)`` (pre-norm: the
  Llama layer above, ViT's ``layernorm_after``; BERT's embeddings; Phi-3's ``residual +
  self.resid_attn_dropout(hidden_states)``): the add becomes ``_normkit_y, H =
  self._normkit_add_norm(self.N, A, B)``, the copies stay, the norm call becomes ``Y =
  _normkit_y``;
* ``self.N(A + B)`` anywhere in an expression (post-norm: BERT's ``self.LayerNorm(
  hidden_states + input_tensor)``) becomes ``self._normkit_add_norm(self.N, A, B)[0]``.

``A`` and ``B`` are evaluated once each, left first, as by the add: a call's arguments
are evaluated in order (a dropout in ``B`` draws the same numbers). Only the lookup of
``self.N`` moves before them.

The rest of the function is the same syntax tree, compiled with the original file name,
line numbers and globals (read, never written). Decorators that keep the function in
their closure (transformers' ``deprecate_kwarg``) are rebuilt around the new function.
The module gets a class derived for it with that ``forward`` and ``_normkit_add_norm =
add_norm``; nothing global is patched, and ``revert`` gives the class back.

``add_norm`` decides per call, and runs ``h = A + B; y = self.N(h)`` (the unfused
code) whenever the fused call could differ:

* ``A``, ``B`` not tensors of one dtype, device and shape (``A + B`` would broadcast or
  promote), the norm not (any more) a plain normkit ``RMSNorm``/``LayerNorm``, or the
  norm with hooks (a fused call would bypass them).

An RMSNorm's casting rule and offset go to ``add_rms_norm`` (``offset=``, ``casting=``),
which runs one pass only where its kernels' one cast of :math:`\hat h` is the rule's
(``"torch"``, ``"llama"`` in fp32/bf16/fp16, fp32 ``"gemma"``, fp32/fp64 ``"t5"``) and
otherwise the add, then the model's norm op (Gemma's bf16 rule multiplies by ``1 + w`` in
fp32 before its cast); either way the norm keeps ``h``, its statistics and the weight.

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

__all__ = ["add_norm", "candidates", "fuse", "is_fused", "unfuse"]

_HELPER, _Y = "_normkit_add_norm", "_normkit_y"
_FORWARDS: dict = {}
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# the ``from __future__`` flags a recompiled function keeps from the original
_FUTURE_FLAGS = functools.reduce(operator.or_, (getattr(__future__, f).compiler_flag
                                                for f in __future__.all_feature_names))


def _fusable_norm(norm) -> bool:
    """A normkit RMSNorm / LayerNorm running its own class's forward, without hooks of
    its own or global ones (``register_module_forward_hook``)."""
    kind = type(norm)
    if isinstance(norm, nknn.RMSNorm):     # (or llm's forward taking the model's arg name)
        plain = nknn.RMSNorm.forward in (kind.forward,
                                         getattr(kind.forward, "_normkit_forward_of", None))
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
    eps = norm.eps if norm.eps is not None else nF.rms_eps(a.dtype)
    return nF.add_rms_norm(a, b, norm.normalized_shape, norm.weight, eps, memory_saving=False,
                           offset=norm.offset, casting=norm.casting)


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


def _add_operands(value):
    """``(A, B)`` (syntax trees) of ``A + B`` where neither is a constant (which is never
    a tensor: such an add would always take the unfused code), else None."""
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add) and \
            not isinstance(value.left, ast.Constant) and \
            not isinstance(value.right, ast.Constant):
        return value.left, value.right
    return None


def _short(text):
    return text if len(text) <= 80 else text[:77] + "..."


def _shown(a, b):
    """``A + B`` as the report shows a site."""
    return _short(f"{ast.unparse(a)} + {ast.unparse(b)}")


def _first_line(stmt):
    return _short(ast.unparse(stmt).splitlines()[0])


def _windows(fn_def, norms):
    """``(block, i, j, hidden, a, b, y, attr)`` of each ``H = A + B; R = H ...; Y =
    self.N(H)`` (statements i..j, any number of copies ``R = H`` between) with ``N`` in
    ``norms``, and the reasons for the adds of a constant before such a call."""
    self_name = (fn_def.args.posonlyargs + fn_def.args.args)[0].arg
    found, misses = [], []
    for block in _blocks(fn_def):
        for i, stmt in enumerate(block):
            add = _assign(stmt)
            if not (add and isinstance(add[1], ast.BinOp) and isinstance(add[1].op, ast.Add)):
                continue
            hidden, j = add[0], i + 1
            while j < len(block) and (kept := _assign(block[j])) and kept[0] != hidden and \
                    _name(kept[1]) == hidden:
                j += 1
            call = _assign(block[j]) if j < len(block) else None
            target = _norm_call(call[1], self_name) if call else None
            if not (target and target[1] == hidden and target[0] in norms):
                continue
            operands = _add_operands(add[1])
            if operands is None:
                misses.append(f"before {target[0]}, `{_first_line(stmt)}` adds a constant")
                continue
            found.append((block, i, j, hidden, *operands, call[0], target[0]))
    return found, misses


def _helper_call(self_name, attr, a, b):
    """``self._normkit_add_norm(self.N, A, B)``, ``A`` and ``B`` the add's operands."""
    return ast.Call(ast.Attribute(ast.Name(self_name, ast.Load()), _HELPER, ast.Load()),
                    [ast.Attribute(ast.Name(self_name, ast.Load()), attr, ast.Load()), a, b],
                    [])


def _rewrite(found, self_name):
    """Replace each window by ``_normkit_y, H = self._normkit_add_norm(self.N, A, B)``,
    the copies, ``Y = _normkit_y`` (last first, so the indices of a block stay valid)."""
    for block, i, j, hidden, a, b, y, attr in sorted(found, key=lambda w: -w[1]):
        fused = ast.Assign([ast.Tuple([ast.Name(_Y, ast.Store()), ast.Name(hidden, ast.Store())],
                                      ast.Store())], _helper_call(self_name, attr, a, b))
        result = ast.Assign([ast.Name(y, ast.Store())], ast.Name(_Y, ast.Load()))
        block[i:j + 1] = [ast.copy_location(fused, block[i]), *block[i + 1:j],
                          ast.copy_location(result, block[j])]


class _PostNorm(ast.NodeTransformer):
    """``self.N(A + B)`` (a post-norm block: BERT's ``self.LayerNorm(hidden_states +
    input_tensor)``) becomes ``self._normkit_add_norm(self.N, A, B)[0]``; nested functions
    and classes keep their code."""

    def __init__(self, self_name, norms):
        self.self_name, self.norms, self.sites = self_name, norms, []

    def visit_Call(self, node):
        self.generic_visit(node)
        if isinstance(node.func, ast.Attribute) and _name(node.func.value) == self.self_name \
                and node.func.attr in self.norms and len(node.args) == 1 and \
                not node.keywords and _add_operands(node.args[0]):
            a, b = _add_operands(node.args[0])
            self.sites.append((node.lineno, _shown(a, b), node.func.attr))
            call = _helper_call(self.self_name, node.func.attr, a, b)
            return ast.copy_location(ast.Subscript(call, ast.Constant(0), ast.Load()), node)
        return node

    def _keep(self, node):
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = _keep


# ---------------------------------------------------------------- the new forward


def _chain(fn):
    """``fn`` and the functions its decorators wrap, outermost first."""
    chain = [fn]
    while isinstance(getattr(chain[-1], "__wrapped__", None), types.FunctionType):
        chain.append(chain[-1].__wrapped__)
    return chain


def _compiled(inner, rewrite):
    """``(new, sites)``: the plain function ``inner`` with its syntax tree changed by
    ``rewrite(fn_def, self_name) -> sites`` (a non-empty list, or the reason there is
    nothing to change: a str), or the reason there is none."""
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
    if not fn_def.args.posonlyargs + fn_def.args.args:
        return "its forward names no self argument"
    sites = rewrite(fn_def, (fn_def.args.posonlyargs + fn_def.args.args)[0].arg)
    if isinstance(sites, str):
        return sites
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
    return new, sites


def _residual_rewrite(norms):
    """The rewrite of ``_compiled`` that fuses the adds before the norms ``norms``; its
    sites ``("a + b", norm attribute)`` in source order."""
    def rewrite(fn_def, self_name):
        found, misses = _windows(fn_def, norms)
        sites = [(block[i].lineno, _shown(a, b), attr)
                 for block, i, _, _, a, b, _, attr in found]
        _rewrite(found, self_name)
        post = _PostNorm(self_name, norms)
        fn_def.body = [post.visit(stmt) for stmt in fn_def.body]
        sites = sorted(sites + post.sites)
        if not sites:
            return "; ".join(misses) if misses else (
                "no residual add directly before a norm call (`h = a + b; r = h; "
                "y = self.norm(h)` or `self.norm(a + b)`) in its forward")
        return [site[1:] for site in sites]
    return rewrite


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


def rewritten_forward(kind, rewrite):
    """``(forward, sites)``: ``kind.forward`` with its source rewritten by ``rewrite`` (see
    ``_compiled``; decorators that keep it in their closure rebuilt around it), or the
    reason there is none. Shared with ``normkit.conversion.activation``."""
    forward = kind.forward
    if not isinstance(forward, types.FunctionType):
        return "its forward is not a Python function"
    chain = _chain(forward)
    result = _compiled(chain[-1], rewrite)
    if isinstance(result, str):
        return result
    new, sites = result
    for wrapper, old in zip(reversed(chain[:-1]), reversed(chain[1:])):
        new = _rewrapped(wrapper, old, new)
        if new is None:
            return (f"its forward is wrapped by {wrapper.__qualname__}, which does not keep "
                    f"the function in its closure")
    return new, sites


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
    """Give ``module`` a class whose forward fuses the adds before its ``norms``; returns
    the fused sites ``("a + b", norm attribute)``, or the reason there is none (a str)."""
    if is_fused(module):
        return []
    if "forward" in vars(module):
        return "its forward is set on the instance"
    kind, norms = type(module), frozenset(norms)
    result = _fused_forward(kind, norms)
    if isinstance(result, str):
        return result
    module.__class__ = fused_class(kind, norms)
    return result[1]


def _fused_forward(kind, norms):
    """``(forward, sites)`` of ``kind`` fusing the adds before ``norms``, or why not (a
    str); parsed and compiled once per class."""
    if (kind, norms) not in _FORWARDS:
        _FORWARDS[kind, norms] = rewritten_forward(kind, _residual_rewrite(norms))
    return _FORWARDS[kind, norms]


def fused_class(kind, norms):
    """The class of ``kind`` whose forward fuses the adds before its norms ``norms``."""
    forward, sites = _fused_forward(kind, norms)
    role = "fused_" + "_".join(sorted({attr for _, attr in sites}))
    return derived_class(role, kind, (kind,),
                         lambda: {"forward": forward, _HELPER: staticmethod(add_norm),
                                  "_normkit_fused_from": kind},
                         (fused_class, kind, norms))


def is_fused(module) -> bool:
    return "_normkit_fused_from" in vars(type(module))


def unfuse(module) -> str:
    """Give a fused module its own class back; returns that class's name."""
    module.__class__ = type(module)._normkit_fused_from
    return type(module).__qualname__
