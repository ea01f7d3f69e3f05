"""normkit in the PyTorch 2 stack: torch.compile (fullgraph, train and eval, equal to
eager), torch.export (+ save / load) and ONNX (onnxruntime equal to PyTorch), on tiny
transformers models converted with ``normkit.convert``."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import normkit
from normkit import ops

transformers = pytest.importorskip("transformers")


def _siglip():
    cfg = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=1, num_attention_heads=2,
                                          image_size=32, patch_size=8)
    return transformers.SiglipVisionModel(cfg)


def _resnet():
    cfg = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                    layer_type="basic")
    return transformers.ResNetModel(cfg)


MODELS = {"siglip": _siglip, "resnet": _resnet}


def _converted(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    report = normkit.convert(model)
    assert report.swapped, "the model has norms to convert"
    return model


def _loss(out):
    return (out.last_hidden_state ** 2).mean() + out.pooler_output.mean()


def _assert_same_state(a, b, rtol=1e-5, atol=1e-6):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=rtol, atol=atol, msg=n)
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=rtol, atol=atol, msg=n)
    for (n, x), y in zip(a.named_buffers(), b.buffers()):
        torch.testing.assert_close(y, x, rtol=rtol, atol=atol, msg=n)


# inductor (the default backend) once per model; the other paths with aot_eager, which
# traces the same graphs (fake kernels, autograd, functionalization) without the C++
# compilation, to keep the suite short on 2 cores
COMPILE_CASES = [("siglip", True, "inductor"), ("resnet", True, "inductor"),
                 ("resnet", False, "aot_eager"), ("siglip", False, "aot_eager")]


@pytest.mark.parametrize("name, decomposed, backend", COMPILE_CASES,
                         ids=[f"{n}-{'decomposed' if d else 'operator'}-{b}"
                              for n, d, b in COMPILE_CASES])
def test_compile_fullgraph_trains_and_evaluates_as_eager(name, decomposed, backend):
    ops.compile_decomposed(decomposed)
    try:
        _check_compiled_training(name, backend)
    finally:
        ops.compile_decomposed(True)


def _check_compiled_training(name, backend):
    eager = _converted(name).train()
    model = copy.deepcopy(eager)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    opt_c = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        x = torch.randn(4, 3, 32, 32)
        le, lc = _loss(eager(x)), _loss(compiled(x))
        le.backward()
        lc.backward()
        torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
        _assert_same_state(eager, model)
        opt_e.step(), opt_c.step(), opt_e.zero_grad(), opt_c.zero_grad()
    _assert_same_state(eager, model)
    eager.eval(), model.eval()
    with torch.no_grad():
        x = torch.randn(3, 3, 32, 32)
        torch.testing.assert_close(compiled(x).last_hidden_state, eager(x).last_hidden_state,
                                   rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 2  # one graph for training, one for eval: no graph break


@pytest.mark.parametrize("decomposed", [True, False], ids=["decomposed", "operator"])
def test_compiled_autograd_of_a_compiled_training_step_equals_eager(decomposed):
    """A compiled training step whose backward compiled autograd traces: the compiled
    forward holds no autograd node of the C++ executor (which compiled autograd cannot
    trace: a norm left eager in it fails), and gradients and running statistics equal
    eager's."""
    from torch._dynamo.utils import counters

    ops.compile_decomposed(decomposed)
    try:
        eager = _converted("resnet").train()
        model = copy.deepcopy(eager)

        def step(x):
            _loss(model(x)).backward()

        counters["compiled_autograd"].clear()
        with torch._dynamo.config.patch(compiled_autograd=True):
            compiled = torch.compile(step, backend="aot_eager")
            for _ in range(2):
                x = torch.randn(4, 3, 32, 32)
                _loss(eager(x)).backward()
                compiled(x)
                _assert_same_state(eager, model)
        assert counters["compiled_autograd"]["captures"] > 0
    finally:
        ops.compile_decomposed(True)


