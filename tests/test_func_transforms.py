"""torch.func transforms (vmap, grad, jacrev, jvp) and forward-mode AD on normkit's layers
and functional ops, against torch.nn's under the same transform: per-sample gradients,
model ensembling, Jacobians. Under a transform every call takes the composite torch ops
(``normkit.autograd.transformed``); without one the kernels run, so each test also shows
that the transform did not leave a kernel's output behind (a dropped tangent, a C++ node
under ``grad``)."""

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.autograd import forward_ad  # noqa: E402
from torch.func import (functional_call, grad, jacrev, jvp, stack_module_state,  # noqa: E402
                        vmap)

import normkit.functional as nF  # noqa: E402
import normkit.nn as nknn  # noqa: E402

# (class name, constructor arguments, one sample's shape): each exists in torch.nn too
LAYERS = [
    ("LayerNorm", (7,), (5, 7)),
    ("RMSNorm", (7,), (5, 7)),
    ("GroupNorm", (2, 6), (6, 3, 4)),
    ("InstanceNorm1d", (6, 1e-5, 0.1, True), (6, 9)),
    ("InstanceNorm2d", (6, 1e-5, 0.1, True), (6, 3, 4)),
    ("BatchNorm1d", (6,), (6, 9)),
    ("BatchNorm2d", (6,), (6, 3, 4)),
]


def _pair(name, args, train=False):
    """A normkit layer and torch.nn's with the same (non-default) affine parameters."""
    gen = torch.Generator().manual_seed(1)
    ours, theirs = getattr(nknn, name)(*args), getattr(nn, name)(*args)
    with torch.no_grad():
        for p, q in zip(ours.parameters(), theirs.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + 1)
            q.copy_(p)
    return ours.train(train), theirs.train(train)


def _batch(shape, n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=gen) * 2 + 0.5


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,args,shape", LAYERS)
def test_per_sample_gradients(name, args, shape):
    """vmap(grad) over the parameters, one sample at a time (eval for BatchNorm: a batch
    of one has no batch statistics), as DP-SGD and Opacus compute them."""
    ours, theirs = _pair(name, args)
    xs = _batch((1, *shape))

    def per_sample(module):
        params = {k: v.detach() for k, v in module.named_parameters()}
        buffers = dict(module.named_buffers())

        def loss(p, x):
            return functional_call(module, (p, buffers), (x,)).pow(3).sum()
        return vmap(grad(loss), in_dims=(None, 0))(params, xs)

    got, want = per_sample(ours), per_sample(theirs)
    assert got.keys() == want.keys() and got
    for k in got:
        _close(got[k], want[k])


@pytest.mark.parametrize("name,args,shape", LAYERS)
def test_jacobian_and_vmap(name, args, shape):
    """jacrev of the output by the input, and vmap over a leading dim of inputs."""
    ours, theirs = _pair(name, args, train=name.startswith("Batch"))
    x = _batch(shape, n=3)
    if name.startswith("Batch"):            # batch statistics: no running buffers to update
        ours.track_running_stats = theirs.track_running_stats = False
        ours.running_mean = ours.running_var = theirs.running_mean = theirs.running_var = None
    _close(jacrev(ours)(x), jacrev(theirs)(x))
    stacked = _batch(x.shape, n=2, seed=3)
    _close(vmap(ours)(stacked), vmap(theirs)(stacked))


@pytest.mark.parametrize("name,args,shape", LAYERS)
def test_forward_mode(name, args, shape):
    """torch.func.jvp and eager forward AD: the tangent of the output, never dropped."""
    ours, theirs = _pair(name, args, train=True)
    x, t = _batch(shape, n=3), _batch(shape, n=3, seed=5)
    _close(jvp(ours.eval(), (x,), (t,))[1], jvp(theirs.eval(), (x,), (t,))[1])
    tangents = []
    for module in (ours.train(), theirs.train()):
        with forward_ad.dual_level():
            tangent = forward_ad.unpack_dual(module(forward_ad.make_dual(x, t))).tangent
        assert tangent is not None, type(module).__module__
        tangents.append(tangent)
    _close(*tangents)
    if name.startswith("Batch"):            # the running statistics updated as torch's
        _close(ours.running_var, theirs.running_var)


def test_functional_ops_under_vmap_equal_a_loop():
    """The functional ops without a torch.nn twin (the residual-add norms, a model's RMSNorm
    casting rule, BatchRenorm, normalize, a fused BatchNorm+activation) under vmap equal
    the same op called on each sample (the kernels)."""
    x, r = _batch((5, 8)), _batch((5, 8), seed=1)
    w = torch.rand(8) + 0.5
    rm, rv = torch.zeros(8), torch.ones(8)
    cases = [
        (lambda a, b: nF.add_layer_norm(a, b, (8,), w, w)[0], (x, r)),
        (lambda a, b: nF.add_rms_norm(a, b, (8,), w)[1], (x, r)),
        (lambda a: nF.rms_norm(a.bfloat16(), (8,), w, 1e-6, casting="llama").float(), (x,)),
        (lambda a: nF.rms_norm(a, (8,), w, 1e-6, offset=1.0, casting="gemma"), (x,)),
        (lambda a: nF.normalize(a, dims=(0,)), (x,)),
        (lambda a: nF.batch_renorm(a, rm, rv, w, w, training=False), (x,)),
        (lambda a: nF.batch_norm_act(a, rm, rv, w, w, activation="silu"), (x,)),
    ]
    for f, args in cases:
        looped = torch.stack([f(*(a[i] for a in args)) for i in range(len(x))])
        _close(vmap(f)(*args), looped)


def test_ensemble_trains_batch_norm_like_torch():
    """Model ensembling (stack_module_state, vmap over parameters and buffers): training
    BatchNorms update each model's running statistics, as torch.nn's do."""
    out = []
    for norm in (nknn.BatchNorm1d, nn.BatchNorm1d):
        torch.manual_seed(0)
        models = [nn.Sequential(nn.Conv1d(4, 6, 3), norm(6), nn.ReLU()) for _ in range(3)]
        params, buffers = stack_module_state(models)
        base = copy.deepcopy(models[0]).to("meta")
        y = vmap(lambda p, b, x: functional_call(base, (p, b), (x,)),
                 in_dims=(0, 0, None))(params, buffers, _batch((4, 9)))
        out.append((y, buffers["1.running_mean"], buffers["1.running_var"]))
    for got, want in zip(*out):
        _close(got, want)
    assert not torch.equal(out[0][1][0], out[0][1][1])      # each model its own statistics


def test_unbatched_running_statistics_under_vmap_say_what_to_do():
    layer = nknn.BatchNorm1d(6)
    with pytest.raises(RuntimeError, match="track_running_stats=False"):
        vmap(layer)(_batch((4, 6, 9), n=2))
    layer.eval()                                             # eval: fine, as torch's
    _close(vmap(layer)(_batch((4, 6, 9), n=2)),
           vmap(nn.BatchNorm1d(6).eval())(_batch((4, 6, 9), n=2)))
