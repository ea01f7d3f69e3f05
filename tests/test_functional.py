"""normkit.functional against torch.nn.functional: outputs, gradients, running statistics,
gradcheck/gradgradcheck, hard inputs and invariances."""

import itertools

import numpy as np
import pytest
from conftest import assert_close

torch = pytest.importorskip("torch")
import torch.nn.functional as TF  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

import normkit.functional as NF  # noqa: E402
import normkit.nn as nknn  # noqa: E402
from normkit import reference  # noqa: E402

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def _make(shape, dtype, seed=0, requires_grad=True, scale=1.0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * scale + offset).to(dtype)
    return x.requires_grad_(requires_grad)


def _params(c_shape, dtype, weight, bias, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = (torch.rand(c_shape, generator=g, dtype=torch.float64) + 0.5).to(dtype) if weight else None
    b = torch.randn(c_shape, generator=g, dtype=torch.float64).to(dtype) if bias else None
    return [p.requires_grad_() if p is not None else None for p in (w, b)]


def _run_both(nk_fn, th_fn, x, params, seed=3):
    """Forward and backward through both implementations with the same upstream grad."""
    results = []
    for fn in (nk_fn, th_fn):
        xs = x.detach().clone().requires_grad_()
        ps = [p.detach().clone().requires_grad_() if p is not None else None for p in params]
        y = fn(xs, *ps)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed),
                        dtype=torch.float64).to(y.dtype)
        inputs = [xs] + [p for p in ps if p is not None]
        grads = torch.autograd.grad(y, inputs, g)
        results.append((y, grads))
    return results


def _check(nk_fn, th_fn, x, params, dtype):
    (y1, g1), (y2, g2) = _run_both(nk_fn, th_fn, x, params)
    assert y1.dtype == y2.dtype == dtype
    assert_close(y1, y2, dtype, msg="forward")
    for a, b in zip(g1, g2):
        assert a.dtype == b.dtype
        assert_close(a, b, dtype, grad=True, msg="gradient")


AFFINE = [(True, True), (True, False), (False, False)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,k", [((7, 13), 1), ((2, 3, 1536), 1), ((3, 4, 5, 6), 2),
                                     ((2, 3, 4, 5, 7), 3), ((5, 123, 123), 1)])
@pytest.mark.parametrize("weight,bias", AFFINE)
def test_layer_norm(dtype, shape, k, weight, bias):
    x = _make(shape, dtype)
    ns = list(shape[-k:])
    w, b = _params(ns, dtype, weight, bias)
    _check(lambda x, *p: NF.layer_norm(x, ns, *p), lambda x, *p: TF.layer_norm(x, ns, *p),
           x, [w, b], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,k", [((7, 13), 1), ((2, 3, 1536), 1), ((3, 4, 5, 6), 2)])
@pytest.mark.parametrize("weight", [True, False])
@pytest.mark.parametrize("eps", [None, 1e-6])
def test_rms_norm(dtype, shape, k, weight, eps):
    x = _make(shape, dtype)
    ns = list(shape[-k:])
    w, _ = _params(ns, dtype, weight, False)
    _check(lambda x, *p: NF.rms_norm(x, ns, *p, eps=eps),
           lambda x, *p: TF.rms_norm(x, ns, *p, eps=eps), x, [w], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,groups", [((2, 6), 3), ((3, 6, 7), 2), ((2, 8, 5, 3), 4),
                                          ((2, 4, 3, 3, 3), 1), ((1, 6, 11, 13), 6)])
@pytest.mark.parametrize("weight,bias", AFFINE)
def test_group_norm(dtype, shape, groups, weight, bias):
    x = _make(shape, dtype)
    w, b = _params(shape[1], dtype, weight, bias)
    _check(lambda x, *p: NF.group_norm(x, groups, *p), lambda x, *p: TF.group_norm(x, groups, *p),
           x, [w, b], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 3, 5, 4), (2, 3, 2, 3, 4)])
@pytest.mark.parametrize("weight,bias", AFFINE)
def test_instance_norm(dtype, shape, weight, bias):
    x = _make(shape, dtype)
    w, b = _params(shape[1], dtype, weight, bias)
    _check(lambda x, *p: NF.instance_norm(x, weight=p[0] if p else None,
                                          bias=p[1] if len(p) > 1 else None),
           lambda x, *p: TF.instance_norm(x, weight=p[0] if p else None,
                                          bias=p[1] if len(p) > 1 else None),
           x, [p for p in (w, b) if p is not None] or [], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(9, 4), (5, 3, 7), (4, 3, 5, 6), (2, 3, 2, 3, 4)])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("weight,bias", AFFINE)
