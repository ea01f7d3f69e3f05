r"""Functional normalizations with the signatures of ``torch.nn.functional``.

Each op validates its arguments (raising the same exception types as torch, with the
values and the fix in the message), describes its groups with ``normkit.grouping``, and
runs ``normkit.autograd.NormFunction``: one dispatch to a backend, a hand-derived backward.

All of them compute

.. math::
    y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \cdot \gamma + \beta

with the biased variance over the group, statistics in fp32 (fp64 for fp64 inputs) and
the output in the input's dtype.
"""

from __future__ import annotations

import math

try:
    import torch
except ModuleNotFoundError as error:   # (an optional dependency)
    from normkit._extras import needs

    raise needs(error, "normkit.functional") from None

from normkit import backends, ops
from normkit import grouping as G
from normkit._checks import (_check_channels, _check_flag, _check_floating, _check_running,
                             _check_vectors, _dims, _index, _momentum, _refuse_dtype, _size)
from normkit.activation import resolve
from normkit.ops import add_norm, apply_norm, cast_norm
from normkit.backends import torch_ops
from normkit.backends.torch_ops import stat_dtype
from normkit.rms_casting import check_casting, normalize_dtype

__all__ = ["batch_norm", "batch_norm_act", "layer_norm", "group_norm", "instance_norm", "rms_norm", "normalize",
           "batch_renorm", "add_layer_norm", "add_rms_norm"]


def _eager_cached(make):
    """``make(shape, ...)`` (a ``normkit.grouping`` constructor) cached on its arguments in
    eager mode: a model asks for the same few groupings on every call, and building one
    costs several times more between a model's other ops than alone (docs/performance.md,
    "Between convolutions"). Traced, it is called as it is: a cache keyed on symbolic
    sizes would pin them (under torch.compile), or cannot hash them (FakeTensor tracing)."""
    cache = {}

    def cached(*args):
        if torch.compiler.is_compiling():
            return make(*args)
        try:
            found = cache.get(args)
        except TypeError:                        # symbolic sizes: unhashable
            return make(*args)
        if found is None:
            if len(cache) >= 4096:
                cache.clear()
            found = cache[args] = make(*args)
        return found
    return cached


_batch, _instance = _eager_cached(G.batch), _eager_cached(G.instance)
_activation = _eager_cached(resolve)
_group, _layer = _eager_cached(G.group), _eager_cached(G.layer)


def rms_eps(dtype) -> float:
    """The ``eps`` of an RMS norm given ``eps=None``: the machine epsilon of the dtype it
    computes in, float32 for float16 and bfloat16 input, as torch's kernels take it (its
    documentation says the input dtype's; bfloat16's 0.0078 would differ by up to 1.8 on
    inputs of size 0.05)."""
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps


def update_running(running_mean, running_var, mean, var, momentum, unbias=1.0):
    """``running = (1 - momentum) * running + momentum * value`` in place for both
    buffers, the variance's value ``var * unbias``: in eager mode on the buffers'
    backend (``normkit.backends.update_running``), traced as torch ops."""
    if ops.plain_eager(running_mean):
        backends.update_running(running_mean, running_var, mean, var, momentum, unbias)
        return
    if not ops.tracing() and _vmapped(mean) and not _vmapped(running_mean):
        raise RuntimeError(
            "a normalization in training under torch.func.vmap got a batched input, but its "
            "running_mean and running_var, which it updates in place, are not batched: call "
            "it in eval mode, build it with track_running_stats=False, set its running_mean "
            "and running_var to None (torch.func.replace_all_batch_norm_modules_ does so for "
            "torch.nn's layers only), or pass batched buffers (torch.func.stack_module_state)")
    torch_ops.update_running(running_mean, running_var, mean, var, momentum, unbias)


