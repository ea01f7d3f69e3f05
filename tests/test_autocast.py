"""normkit's operators under autocast (``normkit.autocast``): the CUDA rule is registered
and gives torch's CUDA dtypes (fp32 for LayerNorm, RMSNorm and GroupNorm; the input's
for Batch/InstanceNorm). Without a GPU the same kernel is registered for the CPU autocast
key inside a test, so that the path from the public ops through the dispatcher runs here;
``benchmarks/gpu_check.py`` compares the CUDA dtypes with torch's on a GPU."""

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import normkit.functional as NF  # noqa: E402
from normkit import autocast  # noqa: E402

from conftest import assert_close  # noqa: E402


def test_cuda_rule_is_registered():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("normkit::norm_forward",
                                                          "AutocastCUDA")


@pytest.mark.parametrize("kind,fp32", [("layer", True), ("group", True), ("batch", False),
                                       ("instance", False)])
def test_inputs_cast_as_torch_casts_them(kind, fp32):
    x = torch.randn(2, 3, dtype=torch.float16)
    w, b = torch.randn(3, dtype=torch.bfloat16), torch.randn(3, dtype=torch.float64)
    cx, cw, cb = autocast.autocast_inputs(x, w, b, kind)
    assert (cx.dtype, cw.dtype) == ((torch.float32,) * 2 if fp32 else (x.dtype, w.dtype))
    assert cb.dtype == torch.float64                       # fp64 is never cast
    assert autocast.autocast_inputs(x, None, None, kind)[1:] == (None, None)


@pytest.fixture
def cpu_rule():
    """The CUDA rule registered for the CPU autocast key, for this test only."""
    lib = torch.library.Library("normkit", "IMPL")
    kernel = autocast.autocast_kernel("AutocastCPU", torch.ops.normkit.norm_forward.default)
    lib.impl("norm_forward", kernel, "AutocastCPU")
    yield
    lib._destroy()


def _run(op, x, w, b):
    c = x.shape[1] if op in ("group_norm", "batch_norm", "instance_norm") else x.shape[-1]
    return {"layer_norm": lambda lib: lib.layer_norm(x, (c,), w, b),
            "rms_norm": lambda lib: lib.rms_norm(x, (c,), w),
            "group_norm": lambda lib: lib.group_norm(x, 2, w, b),
            "batch_norm": lambda lib: lib.batch_norm(x, None, None, w, b, training=True),
            "instance_norm": lambda lib: lib.instance_norm(x, weight=w, bias=b)}[op]


@pytest.mark.parametrize("op,expected", [("layer_norm", torch.float32),
                                         ("rms_norm", torch.float32),
                                         ("group_norm", torch.float32),
                                         ("batch_norm", torch.bfloat16),
                                         ("instance_norm", torch.bfloat16)])
def test_public_ops_under_autocast(cpu_rule, op, expected):
    x = torch.randn(4, 6, 5, dtype=torch.bfloat16, requires_grad=True)
    c = x.shape[1] if op in ("group_norm", "batch_norm", "instance_norm") else x.shape[-1]
    w = torch.randn(c, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(c, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = _run(op, x, w, b)(NF)
    assert y.dtype == expected
    ref = _run(op, x.float(), w.float(), b.float())(F) if expected == torch.float32 \
        else _run(op, x, w, b)(F)
    assert_close(y, ref.to(expected), dtype=torch.bfloat16)
    gx, gw = torch.autograd.grad(y.float().sum() + (y.float() ** 2).sum(), (x, w))
    assert gx.dtype == x.dtype and gw.dtype == w.dtype