def test_batch_norm(dtype, shape, training, weight, bias):
    x = _make(shape, dtype)
    c = shape[1]
    w, b = _params(c, dtype, weight, bias)
    buffers = {}
    for name in ("nk", "th"):  # buffers in the layer's dtype, as a module would hold them
        gen = torch.Generator().manual_seed(7)
        buffers[name] = (torch.randn(c, generator=gen).to(dtype),
                         (torch.rand(c, generator=gen) + 0.5).to(dtype))
    _check(lambda x, *p: NF.batch_norm(x, *buffers["nk"], *p, training=training, momentum=0.3),
           lambda x, *p: TF.batch_norm(x, *buffers["th"], *p, training=training, momentum=0.3),
           x, [w, b], dtype)
    # running statistics: updated once per forward, identically
    for a, e in zip(buffers["nk"], buffers["th"]):
        assert_close(a, e, dtype)


def test_batch_norm_running_stats_match_reference():
    x = _make((6, 3, 4, 5), torch.float64, requires_grad=False)
    rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    NF.batch_norm(x, rm, rv, training=True, momentum=0.25)
    _, cache = reference.batch_norm_forward(x.numpy(), np.zeros(3), np.ones(3), training=True,
                                            momentum=0.25)
    np.testing.assert_allclose(rm.numpy(), cache["new_running_mean"], rtol=1e-12)
    np.testing.assert_allclose(rv.numpy(), cache["new_running_var"], rtol=1e-12)


@pytest.mark.parametrize("use_input_stats", [True, False])
def test_instance_norm_running_stats(use_input_stats):
    x = _make((4, 3, 5, 6), torch.float64)
    bufs = [(torch.zeros(3, dtype=torch.float64) + 0.2, torch.ones(3, dtype=torch.float64) * 1.5)
            for _ in range(2)]
    w, b = _params(3, torch.float64, True, True)
    _check(lambda x, *p: NF.instance_norm(x, *bufs[0], *p, use_input_stats=use_input_stats,
                                          momentum=0.2),
           lambda x, *p: TF.instance_norm(x, *bufs[1], *p, use_input_stats=use_input_stats,
                                          momentum=0.2), x, [w, b], torch.float64)
    for a, e in zip(bufs[0], bufs[1]):
        assert_close(a, e, torch.float64)


def test_instance_norm_of_rows_with_given_statistics_as_torch():
    # (N, C) has no spatial dim: torch normalizes it with the running statistics and
    # refuses it with input statistics; so does normkit
    x = _make((4, 3), torch.float64)
    rm, rv = torch.randn(3, dtype=torch.float64), torch.rand(3, dtype=torch.float64) + 0.5
    w, b = _params(3, torch.float64, True, True)
    _check(lambda x, *p: NF.instance_norm(x, rm, rv, *p, use_input_stats=False),
           lambda x, *p: TF.instance_norm(x, rm, rv, *p, use_input_stats=False), x, [w, b],
           torch.float64)
    for f in (NF, TF):
        with pytest.raises(ValueError):
            f.instance_norm(x, rm, rv, use_input_stats=True)
        with pytest.raises((ValueError, IndexError)):
            f.instance_norm(x[0], rm, rv, use_input_stats=False)


def test_output_layouts_where_they_differ():
    # docs/architecture.md, "Where normkit differs from torch on purpose": same values
    rows = _make((2, 7, 6), torch.float32).transpose(1, 2)          # (N, C, L), C adjacent
    cl = _make((2, 6, 3, 5), torch.float32).to(memory_format=torch.channels_last)
    cases = [(lambda F, x: F.batch_norm(x, None, None, training=True), rows, rows.stride()),
             (lambda F, x: F.group_norm(x, 2), rows, rows.stride()),
             (lambda F, x: F.instance_norm(x), cl, cl.stride()),
             (lambda F, x: F.rms_norm(x, [5]), cl, (90, 15, 5, 1))]
    for op, x, strides in cases:
        ours, theirs = op(NF, x), op(TF, x)
        assert ours.stride() == strides
        assert_close(ours, theirs, torch.float32)


# --- gradcheck / gradgradcheck in float64 for every functional op ----------------------

