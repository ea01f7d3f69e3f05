"""``normkit.backends.cpu.channels_last``: Batch/Instance/GroupNorm on channels_last (and
BatchNorm of (N, C), one position per channel) against torch and the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("numba")

import _cpu_cases as cases  # noqa: E402
from _cpu_cases import DTYPES, NCHW_SHAPES, threaded  # noqa: E402,F401 -- fixture by name
from normkit.backends.cpu import tuning  # noqa: E402

pytestmark = pytest.mark.usefixtures("threaded")

CL = "channels_last"


@pytest.mark.parametrize("check", [cases.check_group_norm, cases.check_batch_norm_training,
                                   cases.check_instance_norm], ids=lambda f: f.__name__[6:])
@pytest.mark.parametrize("shape,dtype", cases.cases(NCHW_SHAPES, CL), ids=str)
def test_against_torch_and_reference(check, shape, dtype):
    check(shape, CL, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batch_norm_training_of_rows(dtype):
    # (N, C): a contiguous tensor whose view (N, C, 1) is a run of rows of C channels
    cases.check_batch_norm_training((7, 6), "contiguous", dtype)


@pytest.mark.parametrize("shape,dtype", cases.cases(NCHW_SHAPES[:2], CL), ids=str)
def test_batch_norm_eval(shape, dtype):
    cases.check_batch_norm_eval(shape, CL, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_instance_norm_fixed_statistics(dtype):
    cases.check_instance_norm_fixed_statistics(NCHW_SHAPES[0], CL, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", ["batch", "group", "instance"])
def test_small_blocks_and_groups(op, dtype, monkeypatch):
    # tiny blocks (16 rows) read in runs of 2 rows of C: several blocks per range (S = 63:
    # the last block of 15 rows, a partial run), block-wise flushes in backward
    monkeypatch.setattr(tuning, "BLOCK_BYTES", 200 * dtype.itemsize)
    monkeypatch.setattr(tuning, "RUN_LANES", 24)
    shape, c = (3, 12, 7, 9), 12
    assert tuning.cl_blocks(c, dtype.itemsize) == (16, 2)
    x, w, b, dy = cases.inputs(shape, dtype, c, CL, offset=3.0)
    fn, ref = cases.op(op, c)
    cases.check_against_reference(cases.run(fn, x, w, b, dy), ref, x, w, b, dy, dtype)


@pytest.mark.parametrize("offset", [1e3, 3e4])
def test_group_and_batch_norm_of_data_far_from_zero(offset):
    cases.check_far_from_zero(CL, offset)


@pytest.mark.parametrize("case", ["outlier_first", "ramp"])
def test_shifted_sums_stay_accurate(case, monkeypatch):
    if case == "ramp":                      # blocks of 8 rows (runs of 2): 288 per sample
        monkeypatch.setattr(tuning, "RUN_LANES", 2 * 16)
        monkeypatch.setattr(tuning, "BLOCK_BYTES", 8 * 16 * 4)
    cases.check_shifted_sums(CL, case)


def test_batch_norm_expanded_grad_and_no_affine():
    import normkit.functional as NF

    x = torch.randn(4, 8, 6, 5).to(memory_format=torch.channels_last).requires_grad_(True)
    NF.batch_norm(x, None, None, training=True).sum().backward()
    xr = x.detach().clone().requires_grad_(True)
    F.batch_norm(xr, None, None, training=True).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(5, 12, 7, 9), (315, 12)], ids=str)
@pytest.mark.parametrize("node", [True, False], ids=["node", "python"])
def test_batch_norm_rows_of_channels_same_bits_on_any_threads(shape, node, dtype,
                                                              monkeypatch):
    # BatchNorm on rows of channels (``columns``): 315 rows in chunks of 16 (the last one
    # 11 rows), each chunk's moments and gradient sums merged in order on one thread, so
    # one thread and three give the same bits; the C++ node and the Python plan alike
    from normkit.backends.cpu import native

    monkeypatch.setattr(tuning, "BLOCK_BYTES", 16 * 12 * dtype.itemsize)
    monkeypatch.setattr(tuning, "RUN_LANES", 48)                   # runs of 4 rows
    assert tuning.cl_blocks(12, dtype.itemsize) == (16, 4)
    x, w, b, dy = cases.inputs(shape, dtype, 12, CL if len(shape) == 4 else "contiguous",
                               offset=2.0)
    fn, ref = cases.op("batch", 12)
    native.switch(node)
    try:
        results = []
        for threads in (1, 3):
            monkeypatch.setattr(torch, "get_num_threads", lambda t=threads: t)
            results.append(cases.run(fn, x, w, b, dy))
            assert ("NormNode" in results[-1][0].grad_fn.name()) == node
    finally:
        native.switch(True)
    cases.same_bits(results[0], results[1], "1 thread against 3")
    cases.check_against_reference(results[1], ref, x, w, b, dy, dtype)
    want = cases.run(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), x, w,
                     b, dy)
    cases.check_against_torch(results[1], want, dtype)


def _formula(x, w, b, dims):
    """The normalization over ``dims`` with per-channel w and b, in torch ops (the oracle
    where torch's own kernels are wrong)."""
    view = [1, -1] + [1] * (x.dim() - 2)
    mean = x.mean(dims, keepdim=True)
    var = x.var(dims, keepdim=True, unbiased=False)
    return (x - mean) / torch.sqrt(var + 1e-5) * w.view(view) + b.view(view)


def _assert_within(got, want, names, what, bound=1e-6):
    """Each of ``got`` within ``bound`` of ``want``, relative to its largest value."""
    for name, g, e in zip(names, got, want):
        err = ((g - e).abs().max() / e.abs().max()).item()
        assert err < bound, f"{what} {name}: relative error {err:.1e}"


@pytest.mark.parametrize("shape", [(1, 3, 5, 5), (1, 16, 24, 24), (2, 16, 24, 24)], ids=str)
def test_instance_norm_of_channels_last_gradients(shape):
    """InstanceNorm of channels_last input with a channels_last gradient (what autograd
    hands back through a channels_last model), one sample among them: y, dx and dweight
    against float64 autograd of the formula. torch 2.13's ``F.instance_norm`` gets this
    backward wrong for one sample (dx off by more than 100 %), so torch is no oracle here."""
    import normkit.functional as NF

    gen = torch.Generator().manual_seed(0)
    x, dy = (torch.randn(shape, generator=gen).to(memory_format=torch.channels_last)
             for _ in range(2))
    w, b = torch.rand(shape[1], generator=gen) + 0.5, torch.randn(shape[1], generator=gen)

    def run(fn, dtype):
        xi, wi = (t.to(dtype).detach().requires_grad_() for t in (x, w))
        y = fn(xi, wi, b.to(dtype))
        y.backward(dy.to(dtype))
        return [t.detach().double() for t in (y, xi.grad, wi.grad)]

    want = run(lambda x, w, b: _formula(x, w, b, (2, 3)), torch.float64)
    for got in (run(lambda x, w, b: NF.instance_norm(x, weight=w, bias=b), torch.float32),
                run(lambda x, w, b: NF.instance_norm(x, weight=w, bias=b), torch.float64)):
        _assert_within(got, want, ("y", "dx", "dweight"), shape)


@pytest.mark.parametrize("shape, strides", [((2, 3, 1, 4), (12, 1, 1, 3)),
                                            ((2, 3, 4, 1), (12, 1, 3, 1)),
                                            ((2, 3, 1, 4), (12, 1, 99, 3)),
                                            ((1, 3, 1, 1, 5), (15, 1, 1, 1, 3))], ids=str)
def test_batch_norm_of_channels_last_with_odd_strides_on_size_one_dims(shape, strides):
    """BatchNorm of a channels_last input whose size-1 dims have strides other than the
    canonical ones (what a transpose or permute leaves there), with a contiguous gradient:
    dx, dweight and dbias against float64 autograd of the formula. torch 2.13's CPU
    ``F.batch_norm`` backward gets these wrong (dweight and dbias off by 100 % and more),
    so torch is no oracle here."""
    import normkit.functional as NF

    gen = torch.Generator().manual_seed(0)
    x = torch.empty_strided(shape, strides).copy_(torch.randn(shape, generator=gen))
    dy = torch.randn(shape, generator=gen)
    w, b = torch.rand(shape[1], generator=gen) + 0.5, torch.randn(shape[1], generator=gen)
    dims = [0] + list(range(2, len(shape)))

    def run(fn, dtype):
        xi = (x.double().contiguous() if dtype == torch.float64
              else x.clone(memory_format=torch.preserve_format)).requires_grad_()
        wi, bi = (t.to(dtype).requires_grad_() for t in (w, b))
        assert xi.stride() == strides or dtype == torch.float64
        fn(xi, wi, bi).backward(dy.to(dtype))
        return [t.detach().double() for t in (xi.grad, wi.grad, bi.grad)]

    want = run(lambda x, w, b: _formula(x, w, b, dims), torch.float64)
    got = run(lambda x, w, b: NF.batch_norm(x, None, None, w, b, training=True), torch.float32)
    _assert_within(got, want, ("dx", "dweight", "dbias"), f"{shape} {strides}")


@pytest.mark.parametrize("groups", [1, 2])
def test_group_norm_of_channels_last_gradients_of_the_parameters_alone(groups):
    """GroupNorm of a channels_last input that needs no gradient (a frozen stem before it,
    or norm-only fine-tuning): dweight and dbias against float64 autograd on NCHW memory.
    torch 2.13's CPU ``F.group_norm`` backward crashes the process here (a segmentation
    fault), so torch is no oracle."""
    import normkit.functional as NF

    gen = torch.Generator().manual_seed(0)
    shape = (2, 4, 16, 16)
    x = torch.randn(shape, generator=gen).to(memory_format=torch.channels_last)
    dy = torch.randn(shape, generator=gen)
    w, b = torch.rand(4, generator=gen) + 0.5, torch.randn(4, generator=gen)

    def run(fn, xi, dtype):
        wi, bi = (t.to(dtype).requires_grad_() for t in (w, b))
        fn(xi, groups, wi, bi).backward(dy.to(dtype))
        return [t.grad.double() for t in (wi, bi)]

    want = run(torch.nn.functional.group_norm, x.double().contiguous(), torch.float64)
    _assert_within(run(NF.group_norm, x, torch.float32), want, ("dweight", "dbias"), groups)
