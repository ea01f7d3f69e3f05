"""GPU backend (Triton): the kernels in the interpreter, the dispatch, and on CUDA the public ops.

* The Triton kernels run here without a GPU, in Triton's interpreter on CPU tensors:
  ``tests/_triton_interp_check.py`` runs in a subprocess with ``TRITON_INTERPRET=1`` (the
  variable must be set before triton is first imported, and other tests in this process
  may import it normally), one subprocess per case family, and compares every kernel
  with the float64 reference. Skipped when triton is not installed.
* ``add_layer_norm`` / ``add_rms_norm`` on CPU: ``tests/test_add_norm.py``.
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

from conftest import assert_close, needs_triton_interpreter  # noqa: E402
from test_add_norm import _pair, _torch  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed "
                                  "(pip install 'normkit[gpu]'); the GPU kernels are untested")
HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------

@needs_triton
def test_registered_in_the_dispatch():
    """With triton installed the dispatch loads the GPU backend, last of the optional ones
    (a CPU tensor goes to the CPU backend first), with the interface that the dispatch and
    the residual-add ops call."""
    from normkit.backends import gpu

    found = backends._candidates()
    assert gpu in found and found.index(gpu) == len(found) - 1
    for name in ("supports", "forward", "backward", "fused_add_forward", "fused_add_backward"):
        assert callable(getattr(gpu, name)), name


@needs_triton
def test_never_chosen_for_cpu_tensors_and_no_interpreter_forced():
    env_before = os.environ.get("TRITON_INTERPRET")
    from normkit import grouping as G
    from normkit.backends import gpu

    assert os.environ.get("TRITON_INTERPRET") == env_before
    x = torch.randn(4, 8)
    assert not gpu.supports(x, G.layer(x.shape, 1))
    assert backends.select(x, G.layer(x.shape, 1)) is not gpu


@needs_triton
def test_launches_run_in_the_tensors_device_context(monkeypatch):
    """Triton launches on the current device, not the tensors': each function that
    launches a kernel enters the device context of its first tensor (recorded here in
    place of torch.cuda.device), and no other function of the backend launches one."""
    import ast
    import inspect

    from normkit.backends import gpu

    entered = []

    class Context:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            entered.append("exit")

    class OnCuda1:
        device = torch.device("cuda", 1)

    monkeypatch.setattr(torch.cuda, "device", Context)
    inside = gpu._device_guard(lambda t, a: (list(entered), a))
    assert inside(OnCuda1(), 5) == ([torch.device("cuda", 1)], 5)
    assert entered == [torch.device("cuda", 1), "exit"]
    launchers = {f.name for f in ast.walk(ast.parse(inspect.getsource(gpu)))
                 if isinstance(f, ast.FunctionDef)
                 and any(isinstance(n, ast.Subscript) and isinstance(n.value, ast.Attribute)
                         and n.value.attr.endswith("_kernel") for n in ast.walk(f))}
    guarded = {"rows_forward", "rows_backward", "_nc_forward", "_nc_backward"}
    assert launchers == guarded | {"_launch_affine"}      # called by the _nc_* two only
    assert all(hasattr(getattr(gpu, name), "__wrapped__") for name in guarded)


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

@needs_triton_interpreter
@pytest.mark.parametrize("family", ["rows", "add", "units", "act", "dispatch", "variants"])
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

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("act", ["relu", "relu6", "leaky_relu", "silu"])
    @pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
    @pytest.mark.parametrize("training", [True, False])
    def test_batch_norm_act_matches_torch(self, dtype, act, layout, training):
        """BatchNorm + activation fused in the Triton kernels vs torch's BatchNorm then
        the activation: values, gradients, running statistics."""
        from normkit import grouping as G
        from normkit.activation import resolve
        from normkit.backends import gpu

        shape = (4, 64, 17, 9)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(shape, generator=gen).to("cuda", dtype)
        if layout == "channels_last":
            x = x.contiguous(memory_format=torch.channels_last)
        w = (torch.randn(64, generator=gen) * 4).to("cuda", dtype).requires_grad_(True)
        b = torch.randn(64, generator=gen).to("cuda", dtype).requires_grad_(True)
        gy = torch.randn(shape, generator=gen).to("cuda", dtype)
        outs = []
        for fused in (True, False):
            xi = x.clone().requires_grad_(True)
            rm = torch.full((64,), 0.25, device="cuda", dtype=dtype)
            rv = torch.full((64,), 2.0, device="cuda", dtype=dtype)
            if fused:
                y = NF.batch_norm_act(xi, rm, rv, w, b, training=training, activation=act)
            else:
                y = getattr(F, act)(F.batch_norm(xi, rm, rv, w, b, training=training))
            outs.append((y, torch.autograd.grad((y.float() * gy.float()).sum(), (xi, w, b)),
                         rm, rv))
        gr = G.batch(shape)
        assert backends.select(x.reshape(gr.view), gr, True, not training, resolve(act)) is gpu
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
