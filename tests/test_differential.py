"""Random layers against torch.nn's twins: every normkit layer, random shapes (sizes of one
included), dtypes, train/eval, affine or not, channels_last, running statistics or none.

For each case both layers run forward and backward on the same input, and the float64
twin on that input (rounded to the dtype first) gives the exact answer. normkit must
raise where torch raises (a ValueError or RuntimeError on either side), and otherwise be
no further from the float64 answer than torch is (twice torch's error, or a few rounding
units of the dtype) for the output, the input's gradient, the parameters' gradients and
the running buffers. Seeded: a failure names its case, which reruns alone."""

from __future__ import annotations

import math
import random

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import normkit.nn as nknn  # noqa: E402

DTYPES = [torch.float32, torch.float32, torch.float64, torch.bfloat16, torch.float16]
#: rounding units allowed beyond twice torch's error (sums over a group in half precision)
SLACK = {torch.float32: 64, torch.float64: 1e6, torch.bfloat16: 4, torch.float16: 4}


def _case(seed):
    """``(make, shape, dtype, train, channels_last, size)``: ``make(module)`` builds the
    layer from ``normkit.nn`` or ``torch.nn`` with the same arguments; ``size``: the
    number of values that share a mean (0: none, RMSNorm)."""
    rng = random.Random(seed)
    kind = rng.choice(["batch", "layer", "group", "instance", "rms"])
    spatial = [rng.choice([1, 2, 3, 5, 8]) for _ in range(rng.choice([0, 1, 2, 3]))]
    n, c = rng.choice([1, 2, 3, 7]), rng.choice([1, 2, 3, 4, 6, 8])
    shape = [n, c] + spatial
    affine, train = rng.random() < 0.8, rng.random() < 0.7
    if kind == "batch":
        name = f"BatchNorm{max(1, len(spatial))}d"
        kw = dict(affine=affine, momentum=rng.choice([0.1, None]),
                  track_running_stats=rng.random() < 0.8)
        make = lambda m: getattr(m, name)(c, **kw)  # noqa: E731
        size = n * math.prod(spatial)
    elif kind == "instance" and spatial:
        name = f"InstanceNorm{len(spatial)}d"
        kw = dict(affine=affine, track_running_stats=rng.random() < 0.3)
        make = lambda m: getattr(m, name)(c, **kw)  # noqa: E731
        size = math.prod(spatial)
    elif kind == "group":
        groups = rng.choice([d for d in range(1, c + 1) if c % d == 0])
        make = lambda m: m.GroupNorm(groups, c, affine=affine)  # noqa: E731
        size = c // groups * math.prod(spatial)
    elif kind == "layer":
        ns = shape[-rng.randint(1, len(shape) - 1):]
        bias = rng.random() < 0.7
        make = lambda m: m.LayerNorm(ns, elementwise_affine=affine, bias=bias)  # noqa: E731
        size = math.prod(ns)
    else:
        ns = shape[-rng.randint(1, len(shape) - 1):]
        eps = rng.choice([None, 1e-6])
        make = lambda m: m.RMSNorm(ns, eps=eps, elementwise_affine=affine)  # noqa: E731
        size = 0
    return (make, shape, rng.choice(DTYPES), train, len(spatial) == 2 and rng.random() < 0.4,
            size)


def _run(layer, x, g):
    """``(y, dx, parameter gradients, buffers)`` in float64, or the exception raised."""
    x = x.clone().requires_grad_()
    try:
        y = layer(x)
        y.backward(g)
    except (ValueError, RuntimeError) as error:
        return error
    return ([y.detach().double(), x.grad.double()]
            + [p.grad.double() for p in layer.parameters()]
            + [b.double() for b in layer.buffers() if b.is_floating_point()])


@pytest.mark.parametrize("seed", range(0, 240, 8), ids=lambda s: f"seeds{s}-{s + 7}")
def test_never_further_from_float64_than_torch(seed):
    for case in range(seed, seed + 8):
        make, shape, dtype, train, channels_last, size = _case(case)
        gen = torch.Generator().manual_seed(case)
        x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 3 + 2).to(dtype)
        g = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        theirs = make(nn)
        with torch.no_grad():
            for p in theirs.parameters():
                p.copy_(torch.randn(p.shape, generator=gen).to(dtype).float())
        exact = make(nn).double().train(train)
        exact.load_state_dict(theirs.state_dict())
        ours = make(nknn)
        ours.load_state_dict(theirs.state_dict())
        ours, theirs = ours.to(dtype).train(train), theirs.to(dtype).train(train)
        got, want, truth = _run(ours, x, g), _run(theirs, x, g), _run(exact, x.double(),
                                                                        g.double())
        where = f"case {case}: {ours!r} on {shape} {dtype} train={train} cl={channels_last}"
        if isinstance(want, Exception) or isinstance(got, Exception):
            assert isinstance(got, Exception) and isinstance(want, Exception), (
                f"{where}: normkit {got!r}, torch {want!r}")
            continue
        unit = torch.finfo(dtype).eps
        if size == 1:   # one value per mean: y = b, dx = 0 up to rounding times 1/sqrt(eps)
            got, want, truth = got[:1], want[:1], truth[:1]
        for i, (a, b, t) in enumerate(zip(got, want, truth)):
            scale = max(1.0, t.abs().max().item()) if t.numel() else 1.0
            ours_err = (a - t).abs().max().item() if t.numel() else 0.0
            torch_err = (b - t).abs().max().item() if t.numel() else 0.0
            # (sums of a group in the dtype: allow the group's size in rounding units)
            allowed = 2 * torch_err + SLACK[dtype] * unit * scale * math.sqrt(t.numel() or 1)
            assert ours_err <= allowed, (f"{where}: tensor {i} (y, dx, params' grads, "
                                         f"buffers) off by {ours_err:.3g}, torch "
                                         f"{torch_err:.3g}")