def _vmapped(t) -> bool:
    """Whether ``t`` is batched by ``torch.func.vmap`` at any of its transforms' levels."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_batchedtensor(t):
            return True
        t = functorch.get_unwrapped(t)
    return False


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,
               momentum=0.1, eps=1e-5):
    r"""Batch normalization over ``(N, C, *S)``: one mean and variance per channel
    (``batch_norm_act``: followed by an activation in the same call).

    .. math:: y = \gamma \cdot \frac{x - \mu_c}{\sqrt{\sigma_c^2 + \epsilon}} + \beta

    In training (or without running statistics) :math:`\mu_c, \sigma^2_c` are the batch's
    mean and *biased* variance over N and all spatial positions, and the running
    statistics, if given, are updated in place with
    ``running = (1 - momentum) * running + momentum * batch_stat``, the variance stored
    *unbiased* (``var * n / (n - 1)``). In eval the running statistics normalize.

    Example::

        >>> x = torch.randn(8, 3, 4, 4)
        >>> rm, rv = torch.zeros(3), torch.ones(3)
        >>> y = batch_norm(x, rm, rv, training=True)
    """
    return _batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps,
                       None)


def batch_norm_act(input, running_mean, running_var, weight=None, bias=None, training=False,
                   momentum=0.1, eps=1e-5, *, activation="relu", negative_slope=0.01):
    r"""``batch_norm`` followed by an activation, in one call.

    .. math:: y = \mathrm{act}\Big(\gamma \cdot \frac{x - \mu_c}{\sqrt{\sigma_c^2 +
              \epsilon}} + \beta\Big)

    In training (or without running statistics) :math:`\mu_c, \sigma^2_c` are the batch's
    mean and *biased* variance over N and all spatial positions, and the running
    statistics, if given, are updated in place with
    ``running = (1 - momentum) * running + momentum * batch_stat``, the variance stored
    *unbiased* (``var * n / (n - 1)``). In eval the running statistics normalize.

    ``activation`` (keyword-only) is one of ``"relu"``, ``"relu6"``,
    ``"leaky_relu"`` (with ``negative_slope``) and ``"silu"``: the result then equals
    ``F.relu(batch_norm(...))`` etc., the activation applied where the output is stored
    and its derivative folded into the backward (which recomputes the pre-activation from
    the input and the statistics: nothing more is kept for backward than without it).
    Statistics and the running update are BatchNorm's.

    Example::

        >>> x = torch.randn(8, 3, 4, 4)
        >>> rm, rv = torch.zeros(3), torch.ones(3)
        >>> y = batch_norm_act(x, rm, rv, training=True, activation="relu")
    """
    return _batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps,
                       _activation(activation, negative_slope))


def _batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps, act):
    """``batch_norm`` (``act`` None) and ``batch_norm_act`` (``act`` an ``Activation``)."""
    if input.dim() < 2:
        raise ValueError(f"batch_norm expects an input of shape (N, C, *), got {input.dim()}D "
                         f"input of size {_size(input.shape)}; add a batch dim with unsqueeze(0)")
    _check_channels("batch_norm", input, running_mean, running_var, weight, bias)
    _check_flag("batch_norm", "training", training)
    if not training and (running_mean is None or running_var is None):
        missing = "running_mean" if running_mean is None else "running_var"
        raise RuntimeError(f"{missing} must be defined in evaluation mode: batch_norm with "
                           f"training=False normalizes with the running statistics; pass "
                           f"running_mean and running_var, or training=True to use the batch's")
    _check_running("batch_norm", running_mean, running_var)
    momentum = _momentum("batch_norm", momentum)
    grouping = _batch(input.shape)
    if eps < 0 or (training and eps == 0):
        raise ValueError(f"batch_norm eps must be positive (non-negative in eval), got "
                         f"eps={eps}: it keeps a constant channel from dividing by zero; "
                         f"use the usual 1e-5")
    n = grouping.group_size if training else 0
    if training and n == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size "
            f"{input.size()}: a batch of one sample with no spatial positions cannot be "
            f"normalized; use a larger batch, eval mode, or a batch-independent norm "
            f"(GroupNorm, LayerNorm)")
    if not training:
        sdtype = stat_dtype(input.dtype)
        # (C,) as they are: the paths that broadcast them view them (torch_ops.fixed_stats);
        # converted only where their dtype differs (a call to .to costs a microsecond)
        mean = running_mean if running_mean.dtype == sdtype else running_mean.to(sdtype)
        var = running_var if running_var.dtype == sdtype else running_var.to(sdtype)
        return apply_norm(input, grouping, weight, bias, eps, True, mean, keep_stats=False,
                          fixed_var=var, act=act)[0]
    running = (None if running_mean is None or n <= 0 else
               (running_mean, running_var, momentum, n / (n - 1)))
    y, mean, var = apply_norm(input, grouping, weight, bias, eps, running=running, act=act)
    if running is not None and mean is not None:     # traced: not updated on the way
        update_running(*running[:2], mean, var, *running[2:])
    return y


def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None,
                  use_input_stats=True, momentum=0.1, eps=1e-5):
    r"""Instance normalization over ``(N, C, *S)``: one mean and variance per (sample,
    channel), over the spatial positions.

    .. math:: y_{n,c} = \gamma_c \cdot \frac{x_{n,c} - \mu_{n,c}}{\sqrt{\sigma_{n,c}^2
              + \epsilon}} + \beta_c

    With ``use_input_stats`` the running statistics, if given, are updated with the mean
    over the batch of the per-instance mean and unbiased variance; without it they
    normalize every instance.
    """
    if input.dim() < 3 and (use_input_stats or input.dim() < 2):
        raise ValueError(f"instance_norm expects an input of shape (N, C, *S) with at least "
                         f"one spatial dim (or (N, C) with use_input_stats=False, as torch), "
                         f"got {input.dim()}D input of size {_size(input.shape)}")
    c = _check_channels("instance_norm", input, running_mean=running_mean,
                        running_var=running_var, weight=weight, bias=bias)
    _check_vectors(input, weight, bias)
    _check_flag("instance_norm", "use_input_stats", use_input_stats)
    _check_running("instance_norm", running_mean, running_var)
    momentum = _momentum("instance_norm", momentum)
    grouping = _instance(input.shape)
    s = grouping.group_size
    if not use_input_stats:
        if running_mean is None:
            raise RuntimeError("Expected running_mean and running_var to be defined when "
                               "use_input_stats is false: instance_norm normalizes with them "
                               "then; pass both, or use_input_stats=True")
        sdtype = stat_dtype(input.dtype)
        shape = grouping.stat_shape
        mean = running_mean.to(sdtype).view(1, c, 1).expand(shape)
        rstd = torch.rsqrt(running_var.to(sdtype).view(1, c, 1) + eps).expand(shape)
        return apply_norm(input, grouping, weight, bias, eps, True, mean, rstd,
                          keep_stats=False)[0]
    if s == 1:
        raise ValueError(f"Expected more than 1 spatial element when training, got input size "
                         f"{input.size()}: one value per instance cannot be normalized")
    y, mean, var = apply_norm(input, grouping, weight, bias, eps)
    if running_mean is not None and input.numel() > 0:
        update_running(running_mean, running_var, mean.view(-1, c).mean(0),
                       (var.view(-1, c) * (s / (s - 1))).mean(0), momentum)
    return y


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    r"""Group normalization over ``(N, C, *S)``: one mean and variance per (sample, group
    of ``C / num_groups`` channels), over those channels and all spatial positions; the
    affine parameters are per channel.

    .. math:: y = \gamma_c \cdot \frac{x - \mu_{n,g}}{\sqrt{\sigma_{n,g}^2 + \epsilon}}
              + \beta_c
    """
    if input.dim() < 2:
        raise RuntimeError(f"Expected at least 2 dimensions for input tensor but received "
                           f"{input.dim()} (size {_size(input.shape)}); group_norm expects "
                           f"(N, C, *)")
    c = input.shape[1]
    groups = _index(num_groups)
    if groups is None:                                               # (as torch's)
        raise TypeError(f"group_norm(): num_groups must be an int, got "
                        f"{type(num_groups).__name__} {num_groups!r}")
    num_groups = groups
    if num_groups <= 0 or c % num_groups != 0:
        raise RuntimeError(
            f"Expected number of channels in input to be divisible by num_groups, but got "
            f"input of shape {_size(input.shape)} and num_groups={num_groups}; choose "
            f"num_groups among the divisors of {c}")
    _check_channels("group_norm", input, weight=weight, bias=bias)
    _check_vectors(input, weight, bias)
    if _one_value_per_group(input, num_groups):
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size "
            f"{_size(input.shape)}: with num_groups={num_groups} each group holds one value "
            f"(torch's group_norm refuses this too); use fewer groups or a larger input")
    return apply_norm(input, _group(input.shape, num_groups), weight, bias, eps,
                      keep_stats=False)[0]


def _one_value_per_group(input, num_groups) -> bool:
    """torch's ``group_norm`` check: the product of ``N * C / G`` and the spatial sizes is 1
    (a batch of one, one channel per group, no positions)."""
    return input.shape[0] * (input.shape[1] // num_groups) * math.prod(input.shape[2:]) == 1


def _check_normalized_shape(input, normalized_shape, weight, bias, op, any_weight=False):
    """A floating input (``_check_floating``) whose trailing dims are ``normalized_shape``,
    the shape of the given weight and bias, floating point (but with ``any_weight``, the
    RMSNorms': torch's composite promotes an integer weight); returns it as a tuple."""
    _check_floating(input, op)
    try:
        shape = tuple(normalized_shape)
    except TypeError:                              # (torch's type, with the fix)
        raise TypeError(f"{op}: normalized_shape must be a tuple of ints, got "
                        f"{type(normalized_shape).__name__} {normalized_shape!r}; for the "
                        f"last dim alone pass ({normalized_shape!r},)") from None
    k = len(shape)
    if (k and input.shape[input.dim() - k:] == shape
            and (weight is None or (weight.shape == shape
                                    and (weight.is_floating_point() or any_weight)))
            and (bias is None or (bias.shape == shape and bias.is_floating_point()))):
        return shape                               # the usual case, without a conversion
    shape = tuple(_size(normalized_shape))
    k = len(shape)
    if k == 0 or tuple(input.shape[input.dim() - k:]) != shape or input.dim() < k:
        raise RuntimeError(
            f"Given normalized_shape={list(shape)}, expected input with shape "
            f"[*, {', '.join(map(str, shape))}], but got input of size {_size(input.shape)}; "
            f"{op} normalizes over the trailing dims, so normalized_shape must equal the "
            f"last {k} dim(s) of the input")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(p.shape) != shape:
            raise RuntimeError(f"Expected {name} to be of same shape as normalized_shape, but "
                               f"got {name} of shape {_size(p.shape)} and normalized_shape = "
                               f"{list(shape)}")
        if p is not None and not p.is_floating_point() and not (any_weight and p is weight):
            _refuse_dtype(op, name, p)
    return shape


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    r"""Layer normalization: one mean and variance per sample (per token), over the
    trailing ``normalized_shape`` dims; elementwise affine over those dims.

    .. math:: y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \cdot \gamma
              + \beta

    Example::

        >>> x = torch.tensor([[49., 90., 29., 76., 33.]])
        >>> layer_norm(x, [5]).round(decimals=4)
        tensor([[-0.2675,  1.4464, -1.1036,  0.8611, -0.9364]])
    """
    if input.is_nested:
        return _on_values(input, len(normalized_shape), "layer_norm",
                          lambda v: layer_norm(v, normalized_shape, weight, bias, eps))
    shape = _check_normalized_shape(input, normalized_shape, weight, bias, "layer_norm")
    return apply_norm(input, _layer(input.shape, len(shape)), weight, bias, eps,
                      keep_stats=False)[0]


def _on_values(input, k, op, norm):
    """``norm`` of a nested tensor in the jagged layout over its last ``k`` dims, all
    dense: a norm of each of its rows, so ``norm`` of its values (the rows of every
    sequence, one after the other), kept with its offsets and lengths. Other nested
    tensors (the strided layout, a norm over the ragged dim) are refused."""
    ragged = getattr(input, "_ragged_idx", 1)
    if input.layout != torch.jagged or ragged >= input.dim() - k:
        raise NotImplementedError(
            f"{op} takes a nested tensor in the jagged layout, normalized over dims after its "
            f"ragged one (got layout {input.layout}, ragged dim {ragged}, {input.dim()} dims, "
            f"the last {k} normalized): build it with torch.nested.nested_tensor(..., "
            f"layout=torch.jagged), or use torch's {op} for this one")
    return torch.nested.nested_tensor_from_jagged(norm(input.values()), input.offsets(),
                                                  input.lengths())


def rms_norm(input, normalized_shape, weight=None, eps=None, *, offset=0.0, casting="torch"):
    r"""RMS normalization (Zhang & Sennrich, 2019): LayerNorm without centering.

    .. math:: y = \frac{x}{\sqrt{\mathrm{mean}(x^2) + \epsilon}} \cdot (\text{offset}
              + \gamma)

    ``eps=None`` uses the epsilon of the compute dtype (``rms_eps``: float32's for half
    inputs), as torch's kernel does. Keyword-only, for language models: ``offset`` (Gemma
    stores the weight as an offset from 1: ``offset=1.0``) and ``casting``, where the cast
    to the output dtype happens:
    ``"torch"`` (torch.nn.RMSNorm's, one fused op), ``"llama"``, ``"gemma"`` or ``"t5"``
    (see ``normkit.rms_casting``).

    Example::

        >>> x = torch.randn(2, 8, dtype=torch.bfloat16)
        >>> y = rms_norm(x, [8], torch.zeros(8, dtype=torch.bfloat16), 1e-6, offset=1.0,
        ...              casting="gemma")
    """
    if input.is_nested:
        return _on_values(input, len(normalized_shape), "rms_norm",
                          lambda v: rms_norm(v, normalized_shape, weight, eps, offset=offset,
                                             casting=casting))
    shape = _check_normalized_shape(input, normalized_shape, weight, None, "rms_norm",
                                    any_weight=True)
    if eps is None:
        eps = rms_eps(input.dtype)
    check_casting(casting, offset, weight)
    if casting != "torch":                       # normalize as the model does, then its cast
        return cast_norm(input, _layer(input.shape, len(shape)), weight, None, eps, False,
                         casting, offset, normalize_dtype(input, casting))
    if offset:
        weight = offset + weight
    return apply_norm(input, _layer(input.shape, len(shape)), weight, None, eps, False,
                      keep_stats=False)[0]


def normalize(x, dims, eps=1e-5, weight=None, bias=None, center=True):
    r"""Standardize ``x`` over any set of ``dims``; the general form of every method.

    .. math:: y = \gamma \cdot \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}} + \beta

    with :math:`\mu, \sigma^2` the mean and biased variance over ``dims`` (one statistic
    for every index of the other dims). ``center=False`` gives RMS normalization
    (:math:`\mu = 0`, :math:`\sigma^2 = \mathrm{mean}(x^2)`). ``weight`` and ``bias``
    broadcast against ``x``. Unlike ``torch.nn.functional.normalize`` (an Lp-norm
    rescaling), this is a standardization.

    Example::

        >>> x = torch.randn(4, 3, 8, 8)
        >>> y = normalize(x, dims=(0, 2, 3))            # BatchNorm's groups
        >>> z = normalize(x, dims=(-1,), center=False)  # RMSNorm over the last dim
    """
    _check_floating(x, "normalize")
    dims = _dims("normalize", dims, x.dim())
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            if not all(a == b or 1 in (a, b) for a, b in zip(reversed(p.shape),
                                                             reversed(x.shape))):
                raise ValueError(f"{name} of shape {_size(p.shape)} does not broadcast against "
                                 f"the input of shape {_size(x.shape)}")
            if p.dim() > x.dim() or torch.broadcast_shapes(p.shape, x.shape) != x.shape:
                raise ValueError(f"{name} of shape {_size(p.shape)} would enlarge the input "
                                 f"of shape {_size(x.shape)}; give it at most x's shape")
    return apply_norm(x, G.dims(x.shape, dims), weight, bias, eps, center, keep_stats=False)[0]


def batch_renorm(input, running_mean, running_var, weight=None, bias=None, training=False,
                 momentum=0.1, eps=1e-5, r_max=3.0, d_max=5.0):
    r"""Batch renormalization (Ioffe, 2017) over ``(N, C, *S)``: BatchNorm whose batch
    statistics are corrected toward the running ones.

    .. math::
        \hat{x} = \frac{x - \mu_B}{\sigma_B}, \quad
        y = \gamma \cdot (\hat{x} \cdot r + d) + \beta, \quad
        r = \mathrm{clip}_{[1/r_{max},\, r_{max}]}\Big(\frac{\sigma_B}{\sigma}\Big), \quad
        d = \mathrm{clip}_{[-d_{max},\, d_{max}]}\Big(\frac{\mu_B - \mu}{\sigma}\Big)

    with :math:`\mu_B` and :math:`\sigma_B = \sqrt{\mathrm{Var}_B + \epsilon}` the batch
    mean and (biased) standard deviation per channel, :math:`\mu` = ``running_mean`` and
    :math:`\sigma = \sqrt{\texttt{running\_var} + \epsilon}`. ``r`` and ``d`` are
    constants for the gradient (stop-gradient). ``r_max = 1, d_max = 0`` is BatchNorm;
    unclipped, the output equals eval mode's. The running statistics (required) are then
    updated as BatchNorm's, the variance stored unbiased. In eval this is
    ``batch_norm(..., training=False)``.

    Computed as BatchNorm with the folded per-channel affine ``weight * r`` and
    ``weight * d + bias``, so the weight gradient is ``sum(g * (xhat * r + d))`` and the
    bias gradient ``sum(g)``; the batch statistics are computed once more (without
    autograd) to get ``r`` and ``d`` before the normalization.

    Example::

        >>> x = torch.randn(8, 3, 4, 4)
        >>> rm, rv = torch.zeros(3), torch.ones(3)
        >>> y = batch_renorm(x, rm, rv, training=True, r_max=2.0, d_max=1.0)
    """
    if input.dim() < 2:
        raise ValueError(f"batch_renorm expects an input of shape (N, C, *), got {input.dim()}D "
                         f"input of size {_size(input.shape)}; add a batch dim with unsqueeze(0)")
    if running_mean is None or running_var is None:
        raise ValueError("batch_renorm needs running_mean and running_var (r and d compare the "
                         "batch statistics with them); pass both, or use batch_norm")
    if not r_max >= 1.0 or not d_max >= 0.0:
        raise ValueError(f"batch_renorm needs r_max >= 1 and d_max >= 0 (r is clipped to "
                         f"[1/r_max, r_max], d to [-d_max, d_max]), got r_max={r_max}, "
                         f"d_max={d_max}; r_max=1, d_max=0 is plain batch_norm")
    if not training:
        return batch_norm(input, running_mean, running_var, weight, bias, False, momentum, eps)
    _check_channels("batch_renorm", input, running_mean, running_var, weight, bias)
    grouping = _batch(input.shape)
    n = grouping.group_size
    if n == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size "
            f"{input.size()}; use a larger batch or eval mode")
    sdtype = stat_dtype(input.dtype)
    # r, d: stop-gradient (detached inputs, not a no_grad block: torch.export keeps this)
    xs = input.detach().to(sdtype).reshape(grouping.view)                      # N, C, S
    var_b, mean_b = torch.var_mean(xs, dim=grouping.reduce, correction=0)      # C
    sigma = torch.sqrt(running_var.detach().to(sdtype) + eps)                  # C
    r = (torch.sqrt(var_b + eps) / sigma).clamp(1.0 / r_max, r_max)            # C
    d = ((mean_b - running_mean.detach().to(sdtype)) / sigma).clamp(-d_max, d_max)  # C
    w_eff = r if weight is None else weight.to(sdtype) * r         # gamma * r
    b_eff = d if weight is None else weight.to(sdtype) * d         # gamma * d
    if bias is not None:
        b_eff = b_eff + bias.to(sdtype)                            # gamma * d + beta
    y, mean, var = apply_norm(input, grouping, w_eff, b_eff, eps)
    if n > 0:
        update_running(running_mean, running_var, mean, var, momentum, n / (n - 1))
    return y


def _check_residual(x, residual, op):
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"{op} expects residual to be a Tensor, got {type(residual).__name__}")
    if residual.dtype != x.dtype:
        raise TypeError(f"{op} expects x and residual of one dtype, got {x.dtype} and "
                        f"{residual.dtype}; cast one of them with .to(...)")
    if residual.device != x.device:
        raise ValueError(f"{op} expects x and residual on one device, got {x.device} and "
                         f"{residual.device}; move one of them with .to(...)")
    if residual.shape != x.shape:
        raise ValueError(f"{op} expects x and residual of one shape, got {_size(x.shape)} and "
                         f"{_size(residual.shape)}; broadcast the residual first with "
                         f"residual.expand_as(x)")


def add_layer_norm(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5, *,
                   memory_saving=None):
    r"""Residual add fused with layer normalization: ``(layer_norm(x + residual), x +
    residual)``, the pre-norm transformer block's pair.

    .. math:: h = x + r, \qquad y = \frac{h - \mathrm{E}[h]}{\sqrt{\mathrm{Var}[h] +
              \epsilon}} \cdot \gamma + \beta

    ``h`` is computed in the input dtype (as ``x + residual`` is), then normalized as
    ``layer_norm`` does (biased variance over ``normalized_shape``, fp32 statistics).
    Gradients flow to ``x`` and ``residual`` through both outputs. On CUDA with triton
    installed, and on the CPU executor for inputs that outrun the last-level cache, this is
    one pass each way (x and residual read once, h and y written together), with the bits
    of ``x + residual`` followed by ``layer_norm``; elsewhere (and traced) it is that add
    followed by the norm.

    ``memory_saving=True`` (default: ``normkit.backends.memory_saving``'s setting) keeps
    the output instead of ``h`` for the backward and recomputes the normalized input as
    ``(y - bias) / weight``; it requires every weight element nonzero and falls back to
    keeping ``h`` when one is 0. See ``docs/gpu.md``.

    Example::

        >>> x, r = torch.randn(4, 8), torch.randn(4, 8)
        >>> y, h = add_layer_norm(x, r, [8])
        >>> torch.allclose(h, x + r)
        True
    """
    _check_residual(x, residual, "add_layer_norm")
    shape = _check_normalized_shape(x, normalized_shape, weight, bias, "add_layer_norm")
    return add_norm(x, residual, len(shape), weight, bias, eps, True, memory_saving)


def add_rms_norm(x, residual, normalized_shape, weight=None, eps=None, *, memory_saving=None,
                 offset=0.0, casting="torch"):
    r"""Residual add fused with RMS normalization: ``(rms_norm(x + residual), x +
    residual)``.

    .. math:: h = x + r, \qquad y = \frac{h}{\sqrt{\mathrm{mean}(h^2) + \epsilon}}
              \cdot (\text{offset} + \gamma)

    ``eps=None`` uses ``rms_eps(x.dtype)``, as ``rms_norm``. ``memory_saving``
    as in ``add_layer_norm`` (weight nonzero required; ``xhat = y / weight``).
    ``offset`` and ``casting`` as in ``rms_norm``: with a model's casting rule the output
    and gradients are those of ``x + residual`` followed by ``rms_norm`` with that rule,
    bit for bit on CPU, saving ``h``, the statistics and the weight; the one pass runs
    where the rule's ``x_hat`` is in ``x``'s dtype (``llama``; ``gemma``/``t5`` in fp32),
    and the memory-saving backward is not available (``memory_saving=True``: an error).

    Example::

        >>> x, r = torch.randn(4, 8), torch.randn(4, 8)
        >>> y, h = add_rms_norm(x, r, [8], torch.ones(8))
    """
    _check_residual(x, residual, "add_rms_norm")
    shape = _check_normalized_shape(x, normalized_shape, weight, None, "add_rms_norm",
                                    any_weight=True)
    if eps is None:
        eps = rms_eps(x.dtype)
    check_casting(casting, offset, weight)
    if casting == "torch":
        if offset:
            weight = offset + weight
        return add_norm(x, residual, len(shape), weight, None, eps, False, memory_saving)
    if memory_saving:
        raise ValueError(f"add_rms_norm: memory_saving=True recomputes x_hat from y, which "
                         f"the casting rule {casting!r} rounds; pass memory_saving=False, or "
                         f"casting='torch'")
    return add_norm(x, residual, len(shape), weight, None, eps, False, False, (casting, offset))


# every op above is also torch.ops.normkit.NAME (see normkit.ops)
ops.register_public({name: globals()[name] for name in ops.PUBLIC})
