"""``normkit.backends.cpu.planes``: Batch/Instance/GroupNorm on contiguous NCHW against
torch and the reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("numba")

import _cpu_cases as cases  # noqa: E402
from _cpu_cases import DTYPES, NCHW_SHAPES, threaded  # noqa: E402,F401 -- fixture by name
from normkit.backends.cpu import tuning  # noqa: E402

pytestmark = pytest.mark.usefixtures("threaded")


def _nchw(shapes):
    # contiguous shapes with more than one position per plane
    return cases.cases(shapes, "contiguous")


@pytest.mark.parametrize("check", [cases.check_group_norm, cases.check_batch_norm_training,
                                   cases.check_instance_norm], ids=lambda f: f.__name__[6:])
@pytest.mark.parametrize("shape,dtype", _nchw(NCHW_SHAPES), ids=str)
def test_against_torch_and_reference(check, shape, dtype):
    check(shape, "contiguous", dtype)


@pytest.mark.parametrize("shape,dtype", _nchw(NCHW_SHAPES[:2]), ids=str)
def test_batch_norm_eval(shape, dtype):
    cases.check_batch_norm_eval(shape, "contiguous", dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_instance_norm_fixed_statistics(dtype):
    cases.check_instance_norm_fixed_statistics(NCHW_SHAPES[0], "contiguous", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_small_channel_blocks(training, dtype, monkeypatch):
    # blocks of 2 channels in forward and backward (C = 7 over 3 threads: ranges of 3,
    # 2, 2, the first one ending in a partial block), every block walked sample by
    # sample: the same bits as one block per range, and right
    import normkit.functional as NF

    shape, c = (5, 7, 4, 6), 7
    x, w, b, dy = cases.inputs(shape, dtype, c, offset=2.5)
    rm = torch.randn(c, dtype=torch.float64).to(dtype)
    rv = (torch.rand(c, dtype=torch.float64) + 0.5).to(dtype)

    def fn(x, w, b):
        return NF.batch_norm(x, rm.clone(), rv.clone(), w, b, training=training)

    results = {}
    for block in (2, 1 << 20):
        monkeypatch.setattr(tuning, "channel_block", lambda channel_bytes, b=block: b)
        results[block] = cases.run(fn, x, w, b, dy)
    cases.same_bits(results[2], results[1 << 20], "blocks of 2 channels")
    cases.check_against_reference(
        results[2], lambda x, w, b: cases.reference.batch_norm_forward(
            x, cases.np64(rm), cases.np64(rv), w, b, training), x, w, b, dy, dtype)


@pytest.mark.parametrize("size", [28, 8], ids=["planes", "small_planes"])
@pytest.mark.parametrize("offset", [1e3, 3e4])
def test_group_and_batch_norm_of_data_far_from_zero(offset, size):
    cases.check_far_from_zero("contiguous", offset, size)


@pytest.mark.parametrize("case", ["outlier_first", "ramp"])
def test_shifted_sums_stay_accurate(case):
    cases.check_shifted_sums("contiguous", case)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["group", "instance"])
def test_prefetch_changes_nothing(op, dtype, monkeypatch):
    cases.check_prefetch_changes_nothing(op, dtype, monkeypatch)


@pytest.mark.parametrize("op", ["instance", "group", "batch", "layer", "rms"])
def test_long_planes_and_rows_keep_torchs_accuracy(op):
    """A float32 sum over a whole plane (2^21 elements here) in vector lanes was off by
    about 1e-6 relative (1e-5 at 2048 x 2048; torch 7e-8): sums now run in float32 for at
    most ``half.SUM_RUN`` elements, and those runs add in float64. y, dx and dweight
    against float64, within a few times torch's own float32 error."""
    import torch.nn.functional as F

    import normkit.functional as NF

    gen = torch.Generator().manual_seed(0)
    shape = (1, 1 << 21) if op in ("layer", "rms") else (1, 4, 1024, 2048)
    x = torch.randn(shape, generator=gen).add_(0.5)
    dy = torch.randn(shape, generator=gen)
    c = shape[-1] if op in ("layer", "rms") else shape[1]
    w = torch.rand(c, generator=gen) + 0.5
    calls = {"instance": lambda f, x, w: f.instance_norm(x, weight=w),
             "group": lambda f, x, w: f.group_norm(x, 2, w),
             "batch": lambda f, x, w: f.batch_norm(x, None, None, w, training=True),
             "layer": lambda f, x, w: f.layer_norm(x, (c,), w),
             "rms": lambda f, x, w: f.rms_norm(x, (c,), w)}

    def run(f, dtype):
        xi, wi = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
        y = calls[op](f, xi, wi)
        y.backward(dy.to(dtype))
        return [t.detach().double() for t in (y, xi.grad, wi.grad)]

    want = run(F, torch.float64)
    ours, theirs = run(NF, torch.float32), run(F, torch.float32)
    for name, got, ref, want_ in zip(("y", "dx", "dweight"), ours, theirs, want):
        scale = want_.abs().max()
        err, torch_err = ((got - want_).abs().max() / scale).item(), \
            ((ref - want_).abs().max() / scale).item()
        assert err <= max(3 * torch_err, 3e-7), \
            f"{op} {name}: relative error {err:.1e}, torch's {torch_err:.1e}"
