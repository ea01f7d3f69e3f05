"""normkit.nn layers against torch.nn: signatures, attributes, state_dicts, several training
steps and eval, every flag combination, dtypes, layouts, errors and checkpoints."""

import copy
import inspect
import itertools

import pytest
from conftest import ARTICLE_OUTPUT, assert_close

torch = pytest.importorskip("torch")
from torch import nn as tnn  # noqa: E402

import normkit.nn as nknn  # noqa: E402
from normkit.cli.explain.drawing import WORKED_INPUT  # noqa: E402

NAMES = ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "InstanceNorm1d", "InstanceNorm2d",
         "InstanceNorm3d", "LayerNorm", "GroupNorm", "RMSNorm"]


@pytest.mark.parametrize("name", NAMES)
def test_constructor_signature_is_torchs(name):
    ours = inspect.signature(getattr(nknn, name).__init__).parameters
    theirs = inspect.signature(getattr(tnn, name).__init__).parameters
    assert list(ours)[:len(theirs)] == list(theirs)
    # normkit's own options come after torch's, keyword-only (RMSNorm's offset and casting,
    # BatchNorm's fused activation)
    extra = list(ours)[len(theirs):]
    assert all(ours[k].kind is inspect.Parameter.KEYWORD_ONLY for k in extra), extra
    own = {"RMSNorm": ["offset", "casting"], "BatchNorm1d": ["activation", "negative_slope"],
           "BatchNorm2d": ["activation", "negative_slope"],
           "BatchNorm3d": ["activation", "negative_slope"]}
    assert extra == own.get(name, [])
    for key in theirs:
        assert ours[key].kind == theirs[key].kind, key
        assert ours[key].default == theirs[key].default, key


def _flag_sets(name):
    if name.startswith("BatchNorm"):
        return [dict(affine=a, track_running_stats=t, bias=b, momentum=m)
                for a, t, b, m in itertools.product([True, False], [True, False], [True, False],
                                                    [0.1, None])
                if a or b]
    if name.startswith("InstanceNorm"):
        return [dict(affine=a, track_running_stats=t, bias=b)
                for a, t, b in itertools.product([True, False], [True, False], [True, False])
                if a or b]
    if name == "LayerNorm":
        return [dict(elementwise_affine=a, bias=b) for a, b in
                [(True, True), (True, False), (False, True)]]
    if name == "GroupNorm":
        return [dict(affine=a, bias=b) for a, b in [(True, True), (True, False), (False, True)]]
    return [dict(elementwise_affine=a, eps=e) for a in (True, False) for e in (None, 1e-6)]


# positional constructor arguments and input shapes (odd sizes, several ranks)
SPECS = {
    "BatchNorm1d": [((5,), (7, 5)), ((3,), (4, 3, 9))],
    "BatchNorm2d": [((3,), (4, 3, 5, 7))],
    "BatchNorm3d": [((2,), (3, 2, 3, 4, 5))],
    "InstanceNorm1d": [((3,), (4, 3, 9))],
    "InstanceNorm2d": [((3,), (2, 3, 5, 7))],
    "InstanceNorm3d": [((2,), (2, 2, 3, 4, 5))],
    "LayerNorm": [((13,), (3, 5, 13)), (([4, 6],), (2, 3, 4, 6)), ((1536,), (2, 1536))],
    "GroupNorm": [((2, 6), (3, 6, 5, 4)), ((3, 3), (2, 3, 7)), ((1, 4), (2, 4))],
    "RMSNorm": [((13,), (3, 5, 13)), (([4, 6],), (2, 3, 4, 6))],
}
CASES = [(name, args, shape, flags) for name in NAMES for args, shape in SPECS[name]
         for flags in _flag_sets(name)]


def _pair(name, args, flags, dtype=torch.float32):
    torch.manual_seed(0)
    theirs = getattr(tnn, name)(*args, **flags, dtype=dtype)
    ours = getattr(nknn, name)(*args, **flags, dtype=dtype)
    # random affine parameters so that they matter
    with torch.no_grad():
        for p_t, p_o in zip(theirs.parameters(), ours.parameters()):
            p_t.copy_(torch.rand_like(p_t) + 0.5)
            p_o.copy_(p_t)
    return ours, theirs