def _gc_cases():
    x = lambda *s: _make(s, torch.float64, seed=11)  # noqa: E731
    p = lambda *s: _params(s, torch.float64, True, True, seed=12)  # noqa: E731
    rm, rv = torch.randn(3, dtype=torch.float64), torch.rand(3, dtype=torch.float64) + 0.5
    return {
        "layer_norm": (lambda x, w, b: NF.layer_norm(x, [5], w, b), [x(3, 4, 5), *p(5)]),
        "rms_norm": (lambda x, w: NF.rms_norm(x, [4, 5], w, eps=1e-5), [x(3, 4, 5), p(4, 5)[0]]),
        "group_norm": (lambda x, w, b: NF.group_norm(x, 2, w, b), [x(2, 4, 3, 2), *p(4)]),
        "instance_norm": (lambda x, w, b: NF.instance_norm(x, weight=w, bias=b),
                          [x(2, 3, 4), *p(3)]),
        "batch_norm_train": (lambda x, w, b: NF.batch_norm(x, None, None, w, b, training=True),
                             [x(4, 3, 2), *p(3)]),
        "batch_norm_eval": (lambda x, w, b: NF.batch_norm(x, rm, rv, w, b, training=False),
                            [x(4, 3, 2), *p(3)]),
        # one sample of (N, C): no dim of the view is summed for the parameter gradients
        "batch_norm_eval_one_sample": (lambda x, w, b: NF.batch_norm(x, rm, rv, w, b),
                                       [x(1, 3), *p(3)]),
        "normalize": (lambda x, w, b: NF.normalize(x, (0, 2), weight=w.view(1, 3, 1),
                                                   bias=b.view(1, 3, 1)), [x(4, 3, 2), *p(3)]),
        "normalize_rms": (lambda x, w: NF.normalize(x, -1, weight=w, center=False),
                          [x(4, 3, 5), p(5)[0]]),
    }


@pytest.mark.parametrize("name", list(_gc_cases()))
def test_gradcheck_and_gradgradcheck(name):
    fn, inputs = _gc_cases()[name]
    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


@pytest.mark.parametrize("native", [True, False], ids=["cpp-node", "python"])
def test_backward_saves_only_input_and_fp32_stats(native):
    cpp = pytest.importorskip("normkit.backends.cpu.native")
    x = _make((4, 6, 5), torch.bfloat16)
    w, b = _params(6, torch.bfloat16, True, True)
    saved = []
    cpp.switch(native)
    try:   # everything the graph saves, on either path (the C++ node's included)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                      lambda t: t):
            NF.group_norm(x, 3, w, b)
    finally:
        cpp.switch(True)
    sizes = sorted(t.numel() for t in saved)
    assert any(t.data_ptr() == x.data_ptr() and t.numel() == x.numel() for t in saved)
    stats = [t for t in saved if t.numel() == 4 * 3]
    assert len(stats) == 2 and all(t.dtype == torch.float32 for t in stats)
    assert sizes == sorted([x.numel(), w.numel(), 12, 12])


