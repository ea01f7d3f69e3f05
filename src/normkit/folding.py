r"""``normkit.fold(model)``: fold eval-mode BatchNorm layers into the layer that feeds them.

In eval mode a BatchNorm is a fixed per-channel affine map of its input,

.. math:: y = \gamma \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}} + \beta
          = s\,x + (\beta - s\,\mu), \qquad s = \frac{\gamma}{\sqrt{\sigma^2 + \epsilon}},

with the running estimates :math:`\mu` (``running_mean``) and :math:`\sigma^2`
(``running_var``). When ``x = W * u + b`` comes from a convolution or a Linear layer whose
output goes nowhere else, the two maps compose into one layer with

.. math:: W' = s_o\,W_o, \qquad b' = (b_o - \mu_o)\,s_o + \beta_o

for every output channel ``o``, and the BatchNorm becomes a ``FoldedBatchNorm``: the
identity, after a check that its input has the layout the fold assumed. ``fold`` computes
``s``, ``W'`` and ``b'`` in float64 and casts them once to the producer's dtype.

Which layer feeds which BatchNorm is read off the graph that ``torch.fx`` records, not off
the order of the modules. A module whose forward cannot be traced (Python control flow on
tensor values, such as transformers' shape checks) is kept as one opaque call in its
parent's graph and its children are traced one by one; fold then assumes that such a
module uses its children only by calling them, which is how models are written.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

try:
    import torch
except ModuleNotFoundError as error:   # (an optional dependency)
    from normkit._extras import needs

    raise needs(error, "normkit.fold") from None

from torch import fx, nn

import normkit.nn as nknn

__all__ = ["fold", "FoldReport", "FoldedBatchNorm"]


@dataclass
class FoldReport:
    """What ``fold`` did.

    Attributes
    ----------
    model : nn.Module
        The folded model: a copy of the input, or the input itself with ``inplace=True``.
    folded : list of (BatchNorm name, producer name, producer type name)
    left : list of (BatchNorm name, type name, reason)
        BatchNorm layers that are still in the model, with the reason.
    notes : list of str
        Remarks about the model as a whole (training mode, no BatchNorm, modules that
        were traced child by child).
    """

    model: nn.Module
    folded: list = field(default_factory=list)
    left: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"folded {len(self.folded)} BatchNorm layer(s), left {len(self.left)}"]
        lines += [f"  folded {b} into {p} ({t})" for b, p, t in self.folded]
        lines += [f"  left {n or '<root>'} ({t}): {why}" for n, t, why in self.left]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


# the BatchNorm types fold rewrites (exact types: a subclass may compute something else)
_FOLDABLE = {nn.BatchNorm1d: 1, nn.BatchNorm2d: 2, nn.BatchNorm3d: 3,
             nknn.BatchNorm1d: 1, nknn.BatchNorm2d: 2, nknn.BatchNorm3d: 3}
# producer type -> the BatchNorm dimensionality its output fits
_PRODUCERS = {nn.Linear: 1, nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3,
              nn.ConvTranspose1d: 1, nn.ConvTranspose2d: 2, nn.ConvTranspose3d: 3}
_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _producer_kind(module):
    """The producer type of ``_PRODUCERS`` that ``module`` computes: its own type, or the
    one it subclasses keeping that type's ``forward`` (and a convolution's
    ``_conv_forward``), as transformers' ``EfficientNetDepthwiseConv2d`` does; else None."""
    for kind in type(module).__mro__:
        if kind in _PRODUCERS:
            same = all(getattr(type(module), method, None) is getattr(kind, method, None)
                       for method in ("forward", "_conv_forward"))
            return kind if same else None
    return None


def _is_batch_norm(module) -> bool:
    return isinstance(module, (nn.modules.batchnorm._BatchNorm, nknn.batchnorm._BatchNorm))


def _type_name(module) -> str:
    kind = type(module)
    if kind in _FOLDABLE:
        return f"{kind.__module__.split('.')[0]}.nn.{kind.__name__}"
    return f"{kind.__module__}.{kind.__qualname__}"