def _ids(case):
    name, args, shape, flags = case
    return f"{name}-{shape}-" + "-".join(f"{k}={v}" for k, v in flags.items())


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_attributes_repr_and_state_dict_match(case):
    name, args, _, flags = case
    ours, theirs = _pair(name, args, flags)
    assert repr(ours) == repr(theirs)
    so, st = ours.state_dict(), theirs.state_dict()
    assert list(so) == list(st)
    for k in st:
        assert so[k].dtype == st[k].dtype and so[k].shape == st[k].shape, k
    for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats",
                 "normalized_shape", "elementwise_affine", "num_groups", "num_channels"):
        if hasattr(theirs, attr):
            assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert [n for n, _ in ours.named_buffers()] == [n for n, _ in theirs.named_buffers()]
    assert type(ours)._version == type(theirs)._version


def _steps(ours, theirs, shape, dtype, steps=3, memory_format=None):
    """Train both for a few steps, then eval; compare outputs, grads and buffers."""
    for step in range(steps + 1):
        training = step < steps
        ours.train(training)
        theirs.train(training)
        g = torch.Generator().manual_seed(step)
        x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 1).to(dtype)
        if memory_format is not None:
            x = x.to(memory_format=memory_format)
        xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        yo, yt = ours(xo), theirs(xt)
        assert yo.dtype == yt.dtype and yo.shape == yt.shape
        assert_close(yo, yt, dtype, msg=f"output, step {step}")
        up = torch.randn(yt.shape, generator=g, dtype=torch.float64).to(dtype)
        yo.backward(up)
        yt.backward(up)
        assert_close(xo.grad, xt.grad, dtype, grad=True, msg=f"input grad, step {step}")
        for (n, po), (_, pt) in zip(ours.named_parameters(), theirs.named_parameters()):
            assert_close(po.grad, pt.grad, dtype, grad=True, msg=f"{n}.grad, step {step}")
            po.grad = pt.grad = None
        for (n, bo), (_, bt) in zip(ours.named_buffers(), theirs.named_buffers()):
            if bt.dtype == torch.long:
                assert torch.equal(bo, bt), n
            else:
                assert_close(bo, bt, dtype, msg=f"{n}, step {step}")
    return yo


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_training_steps_then_eval_match_torch(case):
    name, args, shape, flags = case
    ours, theirs = _pair(name, args, flags, torch.float64)
    _steps(ours, theirs, shape, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", NAMES)
def test_dtypes_match_torch(name, dtype):
    args, shape = SPECS[name][0]
    flags = _flag_sets(name)[0]
    ours, theirs = _pair(name, args, flags, dtype)
    _steps(ours, theirs, shape, dtype, steps=2)


@pytest.mark.parametrize("name", ["BatchNorm2d", "InstanceNorm2d", "GroupNorm"])
def test_channels_last_keeps_memory_format(name):
    args = {"GroupNorm": (2, 4)}.get(name, (4,))
    flags = {"InstanceNorm2d": dict(affine=True, track_running_stats=True)}.get(name, {})
    ours, theirs = _pair(name, args, flags)
    y = _steps(ours, theirs, (3, 4, 5, 6), torch.float32, steps=2,
               memory_format=torch.channels_last)
    assert y.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("name,shape", [("InstanceNorm1d", (3, 9)), ("InstanceNorm2d", (3, 4, 5)),
                                        ("InstanceNorm3d", (3, 2, 4, 5))])
def test_instance_norm_without_batch_dim(name, shape):
    ours, theirs = _pair(name, (3,), dict(affine=True, track_running_stats=True))
    _steps(ours, theirs, shape, torch.float32, steps=2)


@pytest.mark.parametrize("name,args,shape", [("BatchNorm2d", (3,), (0, 3, 4, 4)),
                                             ("BatchNorm1d", (3,), (0, 3)),
                                             ("LayerNorm", (5,), (0, 5)),
                                             ("GroupNorm", (1, 3), (0, 3, 4)),
                                             ("InstanceNorm1d", (3,), (0, 3, 4))])
def test_zero_size_batch(name, args, shape):
    ours, theirs = _pair(name, args, {})
    _steps(ours, theirs, shape, torch.float32, steps=1)


@pytest.mark.parametrize("name,args,shape", [("GroupNorm", (2, 4), (2, 4, 0, 5)),
                                             ("InstanceNorm2d", (4,), (0, 4, 3, 5)),
                                             ("InstanceNorm2d", (4,), (2, 4, 0, 5)),
                                             ("BatchNorm2d", (4,), (2, 4, 0, 5)),
                                             ("LayerNorm", (5,), (2, 0, 5))])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_groups_of_no_element(name, args, shape, train):
    # an empty output, and the parameters' gradients are sums over no element: 0. torch 2.13
    # gives GroupNorm's as NaN, and raises IndexError for InstanceNorm on a batch of 0
    flags = dict(affine=True, track_running_stats=True) if "Instance" in name else {}
    layer = getattr(nknn, name)(*args, **flags).train(train)
    x = torch.randn(shape, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.shape == x.shape and x.grad.shape == x.shape
    for p in layer.parameters():
        assert torch.equal(p.grad, torch.zeros_like(p)), name


def test_momentum_none_is_cumulative_average():
    ours = nknn.BatchNorm1d(2, momentum=None, dtype=torch.float64)
    xs = [torch.randn(6, 2, dtype=torch.float64) + i for i in range(4)]
    for x in xs:
        ours(x)
    means = torch.stack([x.mean(0) for x in xs]).mean(0)
    torch.testing.assert_close(ours.running_mean, means)
    assert int(ours.num_batches_tracked) == 4


# --- errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("make,call,err", [
    (lambda m: m.BatchNorm1d(3), lambda layer: layer(torch.randn(1, 3)), ValueError),
    (lambda m: m.BatchNorm2d(3), lambda layer: layer(torch.randn(1, 3, 1, 1)), ValueError),
    (lambda m: m.BatchNorm2d(3), lambda layer: layer(torch.randn(2, 3)), ValueError),
    (lambda m: m.BatchNorm1d(3), lambda layer: layer(torch.randn(2, 3, 4, 5)), ValueError),
    (lambda m: m.InstanceNorm2d(3), lambda layer: layer(torch.randn(3, 4)), ValueError),
    (lambda m: m.InstanceNorm1d(3, affine=True), lambda layer: layer(torch.randn(2, 4, 5)),
     ValueError),
    (lambda m: m.LayerNorm(5), lambda layer: layer(torch.randn(3, 4)), RuntimeError),
    (lambda m: m.RMSNorm([2, 5]), lambda layer: layer(torch.randn(3, 5)), RuntimeError),
    (lambda m: m.GroupNorm(2, 4), lambda layer: layer(torch.randn(4)), RuntimeError),
    (lambda m: m.GroupNorm(2, 4), lambda layer: layer(torch.randn(2, 6, 3)), RuntimeError),
    (lambda m: m.BatchNorm1d(4, momentum="a"), lambda layer: layer(torch.randn(3, 4)), TypeError),
])
def test_errors_have_torchs_types(make, call, err):
    for lib in (tnn, nknn):
        layer = make(lib)
        with pytest.raises(err):
            call(layer)


