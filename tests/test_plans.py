"""The per-call path: cached plans (``normkit.backends.plan``), the outputs that are not
views of the autograd Function's output, the running-statistics update, and
``normkit bench --models``. Every result is compared with torch.nn's."""

from __future__ import annotations

import json

import pytest
import torch

import normkit
import normkit.functional as NF
import normkit.nn as nk
from normkit import backends
from normkit import grouping as G

from conftest import GRAD_TOL, TOL, assert_close

pytest.importorskip("numba")


def _layer_pair(make, seed=0):
    torch.manual_seed(seed)
    ours, theirs = make(nk), make(torch.nn)
    theirs.load_state_dict(ours.state_dict())
    with torch.no_grad():
        for p in ours.parameters():
            p.uniform_(0.5, 1.5)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _fwd_bwd(layer, x, g):
    x = x.detach().requires_grad_(True)
    y = layer(x)
    y.backward(g)
    return y, x.grad, [p.grad for p in layer.parameters()]


# one cached plan per (grouping, dtype, device, strides, centering, fixed, threads): the same
# layer called on a sequence of shapes, layouts and dtypes gives torch's result every time
SEQUENCE = [((4, 8, 5, 5), torch.float32, "contiguous"),
            ((4, 8, 5, 5), torch.float32, "channels_last"),
            ((4, 8, 5, 5), torch.float64, "contiguous"),
            ((2, 8, 3, 7), torch.float32, "contiguous"),
            ((4, 8, 5, 5), torch.float32, "contiguous"),      # the first plan again
            ((2, 8, 1, 1), torch.float32, "contiguous"),
            ((3, 8, 2, 2), torch.bfloat16, "channels_last")]


@pytest.mark.parametrize("name", ["batch", "group", "instance", "layer"])
def test_one_layer_many_shapes_each_with_its_plan(name):
    make = {"batch": lambda m: m.BatchNorm2d(8), "group": lambda m: m.GroupNorm(4, 8),
            "instance": lambda m: m.InstanceNorm2d(8, affine=True),
            "layer": lambda m: m.LayerNorm([8])}[name]
    ours, theirs = _layer_pair(make)
    for shape, dtype, layout in SEQUENCE:
        if name == "instance" and shape[2] * shape[3] == 1:
            continue                                 # one value per instance: an error
        torch.manual_seed(1)
        x = torch.randn(shape, dtype=torch.float64)
        if name == "layer":
            x = x.transpose(1, 3)                    # (..., 8): normalized over C
        x = x.to(dtype)
        if layout == "channels_last" and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        g = torch.randn(x.shape, dtype=dtype)
        a, b = ours.to(dtype), theirs.to(dtype)
        for p in list(a.parameters()) + list(b.parameters()):
            p.grad = None
        got, want = _fwd_bwd(a, x, g), _fwd_bwd(b, x, g)
        assert_close(got[0], want[0], dtype, msg=f"y {shape} {dtype} {layout}")
        assert_close(got[1], want[1], dtype, grad=True, msg=f"dx {shape} {dtype} {layout}")
        for p, q in zip(got[2], want[2]):
            assert_close(p, q, dtype, grad=True, msg=f"dparam {shape} {dtype} {layout}")
    assert len(backends._PLANS) >= 4


def test_plans_are_cached_and_cleared():
    x = torch.randn(6, 16)
    grouping = G.layer(x.shape, 1)
    first = backends.plan(x, grouping)
    assert backends.plan(x, grouping) is first
    assert backends.plan(x, grouping, center=False) is not first          # RMSNorm's
    assert backends.plan(x.double(), grouping) is not first
    backends.clear_plans()
    assert backends.plan(x, grouping) is not first


def test_statistics_skipped_only_where_unused():
    # keep_stats=False (LayerNorm's no-grad forward) gives the same y, and no statistics
    x, w, b = torch.randn(5, 32), torch.rand(32) + 0.5, torch.randn(32)
    grouping = G.layer(x.shape, 1)
    plan = backends.plan(x, grouping)
    y, mean, rstd, var = plan.forward(x, w, b, 1e-5)
    y2, *stats = plan.forward(x, w, b, 1e-5, keep_stats=False)
    assert torch.equal(y, y2) and stats == [None, None, None]
    want_var, want_mean = torch.var_mean(x, dim=1, correction=0, keepdim=True)
    assert_close(mean, want_mean, torch.float32)
    assert_close(var, want_var, torch.float32)
    assert_close(rstd, torch.rsqrt(want_var + 1e-5), torch.float32)


