"""Shared inputs and checks of the CPU backend tests (``tests/test_cpu_*.py``).

Half-precision results are compared with the float64 reference evaluated on the same
(rounded) inputs, with a tolerance of a few units in the last place of the output dtype.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import normkit.functional as NF
from normkit import reference

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
# max |a - b| / max |b| allowed, per dtype
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
CL = {4: torch.channels_last, 5: torch.channels_last_3d}
LAYOUTS = ["contiguous", "channels_last"]


@pytest.fixture
def threaded(monkeypatch):
    """Split even the small test shapes over three threads, so that every kernel's range
    boundaries and per-thread partial sums are exercised."""
    from normkit.backends.cpu import tuning

    monkeypatch.setattr(tuning, "SERIAL_BELOW", 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)


def close(got, want, dtype, what):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    scale = max(np.abs(want).max(), 1e-6)
    err = np.abs(got - want).max() / scale
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e} > {TOL[dtype]:.0e}"


def np64(t):
    return None if t is None else t.detach().double().numpy()


def inputs(shape, dtype, c, layout="contiguous", offset=0.0, seed=0):
    """x, weight, bias (c,), dy of ``shape`` in ``dtype`` and ``layout``."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + offset).to(dtype)
    w = (torch.rand(c, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    b = torch.randn(c, generator=gen, dtype=torch.float64).to(dtype)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=CL[len(shape)])
        dy = dy.contiguous(memory_format=CL[len(shape)])
    return x, w, b, dy


def run(fn, x, w, b, dy):
    """Forward and backward of ``fn(x, w, b)``: (y, dx, dw, db), with plans built afresh
    (the tests change tuning numbers between runs, which a cached plan would not see)."""
    from normkit import backends

    backends.clear_plans()
    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    b = None if b is None else b.detach().requires_grad_(True)
    y = fn(x, w, b)
    y.backward(dy)
    return y, x.grad, w.grad, None if b is None else b.grad


def memory_format(x):
    if x.dim() in CL and x.is_contiguous(memory_format=CL[x.dim()]) and not x.is_contiguous():
        return CL[x.dim()]
    return torch.contiguous_format


def check_against_reference(got, ref_fwd, x, w, b, dy, dtype):
    """(y, dx, dw, db) against the float64 reference, and the output's dtype and layout."""
    y, dx, dw, db = got
    ry, cache = ref_fwd(np64(x), np64(w), np64(b))
    rdx, rdw, rdb = reference.normalize_backward(np64(dy), cache)
    close(np64(y), ry, dtype, "y")
    close(np64(dx), rdx, dtype, "dx")
    close(np64(dw), rdw, dtype, "dweight")
    if db is not None:
        close(np64(db), rdb, dtype, "dbias")
    assert y.dtype == dx.dtype == dtype
    fmt = memory_format(x)
    assert y.is_contiguous(memory_format=fmt) and dx.is_contiguous(memory_format=fmt)


def check_against_torch(got, want, dtype):
    for g, t, name in zip(got, want, ("y", "dx", "dweight", "dbias")):
        if g is not None:
            close(np64(g), np64(t), dtype, f"{name} vs torch")


def op(name, c):
    """(normkit op, reference forward) of ``fn(x, w, b)`` for an op name; the group
    count is 3 or 2 (whichever divides c), RMSNorm ignores b."""
    groups = 3 if c % 3 == 0 else (2 if c % 2 == 0 else 1)
    return {
        "layer": (lambda x, w, b: NF.layer_norm(x, (c,), w, b),
                  lambda x, w, b: reference.layer_norm_forward(x, (c,), w, b)),
        "rms": (lambda x, w, b: NF.rms_norm(x, (c,), w),
                lambda x, w, b: reference.rms_norm_forward(x, (c,), w)),
        "group": (lambda x, w, b: NF.group_norm(x, groups, w, b),
                  lambda x, w, b: reference.group_norm_forward(x, groups, w, b)),
        "batch": (lambda x, w, b: NF.batch_norm(x, None, None, w, b, training=True),
                  lambda x, w, b: reference.batch_norm_forward(x, None, None, w, b, True)),
        "instance": (lambda x, w, b: NF.instance_norm(x, weight=w, bias=b),
                     lambda x, w, b: reference.instance_norm_forward(x, w, b)),
    }[name]


def same_bits(first, second, what):
    """Every tensor of two (y, dx, dw, db) results equal bit for bit."""
    for p, q, name in zip(first, second, ("y", "dx", "dweight", "dbias")):
        if p is not None:
            assert torch.equal(p, q), f"{what}: {name} differs"


# ---- the op checks, shared by the NCHW (test_cpu_planes) and channels_last modules ------

NCHW_SHAPES = [(5, 12, 7, 9), (1, 6, 3, 5), (2, 4, 3, 4, 5), (3, 6, 17)]


def cases(shapes, layout):
    """(shape, dtype) pairs of the shapes that have ``layout`` (channels_last: 4-d, 5-d)."""
    return [(s, dt) for s in shapes if layout == "contiguous" or len(s) in CL for dt in DTYPES]


def check_group_norm(shape, layout, dtype):
    import torch.nn.functional as F

    c = shape[1]
    groups = 3 if c % 3 == 0 else 2
    x, w, b, dy = inputs(shape, dtype, c, layout, offset=-2.0)
    got = run(lambda x, w, b: NF.group_norm(x, groups, w, b), x, w, b, dy)
    check_against_reference(
        got, lambda x, w, b: reference.group_norm_forward(x, groups, w, b), x, w, b, dy, dtype)
    check_against_torch(got, run(lambda x, w, b: F.group_norm(x, groups, w, b), x, w, b, dy),
                        dtype)


def check_batch_norm_training(shape, layout, dtype):
    import torch.nn.functional as F

    c = shape[1]
    x, w, b, dy = inputs(shape, dtype, c, layout, offset=1.5)
    rm, rv = torch.zeros(c, dtype=dtype), torch.ones(c, dtype=dtype)   # torch: x's dtype
    got = run(lambda x, w, b: NF.batch_norm(x, rm, rv, w, b, training=True), x, w, b, dy)
    check_against_reference(
        got, lambda x, w, b: reference.batch_norm_forward(x, None, None, w, b, True),
        x, w, b, dy, dtype)
    trm, trv = torch.zeros(c, dtype=dtype), torch.ones(c, dtype=dtype)
    want = run(lambda x, w, b: F.batch_norm(x, trm, trv, w, b, training=True), x, w, b, dy)
    check_against_torch(got, want, dtype)
    tol = max(TOL[dtype], 1e-6)
    torch.testing.assert_close(rm, trm, atol=tol, rtol=tol)
    torch.testing.assert_close(rv, trv, atol=tol, rtol=tol)


def check_batch_norm_eval(shape, layout, dtype):
    import torch.nn.functional as F

    c = shape[1]
    x, w, b, dy = inputs(shape, dtype, c, layout)
    rm = torch.randn(c, dtype=torch.float64).to(dtype)
    rv = (torch.rand(c, dtype=torch.float64) + 0.5).to(dtype)
    got = run(lambda x, w, b: NF.batch_norm(x, rm, rv, w, b, training=False), x, w, b, dy)
    check_against_reference(
        got, lambda x, w, b: reference.batch_norm_forward(x, np64(rm), np64(rv), w, b, False),
        x, w, b, dy, dtype)
    want = run(lambda x, w, b: F.batch_norm(x, rm, rv, w, b, training=False), x, w, b, dy)
    check_against_torch(got, want, dtype)


def check_instance_norm(shape, layout, dtype):
    import torch.nn.functional as F

    c = shape[1]
    x, w, b, dy = inputs(shape, dtype, c, layout, offset=4.0)
    got = run(lambda x, w, b: NF.instance_norm(x, weight=w, bias=b), x, w, b, dy)
    check_against_reference(
        got, lambda x, w, b: reference.instance_norm_forward(x, w, b), x, w, b, dy, dtype)
    # torch on contiguous copies: torch 2.13's instance_norm backward is wrong for a
    # channels_last input with N = 1 (dx differs from the contiguous case)
    want = run(lambda x, w, b: F.instance_norm(x, weight=w, bias=b), x.contiguous(), w, b,
               dy.contiguous())
    check_against_torch(got, want, dtype)


def check_instance_norm_fixed_statistics(shape, layout, dtype):
    c = shape[1]
    x, w, b, dy = inputs(shape, dtype, c, layout)
    rm = torch.randn(c, dtype=torch.float64).float()
    rv = (torch.rand(c, dtype=torch.float64) + 0.5).float()
    got = run(lambda x, w, b: NF.instance_norm(x, rm, rv, w, b, use_input_stats=False),
              x, w, b, dy)
    check_against_reference(
        got, lambda x, w, b: reference.instance_norm_forward(
            x, w, b, running_mean=np64(rm), running_var=np64(rv), use_input_stats=False),
        x, w, b, dy, dtype)


def check_far_from_zero(layout, offset, size=28):
    """fp32 data with |mean| >> std: the error must stay at the input's own rounding
    (ulp(offset) ~ offset * 6e-8). torch 2.13's channels_last GroupNorm takes
    E[x^2] - E[x]^2 and is off by 8.2 at offset 1e3, by 1.3e3 at 1e4. ``size``: of the
    square planes (8: under tuning.SMALL_PLANE)."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    x64 = torch.randn(4, 64, size, size, generator=gen, dtype=torch.float64) + offset
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


def check_shifted_sums(layout, case):
    """The one-pass sums shift each plane (NCHW) or block of rows (channels_last) by the
    mean known so far: an outlier as the first value, or block means drifting away from
    the running mean (a spatial ramp), must not cost accuracy. (A shift by the first
    value alone is off by 6.2e-5 on the channels_last outlier.)"""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(1)
    x64 = torch.randn(2, 16, 48, 48, generator=gen, dtype=torch.float64)
    if case == "outlier_first":
        x64[:, :, 0, 0] = 100.0
    else:
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


def check_prefetch_changes_nothing(name, dtype, monkeypatch):
    """The prefetch of the rows (planes) ahead is a hint: the same bits with and without
    it, up to the end of each thread's range (where it stops)."""
    from normkit.backends.cpu import tuning

    shape = (37, 96) if name in ("layer", "rms") else (3, 6, 9, 11)
    c = shape[-1] if name in ("layer", "rms") else shape[1]
    x, w, b, dy = inputs(shape, dtype, c, "contiguous", offset=1.5)
    fn, _ = op(name, c)
    if name == "rms":
        b = None
    results = []
    for ahead in (0, 1, 2, 5, 40):
        monkeypatch.setattr(tuning, "rows_ahead", lambda *args, a=ahead: a)
        results.append(run(fn, x, w, b, dy))
    for other in results[1:]:
        same_bits(results[0], other, "prefetch")