def test_compile_dynamic_batch_does_not_recompile():
    # (frames compiled by the tests before, in this worker, count toward dynamo's
    # recompile limit for the same code: start from none)
    torch._dynamo.reset()
    model = _converted("siglip").eval()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for batch in (2, 3, 5, 6):
            x = torch.randn(batch, 3, 32, 32)
            torch.testing.assert_close(compiled(x).last_hidden_state,
                                       model(x).last_hidden_state, rtol=1e-5, atol=1e-5)
            if batch == 2:
                first = counter.frame_count
    assert counter.frame_count == first  # batches 3, 5, 6: no recompilation


def test_inductor_with_symbolic_image_sizes():
    # dynamic=True makes the image's height and width symbolic. A norm between two
    # convolutions whose output was a reshape of its (N, C, H * W) view could not be
    # compiled (inductor: "cannot determine truth value of Relational"); the composite
    # now writes y from x in its own shape (torch_ops.forward, own_shape)
    import normkit.nn as nknn
    torch._dynamo.reset()
    torch.manual_seed(0)
    conv = lambda i, o: torch.nn.Conv2d(i, o, 3, padding=1)  # noqa: E731
    model = torch.nn.Sequential(conv(3, 8), nknn.BatchNorm2d(8, activation="relu"), conv(8, 8),
                                nknn.GroupNorm(2, 8), conv(8, 8),
                                nknn.InstanceNorm2d(8, affine=True), conv(8, 2))
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for train in (True, False):
        model.train(train)
        for shape in ((2, 3, 6, 6), (3, 3, 7, 5)):
            x = torch.randn(shape)
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            ya, yb = compiled(xa), model(xb)
            ya.square().sum().backward()
            yb.square().sum().backward()
            torch.testing.assert_close(ya, yb, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-4)


