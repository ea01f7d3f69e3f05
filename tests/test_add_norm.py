"""The residual-add norms ``add_layer_norm`` / ``add_rms_norm`` and their memory-saving
backward on CPU against torch's ``F.layer_norm(x + r)`` / ``F.rms_norm(x + r)`` (values
and gradients), the one-pass CPU route against normkit's own add followed by the norm (the
same bits), plus the zero-weight fallback, the switch, double backward and errors. The fused CUDA kernels of the same ops are checked in
``tests/test_gpu_kernels.py`` (interpreter and ``TestCuda``).
"""

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import normkit.functional as NF  # noqa: E402
from normkit import backends  # noqa: E402

from conftest import assert_close  # noqa: E402

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


@pytest.mark.parametrize("op", ["layer", "rms"])
@pytest.mark.parametrize("shape", [(5, 37), (300, 257)], ids=str)   # serial; threaded
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("use_h", [True, False], ids=["y_and_h", "y_only"])
def test_cpu_add_norm_is_one_pass_with_the_bits_of_add_then_norm(op, shape, dtype, use_h,
                                                                  monkeypatch):
    # the executor's one pass (x and r read once, h and y written together; dh = the
    # norm's gradient rounded, plus h's own) gives exactly what x + r followed by
    # normkit's norm gives, forward and backward
    from normkit.backends.cpu import tuning

    monkeypatch.setattr(tuning, "ONE_PASS_ADD", 0)                # every size in one pass
    g = torch.Generator().manual_seed(0)
    k = shape[-1]
    x, r, gy, gh = (torch.randn(shape, generator=g).to(dtype) for _ in range(4))
    w = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    b = (0.1 * torch.randn(k, generator=g)).to(dtype) if op == "layer" else None
    params = [w] + ([b] if b is not None else [])
    grads = []
    for fused in (True, False):
        xs, rs = x.clone().requires_grad_(True), r.clone().requires_grad_(True)
        ps = [p.clone().requires_grad_(True) for p in params]
        bs = ps[1] if b is not None else None
        if fused:
            y, h = _pair(op, xs, rs, (k,), ps[0], bs)
            assert type(y.grad_fn).__name__ == "AddNormFunctionBackward"
            saved = [t.data_ptr() for t in y.grad_fn.saved_tensors if t is not None]
            assert h.data_ptr() in saved                            # h kept, not x or r
            assert xs.data_ptr() not in saved and rs.data_ptr() not in saved
        else:
            h = xs + rs
            y = (NF.layer_norm(h, (k,), ps[0], bs) if op == "layer"
                 else NF.rms_norm(h, (k,), ps[0]))
        loss = (y.float() * gy.float()).sum() + ((h.float() * gh.float()).sum() if use_h else 0)
        grads.append((y, h, *torch.autograd.grad(loss, (xs, rs, *ps))))
    for got, want in zip(*grads):
        assert torch.equal(got, want)


def test_cpu_add_norm_takes_one_pass_from_the_cache_size(monkeypatch):
    # below tuning.ONE_PASS_ADD (x, r, h and y together) the add and then the norm run,
    # from it the one pass: the same bits either way
    from normkit.backends.cpu import tuning

    x, r = torch.randn(64, 256), torch.randn(64, 256)
    routes = {}
    for limit in (4 * x.numel() * 4 + 4, 4 * x.numel() * 4):
        monkeypatch.setattr(tuning, "ONE_PASS_ADD", limit)
        y, h = NF.add_layer_norm(x.requires_grad_(True), r, (256,))
        routes[limit] = type(y.grad_fn).__name__
    below, above = routes.values()
    assert "AddNorm" not in below and above == "AddNormFunctionBackward", routes


def test_cpu_add_norm_takes_a_residual_of_other_strides(monkeypatch):
    from normkit.backends.cpu import tuning

    monkeypatch.setattr(tuning, "ONE_PASS_ADD", 0)
    x = torch.randn(6, 40)
    r = torch.randn(40, 6).t()                                     # a transposed residual
    y, h = NF.add_layer_norm(x, r, (40,))
    assert torch.equal(h, x + r)
    assert torch.equal(y, NF.layer_norm(x + r, (40,)))


def test_cpu_add_norm_plans_are_layer_plans_only():
    from normkit import grouping as G

    x = torch.randn(4, 3, 5, 5)
    plan = backends.plan(x, G.batch(tuple(x.shape)))
    with pytest.raises(RuntimeError, match="LayerNorm/RMSNorm plans only"):
        plan.add_forward(x, x, None, None, 1e-5)


def test_memory_saving_switch():
    assert not backends.memory_saving_enabled()
    with backends.memory_saving(True):
        assert backends.memory_saving_enabled()
        x = torch.randn(3, 4, requires_grad=True)
        y, _ = NF.add_rms_norm(x, torch.randn(3, 4), (4,), torch.ones(4))
        assert y.grad_fn is not None and "AddNorm" in type(y.grad_fn).__name__
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.data_ptr()),
                                                      lambda p: None):
            y2, h2 = NF.add_rms_norm(x, torch.randn(3, 4), (4,), torch.ones(4),
                                     memory_saving=False)
        assert h2.data_ptr() in saved and y2.data_ptr() not in saved   # the input h, not y
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
    # the memory-saving backward keeps y, not h: it says so where a double backward is asked
    y, _ = NF.add_layer_norm(x, r, (5,), w, memory_saving=True)
    with pytest.raises(RuntimeError, match="call them with memory_saving=False"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)


def test_add_norm_errors():
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="expand_as"):
        NF.add_layer_norm(x, torch.randn(4), (4,))
    with pytest.raises(TypeError, match="dtype"):
        NF.add_rms_norm(x, torch.randn(2, 4, dtype=torch.float64), (4,))
    with pytest.raises(RuntimeError, match="normalized_shape"):
        NF.add_layer_norm(x, torch.randn(2, 4), (3,))