def test_error_messages_say_what_and_how():
    with pytest.raises(ValueError, match=r"num_channels \(4\).*num_groups \(3\).*\[1, 2, 4\]"):
        nknn.GroupNorm(3, 4)
    with pytest.raises(ValueError, match="larger batch.*GroupNorm"):
        nknn.BatchNorm1d(3)(torch.randn(1, 3))
    with pytest.raises(RuntimeError, match=r"normalized_shape=\[5\].*\[3, 4\]"):
        nknn.LayerNorm(5)(torch.randn(3, 4))
    with pytest.raises(TypeError, match="momentum must be a number or None, got str 'a'"):
        nknn.BatchNorm1d(4, momentum="a")(torch.randn(3, 4))
    x, theirs = torch.randn(3, 4), tnn.BatchNorm1d(4, momentum=torch.tensor(0.2))
    ours = nknn.BatchNorm1d(4, momentum=torch.tensor(0.2))   # (a one-element tensor: as torch)
    torch.testing.assert_close(ours(x), theirs(x))
    torch.testing.assert_close(ours.running_mean, theirs.running_mean)
    with pytest.raises(ValueError, match="expected 4D input \\(got 2D"):
        nknn.BatchNorm2d(3)(torch.randn(2, 3))
    for train in (True, False):          # (a training call keeps a plan: it is not asked)
        with pytest.raises(RuntimeError, match="running_mean should contain 5 elements not 4"):
            nknn.BatchNorm2d(4).train(train)(torch.randn(2, 5, 3, 3))
    # nothing per channel: like torch, any channel count
    x = torch.randn(2, 5, 3, 3)
    torch.testing.assert_close(nknn.BatchNorm2d(4, affine=False, track_running_stats=False)(x),
                               tnn.BatchNorm2d(4, affine=False, track_running_stats=False)(x))


