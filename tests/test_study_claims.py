"""normkit study's further claims: each verdict on constructed results that must pass and
that must fail, the experiments' resumable parts, and the measurements the verdicts rest on
(gradient spread, rate range, per-signal style, the weight-scale probe, a batch of one)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")
pytest.importorskip("mnist1d")

from normkit.study import claims, data, depth, experiments, lr_range, model, probes, robust  # noqa: E402
from normkit.study import sequence  # noqa: E402
from normkit.study import experiment_claims as ec  # noqa: E402
from normkit.study.experiment_report import disagreements  # noqa: E402


def _exp(parts, **config):
    return {"config": config, "parts": parts}


def _depth_part(init, trained):
    return {"depth": len(init), "steps": 10,
            "gradients": {"init": {"activation": init}, "trained": {"activation": trained}}}


FLAT = [1.0] * 20
VANISH = [10.0 ** (-k) for k in range(20)][::-1]   # 1e-19 at layer 1 ... 1 at layer 20


def test_depth_verdict():
    ok = _exp({"none": _depth_part(VANISH, VANISH), "batch": _depth_part(FLAT, FLAT), "layer": _depth_part(FLAT, FLAT)})
    assert ec.depth_row(ok)[-1] == "yes"
    grows = [1.1 ** k for k in range(40)][:20]  # 6.1x over 20 layers: still within the small factor
    assert ec.depth_row(_exp({**ok["parts"], "batch": _depth_part(grows, FLAT)}))[-1] == "yes"
    partly = _exp({**ok["parts"], "batch": _depth_part([1.3 ** k for k in range(20)], FLAT)})
    assert ec.depth_row(partly)[-1].startswith("partly: LayerNorm within 10x; BatchNorm 14")
    plain_fine = _exp({**ok["parts"], "none": _depth_part(FLAT, FLAT)})
    assert ec.depth_row(plain_fine)[-1] == "no"
    assert ec.depth_row(None) is None
    assert depth.spread([1.0, 0.0]) == float("inf") and depth.spread([2.0, 0.5]) == 4.0


def _lr_part(losses, diverged=()):
    lrs = [0.01, 0.1, 1.0, 10.0]
    return {"target": 0.5, "steps": 100, "batch_size": 32,
            "runs": [{"lr": lr, "final_train_loss": v, "diverged": lr in diverged, "test_error": 0.1}
                     for lr, v in zip(lrs, losses)]}


def test_lr_range_verdict():
    lrs = [0.01, 0.1, 1.0, 10.0]
    bn = _lr_part([0.8, 0.3, 0.2, 2.3])
    none = _lr_part([1.5, 0.4, 2.3, 2.3])
    assert lr_range.reached(bn) == [0.1, 1.0] and lr_range.rate_range(bn) == pytest.approx(10.0)
    assert ec.lr_row(_exp({"none": none, "batch": bn}, lrs=lrs))[-1] == "yes"
    assert ec.lr_row(_exp({"none": bn, "batch": none}, lrs=lrs))[-1] == "no"
    # a diverged run does not count, whatever its last loss
    bn_div = _lr_part([0.8, 0.3, 0.2, 0.1], diverged=(1.0, 10.0))
    assert lr_range.reached(bn_div) == [0.1]
    assert ec.lr_row(_exp({"none": none, "batch": bn_div}, lrs=lrs))[-1] == "no"
    assert lr_range.rate_range(_lr_part([1.0] * 4)) == 0.0


def _robust_part(style_err, shift_err, rescale_err, scale=None, one=None):
    sizes = [0.0, 1.0, 2.0]
    curve = lambda e: {"size": sizes, "test_error": e, "changed": [0.0] * 3}  # noqa: E731
    return {"style": curve(style_err), "drift": {"shift": curve(shift_err), "rescale": curve(rescale_err)},
            "weight_scale": scale or [], "batch_of_one": one or {"alone_change": 0.0, "alone_error": 0.1,
                                                                  "eval_error": 0.1}}


def _robust(instance_style=(0.2, 0.21, 0.22), bn_shift=(0.05, 0.5, 0.8), bn_rescale=(0.05, 0.3, 0.5),
            bn_scale=((0.1, 1e-6, 0.1), (10.0, 1e-7, 10.0)), none_scale=((0.1, 0.9, 0.5), (10.0, 9.0, 0.2)),
            bn_error="ValueError: Expected more than 1 value per channel when training", gn_alone=0.0):
    ws = lambda rows: [{"scale": c, "logit_change": d, "grad_ratio": r} for c, d, r in rows]  # noqa: E731
    mild = (0.05, 0.2, 0.3)
    return _exp({
        "none": _robust_part((0.2, 0.5, 0.7), mild, mild, ws(none_scale)),
        "batch": _robust_part((0.05, 0.4, 0.6), bn_shift, bn_rescale, ws(bn_scale),
                              {"error": bn_error, "alone_change": 5.0, "alone_error": 0.9, "eval_error": 0.05}),
        "group": _robust_part((0.05, 0.2, 0.3), mild, (0.05, 0.05, 0.05),
                              one={"error": None, "alone_change": gn_alone, "alone_error": 0.05, "eval_error": 0.05}),
        "layer": _robust_part((0.1, 0.2, 0.3), mild, (0.1, 0.1, 0.1),
                              one={"error": None, "alone_change": 0.0, "alone_error": 0.1, "eval_error": 0.1}),
        "instance": _robust_part(instance_style, (0.2, 0.2, 0.2), (0.2, 0.2, 0.2)),
    }, train={})


def test_style_verdict():
    assert ec.style_row(_robust())[-1] == "yes"
    assert ec.style_row(_robust(instance_style=(0.2, 0.5, 0.9)))[-1] == "no"


def test_drift_verdict():
    assert ec.drift_row(_robust())[-1] == "yes"
    assert ec.drift_row(_robust(bn_rescale=(0.05, 0.05, 0.05)))[-1] == "partly: BatchNorm worst under shift only"
    assert ec.drift_row(_robust(bn_shift=(0.05, 0.05, 0.05), bn_rescale=(0.05, 0.05, 0.05)))[-1] == "no"


def test_weight_scale_verdict():
    assert ec.scale_row(_robust())[-1] == "yes"
    # the gradient not divided by the constant
    assert ec.scale_row(_robust(bn_scale=((0.1, 1e-6, 1.0), (10.0, 1e-7, 1.0))))[-1] == "no"
    # the output moves behind BatchNorm
    assert ec.scale_row(_robust(bn_scale=((0.1, 0.5, 0.1), (10.0, 1e-7, 10.0))))[-1] == "no"
    # nothing to compare with: the network without normalization does not move either
    assert ec.scale_row(_robust(none_scale=((0.1, 1e-6, 0.1), (10.0, 1e-6, 10.0))))[-1] == "no"


def test_batch_of_one_verdict():
    row = ec.batch_one_row(_robust())
    assert row[-1] == "yes" and "ValueError" in row[3]
    assert ec.batch_one_row(_robust(bn_error=None))[-1] == "no"
    assert ec.batch_one_row(_robust(gn_alone=0.3))[-1] == "no"


def _seq(bn, ln, at_recurrent=None):
    """The sequence experiment with these test errors per seed, with the norm of the summed
    input and, where given as ``(bn, ln)``, of the recurrent term."""
    places = {"sum": {"batch": bn, "layer": ln, "none": [0.5, 0.5]}}
    if at_recurrent:
        places["recurrent"] = {"batch": at_recurrent[0], "layer": at_recurrent[1]}

    def part(m):
        return {"steps": 10, "batch_size": 32,
                "runs": [{"place": place, "test_error": e, "test_error_train_mode": e}
                         for place, errs in places.items() for e in errs.get(m, [])]}
    return _exp({m: part(m) for m in ("none", "batch", "layer")}, places=list(places))


def test_sequence_verdict_at_one_place():
    assert ec.sequence_row(_seq([0.40, 0.42], [0.30, 0.31]))[-1] == "yes"
    assert ec.sequence_row(_seq([0.30, 0.31], [0.40, 0.42]))[-1] == "no: BatchNorm is better with the norm of the " \
                                                                     "summed input"
    assert ec.sequence_row(_seq([0.30, 0.40], [0.35, 0.36]))[-1] == "no clear difference"  # within the seeds' spread


def test_sequence_verdict_over_both_places():
    ahead, level = ([0.40, 0.42], [0.30, 0.31]), ([0.30, 0.40], [0.35, 0.36])
    assert ec.sequence_row(_seq(*ahead, at_recurrent=ahead))[-1] == "yes"
    row = ec.sequence_row(_seq(*level, at_recurrent=ahead))
    assert row[-1] == "partly: LayerNorm ahead with the norm of the recurrent term, not of the summed input"
    assert "norm of the summed input: BatchNorm 35.00 %" in row[3] and "LayerNorm 30.50 %" in row[3]
    assert ec.sequence_row(_seq(*level, at_recurrent=level))[-1] == "no clear difference"


def test_sequence_runs_stored_without_a_place_count_as_the_summed_input():
    exp = _seq([0.40, 0.42], [0.30, 0.31])
    for part in exp["parts"].values():
        for run in part["runs"]:
            del run["place"]
    del exp["config"]["places"]
    assert ec.sequence_row(exp)[-1] == "yes"


def _grid(bn_gap, gn_gap):
    runs = []
    for m, gap in (("batch", bn_gap), ("group", gn_gap)):
        for s, jitter in enumerate((-0.001, 0.0, 0.001)):
            runs.append({"method": m, "batch_size": 32, "seed": s, "train_error": 0.02,
                         "test_error": 0.02 + gap + jitter})
    return {"protocol": {"seeds": [0, 1, 2], "batch_sizes": [32]}, "runs": runs}


def test_grid_gap_rows():
    assert ec.grid_gap_row(_grid(0.01, 0.03), 32)[-1] == "BatchNorm's gap smaller"
    assert ec.grid_gap_row(_grid(0.03, 0.01), 32)[-1] == "BatchNorm's gap larger"
    assert ec.grid_gap_row(_grid(0.02, 0.021), 32)[-1] == "no clear difference"
    assert ec.grid_gap_row(_grid(0.01, 0.03), 8) is None  # no runs at that batch


def _regularize(errors):
    """The experiment with ``errors[method][n]`` the mean test error of three seeds
    (+-0.001), every training set fitted."""
    parts = {m: {"method": m, "runs": [{"n_train": n, "seed": s, "train_error": 0.0, "test_error": e + jitter}
                                       for n, e in by_size.items()
                                       for s, jitter in enumerate((-0.001, 0.0, 0.001))]}
             for m, by_size in errors.items()}
    return _exp(parts, sizes=[1000, 2000], steps=2000, batch_size=32, ghost=4, seeds=[0, 1, 2])


NO_EFFECT = {"batch": {1000: 0.05, 2000: 0.04}, "ghost": {1000: 0.06, 2000: 0.04}, "group": {1000: 0.05, 2000: 0.03}}


def test_regularize_verdict():
    noise_helps = {"batch": {1000: 0.04, 2000: 0.03}, "ghost": {1000: 0.03, 2000: 0.02},
                   "group": {1000: 0.05, 2000: 0.04}}
    row = ec.regularize_row(_regularize(noise_helps))
    assert row[-1] == "yes"
    assert ("1000 signals: BatchNorm 4.00 %, in ghost batches of 4 signals 3.00 %, GroupNorm 5.00 % (thresholds: "
            "against GroupNorm 0.20, ghost against BatchNorm 0.20 points; "
            "training error 0.00 / 0.00 / 0.00 %)") in row[3]
    only_small = {**noise_helps, "ghost": {1000: 0.03, 2000: 0.03}}
    assert ec.regularize_row(_regularize(only_small))[-1] == (
        "partly: BatchNorm's test error below GroupNorm's at 1000 and 2000 signals; more batch noise (ghost batches) "
        "lowers it at 1000 signals")
    not_noise = {**noise_helps, "ghost": {1000: 0.045, 2000: 0.03}}
    assert ec.regularize_row(_regularize(not_noise))[-1] == (
        "partly: BatchNorm's test error below GroupNorm's at 1000 and 2000 signals; more batch noise (ghost batches) "
        "does not lower it")
    assert ec.regularize_row(_regularize(NO_EFFECT))[-1] == "no"
    assert ec.regularize_row(None) is None


def test_ghost_batches_normalize_each_part_on_its_own():
    from normkit.study import regularize
    norm = regularize.GhostBatchNorm(model.make_norm("batch", 3, (5,)), 4)
    x = torch.randn(8, 3, 5) * torch.arange(1.0, 9.0).view(8, 1, 1)
    y = norm(x)
    for part, out in zip(x.split(4), y.split(4)):
        ref = torch.nn.functional.batch_norm(part, None, None, training=True)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    whole = torch.nn.functional.batch_norm(x, None, None, training=True)
    assert (y - whole).abs().max() > 0.1       # not the statistics of the whole batch
    norm.eval()
    torch.testing.assert_close(norm(x), norm.norm(x))


def test_claims_table_carries_the_experiments_and_disagreements():
    results = {"protocol": {"seeds": [0, 1, 2], "batch_sizes": [32], "methods": []}, "runs": _grid(0.03, 0.01)["runs"],
               "experiments": {"robust": _robust(instance_style=(0.2, 0.5, 0.9)), "regularize": _regularize(NO_EFFECT)}}
    rows = claims.claims(results, {}, None)
    names = [r[0] for r in rows]
    assert "InstanceNorm removes style (contrast, brightness)" in names
    assert names[-1] == "BatchNorm cannot normalize a batch of one in training"
    assert all(len(r) == len(claims.HEADER) for r in rows)
    off = disagreements(rows)[1][1]
    assert any(line.startswith("InstanceNorm removes style") for line in off)
    assert any(line.startswith("Mini-batch noise regularizes mildly") for line in off)
    assert not any(line.startswith("BatchNorm suits distribution drift") for line in off)
    # an experiment with a part missing is left out, not half-reported
    del results["experiments"]["robust"]["parts"]["layer"]
    assert "InstanceNorm removes style (contrast, brightness)" not in [r[0] for r in claims.claims(results, {}, None)]


def test_experiment_parts_resume():
    cfgs = experiments.configs(True, {"epochs": 1})
    every = experiments.tasks(cfgs, {})
    assert {(n, m) for n, m, _ in every} == {(n, m) for n, spec in experiments.EXPERIMENTS.items() for m in spec[0]}
    stored = {"depth": {"config": cfgs["depth"], "parts": {"none": {}, "batch": {}}}}
    left = experiments.tasks(cfgs, stored)
    assert ("depth", "none") not in {(n, m) for n, m, _ in left} and ("depth", "layer") in {(n, m) for n, m, _ in left}
    stored["depth"]["config"] = dict(cfgs["depth"], steps=99)  # a changed config reruns every part
    assert ("depth", "none") in {(n, m) for n, m, _ in experiments.tasks(cfgs, stored)}
    assert cfgs["robust"]["train"] == {"epochs": 1}


def test_style_change_is_affine_per_signal():
    x = torch.randn(6, 1, 40)
    assert torch.equal(robust.style(x, 0.0), x)
    y = robust.style(x, 1.0)
    for i in range(6):  # y = a x + b per signal, a in [1/e, e], b in [-1, 1]
        a, b = np.polyfit(x[i, 0].numpy(), y[i, 0].numpy(), 1)
        assert np.exp(-1) - 1e-4 <= a <= np.exp(1) + 1e-4 and abs(b) <= 1 + 1e-4
        assert np.allclose(a * x[i, 0].numpy() + b, y[i, 0].numpy(), atol=1e-4)


def test_weight_scale_probe_measures_batchnorm_invariance():
    torch.manual_seed(0)
    x, y = torch.randn(32, 1, 40), torch.randint(0, 10, (32,))
    bn = probes.weight_scale(model.Conv1dNet("batch"), x, y)
    assert [p["scale"] for p in bn] == list(probes.SCALES)
    for p in bn:
        assert p["logit_change"] < ec.SCALE_TOL and p["grad_ratio"] == pytest.approx(p["scale"], rel=1e-2)
    none = probes.weight_scale(model.Conv1dNet("none"), x, y)
    assert max(p["logit_change"] for p in none) > 0.1


def test_batch_of_one_probe():
    torch.manual_seed(0)
    x, y = torch.randn(40, 1, 40), torch.randint(0, 10, (40,))
    bn = probes.batch_of_one(model.Conv1dNet("batch"), "batch", x, y)
    assert bn["error"].startswith("ValueError: Expected more than 1 value per channel")
    assert bn["alone_change"] > 1e-2
    for m in ("group", "layer"):
        r = probes.batch_of_one(model.Conv1dNet(m), m, x, y)
        assert r["error"] is None and r["alone_change"] < 1e-4 and r["alone_error"] == r["eval_error"]


def test_deep_network_gradients_per_layer():
    torch.manual_seed(0)
    x, y = torch.randn(64, 1, 40), torch.randint(0, 10, (64,))
    net = depth.DeepMLP("batch")
    before = [b.clone() for b in net.buffers()]
    g = depth.layer_gradients(net, x, y)
    assert len(g["activation"]) == depth.DEPTH == len(g["weight"])
    assert all(torch.equal(a, b) for a, b in zip(before, net.buffers()))  # running averages put back
    plain = depth.layer_gradients(depth.DeepMLP("none"), x, y)["activation"]
    assert plain[0] < 1e-3 * plain[-1]  # PyTorch's default init: the gradient vanishes toward the input


def test_the_recurrent_nets_norm_takes_its_place():
    x = torch.randn(5, 1, 40)
    nets = {}
    for place in ("sum", "recurrent"):          # without a norm, the two places are one network
        torch.manual_seed(0)
        nets[place] = sequence.StepRNN("none", chunk=4, place=place)
    torch.testing.assert_close(nets["sum"](x), nets["recurrent"](x), rtol=0, atol=0)

    torch.manual_seed(0)
    net = sequence.StepRNN("layer", chunk=4, place="recurrent")
    with torch.no_grad():
        xs = net.inp(x[:, 0].reshape(5, 10, 4))
        h = torch.tanh(xs[:, 0])
        for t in range(1, 10):
            h = torch.tanh(xs[:, t] + torch.nn.functional.layer_norm(net.rec(h), (48,)))
        torch.testing.assert_close(net(x), net.head(h))
    with pytest.raises(ValueError, match="choose from sum, recurrent"):
        sequence.StepRNN("layer", place="input")

    signals = data.load("mnist1d", 40, 20)
    assert [r["place"] for r in sequence.run(signals, "none", sequence.QUICK)["runs"]] == ["sum"]
    assert [r["place"] for r in sequence.run(signals, "batch", sequence.QUICK)["runs"]] == ["sum", "recurrent"]