# --- memory format -------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["batch", "instance", "group"])
def test_channels_last_output_keeps_memory_format(op):
    x = _make((3, 8, 5, 4), torch.float32).detach().to(memory_format=torch.channels_last)
    x.requires_grad_()
    fns = {"batch": (lambda t: NF.batch_norm(t, None, None, training=True),
                     lambda t: TF.batch_norm(t, None, None, training=True)),
           "instance": (NF.instance_norm, TF.instance_norm),
           "group": (lambda t: NF.group_norm(t, 4), lambda t: TF.group_norm(t, 4))}
    nk, th = fns[op]
    y = nk(x)
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert_close(y, th(x.detach()), torch.float32)
    (gx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert gx.shape == x.shape


# --- hard inputs ---------------------------------------------------------------------------

def test_constant_rows_with_tiny_eps_give_finite_zeros():
    x = torch.full((4, 16), 3.0, requires_grad=True)
    y = NF.layer_norm(x, [16], eps=1e-12)
    assert torch.isfinite(y).all() and (y == 0).all()
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_offset_small_spread_matches_exact(dtype):
    base = torch.tensor([1e6], dtype=torch.float64)
    x64 = base + torch.linspace(-0.5, 0.5, 64, dtype=torch.float64)
    x = x64.to(dtype).view(1, 64)
    y = NF.layer_norm(x, [64], eps=1e-9)
    exact, _ = reference.layer_norm_forward(x.double().numpy(), [64], eps=1e-9)
    np.testing.assert_allclose(y.double().numpy(), exact, atol=1e-3 if dtype == torch.float32
                               else 1e-9)
    th = TF.layer_norm(x, [64], eps=1e-9)
    err_nk = (y.double() - torch.from_numpy(exact)).abs().max()
    err_th = (th.double() - torch.from_numpy(exact)).abs().max()
    assert err_nk <= err_th + 1e-6


def test_fp16_whose_squares_overflow():
    x = (torch.randn(4, 64, dtype=torch.float64) * 300 + 1000).to(torch.float16)
    assert torch.isinf(x.float().square().to(torch.float16)).any()
    y = NF.layer_norm(x, [64])
    assert torch.isfinite(y).all()
    exact, _ = reference.layer_norm_forward(x.double().numpy(), [64])
    np.testing.assert_allclose(y.double().numpy(), exact, atol=1e-2)
    z = NF.rms_norm(x, [64])
    assert torch.isfinite(z).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_and_inf_propagate_like_torch(bad):
    x = torch.randn(3, 4, 5)
    x[1, 2, 3] = bad
    for nk, th in [(lambda t: NF.layer_norm(t, [5]), lambda t: TF.layer_norm(t, [5])),
                   (lambda t: NF.group_norm(t, 2), lambda t: TF.group_norm(t, 2)),
                   (lambda t: NF.batch_norm(t, None, None, training=True),
                    lambda t: TF.batch_norm(t, None, None, training=True))]:
        a, b = nk(x), th(x)
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        assert_close(a, b, torch.float32)


# --- errors ----------------------------------------------------------------------------

def test_errors_match_torch_types_and_carry_values():
    cases = [
        (lambda F: F.batch_norm(torch.randn(1, 3), torch.zeros(3), torch.ones(3), training=True),
         ValueError, "more than 1 value per channel"),
        (lambda F: F.group_norm(torch.randn(2, 4, 3), 3), RuntimeError, "divisible"),
        # (normkit took True as 1 group, a (2, 2) weight as 4 channels' weights)
        (lambda F: F.group_norm(torch.randn(2, 4, 3), True), TypeError, "got bool True"),
        (lambda F: F.group_norm(torch.randn(2, 4, 3), 2.0), TypeError, "got float 2.0"),
        (lambda F: F.group_norm(torch.randn(2, 4, 3), 2, torch.ones(2, 2)), RuntimeError,
         r"weight to be a vector .* got weight of shape \[2, 2\]"),
        (lambda F: (nknn if F is NF else torch.nn).GroupNorm(True, 4)(torch.randn(2, 4, 3)),
         TypeError, "got bool True"),                               # (the layer's call)
        (lambda F: F.instance_norm(torch.randn(2, 4, 3), weight=torch.ones(4, 1)), RuntimeError,
         r"weight to be a vector .* shape \[4, 1\]"),
        # flags that are no bool, integer parameters (normkit went by their truth, and
        # took an integer weight as the float one)
        (lambda F: F.batch_norm(torch.randn(4, 3), None, None, training=1), TypeError,
         "argument 'training' must be bool, not int"),
        (lambda F: F.batch_norm(torch.randn(4, 3), None, None, training=None), TypeError,
         "not NoneType"),
        (lambda F: F.instance_norm(torch.randn(2, 3, 4), use_input_stats="yes"), TypeError,
         "argument 'use_input_stats' must be bool"),
        (lambda F: F.batch_norm(torch.randn(4, 3), None, None, torch.ones(3, dtype=torch.int64),
                                training=True), RuntimeError, "weight must be floating point"),
        (lambda F: F.layer_norm(torch.randn(4, 3), [3], None, torch.zeros(3, dtype=torch.bool)),
         RuntimeError, "layer_norm: bias must be floating point, got torch.bool"),
        (lambda F: F.group_norm(torch.randn(2, 4, 3), 2, torch.ones(4, dtype=torch.int32)),
         RuntimeError, "weight must be floating point"),
        (lambda F: F.layer_norm(torch.randn(4, 3), [4]), RuntimeError, "normalized_shape"),
        (lambda F: F.rms_norm(torch.randn(4, 3), [4]), RuntimeError, "normalized_shape"),
        (lambda F: F.layer_norm(torch.randn(4, 3), 3), TypeError,
         r"normalized_shape must be a tuple of ints, got int 3; .* pass \(3,\)"),
        (lambda F: F.rms_norm(torch.randn(4, 3), 3), TypeError, "got int 3"),
        (lambda F: F.batch_norm(torch.randn(4, 3), torch.zeros(4), torch.ones(4)),
         RuntimeError, "running_mean"),
        (lambda F: F.instance_norm(torch.randn(2, 3, 1)), ValueError, "spatial"),
        # running statistics: none in eval, one of the two, a momentum that is no number
        # (normkit normalized with the batch's, ignored the one, or failed in a binding)
        (lambda F: F.batch_norm(torch.randn(4, 3), None, None), RuntimeError,
         "running_mean must be defined in evaluation mode"),
        (lambda F: F.batch_norm(torch.randn(4, 3), None, torch.ones(3)), RuntimeError,
         "running_mean must be defined"),
        (lambda F: F.batch_norm(torch.randn(4, 3), torch.zeros(3), None, training=True),
         ValueError, "got running_mean but running_var=None"),
        (lambda F: F.instance_norm(torch.randn(2, 3, 4), None, torch.ones(3)), ValueError,
         "got running_var but running_mean=None"),
        (lambda F: F.instance_norm(torch.randn(2, 3, 4), use_input_stats=False), RuntimeError,
         "use_input_stats is false"),
        (lambda F: F.batch_norm(torch.randn(4, 3), torch.zeros(3), torch.ones(3), training=True,
                                momentum=None), TypeError, "momentum must be a number, got None"),
        (lambda F: F.instance_norm(torch.randn(2, 3, 4), torch.zeros(3), torch.ones(3),
                                   momentum="0.1"), TypeError, "got str '0.1'"),
    ]
    for call, err, text in cases:
        with pytest.raises(err):
            call(TF)
        with pytest.raises(err, match=text):
            call(NF)
    # torch's RMSNorm (composite ops) promotes an integer weight: so does normkit's
    x, w = torch.randn(4, 3), torch.tensor([1, 2, 3])
    torch.testing.assert_close(NF.rms_norm(x, [3], w), TF.rms_norm(x, [3], w))


@pytest.mark.parametrize("dims, err, text", [
    ((5,), ValueError, r"between -2 and 1\), got \(5,\)"), ((), ValueError, "non-empty"),
    ((-1, 1), ValueError, r"name dim 1 of the 2D input more than once \(-1, 1\)"),
    ((0, 0), ValueError, "more than once"), ((1.0,), TypeError, r"got \(1.0,\)"),
    (None, TypeError, "got None"), (True, TypeError, "got True")])
def test_normalize_rejects_bad_dims(dims, err, text):
    with pytest.raises(err, match=text):
        NF.normalize(torch.randn(2, 3), dims=dims)


def test_normalize_takes_dims_as_any_ints():
    x = torch.randn(2, 3, 4)
    want = NF.normalize(x, (0, 2))
    for dims in ({0, 2}, [2, 0], (0, -1), range(0, 3, 2), (np.int64(0), torch.tensor(2)),
                 np.array([0, 2]), torch.tensor([0, 2])):
        assert_close(NF.normalize(x, dims), want)
    assert_close(NF.normalize(x, np.int64(1)), NF.normalize(x, 1))


# --- the general form is every method ----------------------------------------------------

def test_normalize_reproduces_each_method():
    x = _make((4, 6, 3, 5), torch.float64, requires_grad=False)
    assert_close(NF.normalize(x, (0, 2, 3)), TF.batch_norm(x, None, None, training=True))
    assert_close(NF.normalize(x, (2, 3)), TF.instance_norm(x))
    assert_close(NF.normalize(x, (1, 2, 3)), TF.group_norm(x, 1))
    assert_close(NF.normalize(x, -1, eps=1e-6, center=False), TF.rms_norm(x, [5], eps=1e-6))


# --- properties: shift and scale invariance on random shapes ------------------------------

@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=2, max_size=4),
       shift=st.floats(-1e3, 1e3), scale=st.floats(0.1, 100.0), seed=st.integers(0, 2**16))