# ---------------------------------------------------------------------------------------
# Tracing: one fx graph per traceable scope


class _PiecewiseTracer(fx.Tracer):
    """An fx tracer that keeps going past modules it cannot trace.

    torch.nn and normkit layers (``_normkit_layer``) are leaves, and so are subclasses of
    a producer that compute it (``_producer_kind``). When a submodule's forward raises during
    tracing, the nodes it recorded are erased and the call is recorded as one opaque
    ``call_module`` node instead; the module is listed in ``opaque`` so that its children
    can be traced on their own.
    """

    def __init__(self):
        super().__init__()
        self.opaque: list = []  # (qualified name, module, reason)
        self._forced_leaves: set = set()
        self._proxy_cache: dict = {}

    def is_leaf_module(self, m, module_qualified_name) -> bool:
        return (m in self._forced_leaves or _normkit_layer(m) or _producer_kind(m) is not None
                or super().is_leaf_module(m, module_qualified_name))

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        self._proxy_cache = parameter_proxy_cache  # remembered so a rollback can prune it
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def call_module(self, m, forward, args, kwargs):
        name = self.path_of_module(m)
        if self.is_leaf_module(m, name):
            return super().call_module(m, forward, args, kwargs)
        last = next(iter(reversed(self.graph.nodes)), None)  # newest node before the call
        depth = len(self.module_stack)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as err:  # any failure inside m's forward: record m as opaque
            self._roll_back(last, depth)
            self._forced_leaves.add(m)
            self.opaque.append((name, m, _first_line(err)))
            return super().call_module(m, forward, args, kwargs)

    def _roll_back(self, last, depth) -> None:
        erased = []
        for node in reversed(self.graph.nodes):  # newest first: users go before producers
            if node is last:
                break
            erased.append(node)
        for node in erased:
            self.graph.erase_node(node)
        gone = set(erased)
        for key in [k for k, proxy in self._proxy_cache.items() if proxy.node in gone]:
            del self._proxy_cache[key]
        while len(self.module_stack) > depth:
            self.module_stack.popitem(last=True)


def _normkit_layer(module) -> bool:
    """A layer of normkit's own; not a class ``convert`` derived from a model's class (a
    routed module, or one whose forward it rewrote: traced through like its source)."""
    kind = type(module)
    return kind.__module__.startswith("normkit.") and "_normkit_remake" not in vars(kind)


def _first_line(err) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _trace_scopes(module, prefix, scopes, opaque) -> None:
    """Append ``(prefix, module, graph)`` for ``module`` or, where it cannot be traced as a
    whole, for the pieces of it that can; append ``(name, reason)`` to ``opaque``."""
    if not any(True for _ in module.children()):
        return  # a single layer: nothing inside it to fold
    if type(module).forward is nn.Module.forward:  # ModuleList, ModuleDict: no forward
        for name, child in module.named_children():
            _trace_scopes(child, _join(prefix, name), scopes, opaque)
        return
    tracer = _PiecewiseTracer()
    try:
        graph = tracer.trace(module)
    except Exception as err:  # the module's own forward cannot be traced: go one level down
        opaque.append((prefix, _first_line(err)))
        for name, child in module.named_children():
            _trace_scopes(child, _join(prefix, name), scopes, opaque)
        return
    scopes.append((prefix, module, graph))
    for name, sub, reason in tracer.opaque:
        opaque.append((_join(prefix, name), reason))
        for child_name, child in sub.named_children():
            _trace_scopes(child, _join(_join(prefix, name), child_name), scopes, opaque)


# ---------------------------------------------------------------------------------------
# Deciding which BatchNorm layers fold


def _describe(node, root) -> str:
    if node.op == "call_module":
        return f"{node.target!r} ({type(root.get_submodule(node.target)).__name__})"
    if node.op == "placeholder":
        return f"the input {node.target!r}"
    if node.op == "output":
        return "the output"
    target = getattr(node.target, "__name__", node.target)
    return f"{target!r}"