def _normkit_targets(ep):
    return {str(n.target) for n in ep.graph.nodes
            if n.op == "call_function" and "normkit" in str(n.target)}


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", list(MODELS))
def test_export_save_load_round_trip(name, train):
    model = _converted(name).train(train)
    x = torch.randn(2, 3, 32, 32)
    ep = torch.export.export(copy.deepcopy(model), (x,))
    assert _normkit_targets(ep) == {"normkit.norm_forward.default"}
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf).module()
    want = model(x)
    got = loaded(x)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=0, atol=0)
    if train and name == "resnet":  # the running statistics moved as eager's did
        for (n, b), lb in zip(model.named_buffers(), loaded.buffers()):
            torch.testing.assert_close(lb, b, rtol=0, atol=0, msg=n)
    decomposed = ep.run_decompositions(ops.decompositions())
    assert not _normkit_targets(decomposed)
    torch.testing.assert_close(decomposed.module()(x).last_hidden_state,
                               want.last_hidden_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_language_models_export_decomposes_to_aten_ops(dynamic):
    # T5 (its attention: transpose, contiguous, view); normkit's table keeps torch's
    # defaults, without which torch drops the contiguous and the program raises
    from zoo_models import build_language, tokens

    class Logits(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids):
            return self.inner(input_ids=ids, decoder_input_ids=ids).logits

    theirs = Logits(build_language("t5")).eval()
    mine = copy.deepcopy(theirs)
    assert normkit.convert(mine).swapped
    shapes = None
    if dynamic:
        dims = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("seq", min=2, max=64)
        shapes = {"ids": dict(enumerate(dims))}
    ep = torch.export.export(mine, (tokens(2, 12),), dynamic_shapes=shapes)
    decomposed = ep.run_decompositions(ops.decompositions())
    assert not _normkit_targets(decomposed)
    ids = tokens(3, 17, seed=1) if dynamic else tokens(2, 12, seed=1)
    got = decomposed.module()(ids)          # (with grad enabled: without, the view passed)
    torch.testing.assert_close(got, theirs(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(MODELS))
def test_onnx_standard_operators_run_in_onnxruntime(name, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    model = _converted(name).eval()
    x = torch.randn(2, 3, 32, 32)
    program = torch.onnx.export(model, (x,), dynamo=True, verbose=False)
    proto = program.model_proto
    nodes = list(proto.graph.node) + [n for f in proto.functions for n in f.node]
    assert {n.domain for n in nodes} <= {"", "ai.onnx"}, "standard ONNX operators only"
    path = tmp_path / f"{name}.onnx"
    program.save(str(path))
    _assert_onnxruntime_equals(ort, path, model, x)


def _assert_onnxruntime_equals(ort, path, model, x):
    """The ONNX file at ``path``, run by onnxruntime on ``x``, equals ``model`` in PyTorch."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        want = model(x).last_hidden_state
    torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_jit_trace_records_the_norms(train):
    # the TorchScript tracer records the composite torch ops (the kernels run outside
    # anything it sees): a traced model computes as eager on another input, and in
    # training updates the running statistics as eager does
    model = _converted("resnet").train(train)
    twin = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # (TorchScript's deprecation, the tracer's notes)
        traced = torch.jit.trace(twin, torch.randn(2, 3, 32, 32), strict=False)
    twin.load_state_dict(model.state_dict())      # (the trace's own call updated twin)
    x = torch.randn(2, 3, 32, 32) * 2 + 1
    want = model(x)
    got = traced(x)
    torch.testing.assert_close(got["last_hidden_state"], want.last_hidden_state,
                               rtol=1e-5, atol=1e-5)
    _assert_same_state(model, twin)


def test_legacy_onnx_exporter_runs_in_onnxruntime(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    model = _converted("resnet").eval()
    x = torch.randn(2, 3, 32, 32)
    path = tmp_path / "resnet.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # (the TorchScript-based exporter's deprecation)
        torch.onnx.export(model, (x,), str(path), dynamo=False, input_names=["x"])
    _assert_onnxruntime_equals(ort, path, model, x)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_export_with_a_dynamic_batch(train):
    # a batch dim exported as dynamic: no guard on its size (training BatchNorm's
    # n / (n - 1) once made one), and a call on another batch size equals eager
    model = _converted("resnet").train(train)
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(copy.deepcopy(model), (torch.randn(2, 3, 32, 32),),
                             dynamic_shapes={"pixel_values": {0: batch}})
    loaded = ep.module()
    x = torch.randn(5, 3, 32, 32)
    want, got = model(x), loaded(x)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=1e-5,
                               atol=1e-5)
    for (n, b), lb in zip(model.named_buffers(), loaded.buffers()):
        torch.testing.assert_close(lb, b, rtol=1e-6, atol=1e-6, msg=n)


def test_aot_inductor_package_of_the_decomposed_program_runs_without_normkit(tmp_path):
    # AOTInductor compiles an exported program to a shared library; decomposed first, the
    # package holds aten ops only and loads in a process that never imports normkit (the
    # undecomposed program's package calls normkit's Python operators: "Could not find
    # schema for normkit::norm_forward" there)
    import subprocess
    import sys

    class Hidden(torch.nn.Module):            # (a tensor out: transformers' output class
        def __init__(self):                    # is a pytree the loading process lacks)
            super().__init__()
            self.inner = _converted("resnet")

        def forward(self, x):
            return self.inner(x).last_hidden_state

    model = Hidden().eval()
    x = torch.randn(2, 3, 32, 32)
    ep = torch.export.export(model, (x,)).run_decompositions(ops.decompositions())
    package = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "m.pt2"))
    torch.save(x, tmp_path / "x.pt")
    script = ("import sys, torch\n"
              "run = torch._inductor.aoti_load_package(sys.argv[1])\n"
              "out = run(torch.load(sys.argv[2]))\n"
              "torch.save(out, sys.argv[3])\n"
              "assert 'normkit' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", script, package, str(tmp_path / "x.pt"),
                    str(tmp_path / "y.pt")], check=True, timeout=300)
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(torch.load(tmp_path / "y.pt"), want, rtol=1e-5, atol=1e-5)