def test_shift_and_scale_invariance(shape, shift, scale, seed):
    x = _make(shape, torch.float64, seed=seed, requires_grad=False)
    dims = tuple(range(1, len(shape)))
    if np.prod(shape[1:]) < 2:
        return
    y = NF.normalize(x, dims, eps=0.0 + 1e-30)
    y2 = NF.normalize(x * scale + shift, dims, eps=1e-30)
    varmin = float(x.var(dim=dims, unbiased=False).min())
    if varmin < 1e-6:
        return
    torch.testing.assert_close(y, y2, atol=1e-7, rtol=1e-7)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 6), c=st.integers(1, 4), s=st.integers(1, 5), seed=st.integers(0, 999))
def test_functional_matches_reference_backward(n, c, s, seed):
    x = _make((n, c, s), torch.float64, seed=seed)
    w, b = _params(c, torch.float64, True, True, seed=seed + 1)
    y = NF.batch_norm(x, None, None, w, b, training=True)
    g = torch.randn_like(y)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), g)
    out, cache = reference.batch_norm_forward(x.detach().numpy(), weight=w.detach().numpy(),
                                              bias=b.detach().numpy(), training=True)
    rdx, rdw, rdb = reference.batch_norm_backward(g.numpy(), cache)
    np.testing.assert_allclose(y.detach().numpy(), out, atol=1e-10)
    for a, e in zip((dx, dw, db), (rdx, rdw, rdb)):
        np.testing.assert_allclose(a.numpy(), e, atol=1e-9)