def _leading_flatten(node) -> bool:
    """``node`` is ``h.flatten(0, 1)`` or ``h.flatten(0, -2)`` (``torch.flatten`` too): the
    rows of a Linear's ``(N, L, C)`` output as ``(N * L, C)``, its last dim kept, which a
    BatchNorm1d (LeViT's ``LinearNorm``) then normalizes per channel."""
    if not ((node.op == "call_method" and node.target == "flatten") or
            (node.op == "call_function" and node.target is torch.flatten)):
        return False
    dims = tuple(node.args[1:]) + tuple(node.kwargs[k] for k in ("start_dim", "end_dim")
                                        if k in node.kwargs)
    return dims in ((0, 1), (0, -2))


def _shape_only(node, of) -> bool:
    """``node`` reads only the shape of ``of`` (``y.reshape_as(of)``, ``of.size()``, ...),
    which a fold leaves as it is."""
    if node.op == "call_method" and node.target in ("reshape_as", "view_as", "expand_as"):
        return len(node.args) == 2 and node.args[1] is of and node.args[0] is not of
    if node.op == "call_method" and node.target in ("size", "dim"):
        return True
    return node.op == "call_function" and node.target is getattr and \
        node.args[1:] in (("shape",), ("ndim",))


def _why_not(bn, bn_node, root, prefix, calls, paths, tensors_read) -> tuple:
    """``(producer, producer name, None)`` when ``bn`` folds, else ``(None, None, reason)``."""
    if bn.training:
        return None, None, "in training mode (it normalizes with batch statistics); call .eval()"
    if bn.running_mean is None or bn.running_var is None:
        return None, None, ("no running statistics (track_running_stats=False): it normalizes "
                            "every batch with that batch's statistics, which no fixed weight "
                            "reproduces")
    if calls[bn] > 1:
        return None, None, f"called {calls[bn]} times in the forward (one layer, several uses)"
    source = bn_node.args[0] if bn_node.args else bn_node.kwargs.get("input")
    user = bn_node                                  # the node that reads the producer
    if isinstance(source, fx.Node) and _leading_flatten(source) and len(source.users) == 1 \
            and isinstance(source.args[0], fx.Node) and source.args[0].op == "call_module" \
            and _producer_kind(root.get_submodule(source.args[0].target)) is nn.Linear:
        user, source = source, source.args[0]
    if not isinstance(source, fx.Node) or source.op == "placeholder":
        where = f"the input of {prefix!r}" if prefix else "the model's input"
        return None, None, f"no producer: it normalizes {where}, not a layer's output"
    if source.op != "call_module" or _producer_kind(root.get_submodule(source.target)) is None:
        return None, None, (f"its input comes from {_describe(source, root)}, not straight from "
                            f"a Conv1d/2d/3d, ConvTranspose1d/2d/3d or Linear")
    producer = root.get_submodule(source.target)
    name = _join(prefix, source.target)
    kind = type(producer).__name__
    if _PRODUCERS[_producer_kind(producer)] != _FOLDABLE[type(bn)]:
        return None, None, (f"its producer {name!r} is a {kind}, which does not feed a "
                            f"{type(bn).__name__}")
    channels = producer.out_features if isinstance(producer, nn.Linear) else producer.out_channels
    if channels != bn.num_features:
        return None, None, (f"its producer {name!r} has {channels} output channels but the "
                            f"BatchNorm has num_features={bn.num_features}")
    others = [u for u in source.users if u is not user and not _shape_only(u, source)]
    if others:
        used = ", ".join(_describe(u, root) for u in others)
        return None, None, f"the output of its producer {name!r} ({kind}) is also used by {used}"
    if calls[producer] > 1:
        return None, None, (f"its producer {name!r} ({kind}) is called {calls[producer]} times "
                            f"in the forward; folding would change every call")
    own = producer._parameters          # (parametrized tensors, a property: computed)
    if own.get("weight") is None or producer.weight is not own["weight"] or (
            producer.bias is not None and producer.bias is not own.get("bias")):
        return None, None, (f"its producer {name!r} ({kind}) computes its weight or bias "
                            f"at each call instead of holding them as its own parameters "
                            f"(parametrized tensors, e.g. weight_norm, or a property): a fold "
                            f"could not rewrite them; for a parametrization, fold after "
                            f"parametrize.remove_parametrizations(module, 'weight')")
    for module, what in ((producer, f"its producer {name!r}"), (bn, "it")):
        if len(paths[module]) > 1:
            return None, None, (f"{what} is registered under several names "
                                f"({', '.join(paths[module])})")
        if module._forward_hooks or module._forward_pre_hooks:
            return None, None, f"{what} has forward hooks, which would see other values"
        for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if tensor.is_meta:
                return None, None, f"{what} has tensors on the meta device (not materialized)"
            if id(tensor) in tensors_read:
                return None, None, (f"{what} has a parameter or buffer that is read elsewhere "
                                    f"(shared weights, or used directly in a forward)")
    return producer, name, None