@pytest.mark.parametrize("shape", [(2, 64, 2, 2), (2, 16, 8, 8), (1, 3, 1, 2)])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_small_planes(shape, training):
    # small planes: per-block scratch no larger than C (it was 1 MiB per call at S = 4)
    ours, theirs = _layer_pair(lambda m: m.BatchNorm2d(shape[1]))
    ours.train(training), theirs.train(training)
    if not training:
        for m in (ours, theirs):
            m.running_mean.uniform_(-1, 1), m.running_var.uniform_(0.5, 2)
        theirs.load_state_dict(ours.state_dict())
    x, g = torch.randn(shape), torch.randn(shape)
    got, want = _fwd_bwd(ours, x, g), _fwd_bwd(theirs, x, g)
    for p, q in zip(got[:2], want[:2]):
        assert_close(p, q, torch.float32, grad=True)
    for p, q in zip(got[2], want[2]):
        assert_close(p, q, torch.float32, grad=True)
    assert_close(ours.running_mean, theirs.running_mean, torch.float32)
    assert_close(ours.running_var, theirs.running_var, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16,
                                   torch.float16], ids=str)
def test_running_statistics_eager_equals_traced_update(dtype):
    # the executor's update (eager, in C++) and the torch ops (traced graphs, other
    # devices) round the same way: the same bits; half-precision buffers take the batch
    # statistics in float32, as the kernels give them
    from normkit.backends import cpu, torch_ops

    torch.manual_seed(0)
    sdtype = torch.float64 if dtype == torch.float64 else torch.float32
    buffers = [torch.randn(24).to(dtype), (torch.rand(24) + 0.5).to(dtype)]
    values = [torch.randn(1, 24, 1).to(sdtype), torch.rand(1, 24, 1).to(sdtype)]
    eager = [b.clone() for b in buffers]
    traced = [b.clone() for b in buffers]
    for _ in range(3):
        assert cpu.update_running(*eager, values[0].view(24), values[1].view(24), 0.1, 32 / 31)
        torch_ops.update_running(*traced, *values, 0.1, 32 / 31)
    assert torch.equal(eager[0], traced[0]) and torch.equal(eager[1], traced[1])
    tol = TOL[dtype]
    want_mean, want_var = buffers[0].double(), buffers[1].double()
    for _ in range(3):
        want_mean = 0.9 * want_mean + 0.1 * values[0].double().view(24)
        want_var = 0.9 * want_var + 0.1 * values[1].double().view(24) * 32 / 31
    torch.testing.assert_close(eager[0].double(), want_mean, atol=tol[0], rtol=tol[1])
    torch.testing.assert_close(eager[1].double(), want_var, atol=tol[0], rtol=tol[1])


def test_in_place_op_on_the_output_is_not_copied_back_through_a_view():
    # ResNet adds the shortcut into the BatchNorm output in place: the output is a tensor of
    # its own, so autograd records a plain in-place add, not a CopySlices of a view
    ours, theirs = _layer_pair(lambda m: m.BatchNorm2d(6))
    x, g = torch.randn(3, 6, 4, 4), torch.randn(3, 6, 4, 4)
    results = []
    for layer in (ours, theirs):
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        assert y._base is None
        y += xi
        assert type(y.grad_fn).__name__ == "AddBackward0"
        y.backward(g)
        results.append((y, xi.grad, layer.weight.grad, layer.bias.grad))
    for p, q in zip(*results):
        assert_close(p, q, torch.float32, grad=True)


def test_converted_models_in_place_add_matches_torch():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                    layer_type="basic")
    torch.manual_seed(0)
    plain = transformers.ResNetModel(cfg).train()
    converted = transformers.ResNetModel(cfg).train()
    converted.load_state_dict(plain.state_dict())
    normkit.convert(converted)
    x = torch.randn(2, 3, 32, 32)
    for model in (plain, converted):
        model(x).last_hidden_state.square().mean().backward()
    for (name, p), q in zip(plain.named_parameters(), converted.parameters()):
        tol = GRAD_TOL[torch.float32]
        torch.testing.assert_close(q.grad, p.grad, atol=tol[0], rtol=tol[1], msg=name)