def test_every_weight_bias_combination_matches_the_reference():
    # with and without weight and bias: the output and every gradient equal the float64
    # reference's (torch 2.13's own group_norm backward fails with a weight but no bias)
    for wflag, bflag in itertools.product([True, False], repeat=2):
        x = _make((3, 4, 5), torch.float64)
        w, b = _params(4, torch.float64, wflag, bflag)
        y = NF.group_norm(x, 2, w, b)
        g = torch.randn_like(y)
        y.backward(g)
        arrays = [None if t is None else t.detach().numpy() for t in (x, w, b)]
        ry, cache = reference.group_norm_forward(arrays[0], 2, arrays[1], arrays[2])
        rdx, rdw, rdb = reference.normalize_backward(g.numpy(), cache)
        np.testing.assert_allclose(y.detach().numpy(), ry, atol=1e-10)
        np.testing.assert_allclose(x.grad.numpy(), rdx, atol=1e-9)
        for t, want in ((w, rdw), (b, rdb)):
            if t is not None:
                np.testing.assert_allclose(t.grad.numpy(), want, atol=1e-9)


def test_output_can_be_modified_in_place():
    # ResNet blocks do `out += residual` and ReLU(inplace=True) on a norm's output
    x = _make((4, 3, 5, 5), torch.float32)
    y = NF.batch_norm(x, None, None, training=True)
    y += 1.0
    torch.relu_(y)
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.bool, torch.complex64],
                         ids=str)
def test_non_floating_input_is_refused_as_torch_refuses_it(dtype):
    # torch's kernels raise NotImplementedError for these dtypes; before, normkit returned
    # a truncated integer (or a complex with its imaginary part dropped) without a word
    x = (torch.randn(4, 6, 5) * 3).to(dtype)
    cases = [  # (normkit's call, torch's twin or None)
        (lambda: NF.layer_norm(x, (5,)), lambda: TF.layer_norm(x, (5,))),
        (lambda: NF.group_norm(x, 2), lambda: TF.group_norm(x, 2)),
        (lambda: NF.batch_norm(x, None, None, training=True),
         lambda: TF.batch_norm(x, None, None, training=True)),
        (lambda: NF.instance_norm(x), lambda: TF.instance_norm(x)),
        (lambda: NF.rms_norm(x, (5,)), None),          # (torch's takes complex)
        (lambda: NF.normalize(x, dims=(2,)), None),
        (lambda: NF.batch_renorm(x, torch.zeros(6), torch.ones(6), training=True), None),
        (lambda: NF.add_layer_norm(x, x, (5,))[0], None),
        (lambda: nknn.LayerNorm(5)(x), lambda: torch.nn.LayerNorm(5)(x)),
        (lambda: nknn.BatchNorm1d(6)(x), lambda: torch.nn.BatchNorm1d(6)(x)),
        (lambda: nknn.GroupNorm(2, 6)(x), lambda: torch.nn.GroupNorm(2, 6)(x)),
        (lambda: nknn.RMSNorm(5)(x), None),
    ]
    for ours, theirs in cases:
        with pytest.raises(NotImplementedError, match="floating-point input"):
            ours()
        if theirs is not None:               # (NotImplementedError is a RuntimeError; torch's
            with pytest.raises(RuntimeError):  # layers raise their mixed-dtype one)
                theirs()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_rms_norm_default_eps_is_torchs_on_small_inputs(dtype):
    # eps=None: torch's kernel adds its compute dtype's epsilon (float32's for half inputs,
    # not bfloat16's 0.0078 its documentation names); on inputs of size 0.05 the two differ
    # by up to 1.8, so the outputs must agree exactly here
    x = (torch.randn(8, 16, generator=torch.Generator().manual_seed(0)) * 0.05).to(dtype)
    want = TF.rms_norm(x, [16])
    torch.testing.assert_close(NF.rms_norm(x, [16]), want, rtol=0, atol=3e-7)
    torch.testing.assert_close(nknn.RMSNorm(16).to(dtype)(x), want, rtol=0, atol=3e-7)
    torch.testing.assert_close(NF.add_rms_norm(x, x, [16])[0], TF.rms_norm(x + x, [16]),
                               rtol=0, atol=3e-7)


