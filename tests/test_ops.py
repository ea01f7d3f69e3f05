"""The registered operators (``torch.ops.normkit.*``): ``torch.library.opcheck`` over
dtypes, layouts and flags; results equal to ``normkit.functional`` and torch."""

from __future__ import annotations

import pytest
import torch

import normkit.functional as NF
import normkit.ops  # noqa: F401  (registers torch.ops.normkit)
from normkit import grouping as G

ops = torch.ops.normkit
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def _t(*shape, dtype=torch.float32, grad=True, channels_last=False, transposed=False):
    x = torch.randn(*shape, dtype=torch.float64).to(dtype)
    if transposed:  # (A, B, C) stored as (A, C, B): the SigLIP patch embeddings
        x = torch.randn(shape[0], shape[2], shape[1], dtype=torch.float64).to(dtype)
        x = x.transpose(1, 2)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x.requires_grad_(grad)


def _cases(dtype):
    """(name, op, args, kwargs) for every public operator and the two core ones."""
    t = lambda *s, **k: _t(*s, dtype=dtype, **k)  # noqa: E731
    stat = torch.float64 if dtype == torch.float64 else torch.float32
    rm = lambda c: torch.randn(c, dtype=dtype)  # noqa: E731
    rv = lambda c: torch.rand(c, dtype=dtype) + 0.5  # noqa: E731
    yield "layer_norm", ops.layer_norm, (t(3, 5, 7), [7], t(7), t(7), 1e-5), {}
    yield "layer_norm_2d_noaffine", ops.layer_norm, (t(2, 3, 4, 5), [4, 5]), {}
    yield "layer_norm_transposed", ops.layer_norm, (t(2, 6, 8, transposed=True), [8], t(8),
                                                    t(8)), {}
    yield "rms_norm", ops.rms_norm, (t(4, 9), [9], t(9), None), {}
    yield "rms_norm_eps", ops.rms_norm, (t(2, 3, 6), [6], None, 1e-6), {}
    yield "group_norm", ops.group_norm, (t(2, 6, 3, 5), 3, t(6), t(6), 1e-5), {}
    yield "group_norm_channels_last", ops.group_norm, (t(2, 6, 3, 5, channels_last=True), 2,
                                                       t(6), None), {}
    yield "instance_norm", ops.instance_norm, (t(2, 3, 4, 5), None, None, t(3), t(3)), {}
    yield "instance_norm_running", ops.instance_norm, (t(2, 3, 7), rm(3), rv(3), None, None,
                                                       True, 0.1, 1e-5), {}
    yield "instance_norm_eval", ops.instance_norm, (t(2, 3, 4, 4), rm(3), rv(3), t(3), t(3),
                                                    False), {}
    yield "batch_norm_train", ops.batch_norm, (t(4, 3, 5, 5), rm(3), rv(3), t(3), t(3), True,
                                               0.1, 1e-5), {}
    yield "batch_norm_train_cl", ops.batch_norm, (t(4, 3, 5, 5, channels_last=True), rm(3),
                                                  rv(3), t(3), None, True), {}
    yield "batch_norm_train_1d", ops.batch_norm, (t(6, 5), None, None, None, None, True), {}
    yield "batch_norm_eval", ops.batch_norm, (t(4, 3, 6), rm(3), rv(3), t(3), t(3), False), {}
    yield "batch_renorm", ops.batch_renorm, (t(5, 3, 4), rm(3), rv(3), t(3), t(3), True, 0.1,
                                             1e-5, 2.0, 1.0), {}
    yield "normalize", ops.normalize, (t(3, 4, 5), [0, 2], 1e-5, t(1, 4, 1), t(4, 1)), {}
    yield "normalize_rms", ops.normalize, (t(3, 4, 5), [-1], 1e-5, None, None, False), {}
    yield "add_layer_norm", ops.add_layer_norm, (t(3, 4, 8), t(3, 4, 8), [8], t(8), t(8)), {}
    yield "add_rms_norm", ops.add_rms_norm, (t(5, 8), t(5, 8), [8], t(8)), {}
    g = G.layer((6, 7), 1)
    args = ("layer", [6, 7], [1], [1, 7])
    yield "norm_forward", ops.norm_forward, (t(6, 7), t(7), t(7), *args, 1e-5, True), {}
    yield "norm_forward_fixed", ops.norm_forward, (
        t(4, 3, 5), t(3), None, "batch", [4, 3, 5], [0, 2], [1, 3, 1], 1e-5, True,
        torch.randn(1, 3, 1, dtype=stat), torch.rand(1, 3, 1, dtype=stat) + 0.5), {}
    x = t(6, 7)
    mean, rstd = (torch.randn(6, 1, dtype=stat), torch.rand(6, 1, dtype=stat) + 0.5)
    assert g.stat_shape == (6, 1)
    yield "norm_backward", ops.norm_backward, (t(6, 7), x, mean, rstd, t(7), *args, 1e-5, True,
                                               False, [True, True, True]), {}
    yield "norm_backward_dx_only", ops.norm_backward, (t(6, 7), x, mean, rstd, None, *args,
                                                       1e-5, False, False,
                                                       [True, False, False]), {}