def test_bench_models_quick_json(capsys):
    from normkit.cli import main

    rc = main(["bench", "--models", "--quick", "--json", "--no-progress", "--repeats", "1"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert {(r["model"], r["mode"]) for r in report["models"]} == {("study-cnn-b2", "train"),
                                                                    ("study-cnn-b2", "infer")}
    for r in report["models"]:
        assert r["norms_converted"] == 4
        assert r["ratio"] == pytest.approx(r["converted_ms"] / r["untouched_ms"])
    from normkit.bench.models import CALLS

    assert [r["case"] for r in report["calls"]][::2] == list(CALLS)
    assert all(r["normkit_us"] > 0 and r["torch_us"] > 0 for r in report["calls"])


def test_bench_models_control_times_an_untouched_copy(capsys):
    from normkit.bench.models import format_models
    from normkit.cli import main

    rc = main(["bench", "--models", "--quick", "--json", "--no-progress", "--repeats", "1",
               "--control"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)["models"]
    assert all(r["control"] > 0 for r in rows)
    assert format_models(rows).splitlines()[0].endswith("control")
    assert "control" not in format_models([dict(rows[0], control=None)]).splitlines()[0]


def test_bench_models_alternate_the_order_of_the_models(monkeypatch):
    # each round times the models in turn, the reverse order every other round: none is
    # always first or last (a fixed order read 1.03-1.10 for an untouched copy)
    from normkit.bench import models

    timed = []

    def fake(fn, model, opt, x, steps):
        timed.append(next((k for k, m in pair.items() if m is model), "control"))
        return 1e-3

    real_pair = models._pair

    def spy(build):
        found = real_pair(build)
        pair.update(untouched=found[0], converted=found[1])
        return found

    pair = {}
    monkeypatch.setattr(models, "_pair", spy)
    monkeypatch.setattr(models, "_time_steps", fake)
    models.measure_model("study-cnn-b2", "infer", repeats=3, control=True)
    rounds = [timed[i:i + 3] for i in range(1, len(timed), 3)]    # after the sizing step
    assert rounds == [["untouched", "converted", "control"],
                      ["control", "converted", "untouched"],
                      ["untouched", "converted", "control"]]


def test_bench_models_channels_last_and_batch_norm_1d_rows(capsys):
    from normkit.cli import main

    rc = main(["bench", "--models", "study-cnn-b32-cl", "mlp-bn1d", "--json", "--no-progress",
               "--repeats", "1"])
    assert rc == 0
    rows = {(r["model"], r["mode"]): r for r in json.loads(capsys.readouterr().out)["models"]}
    assert set(rows) == {(m, mode) for m in ("study-cnn-b32-cl", "mlp-bn1d")
                         for mode in ("train", "infer")}
    assert rows["study-cnn-b32-cl", "train"]["norms_converted"] == 4
    assert rows["mlp-bn1d", "train"]["norms_converted"] == 2


def test_bench_models_rejects_unknown_names(capsys):
    from normkit.cli import main

    assert main(["bench", "--models", "resnet-1000"]) == 2
    assert "unknown model" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only machine")
def test_bench_models_on_cuda_without_a_gpu(capsys):
    from normkit.cli import main

    assert main(["bench", "--models", "--device", "cuda", "--quick"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16],
                         ids=str)
@pytest.mark.parametrize("name", ["group", "instance", "instance_running"])
def test_group_and_instance_norm_both_sides_of_the_small_plane_threshold(name, dtype,
                                                                         monkeypatch):
    # Instance/GroupNorm planes under tuning.SMALL_PLANE run planes_small*: torch's results
    # either way; with fixed statistics (running ones in eval) the same bits
    from normkit.backends.cpu import tuning

    make = {"group": lambda m: m.GroupNorm(3, 6),
            "instance": lambda m: m.InstanceNorm2d(6, affine=True),
            "instance_running": lambda m: m.InstanceNorm2d(6, affine=True,
                                                           track_running_stats=True)}[name]
    torch.manual_seed(0)
    x = (torch.randn(3, 6, 5, 7, dtype=torch.float64) * 3 + 40).to(dtype)
    g = torch.randn(x.shape).to(dtype)
    results = {}
    for small in (1 << 30, 0):
        monkeypatch.setattr(tuning, "SMALL_PLANE", small)
        backends.clear_plans()
        ours, theirs = _layer_pair(make)
        ours, theirs = ours.to(dtype), theirs.to(dtype)
        if name == "instance_running":
            for m in (ours, theirs):
                m.running_mean.uniform_(-1, 1), m.running_var.uniform_(0.5, 2)
            theirs.load_state_dict(ours.state_dict())
            ours.eval(), theirs.eval()
        got, want = _fwd_bwd(ours, x, g), _fwd_bwd(theirs, x, g)
        assert_close(got[0], want[0], dtype, msg=f"y, SMALL_PLANE={small}")
        assert_close(got[1], want[1], dtype, grad=True, msg=f"dx, SMALL_PLANE={small}")
        for p, q in zip(got[2], want[2]):
            assert_close(p, q, dtype, grad=True, msg=f"dparam, SMALL_PLANE={small}")
        results[small] = got
    if name == "instance_running":
        assert torch.equal(results[0][0], results[1 << 30][0])
    # the backward formula is the same either side: the same dx for the same statistics
    if name == "instance_running":
        assert torch.equal(results[0][1], results[1 << 30][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16],
                         ids=str)
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_both_sides_of_the_small_plane_threshold(dtype, training, monkeypatch):
    # planes under tuning.SMALL_PLANE run channels_small, the others channels_forward: the
    # same y as torch's either way, and the same running statistics
    from normkit.backends.cpu import tuning

    torch.manual_seed(0)
    x = (torch.randn(3, 6, 5, 7, dtype=torch.float64) * 3 + 40).to(dtype)   # S = 35
    g = torch.randn(x.shape).to(dtype)
    results = {}
    for small in (1 << 30, 0):
        monkeypatch.setattr(tuning, "SMALL_PLANE", small)
        backends.clear_plans()
        ours, theirs = _layer_pair(lambda m: m.BatchNorm2d(6))
        ours, theirs = ours.to(dtype).train(training), theirs.to(dtype).train(training)
        got, want = _fwd_bwd(ours, x, g), _fwd_bwd(theirs, x, g)
        assert_close(got[0], want[0], dtype, msg=f"y, SMALL_PLANE={small}")
        assert_close(got[1], want[1], dtype, grad=True, msg=f"dx, SMALL_PLANE={small}")
        assert_close(ours.running_mean, theirs.running_mean, dtype)
        assert_close(ours.running_var, theirs.running_var, dtype)
        results[small] = got[0]
    if not training:           # fixed statistics: the same formula, the same bits
        assert torch.equal(results[0], results[1 << 30])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_eval_batch_norm_without_grad_takes_rstd_from_the_kernel(dtype, layout, monkeypatch):
    # with nothing to record, eval BatchNorm hands the running variance to the kernel,
    # which computes rstd = 1 / sqrt(var + eps) as torch.rsqrt does: the same bits as the
    # path with a gradient (rstd from torch), both sides of tuning.SMALL_PLANE
    from normkit.backends.cpu import tuning

    torch.manual_seed(0)
    x = (torch.randn(3, 6, 5, 7, dtype=torch.float64) * 3 + 40).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    for small in (1 << 30, 0):
        monkeypatch.setattr(tuning, "SMALL_PLANE", small)
        backends.clear_plans()
        ours, theirs = _layer_pair(lambda m: m.BatchNorm2d(6))
        ours.running_mean.uniform_(35, 45), ours.running_var.uniform_(5, 15)
        with torch.no_grad():
            ours.weight.uniform_(0.5, 2), ours.bias.uniform_(-1, 1)
        theirs.load_state_dict(ours.state_dict())
        ours, theirs = ours.to(dtype).eval(), theirs.to(dtype).eval()
        with torch.no_grad():
            fast, want = ours(x), theirs(x)
        with_grad = ours(x.clone().requires_grad_())
        assert torch.equal(fast, with_grad.detach()), f"SMALL_PLANE={small}"
        assert_close(fast, want, dtype, msg=f"SMALL_PLANE={small}")