def _tensor_uses(model, scopes) -> set:
    """ids of tensors that belong to more than one module, or that a graph reads directly."""
    owners: dict = {}
    for module in model.modules():
        for tensor in list(module._parameters.values()) + list(module._buffers.values()):
            if tensor is not None:
                owners.setdefault(id(tensor), set()).add(id(module))
    read = {key for key, mods in owners.items() if len(mods) > 1}
    for _, root, graph in scopes:
        for node in graph.nodes:
            if node.op == "get_attr":
                value = root
                for atom in node.target.split("."):
                    value = getattr(value, atom)
                if isinstance(value, torch.Tensor):
                    read.add(id(value))
    return read


# ---------------------------------------------------------------------------------------
# The arithmetic


@torch.no_grad()
def _fold_into(producer, bn) -> None:
    r"""Rewrite ``producer`` so that it computes ``bn(producer(u))``, in float64, in place.

    ``s = gamma / sqrt(running_var + eps)`` (``gamma = 1`` without affine weight),
    ``W' = s_o W_o`` along the output-channel axis of the weight (axis 0 for Conv and
    Linear; for ConvTranspose, whose weight is ``(in, out / groups, *k)``, axis 1 within
    each group) and ``b' = (b - running_mean) * s + beta`` (``b = 0`` without bias,
    ``beta = 0`` without affine bias).
    """
    f64 = dict(device="cpu", dtype=torch.float64)
    mean = bn.running_mean.detach().to(**f64)
    var = bn.running_var.detach().to(**f64)
    gamma = bn.weight.detach().to(**f64) if bn.weight is not None else torch.ones_like(var)
    beta = bn.bias.detach().to(**f64) if bn.bias is not None else torch.zeros_like(var)
    scale = gamma / torch.sqrt(var + bn.eps)  # C
    weight = producer.weight
    w = weight.detach().to(**f64)
    if isinstance(producer, _TRANSPOSED):
        groups = producer.groups
        kernel = w.shape[2:]
        w = w.reshape(groups, w.shape[0] // groups, w.shape[1], *kernel)  # G, Cin/G, Cout/G, *k
        w = w * scale.reshape(groups, 1, -1, *[1] * len(kernel))
        w = w.reshape(weight.shape)
    else:
        w = w * scale.reshape(-1, *[1] * (w.dim() - 1))  # Cout, ...
    b = producer.bias.detach().to(**f64) if producer.bias is not None else torch.zeros_like(var)
    b = (b - mean) * scale + beta
    weight.copy_(w.to(device=weight.device, dtype=weight.dtype))
    if producer.bias is not None:
        producer.bias.copy_(b.to(device=producer.bias.device, dtype=producer.bias.dtype))
    else:
        producer.bias = nn.Parameter(b.to(device=weight.device, dtype=weight.dtype),
                                     requires_grad=weight.requires_grad)


# ---------------------------------------------------------------------------------------
# The entry point


class FoldedBatchNorm(nn.Module):
    """A BatchNorm folded into its producer: ``act(x)`` (the identity, or the activation the
    BatchNorm applied), where ``x`` has the layout the fold assumed: ``dims`` dimensions,
    (N, C) after a Linear, (N, C, *spatial) after a convolution. Any other input raises a
    ``ValueError``: the BatchNorm refused it, or, a Linear's 3-D output (N, C, L),
    normalized it over dim 1, not over the Linear's features, which the fold scaled.
    ``from_fusion``: the activation is one ``convert(fuse_activation=True)`` took from a
    module after the BatchNorm; ``normkit.revert`` gives it back there (``give_back``)."""

    def __init__(self, kind: str, producer: str, dims: int, act: nn.Module,
                 from_fusion: bool = False):
        super().__init__()
        self.kind, self.producer, self.dims = kind, producer, dims
        self.layout = ("(N, C)", "(N, C, L)", "(N, C, H, W)", "(N, C, D, H, W)")[dims - 2]
        self.act = act
        self.identity = isinstance(act, nn.Identity)   # (no nested call: about 1 us)
        self.from_fusion = from_fusion

    def give_back(self) -> None:
        """Stop applying the activation (revert restores the module it was fused from)."""
        self.act, self.identity, self.from_fusion = nn.Identity(), True, False

    def forward(self, x):
        if x.dim() != self.dims:
            raise ValueError(f"this {self.kind} was folded into {self.producer} (normkit.fold) "
                             f"for {self.dims}-D input {self.layout}, got a {x.dim()}-D input "
                             f"of shape {list(x.shape)}; the unfolded BatchNorm would normalize "
                             f"another axis or refuse it: run the unfolded model")
        if self.identity:
            return x
        return self.act(x)

    def extra_repr(self) -> str:
        return f"{self.kind} folded into {self.producer}, {self.dims}-D input"


def _after_fold(bn, producer_name, producer):
    """What a folded BatchNorm becomes: a ``FoldedBatchNorm`` that checks its input's
    dimensions and applies the activation module the BatchNorm applied, if any (a normkit
    BatchNorm with ``activation``), else ``nn.Identity()``."""
    name = getattr(bn, "activation", None)
    if name is None:
        act = nn.Identity()
    elif name == "leaky_relu":
        act = nn.LeakyReLU(bn.negative_slope)
    else:
        act = {"relu": nn.ReLU, "relu6": nn.ReLU6, "silu": nn.SiLU}[name]()
    dims = 2 if isinstance(producer, nn.Linear) else _FOLDABLE[type(bn)] + 2
    where = f"{type(producer).__name__} {producer_name!r}"
    return FoldedBatchNorm(type(bn).__name__, where, dims, act,
                           bool(bn.__dict__.get("_normkit_fused_activation")))


def fold(model: nn.Module, *, inplace: bool = False) -> FoldReport:
    r"""Fold every eval-mode BatchNorm1d/2d/3d into the Conv or Linear layer that feeds it.

    For a BatchNorm whose input is the output of a ``Conv1d/2d/3d``, ``ConvTranspose1d/2d/3d``
    or ``Linear`` (or a subclass keeping its ``forward``) used nowhere else (but for its
    shape; a Linear's also through ``flatten(0, 1)``), the producer's weight and bias become

    .. math:: W' = W \frac{\gamma}{\sqrt{\sigma^2 + \epsilon}}, \qquad
              b' = (b - \mu) \frac{\gamma}{\sqrt{\sigma^2 + \epsilon}} + \beta

    per output channel (computed in float64, cast to the producer's dtype; a missing
    bias is created), and the BatchNorm becomes a ``FoldedBatchNorm``: the identity (or
    the activation a normkit BatchNorm with an ``activation`` applied) on an input of the
    layout the fold assumed, a ``ValueError`` on any other. torch.nn's and normkit's
    BatchNorm layers both fold; grouped, dilated and bias-free convolutions included.
    The producer is found from the ``torch.fx`` graph of the model, so the order in which
    modules are declared does not matter. fx records no shapes: a ``Linear`` feeding a
    ``BatchNorm1d`` is assumed to output ``(N, C)``, as torch.ao's fuser assumes too; the
    ``FoldedBatchNorm`` raises where it does not.

    A BatchNorm is left in place, and listed in the report with the reason, when it is in
    training mode, has no running statistics, has no producer, its producer's output or
    weights are also used elsewhere, or its producer is another kind of layer (an
    activation in between, for example). A model in training mode, or without any
    BatchNorm, comes back unchanged.

    Args:
        model: the model, normally after ``model.eval()``.
        inplace: fold ``model`` itself. Default ``False``: fold a deep copy and leave
            ``model`` untouched, like ``torch.ao.quantization.fuse_modules``.

    Returns:
        A ``FoldReport``; ``report.model`` is the folded model.

    Example::

        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8)).eval()
        >>> report = fold(net)
        >>> print(report)
        folded 1 BatchNorm layer(s), left 0
          folded 1 into 0 (Conv2d)
        >>> folded = report.model  # net itself is unchanged
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fold expects a torch.nn.Module, got {type(model).__name__}; pass the "
                        f"model itself (not its state_dict or a list of layers)")
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError("fold works on eager modules, got a TorchScript module; fold the model "
                        "first, then script it")
    if not isinstance(inplace, bool):
        raise TypeError(f"fold: inplace must be True or False, got {inplace!r}")
    if not inplace:
        try:
            model = copy.deepcopy(model)
        except Exception as err:
            raise TypeError(f"fold copies the model unless inplace=True, and copy.deepcopy "
                            f"failed ({_first_line(err)}); pass inplace=True to fold the model "
                            f"itself") from err
    report = FoldReport(model)
    norms = [(name, m) for name, m in model.named_modules() if _is_batch_norm(m)]
    if not norms:
        report.notes.append("no BatchNorm layer in the model: nothing to fold")
        return report
    if model.training:
        report.notes.append("the model is in training mode, where BatchNorm uses batch "
                            "statistics: nothing was folded; call model.eval() first")
        report.left += [(n, _type_name(m), "the model is in training mode") for n, m in norms]
        return report

    scopes, opaque = [], []
    _trace_scopes(model, "", scopes, opaque)
    for name, reason in opaque:
        report.notes.append(f"{name or '<root>'} could not be traced as a whole ({reason}); "
                            f"its children were traced one by one")
    paths: dict = {}
    for name, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(module, []).append(name)
    calls: dict = {}
    sites: dict = {}  # BatchNorm -> (its node, the scope's root, the scope's prefix)
    for prefix, root, graph in scopes:
        for node in graph.find_nodes(op="call_module"):
            module = root.get_submodule(node.target)
            calls[module] = calls.get(module, 0) + 1
            sites.setdefault(module, (node, root, prefix))
    tensors_read = _tensor_uses(model, scopes)

    to_fold = []
    for name, bn in norms:
        if type(bn) not in _FOLDABLE:
            report.left.append((name, _type_name(bn), (
                "not a BatchNorm1d/2d/3d: fold rewrites exactly those types (a subclass or a "
                "variant may compute something else)")))
            continue
        if bn not in sites:
            report.left.append((name, _type_name(bn), (
                "no producer found: the traced forward never calls it (it is unused, or called "
                "from inside a module that could not be traced)")))
            continue
        node, root, prefix = sites[bn]
        producer, producer_name, reason = _why_not(bn, node, root, prefix, calls, paths,
                                                   tensors_read)
        if reason is not None:
            report.left.append((name, _type_name(bn), reason))
        else:
            to_fold.append((name, bn, producer_name, producer))

    for name, bn, producer_name, producer in to_fold:
        _fold_into(producer, bn)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, _after_fold(bn, producer_name,
                                                                    producer))
        report.folded.append((name, producer_name, type(producer).__name__))
    return report
