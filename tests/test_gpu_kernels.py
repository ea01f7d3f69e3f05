"""GPU backend (Triton) and the residual-add norms.

* The Triton kernels run here without a GPU, in Triton's interpreter on CPU tensors:
  ``tests/_triton_interp_check.py`` runs in a subprocess with ``TRITON_INTERPRET=1`` (the
  variable must be set before triton is first imported, and other tests in this process
  may import it normally), one subprocess per case family, and compares every kernel
  with the float64 reference. Skipped when triton is not installed.
* ``add_layer_norm`` / ``add_rms_norm`` (and their memory-saving backward) are checked on
  CPU, through the composite path, against torch's ``F.layer_norm(x + r)``.
* On a machine with CUDA and triton, ``TestCuda`` runs the public ops through the real
  kernels against torch (``benchmarks/gpu_check.sh`` runs it).
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import normkit.functional as NF  # noqa: E402
from normkit import backends  # noqa: E402

from conftest import assert_close  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed "
                                  "(pip install 'normkit[gpu]'); the GPU kernels are untested")
HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------

def test_registered_in_the_dispatch():
    assert "gpu" in backends._OPTIONAL


@needs_triton
def test_never_chosen_for_cpu_tensors_and_no_interpreter_forced():
    env_before = os.environ.get("TRITON_INTERPRET")
    from normkit import grouping as G
    from normkit.backends import gpu

    assert os.environ.get("TRITON_INTERPRET") == env_before
    x = torch.randn(4, 8)
    assert not gpu.supports(x, G.layer(x.shape, 1))
    assert backends.select(x, G.layer(x.shape, 1)) is not gpu


def test_skipped_without_triton():
    """Without triton the module raises ImportError, which the dispatch skips."""
    code = ("import sys, importlib.util as u; u.find_spec = lambda *a, **k: None\n"
            "try:\n    import normkit.backends.gpu\nexcept ImportError: print('skipped')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "skipped", out.stderr


# ---------------------------------------------------------------------------------------
# the kernels, interpreted
# ---------------------------------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("family", ["rows", "add", "units", "dispatch"])
def test_kernels_in_interpreter(family):
    env = dict(os.environ, TRITON_INTERPRET="1")
    src = os.path.join(os.path.dirname(HERE), "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_triton_interp_check.py"),
                           family], env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"checker crashed (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    report = json.loads(lines[-1])
    failed = "\n\n".join(f"{name}:\n{msg}" for name, msg in report["failed"])
    assert not report["failed"], f"{len(report['failed'])} case(s) failed:\n{failed}"
    assert report["passed"]


# ---------------------------------------------------------------------------------------
# residual-add norms on CPU (composite path)
# ---------------------------------------------------------------------------------------

def _pair(op, x, r, k, w, b, **kw):
    if op == "layer":
        return NF.add_layer_norm(x, r, k, w, b, **kw)
    return NF.add_rms_norm(x, r, k, w, **kw)


def _torch(op, x, r, k, w, b):
    h = x + r
    if op == "layer":
        return F.layer_norm(h, k, w, b), h
    return F.rms_norm(h, k, w), h


@pytest.mark.parametrize("op", ["layer", "rms"])
@pytest.mark.parametrize("shape,k", [((3, 7), (7,)), ((5, 130), (130,)),
                                     ((2, 3, 5, 5), (5, 5))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("memory_saving", [False, True])
def test_add_norm_matches_torch(op, shape, k, dtype, memory_saving):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(dtype).requires_grad_(True)
    r = torch.randn(shape, generator=gen).to(dtype).requires_grad_(True)
    w = (torch.rand(k, generator=gen) + 0.5).to(dtype).requires_grad_(True)
    b = torch.randn(k, generator=gen).to(dtype).requires_grad_(True) if op == "layer" else None
    params = [t for t in (x, r, w, b) if t is not None]
    gy = torch.randn(shape, generator=gen).to(dtype)
    gh = torch.randn(shape, generator=gen).to(dtype)
    y, h = _pair(op, x, r, k, w, b, memory_saving=memory_saving)
    grads = torch.autograd.grad((y * gy).sum() + (h * gh).sum(), params)
    ty, th = _torch(op, x, r, k, w, b)
    tgrads = torch.autograd.grad((ty * gy).sum() + (th * gh).sum(), params)
    assert_close(h, th, msg="h")
    assert_close(y, ty, msg="y")
    for name, a, e in zip(("dx", "dresidual", "dweight", "dbias"), grads, tgrads):
        assert_close(a, e, grad=True, msg=name)


@pytest.mark.parametrize("op", ["layer", "rms"])
def test_add_norm_only_one_output_used(op):
    x = torch.randn(4, 9, requires_grad=True)
    r = torch.randn(4, 9, requires_grad=True)
    w = torch.randn(9, requires_grad=True)
    for which in (0, 1):
        with backends.memory_saving(True):
            out = _pair(op, x, r, (9,), w, None)[which]
        gx, gr = torch.autograd.grad(out.sum(), (x, r))
        tx, tr = torch.autograd.grad(_torch(op, x, r, (9,), w, None)[which].sum(), (x, r))
        assert_close(gx, tx, grad=True)
        assert_close(gr, tr, grad=True)


def test_memory_saving_keeps_the_output_not_the_input():
    x = torch.randn(6, 16, requires_grad=True)
    r = torch.randn(6, 16)
    w = torch.rand(16) + 0.5
    y, h = NF.add_layer_norm(x, r, (16,), w, memory_saving=True)
    saved = y.grad_fn.saved_tensors
    saved = [t for t in saved if t is not None]
    assert any(t.data_ptr() == y.data_ptr() for t in saved)
    assert not any(t.data_ptr() == h.data_ptr() for t in saved)


def test_memory_saving_falls_back_when_a_weight_is_zero():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 8, generator=gen, requires_grad=True)
    r = torch.randn(5, 8, generator=gen)
    w = torch.randn(8, generator=gen)
    w[3] = 0.0
    w.requires_grad_(True)
    y, h = NF.add_layer_norm(x, r, (8,), w, memory_saving=True)
    assert any(t is not None and t.data_ptr() == h.data_ptr() for t in y.grad_fn.saved_tensors)
    g = torch.autograd.grad(y.square().sum(), (x, w))
    tg = torch.autograd.grad(F.layer_norm(x + r, (8,), w).square().sum(), (x, w))
    for a, e in zip(g, tg):
        assert torch.isfinite(a).all()
        assert_close(a, e, grad=True)


def test_memory_saving_switch():
    assert not backends.memory_saving_enabled()
    with backends.memory_saving(True):
        assert backends.memory_saving_enabled()
        x = torch.randn(3, 4, requires_grad=True)
        y, _ = NF.add_rms_norm(x, torch.randn(3, 4), (4,), torch.ones(4))
        assert y.grad_fn is not None and "AddNorm" in type(y.grad_fn).__name__
        y2, _ = NF.add_rms_norm(x, torch.randn(3, 4), (4,), torch.ones(4), memory_saving=False)
        assert "AddNorm" not in type(y2.grad_fn).__name__
    assert not backends.memory_saving_enabled()
    backends.memory_saving(True)
    try:
        assert backends.memory_saving_enabled()
    finally:
        backends.memory_saving(False)
    assert not backends.memory_saving_enabled()


def test_add_norm_double_backward_without_memory_saving():
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradgradcheck(lambda a, b, c: NF.add_layer_norm(a, b, (5,), c)[0],
                                 (x, r, w))


def test_add_norm_errors():
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="expand_as"):
        NF.add_layer_norm(x, torch.randn(4), (4,))
    with pytest.raises(TypeError, match="dtype"):
        NF.add_rms_norm(x, torch.randn(2, 4, dtype=torch.float64), (4,))
    with pytest.raises(RuntimeError, match="normalized_shape"):
        NF.add_layer_norm(x, torch.randn(2, 4), (3,))


# ---------------------------------------------------------------------------------------
# on a CUDA machine: the real kernels through the public ops
# ---------------------------------------------------------------------------------------

CUDA = HAS_TRITON and torch.cuda.is_available()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device and triton (benchmarks/gpu_check.sh)")
class TestCuda:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("case", ["layer", "rms", "batch", "batch_eval", "instance",
                                      "group"])
    @pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
    @pytest.mark.parametrize("shape", [(3, 7, 5, 5), (4, 64, 17, 9), (2, 32, 64, 130)])
    def test_ops_match_torch(self, dtype, case, layout, shape):
        from normkit.backends import gpu

        gen = torch.Generator().manual_seed(0)
        x = torch.randn(shape, generator=gen).to("cuda", dtype)
        if layout == "channels_last":
            x = x.contiguous(memory_format=torch.channels_last)
        c = shape[-1] if case in ("layer", "rms") else shape[1]
        w = torch.randn(c, generator=gen).to("cuda", dtype).requires_grad_(True)
        b = torch.randn(c, generator=gen).to("cuda", dtype).requires_grad_(True)
        gy = torch.randn(shape, generator=gen).to("cuda", dtype)
        groups = 1 if shape[1] % 4 else 4
        outs = []
        for lib in (NF, F):
            xi = x.clone().requires_grad_(True)
            rm = torch.zeros(c, device="cuda", dtype=dtype)
            rv = torch.ones(c, device="cuda", dtype=dtype)
            y = {"layer": lambda: lib.layer_norm(xi, (c,), w, b),
                 "rms": lambda: lib.rms_norm(xi, (c,), w),
                 "batch": lambda: lib.batch_norm(xi, rm, rv, w, b, training=True),
                 "batch_eval": lambda: lib.batch_norm(xi, rm + 0.5, rv * 2, w, b),
                 "instance": lambda: lib.instance_norm(xi, weight=w, bias=b),
                 "group": lambda: lib.group_norm(xi, groups, w, b)}[case]()
            y.add_(0.0)            # in place, as ResNet's hidden += residual: not a view
            params = [xi, w] + ([b] if case != "rms" else [])
            outs.append((y, torch.autograd.grad((y.float() * gy.float()).sum(), params),
                         rm, rv))
        gr = _grouping(case, x, groups)
        assert backends.select(x.reshape(gr.view), gr, case != "rms", case == "batch_eval") is gpu
        (y, g, rm, rv), (ty, tg, trm, trv) = outs
        assert_close(y, ty, dtype=dtype)
        for a, e in zip(g, tg):
            assert_close(a, e, dtype=dtype, grad=True)
        assert_close(rm, trm, dtype=dtype)
        assert_close(rv, trv, dtype=dtype)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("k", [7, 4096, 20000])
    @pytest.mark.parametrize("memory_saving", [False, True])
    def test_add_norm_matches_torch(self, dtype, k, memory_saving):
        for op in ("layer", "rms"):
            x = torch.randn(33, k, device="cuda", dtype=dtype, requires_grad=True)
            r = torch.randn(33, k, device="cuda", dtype=dtype, requires_grad=True)
            w = (torch.rand(k, device="cuda") + 0.5).to(dtype).requires_grad_(True)
            b = torch.randn(k, device="cuda", dtype=dtype, requires_grad=True)
            bb = b if op == "layer" else None
            params = [t for t in (x, r, w, bb) if t is not None]
            y, h = _pair(op, x, r, (k,), w, bb, memory_saving=memory_saving)
            assert "AddNorm" in type(y.grad_fn).__name__
            gy, gh = torch.randn_like(y), torch.randn_like(h)
            g = torch.autograd.grad((y * gy).sum() + (h * gh).sum(), params)
            ty, th = _torch(op, x, r, (k,), w, bb)
            tg = torch.autograd.grad((ty * gy).sum() + (th * gh).sum(), params)
            assert_close(y, ty)
            assert_close(h, th)
            for a, e in zip(g, tg):
                assert_close(a, e, grad=True)


def _grouping(case, x, groups):
    from normkit import grouping as G

    if case in ("layer", "rms"):
        return G.layer(x.shape, 1)
    if case.startswith("batch"):
        return G.batch(x.shape)
    return G.instance(x.shape) if case == "instance" else G.group(x.shape, groups)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only machine")
def test_bench_device_cuda_without_a_gpu(capsys):
    from normkit.bench import gpu as bench_gpu

    class Args:
        ops, dtypes, modes, quick, json = ["layer_norm"], ["float32"], ["fwd"], True, False
    assert bench_gpu.main(Args()) == 2
    assert "no CUDA device" in capsys.readouterr().err
