"""The fused numba CPU kernels (``normkit.backends.cpu``) against torch and the reference.

Every op, dtype (float64, float32, bfloat16, float16) and layout (contiguous,
channels_last), odd shapes, forward and backward, fixed (eval) statistics. Half-precision
results are compared with the float64 reference evaluated on the same (rounded) inputs,
with a tolerance of a few units in the last place of the output dtype.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("numba")

import normkit.functional as NF  # noqa: E402
from normkit import backends, reference  # noqa: E402
from normkit import grouping as G  # noqa: E402
from normkit.backends import cpu, torch_ops  # noqa: E402

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
# max |a - b| / max |b| allowed, per dtype
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
CL = {4: torch.channels_last, 5: torch.channels_last_3d}


@pytest.fixture(autouse=True)
def _threaded(monkeypatch):
    # the test shapes are small: split them over threads anyway, so that every kernel's
    # range boundaries and per-thread partial sums are exercised
    monkeypatch.setattr(cpu, "_SERIAL_BELOW", 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)


def _close(got, want, dtype, what):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    scale = max(np.abs(want).max(), 1e-6)
    err = np.abs(got - want).max() / scale
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e} > {TOL[dtype]:.0e}"


def _np(t):
    return None if t is None else t.detach().double().numpy()


def _inputs(shape, dtype, c, layout="contiguous", offset=0.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + offset).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=CL[len(shape)])
    w = (torch.rand(c, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    b = torch.randn(c, generator=gen, dtype=torch.float64).to(dtype)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    if layout == "channels_last":
        dy = dy.contiguous(memory_format=CL[len(shape)])
    return x, w, b, dy


def _run(fn, x, w, b, dy):
    """Forward and backward of ``fn(x, w, b)``: (y, dx, dw, db)."""
    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    b = None if b is None else b.detach().requires_grad_(True)
    y = fn(x, w, b)
    y.backward(dy)
    return y, x.grad, w.grad, None if b is None else b.grad


def _check_against_reference(got, ref_fwd, x, w, b, dy, dtype):
    y, dx, dw, db = got
    ry, cache = ref_fwd(_np(x), _np(w), _np(b))
    rdx, rdw, rdb = reference.normalize_backward(_np(dy), cache)
    _close(_np(y), ry, dtype, "y")
    _close(_np(dx), rdx, dtype, "dx")
    _close(_np(dw), rdw, dtype, "dweight")
    if db is not None:
        _close(_np(db), rdb, dtype, "dbias")
    assert y.dtype == dx.dtype == dtype
    assert y.is_contiguous(memory_format=_fmt(x)) and dx.is_contiguous(memory_format=_fmt(x))


def _fmt(x):
    if x.dim() in CL and x.is_contiguous(memory_format=CL[x.dim()]) and not x.is_contiguous():
        return CL[x.dim()]
    return torch.contiguous_format


# ---------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------

def test_dispatch_picks_the_numba_backend_on_cpu():
    x = torch.randn(4, 8, 5, 5)
    assert backends.select(x, G.layer(x.shape, 2)) is cpu
    assert backends.select(x, G.batch(x.shape)) is cpu
    assert backends.select(x.to(memory_format=torch.channels_last), G.group(x.shape, 2)) is cpu
    assert backends.select(x.bfloat16(), G.instance(x.shape), fixed=True) is cpu
    # what it does not handle falls back to the composite path
    assert backends.select(x, G.dims(x.shape, (0, 2))) is torch_ops
    assert backends.select(x.transpose(2, 3), G.layer(x.shape, 1)) is torch_ops
    assert backends.select(x.to(torch.int32), G.layer(x.shape, 1)) is torch_ops


def test_functional_runs_the_numba_kernels(monkeypatch):
    calls = []
    real = cpu._rows_fwd

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(cpu, "_rows_fwd", spy)
    NF.layer_norm(torch.randn(3, 7), [7])
    assert calls


# ---------------------------------------------------------------------------------------
# LayerNorm / RMSNorm
# ---------------------------------------------------------------------------------------

LAYER_SHAPES = [((5, 123, 123), 1), ((3, 7), 1), ((1, 1536), 1), ((4, 3, 5), 2)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,k", LAYER_SHAPES, ids=str)
def test_layer_norm(shape, k, dtype):
    ns = shape[-k:]
    x, w, b, dy = _inputs(shape, dtype, 1, offset=3.0)
    w, b = w.new_ones(ns) + 0.1 * torch.randn(ns).to(dtype), torch.randn(ns).to(dtype)
    got = _run(lambda x, w, b: NF.layer_norm(x, ns, w, b), x, w, b, dy)
    _check_against_reference(got, lambda x, w, b: reference.layer_norm_forward(x, ns, w, b),
                             x, w, b, dy, dtype)
    want = _run(lambda x, w, b: F.layer_norm(x, ns, w, b), x, w, b, dy)
    for g, t, name in zip(got, want, ("y", "dx", "dweight", "dbias")):
        _close(_np(g), _np(t), dtype, f"{name} vs torch")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,k", LAYER_SHAPES, ids=str)
def test_rms_norm(shape, k, dtype):
    ns = shape[-k:]
    x, _, _, dy = _inputs(shape, dtype, 1)
    w = (torch.rand(ns) + 0.5).to(dtype)
    eps = 1e-6
    got = _run(lambda x, w, b: NF.rms_norm(x, ns, w, eps), x, w, None, dy)
    _check_against_reference(got, lambda x, w, b: reference.rms_norm_forward(x, ns, w, eps),
                             x, w, None, dy, dtype)
    want = _run(lambda x, w, b: F.rms_norm(x, ns, w, eps), x, w, None, dy)
    for g, t, name in zip(got, want, ("y", "dx", "dweight")):
        _close(_np(g), _np(t), dtype, f"{name} vs torch")


def test_layer_norm_large_offset_small_spread_and_constant_rows():
    # values near 1e6 with a spread of 1: the variance must survive (no E[x^2] - E[x]^2);
    # the fp32 mean itself is rounded to half an ulp of 1e6 (0.03), which bounds y's error
    x = (1e6 + torch.randn(64, 300, dtype=torch.float64)).float()
    x[3] = 1e6 + 0.5                                        # a constant row: var = 0
    w, b = torch.rand(300) + 0.5, torch.randn(300)
    grouping = G.layer(x.shape, 1)
    y, mean, rstd, var = cpu.forward(x, grouping, w, b, 1e-5)
    ry, cache = reference.layer_norm_forward(_np(x), [300], _np(w), _np(b))
    assert torch.isfinite(y).all()
    np.testing.assert_allclose(_np(rstd), cache["rstd"], rtol=1e-4)
    np.testing.assert_allclose(_np(mean), cache["mean"], rtol=1e-7)
    np.testing.assert_allclose(_np(y), ry, atol=2e-3, rtol=0)
    np.testing.assert_allclose(_np(y[3]), _np(b), atol=1e-6)
    x64 = x.double() + torch.randn(64, 300, dtype=torch.float64) * 1e-3
    y64 = NF.layer_norm(x64, [300], w.double(), b.double())
    ry64, _ = reference.layer_norm_forward(_np(x64), [300], _np(w), _np(b))
    np.testing.assert_allclose(_np(y64), ry64, atol=1e-6)


def test_layer_norm_without_affine_and_with_expanded_grad():
    x = torch.randn(6, 33, requires_grad=True)
    y = NF.layer_norm(x, [33])
    y.sum().backward()                                      # grad has zero strides
    xr = x.detach().clone().requires_grad_(True)
    F.layer_norm(xr, [33]).sum().backward()
    torch.testing.assert_close(y, F.layer_norm(xr.detach(), [33]))
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# Batch / Instance / GroupNorm, contiguous and channels_last
# ---------------------------------------------------------------------------------------

NCHW_SHAPES = [(5, 12, 7, 9), (1, 6, 3, 5), (2, 4, 3, 4, 5), (3, 6, 17)]
LAYOUTS = ["contiguous", "channels_last"]


def _layouts_for(shape):
    return LAYOUTS if len(shape) in CL else LAYOUTS[:1]


def _cases(shapes=NCHW_SHAPES):
    return [(s, lay, dt) for s in shapes for lay in _layouts_for(s) for dt in DTYPES]


@pytest.mark.parametrize("shape,layout,dtype", _cases(), ids=str)
def test_group_norm(shape, layout, dtype):
    c = shape[1]
    groups = 3 if c % 3 == 0 else 2
    x, w, b, dy = _inputs(shape, dtype, c, layout, offset=-2.0)
    got = _run(lambda x, w, b: NF.group_norm(x, groups, w, b), x, w, b, dy)
    _check_against_reference(
        got, lambda x, w, b: reference.group_norm_forward(x, groups, w, b), x, w, b, dy, dtype)
    want = _run(lambda x, w, b: F.group_norm(x, groups, w, b), x, w, b, dy)
    for g, t, name in zip(got, want, ("y", "dx", "dweight", "dbias")):
        _close(_np(g), _np(t), dtype, f"{name} vs torch")


@pytest.mark.parametrize("shape,layout,dtype", _cases(NCHW_SHAPES + [(7, 6)]), ids=str)
def test_batch_norm_training(shape, layout, dtype):
    c = shape[1]
    x, w, b, dy = _inputs(shape, dtype, c, layout, offset=1.5)
    sd = dtype                                              # torch wants the same dtype
    rm, rv = torch.zeros(c, dtype=sd), torch.ones(c, dtype=sd)
    got = _run(lambda x, w, b: NF.batch_norm(x, rm, rv, w, b, training=True), x, w, b, dy)
    _check_against_reference(
        got, lambda x, w, b: reference.batch_norm_forward(x, None, None, w, b, True),
        x, w, b, dy, dtype)
    trm, trv = torch.zeros(c, dtype=sd), torch.ones(c, dtype=sd)
    want = _run(lambda x, w, b: F.batch_norm(x, trm, trv, w, b, training=True), x, w, b, dy)
    for g, t, name in zip(got, want, ("y", "dx", "dweight", "dbias")):
        _close(_np(g), _np(t), dtype, f"{name} vs torch")
    tol = max(TOL[dtype], 1e-6)
    torch.testing.assert_close(rm, trm, atol=tol, rtol=tol)
    torch.testing.assert_close(rv, trv, atol=tol, rtol=tol)


@pytest.mark.parametrize("shape,layout,dtype", _cases(NCHW_SHAPES[:2]), ids=str)
def test_batch_norm_eval(shape, layout, dtype):
    c = shape[1]
    x, w, b, dy = _inputs(shape, dtype, c, layout)
    rm = torch.randn(c, dtype=torch.float64).to(dtype)     # torch wants the input's dtype
    rv = (torch.rand(c, dtype=torch.float64) + 0.5).to(dtype)
    got = _run(lambda x, w, b: NF.batch_norm(x, rm, rv, w, b, training=False), x, w, b, dy)
    _check_against_reference(
        got, lambda x, w, b: reference.batch_norm_forward(x, _np(rm), _np(rv), w, b, False),
        x, w, b, dy, dtype)
    want = _run(lambda x, w, b: F.batch_norm(x, rm, rv, w, b, training=False), x, w, b, dy)
    for g, t, name in zip(got, want, ("y", "dx", "dweight", "dbias")):
        _close(_np(g), _np(t), dtype, f"{name} vs torch")


@pytest.mark.parametrize("shape,layout,dtype", _cases(), ids=str)
def test_instance_norm(shape, layout, dtype):
    c = shape[1]
    x, w, b, dy = _inputs(shape, dtype, c, layout, offset=4.0)
    got = _run(lambda x, w, b: NF.instance_norm(x, weight=w, bias=b), x, w, b, dy)
    _check_against_reference(
        got, lambda x, w, b: reference.instance_norm_forward(x, w, b), x, w, b, dy, dtype)
    # torch on contiguous copies: torch 2.13's instance_norm backward is wrong for a
    # channels_last input with N = 1 (dx differs from the contiguous case)
    want = _run(lambda x, w, b: F.instance_norm(x, weight=w, bias=b), x.contiguous(), w, b,
                dy.contiguous())
    for g, t, name in zip(got, want, ("y", "dx", "dweight", "dbias")):
        _close(_np(g), _np(t), dtype, f"{name} vs torch")


@pytest.mark.parametrize("shape,layout,dtype", _cases(NCHW_SHAPES[:1]), ids=str)
def test_instance_norm_fixed_statistics(shape, layout, dtype):
    c = shape[1]
    x, w, b, dy = _inputs(shape, dtype, c, layout)
    rm = torch.randn(c, dtype=torch.float64).float()
    rv = (torch.rand(c, dtype=torch.float64) + 0.5).float()
    got = _run(lambda x, w, b: NF.instance_norm(x, rm, rv, w, b, use_input_stats=False),
               x, w, b, dy)
    _check_against_reference(
        got, lambda x, w, b: reference.instance_norm_forward(
            x, w, b, running_mean=_np(rm), running_var=_np(rv), use_input_stats=False),
        x, w, b, dy, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", ["batch", "group", "instance"])
def test_channels_last_small_blocks_and_groups(op, dtype, monkeypatch):
    # tiny two-pass blocks (16 rows) read in runs of 2 rows of C: several blocks per
    # range (S = 63: the last block of 15 rows, a partial run), block-wise flushes in
    # backward
    monkeypatch.setattr(cpu, "_BLOCK_BYTES", 200 * dtype.itemsize)
    monkeypatch.setattr(cpu, "_RUN_LANES", 24)
    shape, c = (3, 12, 7, 9), 12
    assert cpu._cl_blocks(c, dtype.itemsize) == (16, 2)
    x, w, b, dy = _inputs(shape, dtype, c, "channels_last", offset=3.0)
    fn, ref = {
        "batch": (lambda x, w, b: NF.batch_norm(x, None, None, w, b, training=True),
                  lambda x, w, b: reference.batch_norm_forward(x, None, None, w, b, True)),
        "group": (lambda x, w, b: NF.group_norm(x, 3, w, b),
                  lambda x, w, b: reference.group_norm_forward(x, 3, w, b)),
        "instance": (lambda x, w, b: NF.instance_norm(x, weight=w, bias=b),
                     lambda x, w, b: reference.instance_norm_forward(x, w, b)),
    }[op]
    _check_against_reference(_run(fn, x, w, b, dy), ref, x, w, b, dy, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_nchw_small_channel_blocks(training, dtype, monkeypatch):
    # blocks of 2 channels in forward and backward (C = 7 over 3 threads: ranges of 3,
    # 2, 2, the first one ending in a partial block), every block walked sample by sample
    shape, c = (5, 7, 4, 6), 7
    monkeypatch.setattr(cpu, "_CHANNEL_BLOCK_BYTES", 2 * 5 * 24 * dtype.itemsize)
    assert cpu._channel_block(5 * 24 * dtype.itemsize) == 2
    assert cpu._channel_block(2 * 5 * 24 * dtype.itemsize) == 1
    monkeypatch.setattr(cpu, "_channel_block", lambda channel_bytes: 2)
    x, w, b, dy = _inputs(shape, dtype, c, offset=2.5)
    rm = torch.randn(c, dtype=torch.float64).to(dtype)
    rv = (torch.rand(c, dtype=torch.float64) + 0.5).to(dtype)
    got = _run(lambda x, w, b: NF.batch_norm(x, rm.clone(), rv.clone(), w, b,
                                             training=training), x, w, b, dy)
    _check_against_reference(
        got, lambda x, w, b: reference.batch_norm_forward(x, _np(rm), _np(rv), w, b, training),
        x, w, b, dy, dtype)
    want = _run(lambda x, w, b: F.batch_norm(x, rm.clone(), rv.clone(), w, b,
                                             training=training), x, w, b, dy)
    for g, t, name in zip(got, want, ("y", "dx", "dweight", "dbias")):
        _close(_np(g), _np(t), dtype, f"{name} vs torch")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("offset", [1e3, 3e4])
def test_group_and_batch_norm_of_data_far_from_zero(layout, offset):
    # fp32 data with |mean| >> std: the error must stay at the input's own rounding
    # (ulp(offset) ~ offset * 6e-8). torch 2.13's channels_last GroupNorm takes
    # E[x^2] - E[x]^2 and is off by 8.2 at offset 1e3, by 1.3e3 at 1e4
    # (benchmarks/bench_runtime.py).
    gen = torch.Generator().manual_seed(0)
    x64 = torch.randn(4, 64, 28, 28, generator=gen, dtype=torch.float64) + offset
    x = x64.float()
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x64 = x.double()                                       # the rounded input, exactly
    tol = 5 * offset * 2.0 ** -24
    for got, want in (
            (NF.group_norm(x, 8), F.group_norm(x64, 8)),
            (NF.batch_norm(x, None, None, training=True),
             F.batch_norm(x64, None, None, training=True))):
        assert (got.double() - want).abs().max().item() < tol


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", ["outlier_first", "ramp"])
def test_shifted_sums_stay_accurate(layout, case, monkeypatch):
    # the one-pass sums shift each plane (NCHW) or block of rows (channels_last) by the
    # mean known so far: an outlier as the first value, or block means drifting away
    # from the running mean (a spatial ramp), must not cost accuracy. A shift by the
    # first value alone is off by 6.2e-5 on the channels_last outlier. The ramp there
    # runs in blocks of 8 rows (runs of 2), 288 blocks per sample.
    gen = torch.Generator().manual_seed(1)
    x64 = torch.randn(2, 16, 48, 48, generator=gen, dtype=torch.float64)
    if case == "outlier_first":
        x64[:, :, 0, 0] = 100.0
    else:
        monkeypatch.setattr(cpu, "_RUN_LANES", 2 * 16)
        monkeypatch.setattr(cpu, "_BLOCK_BYTES", 8 * 16 * 4)
        x64 = x64 + torch.linspace(0, 4e3, 48 * 48, dtype=torch.float64).view(1, 1, 48, 48)
    x = x64.float()
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x64 = x.double()
    for got, want in ((NF.batch_norm(x, None, None, training=True),
                       F.batch_norm(x64, None, None, training=True)),
                      (NF.group_norm(x, 4), F.group_norm(x64, 4)),
                      (NF.instance_norm(x), F.instance_norm(x64))):
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err < 2e-6, f"{case}, {layout}: relative error {err:.1e}"


def test_batch_norm_channels_last_expanded_grad_and_no_affine():
    x = torch.randn(4, 8, 6, 5).to(memory_format=torch.channels_last).requires_grad_(True)
    NF.batch_norm(x, None, None, training=True).sum().backward()
    xr = x.detach().clone().requires_grad_(True)
    F.batch_norm(xr, None, None, training=True).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-5)


STREAM_CASES = [  # op, shape, layout, streamed outputs: rows and planes longer than a
    # prefetch piece (512), rows of odd byte length (unaligned heads and tails)
    ("layer", (3, 4099), "contiguous", 2),
    ("rms", (5, 3, 777), "contiguous", 2),
    ("group", (2, 4, 47, 45), "contiguous", 2),
    ("instance", (2, 3, 2111), "contiguous", 2),
    ("batch", (3, 5, 41, 53), "contiguous", 2),
    ("group", (3, 12, 7, 9), "channels_last", 2),                  # one sample per thread
    ("instance", (2, 7, 33, 65), "channels_last", 2),              # (n, c) coefficients
    ("batch", (3, 5, 7, 9), "channels_last", 2),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op,shape,layout,n_streamed", STREAM_CASES, ids=str)
def test_streamed_outputs(op, shape, layout, n_streamed, dtype, monkeypatch):
    # y and dx written through the staging buffer with non-temporal stores are the same
    # bits as written directly, and match the reference
    c = shape[-1] if op in ("layer", "rms") else shape[1]
    x, w, b, dy = _inputs(shape, dtype, c, layout, offset=1.5)
    fn, ref = {
        "layer": (lambda x, w, b: NF.layer_norm(x, (c,), w, b),
                  lambda x, w, b: reference.layer_norm_forward(x, (c,), w, b)),
        "rms": (lambda x, w, b: NF.rms_norm(x, (c,), w),
                lambda x, w, b: reference.rms_norm_forward(x, (c,), w)),
        "group": (lambda x, w, b: NF.group_norm(x, 2 if c % 2 == 0 else 1, w, b),
                  lambda x, w, b: reference.group_norm_forward(x, 2 if c % 2 == 0 else 1, w, b)),
        "batch": (lambda x, w, b: NF.batch_norm(x, None, None, w, b, training=True),
                  lambda x, w, b: reference.batch_norm_forward(x, None, None, w, b, True)),
        "instance": (lambda x, w, b: NF.instance_norm(x, weight=w, bias=b),
                     lambda x, w, b: reference.instance_norm_forward(x, w, b)),
    }[op]
    if op == "rms":
        b = None
    calls = []
    monkeypatch.setattr(cpu, "_stream_out", lambda t: False)
    plain = _run(fn, x, w, b, dy)
    monkeypatch.setattr(cpu, "_stream_out", lambda t: calls.append(t.shape) or True)
    streamed = _run(fn, x, w, b, dy)
    assert len(calls) == n_streamed
    for p, s, name in zip(plain, streamed, ("y", "dx", "dweight", "dbias")):
        if p is not None:
            assert torch.equal(p, s), f"{name}: streamed output differs"
    _check_against_reference(streamed, ref, x, w, b, dy, dtype)


def test_streamed_spans_match_the_plain_ones_and_reject_other_arrays():
    # the *_nt intrinsics (vectors with non-temporal stores, plain stores at the unaligned
    # ends) write the same bits as the plain *_span loops, for any start and length
    from numba import errors, njit

    @njit
    def both(kind, lo, n, x, g, w, bb, out_nt, out):
        xs, gs, ws, bs = x[lo:lo + n], g[lo:lo + n], w[lo:lo + n], bb[lo:lo + n]
        a, b, c, d = x[0], g[0], w[0], bb[0]                       # scalars of the dtype
        if kind == 0:
            cpu._plane_affine_nt(out_nt[lo:lo + n], xs, a, b, c, d)
            cpu._plane_affine_span(xs, out[lo:lo + n], a, b, c, d)
        elif kind == 1:
            cpu._row_affine_nt(out_nt[lo:lo + n], xs, ws, bs, a, b, c)
            cpu._row_affine_span(xs, out[lo:lo + n], ws, bs, a, b, c)
        elif kind == 2:
            cpu._row_dx_nt(out_nt[lo:lo + n], gs, xs, ws, a, c, b, d)
            cpu._row_dx_span(gs, xs, ws, out[lo:lo + n], a, c, b, d)
        else:
            cpu._plane_dx_nt(out_nt[lo:lo + n], gs, xs, a, c, b, d, a)
            cpu._plane_dx_span(gs, xs, out[lo:lo + n], a, c, b, d, a)
        cpu._fence()

    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        x, g, w, bb = (rng.standard_normal(1100).astype(dtype) for _ in range(4))
        for kind in range(4):
            for lo in (0, 1, 3, 16, 17):                           # unaligned heads
                for n in (0, 1, 15, 16, 33, 100, 1000):            # and tails
                    out_nt, out = np.zeros(1100, dtype), np.zeros(1100, dtype)
                    both(kind, lo, n, x, g, w, bb, out_nt, out)
                    assert np.array_equal(out_nt, out, equal_nan=True), (dtype, kind, lo, n)
                    assert not out_nt[:lo].any() and not out_nt[lo + n:].any()

    @njit
    def strided(dst, src):
        cpu._plane_affine_nt(dst[::2], src, 0.0, 0.0, 1.0, 0.0)

    @njit
    def half(dst, src):
        cpu._plane_affine_nt(dst, src, 0.0, 0.0, 1.0, 0.0)

    with pytest.raises(errors.TypingError):
        strided(np.zeros(8, np.float32), np.zeros(4, np.float32))
    with pytest.raises(errors.TypingError):
        half(np.zeros(8, np.uint16), np.zeros(8, np.uint16))


def test_stream_out_rule(monkeypatch):
    monkeypatch.setattr(cpu, "_STREAM_BYTES", 1 << 20)
    monkeypatch.setattr(cpu._memory, "resident", lambda t: True)
    assert cpu._stream_out(torch.zeros(1 << 18))                  # 1 MiB of float32
    assert not cpu._stream_out(torch.zeros((1 << 18) - 1))
    assert not cpu._stream_out(torch.zeros(1 << 20, dtype=torch.bfloat16))
    monkeypatch.setattr(cpu._memory, "resident", lambda t: False)  # freshly mapped
    assert not cpu._stream_out(torch.zeros(1 << 18))
    assert cpu._last_level_cache_bytes() > 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["layer", "rms", "group", "instance"])
def test_prefetch_changes_nothing(op, dtype, monkeypatch):
    # the rows and units kernels' prefetch of the rows (planes) ahead is a hint: the same
    # bits with and without it, up to the end of each thread's range (where it stops)
    shape = (37, 96) if op in ("layer", "rms") else (3, 6, 9, 11)
    c = shape[-1] if op in ("layer", "rms") else shape[1]
    x, w, b, dy = _inputs(shape, dtype, c, "contiguous", offset=1.5)
    fn = {"layer": lambda x, w, b: NF.layer_norm(x, (c,), w, b),
          "rms": lambda x, w, b: NF.rms_norm(x, (c,), w),
          "group": lambda x, w, b: NF.group_norm(x, 3, w, b),
          "instance": lambda x, w, b: NF.instance_norm(x, weight=w, bias=b)}[op]
    if op == "rms":
        b = None
    name = "_rows_ahead" if op in ("layer", "rms") else "_units_ahead"
    results = []
    for ahead in (0, 1, 2, 5, 40):
        monkeypatch.setattr(cpu, name, lambda *args, a=ahead: a)
        results.append(_run(fn, x, w, b, dy))
    for other in results[1:]:
        for p, q in zip(results[0], other):
            if p is not None:
                assert torch.equal(p, q)


def test_rows_ahead_rule():
    assert cpu._rows_ahead(768, 4) == 2                            # 3 KiB rows: 6 KiB ahead
    assert cpu._rows_ahead(2048, 4) == 1
    assert cpu._rows_ahead(4096, 4) == 1
    assert cpu._rows_ahead(768, 2) == 0                            # half precision: none
    assert cpu._rows_ahead(1, 8) == 1024
    assert cpu._units_ahead(4, 56 * 56) == 1                       # 12.5 KiB planes
    assert cpu._units_ahead(4, 14 * 14) == 10
    assert cpu._units_ahead(2, 14 * 14) == 0


# ---------------------------------------------------------------------------------------
# normkit bench, end to end
# ---------------------------------------------------------------------------------------

def test_bench_quick_json(capsys):
    from normkit.cli import main

    rc = main(["bench", "--quick", "--json", "--no-progress", "--repeats", "1",
               "--ops", "layer_norm", "batch_norm", "--dtypes", "float32"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["allocators"]) == {"default", "no-mmap"}
    assert report["allocators"]["no-mmap"]["environment"]["malloc_mmap_max"] == "0"
    rows = report["allocators"]["default"]["results"]
    assert {r["op"] for r in rows} == {"layer_norm", "batch_norm"}
    assert {r["layout"] for r in rows} == {"contiguous", "channels_last"}
    for r in rows:
        assert r["normkit_s"] > 0 and r["torch_s"] > 0 and r["copy_s"] > 0
        assert r["normkit_over_torch"] == pytest.approx(r["normkit_s"] / r["torch_s"])

    # benchmarks/bench_table.py turns such reports into the README's tables and summary
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_table.py"
    spec = importlib.util.spec_from_file_location("bench_table", path)
    bench_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_table)
    for full in (False, True):
        lines = bench_table.table([report, report], full=full).splitlines()
        assert len(lines) == 2 + len(report["allocators"]["no-mmap"]["results"])
        assert all(line.count("|") == lines[0].count("|") for line in lines)
    r = report["allocators"]["no-mmap"]["results"][0]
    assert f"{r['normkit_over_torch']:.2f}" in lines[2]
    text = bench_table.summary([report])
    assert "layer_norm" in text and "targets" in text