def test_group_norm_of_one_value_per_group_is_refused_as_torch_refuses_it():
    x = torch.randn(1, 6)
    for call in (lambda m: m.group_norm(x, 6), lambda m: m.group_norm(x[..., None], 6)):
        for module in (NF, TF):
            with pytest.raises(ValueError, match="more than 1 value per channel"):
                call(module)
    for make in (nknn.GroupNorm, torch.nn.GroupNorm):
        with pytest.raises(ValueError, match="more than 1 value per channel"):
            make(6, 6)(x)
    # N * C / G = 2: torch computes it (groups of one value: 0, torch's within 1e-4 of it)
    two = torch.randn(2, 6, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(NF.group_norm(two, 6), TF.group_norm(two, 6), rtol=0, atol=1e-4)
    torch.testing.assert_close(NF.group_norm(x, 3), TF.group_norm(x, 3), rtol=0, atol=1e-4)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_jagged_nested_tensors_are_normalized_as_torch_normalizes_them():
    # LayerNorm / RMSNorm of a jagged nested tensor (variable-length sequences) over its
    # dense trailing dims: normkit's kernels on its values, kept nested; the gradients
    # reach the nested input and the parameters. The strided layout is refused.
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(3, 4, 8, generator=gen), torch.randn(5, 4, 8, generator=gen)]
    for ours, theirs, shape in [(nknn.LayerNorm(8), torch.nn.LayerNorm(8), (8,)),
                                (nknn.LayerNorm([4, 8]), torch.nn.LayerNorm([4, 8]), (4, 8)),
                                (nknn.RMSNorm(8), torch.nn.RMSNorm(8), (8,))]:
        with torch.no_grad():
            ours.weight.uniform_(0.5, 1.5, generator=gen)
            theirs.weight.copy_(ours.weight)
        g = torch.randn(8, 4, 8, generator=gen)
        results = []
        for layer in (ours, theirs):
            x = torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=True)
            y = layer(x)
            assert y.is_nested and y.layout == torch.jagged
            (y.values() * g).sum().backward()
            results.append((y.values(), x.grad.values(), layer.weight.grad))
        for got, want in zip(*results):
            # (dx cancels sums over a row: float32 rounding of their size)
            torch.testing.assert_close(got, want, rtol=1e-4,
                                       atol=1e-5 * max(1.0, want.abs().max().item()))
    strided = torch.nested.nested_tensor(parts)
    with pytest.raises(NotImplementedError, match="jagged layout"):
        nknn.LayerNorm(8)(strided)
    with pytest.raises(NotImplementedError, match="jagged layout"):
        NF.rms_norm(strided, (8,))


_MIXED = {"layer_norm": lambda F, x, w, b, rm, rv: F.layer_norm(x, (5,), w[:5], b[:5]),
          "group_norm": lambda F, x, w, b, rm, rv: F.group_norm(x, 2, w, b),
          "batch_norm": lambda F, x, w, b, rm, rv: F.batch_norm(x, rm, rv, w, b, False)}