@pytest.mark.parametrize("make", [lambda e: nknn.BatchNorm2d(3, eps=e),
                                  lambda e: nknn.LayerNorm(3, eps=e),
                                  lambda e: nknn.GroupNorm(1, 3, eps=e),
                                  lambda e: nknn.InstanceNorm1d(3, eps=e),
                                  lambda e: nknn.RMSNorm(3, eps=e)])
@pytest.mark.parametrize("eps", [0, -1e-5, float("nan")])
def test_non_positive_eps_is_refused(make, eps):
    with pytest.raises(ValueError, match="eps must be a positive"):
        make(eps)


# --- checkpoints ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip(name):
    args, shape = SPECS[name][0]
    flags = {"InstanceNorm": dict(affine=True, track_running_stats=True)}.get(name[:12], {})
    theirs = getattr(tnn, name)(*args, **flags)
    theirs.train()
    theirs(torch.randn(shape) * 3 + 1)  # move the running statistics off their defaults
    ours = getattr(nknn, name)(*args, **flags)
    ours.load_state_dict(theirs.state_dict())
    back = getattr(tnn, name)(*args, **flags)
    back.load_state_dict(ours.state_dict())
    for k, v in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v) and torch.equal(back.state_dict()[k], v), k
    ours.eval(), theirs.eval()
    x = torch.randn(shape)
    torch.testing.assert_close(ours(x), theirs(x))


def test_old_checkpoint_without_num_batches_tracked_loads():
    theirs = tnn.BatchNorm2d(3)
    sd = theirs.state_dict()
    del sd["num_batches_tracked"]
    sd._metadata[""]["version"] = 1  # written before num_batches_tracked existed
    for lib in (tnn, nknn):
        layer = lib.BatchNorm2d(3)
        layer.load_state_dict(sd)  # strict: would fail without the version fix-up
        assert int(layer.num_batches_tracked) == 0


def test_pre_0_4_instance_norm_checkpoint_is_reported():
    sd = tnn.InstanceNorm2d(3, track_running_stats=True).state_dict()
    sd._metadata[""]["version"] = None
    for lib in (tnn, nknn):
        with pytest.raises(RuntimeError, match="running stats"):
            lib.InstanceNorm2d(3).load_state_dict(sd)


def test_deepcopy_and_reset_parameters():
    m = nknn.BatchNorm1d(4)
    m(torch.randn(8, 4) + 5)
    c = copy.deepcopy(m)
    assert torch.equal(c.running_mean, m.running_mean)
    c.reset_parameters()
    assert torch.equal(c.running_mean, torch.zeros(4)) and int(c.num_batches_tracked) == 0


# --- the worked example of the source articles ----------------------------------------------

def test_source_articles_layer_norm_example():
    x = torch.from_numpy(WORKED_INPUT).float()
    expected = torch.from_numpy(ARTICLE_OUTPUT).float()
    y = nknn.LayerNorm(5)(x)
    assert torch.equal(y.detach().round(decimals=4), expected)


def test_torch_jit_script_says_what_to_do_and_the_recipe_works():
    """torch.jit.script of a model holding normkit layers raises an error naming the layer
    and the way out (``_base.refuse_script``; TorchScript's own error pointed inside the
    layer's Python); a reverted copy scripts, equals the model, and leaves it converted."""
    import warnings

    import normkit

    torch.manual_seed(0)
    model = tnn.Sequential(tnn.Conv2d(3, 4, 3), tnn.BatchNorm2d(4), tnn.GroupNorm(2, 4),
                           tnn.InstanceNorm2d(4), tnn.Flatten(1), tnn.LayerNorm(144),
                           tnn.RMSNorm(144)).eval()
    normkit.convert(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)      # (TorchScript's own)
        with pytest.raises(RuntimeError, match=r"cannot compile normkit's BatchNorm2d.*"
                                               r"normkit\.revert\(scripted\)"):
            torch.jit.script(model)
        scripted = copy.deepcopy(model)
        normkit.revert(scripted)
        scripted = torch.jit.script(scripted)
    assert [type(m).__name__ for m in model if type(m).__module__.startswith("normkit.")] == [
        "BatchNorm2d", "GroupNorm", "InstanceNorm2d", "LayerNorm", "RMSNorm"]
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(scripted(x), model(x), rtol=1e-5, atol=1e-5)