_NAMES = [c[0] for c in _cases(torch.float32)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", _NAMES)
def test_opcheck(name, dtype):
    (_, op, args, kwargs), = [c for c in _cases(dtype) if c[0] == name]
    torch.library.opcheck(op, args, kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", [n for n in _NAMES if not n.startswith("norm_")])
def test_public_op_equals_functional(name, dtype):
    (_, op, args, kwargs), = [c for c in _cases(dtype) if c[0] == name]
    clone = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
    got = op(*args, **kwargs)
    fn = getattr(NF, max((f for f in NF.__all__ if name.startswith(f)), key=len))
    want = fn(*clone, **kwargs)
    for g, w in zip(got if isinstance(got, tuple) else (got,),
                    want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
        assert g.stride() == w.stride()
    for a, c in zip(args, clone):  # running statistics mutated the same way
        if isinstance(a, torch.Tensor) and not a.requires_grad:
            torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_mutation_declared_in_schema():
    for name in ("batch_norm", "instance_norm", "batch_renorm"):
        schema = getattr(ops, name).default._schema
        mutated = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
        assert mutated == ["running_mean", "running_var"], name


def test_layouts_kept_as_torch():
    x = _t(2, 6, 4, 4, grad=False, channels_last=True)
    y = ops.group_norm(x, 3)
    assert y.is_contiguous(memory_format=torch.channels_last)
    xt = _t(3, 16, 64, grad=False, transposed=True)
    y = ops.layer_norm(xt, [64])
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(xt, [64]), rtol=1e-5, atol=1e-5)
    with torch._subclasses.FakeTensorMode():
        fx = torch.empty_strided((4, 3, 5, 5), (75, 1, 15, 3))
        assert ops.batch_norm(fx, None, None, None, None, True).stride() == (75, 1, 15, 3)


@pytest.mark.parametrize("name", ["layer_norm", "batch_norm_train", "group_norm",
                                  "normalize", "rms_norm"])
def test_double_backward_through_op(name):
    (_, op, args, kwargs), = [c for c in _cases(torch.float64) if c[0] == name]
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]

    def fn(*ts):
        full = list(args)
        for i, t in zip(tensors, ts):
            full[i] = t
        return op(*full, **kwargs)

    inputs = tuple(args[i] for i in tensors)
    assert torch.autograd.gradgradcheck(fn, inputs)


def test_no_autograd_function_without_grad():
    x = _t(4, 8, grad=False)
    y = ops.layer_norm(x, [8], torch.ones(8, requires_grad=True))
    assert y.grad_fn is not None
    with torch.no_grad():
        assert ops.layer_norm(x, [8], torch.ones(8, requires_grad=True)).grad_fn is None
    assert ops.layer_norm(x, [8]).grad_fn is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", [n for n in _NAMES if n.startswith("norm_")])
def test_the_decompositions_equal_the_core_ops(name, dtype):
    """``normkit.ops.decompositions()`` (what ``run_decompositions`` swaps in, for ONNX and
    AOTInductor) computes what each core op computes; the backward's had no other test (an
    exported training graph holds it)."""
    (_, op, args, kwargs), = [c for c in _cases(dtype) if c[0] == name]
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    decomposed = normkit.ops.decompositions()[op.default](*args, **kwargs)
    for got, want in zip(decomposed, op(*args, **kwargs)):
        tol = {} if dtype != torch.bfloat16 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got, want, **tol)