@pytest.mark.parametrize("op", list(_MIXED))
def test_parameters_of_another_dtype_are_taken_in_the_inputs(op):
    """Where torch refuses a weight, bias or running buffer of another floating dtype than
    a float32 input (docs/architecture.md, "Where normkit differs from torch on purpose"),
    normkit computes as with them cast to the statistics dtype: the same output."""
    x = torch.randn(4, 8, 5, 5)
    half = [t.bfloat16() for t in (torch.rand(8) + 0.5, torch.randn(8), torch.randn(8),
                                   torch.rand(8) + 0.5)]
    with pytest.raises(RuntimeError):
        _MIXED[op](TF, x, *half)
    got = _MIXED[op](NF, x, *half)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _MIXED[op](NF, x, *[t.float() for t in half]), rtol=0,
                               atol=0)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_running_buffers_of_another_dtype_are_updated_in_theirs(dtype, grad):
    """Training BatchNorm on a float32 input with running buffers of another dtype (which
    torch refuses): the output is that of float32 buffers, and the buffers, kept in their
    dtype, hold torch's update of float32 buffers to their dtype's rounding (bf16/fp16
    updated in the executor's call, float64 after it, from its statistics)."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 4, 5, 5, generator=gen) * 2 + 1).requires_grad_(grad)
    rm, rv = torch.randn(4, generator=gen), torch.rand(4, generator=gen) + 0.5
    ours = [rm.to(dtype), rv.to(dtype)]
    theirs = [t.to(dtype).float() for t in ours]
    with pytest.raises(RuntimeError):
        TF.batch_norm(x, *ours, training=True)
    got = NF.batch_norm(x, *ours, training=True, momentum=0.3)
    want = TF.batch_norm(x, *theirs, training=True, momentum=0.3)
    torch.testing.assert_close(got, want)
    layer = nknn.BatchNorm2d(4, momentum=0.3)          # the layer's own call path too
    layer.running_mean, layer.running_var = rm.to(dtype), rv.to(dtype)
    torch.testing.assert_close(layer(x), want)
    for mine, torchs in zip(ours + [layer.running_mean, layer.running_var], theirs * 2):
        assert mine.dtype == dtype
        torch.testing.assert_close(mine, torchs.to(dtype))


_CL = torch.channels_last


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("name, shape, reduce, layout", [
    ("batch_norm", (1000, 4), (0,), None),
    ("batch_norm", (8, 4, 16, 16), (0, 2, 3), None),
    ("batch_norm", (8, 4, 3, 3), (0, 2, 3), None),
    ("batch_norm", (8, 4, 16, 16), (0, 2, 3), _CL),
    ("instance_norm", (2, 4, 16, 16), (2, 3), None),
    ("instance_norm", (2, 4, 16, 16), (2, 3), _CL),
    ("group_norm", (2, 4, 16, 16), (1, 2, 3), None),
    ("group_norm", (2, 4, 16, 16), (1, 2, 3), _CL),
    ("layer_norm", (64, 768), (1,), None),
    ("layer_norm", (4, 8192), (1,), None)], ids=str)
def test_a_constant_group_gives_the_bias_exactly(name, shape, reduce, layout, dtype):
    """A group whose values are all equal (a pruned channel that outputs its conv's bias,
    a constant feature of a tabular batch) has xhat = 0: y is the bias, bit for bit, and
    dweight = sum(g * xhat) is 0: normkit's mean of such a group is its value to the last
    bit (a second pass over the deviations, or a float64 merge, corrects the first sum's
    rounding). torch 2.13's CPU kernels give the bias plus their rounding of the mean
    times 1 / sqrt(eps): 0.2 off at (1000, 4), 0.5 on channels_last (float32, values near
    100), and crash on channels_last GroupNorm (``test_cpu_channels_last``)."""
    gen = torch.Generator().manual_seed(0)
    groups = [1 if d in reduce else s for d, s in enumerate(shape)]
    x = (torch.randn(groups, generator=gen) * 3 + 100).expand(shape).contiguous().to(dtype)
    if layout is not None:
        x = x.contiguous(memory_format=layout)
    c = shape[-1] if name == "layer_norm" else shape[1]
    w = (torch.rand(c, generator=gen) + 0.5).to(dtype).requires_grad_()
    b = torch.randn(c, generator=gen).to(dtype)
    call = {"batch_norm": lambda x: NF.batch_norm(x, None, None, w, b, training=True),
            "instance_norm": lambda x: NF.instance_norm(x, weight=w, bias=b),
            "group_norm": lambda x: NF.group_norm(x, 1, w, b),
            "layer_norm": lambda x: NF.layer_norm(x, (c,), w, b)}[name]
    y = call(x)
    y.backward(torch.randn(shape, generator=gen).to(dtype))
    bias = b if name == "layer_norm" else b.view([1, -1] + [1] * (len(shape) - 2))
    assert torch.equal(y, bias.expand(shape)), (y - bias).abs().max()
    assert torch.equal(w.grad, torch.zeros_like(w.grad)), w.grad
