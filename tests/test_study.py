"""normkit study: the --quick run end to end (twice: same numbers), resuming, the MNIST-1D
loader, the covariate-shift recording, the transformer, and the findings' logic."""

import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")
pytest.importorskip("sklearn")
pytest.importorskip("mnist1d")

import normkit.nn as nk  # noqa: E402
from normkit.study import analysis, data, model, report, runner, shift, train  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("study-batch-size.png", "study-loss-curves.png", "study-bn-train-eval.png", "study-train-loss.png",
         "study-covariate-shift.png", "study-depth-gradients.png", "study-lr-range.png", "study-style.png",
         "study-drift.png", "study-vit.png")
TIMING = ("seconds", "cpu_seconds")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    from normkit.cli import main

    out = tmp_path_factory.mktemp("study")
    assert main(["study", "--quick", "--out", str(out), "--no-progress"]) == 0
    return out


def test_quick_writes_every_output(quick):
    for name in ("report.html", "report.md", "results.json", *PLOTS):
        assert (quick / name).is_file(), name
    for name in PLOTS:
        data = (quick / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000
    html = (quick / "report.html").read_text()
    # self-contained: every image embedded, nothing fetched
    assert html.count('src="data:image/png;base64,') == len(PLOTS)
    assert not re.search(r'src="(?!data:)', html)


def test_results_cover_the_grid(quick):
    r = json.loads((quick / "results.json").read_text())
    p = r["protocol"]
    assert p["quick"] and p["methods"] == list(model.available_methods())
    assert p["dataset"] == "mnist1d" and p["layer_source"] == "normkit.nn"
    keys = {(x["method"], x["batch_size"], x["seed"]) for x in r["runs"]}
    # the batch size is swept for the batch-dependent methods and GroupNorm; the rest run at
    # the smallest, the reference and the largest batch (here 4 and 16)
    assert set(p["swept"]) == set(runner.SWEPT)
    assert keys == {(m, b, s) for m in p["methods"] for b in p["batch_sizes"] for s in p["seeds"]}
    for x in r["runs"]:
        assert 0.0 <= x["test_error"] <= 1.0
        assert x["lr"] == pytest.approx(p["train"]["base_lr"] * x["batch_size"] / 32)
        assert x["steps"] == max(p["train"]["epochs"] * (p["train_images"] // x["batch_size"]),
                                 p["train"]["min_steps"])
        if x["method"] in ("group", "layer", "instance", "rms", "none"):
            # batch-independent: same error in both modes, batch-mates change nothing
            assert x["test_error_train_mode"] == x["test_error"]
            assert x["batch_dependence"] < 1e-4
    bn = [x for x in r["runs"] if x["method"] == "batch"]
    assert all(x["batch_dependence"] > 1e-3 for x in bn)


def test_report_numbers_agree_with_results(quick):
    r = json.loads((quick / "results.json").read_text())
    md = (quick / "report.md").read_text()
    html = (quick / "report.html").read_text()
    for m, cells in r["summary"].items():
        for b, cell in cells.items():
            errors = [x["test_error"] for x in r["runs"] if x["method"] == m and str(x["batch_size"]) == b]
            assert cell["test_error"]["mean"] == pytest.approx(np.mean(errors))
            text = f"{100 * cell['test_error']['mean']:.2f} ± {100 * cell['test_error']['std']:.2f}"
            assert text in md and text in html
    for line in r["findings"]:
        assert f"- {line}" in md
    # the table row of each method carries its numbers in batch order
    bs = sorted(r["protocol"]["batch_sizes"])
    row = next(line for line in md.splitlines() if line.startswith("| GroupNorm |"))
    cells = [c.strip() for c in row.strip("|").split("|")][1:]
    assert cells == [f"{100 * r['summary']['group'][str(b)]['test_error']['mean']:.2f} ± "
                     f"{100 * r['summary']['group'][str(b)]['test_error']['std']:.2f}" for b in bs]


def test_resume_reuses_finished_runs(tmp_path):
    from normkit.study.runner import run_study

    first = run_study(tmp_path, methods=["none"], batch_sizes=[16], seeds=[0], quick=True, progress=False,
                      extra=False)
    again = run_study(tmp_path, methods=["none"], batch_sizes=[16], seeds=[0, 1], quick=True, progress=False,
                      extra=False)
    assert len(again["runs"]) == 2
    assert again["runs"][0] == first["runs"][0]           # reused, not retrained
    assert again["runs"][1]["seed"] == 1
    with pytest.raises(ValueError, match="--fresh"):
        run_study(tmp_path, methods=["none"], batch_sizes=[16], seeds=[0], epochs=2, quick=True, progress=False,
                  extra=False)


def test_same_command_twice_same_results(quick, tmp_path):
    from normkit.cli import main

    assert main(["study", "--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    first = json.loads((quick / "results.json").read_text())
    again = json.loads((tmp_path / "results.json").read_text())
    strip = lambda runs: [{k: v for k, v in r.items() if k not in TIMING} for r in runs]  # noqa: E731
    assert strip(again["runs"]) == strip(first["runs"])
    assert again["summary"] == first["summary"] and again["findings"] == first["findings"]


def test_plan_sweeps_only_the_batch_dependent_methods():
    bs = (2, 4, 8, 16, 32, 64)
    tasks = runner.plan(["none", "batch", "group", "layer"], bs, [0])
    assert [b for m, b, s in tasks if m == "batch"] == list(bs)
    assert [b for m, b, s in tasks if m == "group"] == list(bs)
    assert [b for m, b, s in tasks if m == "layer"] == [2, 32, 64]
    assert len(runner.plan(["none", "layer"], bs, [0, 1], all_batches=True)) == 2 * 2 * len(bs)


def test_mnist1d_is_generated_offline_and_deterministic(tmp_path, monkeypatch):
    import random

    import requests

    def no_network(*args, **kwargs):
        raise AssertionError("the study must not download anything")

    monkeypatch.setattr(requests, "get", no_network)
    monkeypatch.chdir(tmp_path)
    np.random.seed(123)
    random.seed(123)
    before = (np.random.random(), random.random())
    np.random.seed(123)
    random.seed(123)
    a = data.load("mnist1d", 300, 100)
    assert (np.random.random(), random.random()) == before  # global generators untouched
    b = data.load_mnist1d(300, 100)
    assert list(tmp_path.iterdir()) == []                    # no cache file written
    assert a.x_train.shape == (300, 1, 40) and a.x_test.shape == (100, 1, 40)
    assert a.x_train.dtype == np.float32 and a.y_train.dtype == np.int64
    assert a.spatial == (40,) and a.n_classes == 10 and set(a.y_test) <= set(range(10))
    assert abs(a.x_train.mean()) < 1e-5 and abs(a.x_train.std() - 1) < 1e-4
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    # a larger dataset is a different draw, not the same signals repeated
    assert not np.array_equal(data.load_mnist1d(400, 100).x_train[:300], a.x_train)
    with pytest.raises(ValueError, match="at least 10"):
        data.load_mnist1d(5, 100)
    with pytest.raises(ValueError, match="choose from"):
        data.load("cifar")


def test_digits_still_available(tmp_path):
    r = runner.run_study(tmp_path, methods=["batch"], batch_sizes=[8], quick=True, progress=False,
                         dataset="digits")
    assert r["protocol"]["dataset"] == "digits" and r["runs"][0]["steps"] == 192 // 8
    assert "shift" not in r["runs"][0]
    assert r["experiments"] == {}  # the further claims' experiments are MNIST-1D's


def test_layers_are_normkit_layers():
    # the study runs normkit's own layers, never a silent torch.nn substitute
    assert model.layer_source() == "normkit.nn"
    assert isinstance(model.make_norm("batch", 8, (10,)), nk.BatchNorm1d)
    assert isinstance(model.make_norm("batch", 8, (2, 2)), nk.BatchNorm2d)
    assert isinstance(model.make_norm("batchrenorm", 8, (10,)), nk.BatchRenorm1d)
    assert isinstance(model.make_norm("instance", 8, (10,)), nk.InstanceNorm1d)
    assert isinstance(model.make_norm("group", 8, (10,)), nk.GroupNorm)
    with pytest.raises(ValueError, match="spatial"):
        model.make_norm("batch", 8, (2, 2, 2))


def test_shift_recording_changes_nothing_and_orders_percentiles():
    d = data.load("mnist1d", 160, 300)
    cfg = train.TrainConfig(epochs=1)
    plain = train.train_one(d, "batch", 8, 0, cfg)
    rec = train.train_one(d, "batch", 8, 0, cfg, record_shift=True)
    assert rec["loss_curve"] == plain["loss_curve"] and rec["test_error"] == plain["test_error"]
    s = rec["shift"]
    assert s["percentiles"] == [15, 50, 85] and s["step"][0] == 0 and s["step"][-1] == plain["steps"]
    v = np.asarray(s["values"])
    assert v.shape == (len(s["step"]), 3, model.Conv1dNet.WIDTH)
    assert np.all(v[:, 0] <= v[:, 1]) and np.all(v[:, 1] <= v[:, 2])
    # BatchNorm in training mode: every channel's probe median sits near beta = 0 at step 0
    assert np.all(np.abs(v[0, 1]) < 1.0)


def test_shift_movement_is_in_units_of_the_spread():
    steps = [0, 1, 2]
    still = {"step": steps, "percentiles": [15, 50, 85], "values": [[[-1.0], [0.0], [1.0]]] * 3}
    assert shift.movement(still) == {15: 0.0, 50: 0.0, 85: 0.0}
    moving = {"step": steps, "percentiles": [15, 50, 85],
              "values": [[[-1.0 + 4 * t], [4.0 * t], [1.0 + 4 * t]] for t in (0, 0.5, 1)]}
    assert shift.movement(moving)[50] == pytest.approx(2.0)  # moved 4 with a spread of 2


def test_shift_sentence_compares_with_no_normalization():
    still = [[[-1.0], [0.0], [1.0]]] * 3
    moving = [[[-1.0 + 4 * t], [4.0 * t], [1.0 + 4 * t]] for t in (0, 0.5, 1)]
    runs = [{"method": m, "steps": 2, "batch_size": 32, "seed": 0,
             "shift": {"step": [0, 1, 2], "percentiles": [15, 50, 85], "values": v}}
            for m, v in (("none", moving), ("batch", still), ("group", moving))]
    text = analysis.shift_sentence({"runs": runs})
    assert "no normalization 2.00" in text and "BatchNorm 0.00" in text
    assert "1 of 2 normalizations keep it clearly steadier than none" in text and ": BatchNorm;" in text
    assert analysis.shift_sentence({"runs": runs[:0]}) is None


def test_vit_quick(tmp_path):
    from normkit.cli import main

    assert main(["study", "--model", "vit", "--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    vit = json.loads((tmp_path / "vit-results.json").read_text())
    p = vit["protocol"]
    assert {(r["method"], r["lr"]) for r in vit["runs"]} == {(m, lr) for m in p["methods"] for lr in p["lrs"]}
    for r in vit["runs"]:
        if r["diverged"]:
            continue
        if r["method"] == "batch":
            assert r["batch_dependence"] > 1e-3
        else:
            assert r["batch_dependence"] < 1e-4 and r["test_error_train_mode"] == r["test_error"]
    assert (tmp_path / "study-vit.png").read_bytes()[:8] == PNG_MAGIC
    md = (tmp_path / "report.md").read_text()
    assert "LayerNorm in a vision transformer" in md
    for line in analysis.vit_findings(vit):
        assert f"- {line}" in md


def test_token_batchnorm_normalizes_over_batch_and_tokens():
    from normkit.study.vit import make_token_norm

    x = torch.randn(4, 10, 32) * 3 + 1
    y = make_token_norm("batch", 32).train()(x).detach()
    assert torch.allclose(y.mean(dim=(0, 1)), torch.zeros(32), atol=1e-5)
    y = make_token_norm("layer", 32)(x).detach()
    assert torch.allclose(y.mean(dim=2), torch.zeros(4, 10), atol=1e-5)


def test_same_seed_same_numbers():
    d = data.load("mnist1d", 96, 32)
    cfg = train.TrainConfig(epochs=1)
    a = train.train_one(d, "group", 4, 3, cfg)
    b = train.train_one(d, "group", 4, 3, cfg)
    assert a["loss_curve"] == b["loss_curve"] and a["test_error"] == b["test_error"]


def test_min_steps_passes_over_the_data_again():
    # one epoch of 96 signals is 6 steps of 16; min_steps 20 makes it 20: two full passes
    # (12 steps) and 8 steps of a third, each pass a fresh shuffle
    assert train.run_steps(96, 16, 1, 20) == 20 and train.run_steps(96, 2, 1, 20) == 48
    gen = torch.Generator().manual_seed(0)
    batches = list(train._batches(96, 16, 20, gen))
    assert len(batches) == 20 and all(len(b) == 16 for b in batches)
    for first in (0, 6):
        seen = torch.cat(batches[first:first + 6])
        assert sorted(seen.tolist()) == list(range(96))  # a pass sees every signal once
    assert not torch.equal(batches[0], batches[6])
    d = data.load("mnist1d", 96, 32)
    r = train.train_one(d, "batch", 16, 0, train.TrainConfig(epochs=1, min_steps=20))
    assert r["steps"] == 20 and r["loss_curve"]["step"][-1] == 20


def test_bad_arguments_say_what_to_do(tmp_path, capsys):
    from normkit.cli import main

    assert main(["study", "--quick", "--out", str(tmp_path), "--methods", "weightnorm"]) == 2
    assert "choose from" in capsys.readouterr().err
    assert main(["study", "--quick", "--out", str(tmp_path), "--batch-sizes", "1,4"]) == 2
    assert "at least 2" in capsys.readouterr().err


@pytest.mark.parametrize("args, said", [
    (["--epochs", "0"], "--epochs must be at least 1, got 0"),  # 0 read as "the default"
    (["--lr", "0"], "--lr must be a positive number, got 0.0"),  # likewise
    (["--lr", "-1"], "--lr must be a positive number, got -1.0"),  # torch's message, scaled: -0.125
    (["--lr", "nan"], "--lr must be a positive number, got nan"),
    (["--jobs", "0"], "--jobs must be at least 1"),
    (["--seeds", ""], "--seeds is empty"),  # an empty list read as "the default"
    (["--batch-sizes", ","], "--batch-sizes is empty"),
    (["--methods", ","], "--methods is empty"),
    (["--model", "vit", "--seeds", "1"], "leave out --seeds"),  # silently ignored
    (["--model", "vit", "--lr", "0.1", "--epochs", "2"], "leave out --epochs, --lr"),
    (["--model", "vit", "--jobs", "-1"], "--jobs must be at least 1"),
    (["--model", "vit", "--methods", ""], "--methods is empty"),
])
def test_arguments_that_would_change_nothing_are_refused(tmp_path, capsys, args, said):
    # each was taken as the default, or ignored, or left to torch's error; refused before any training
    from normkit.cli import main

    assert main(["study", "--quick", "--out", str(tmp_path), "--no-progress", *args]) == 2
    assert said in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("spatial", [(4, 4), (10,)])
@pytest.mark.parametrize("method", model.available_methods())
def test_make_norm_statistics(method, spatial):
    # right after construction (weight 1, bias 0), each layer normalizes the groups it claims to
    torch.manual_seed(0)
    x = torch.randn(4, 16, *spatial) * 3 + 1
    layer = model.make_norm(method, 16, spatial).train()
    y = layer(x).detach()
    if method == "none":
        assert torch.equal(y, x)
        return
    s = tuple(range(2, 2 + len(spatial)))  # the spatial dims
    dims = {"batch": (0, *s), "batchrenorm": (0, *s), "layer": (1, *s), "instance": s, "rms": (1, *s)}
    if method == "group":
        y = y.reshape(4, model.GROUPS, -1)
        dims[method] = (2,)
    if method == "rms":
        assert torch.allclose(y.pow(2).mean(dims[method]), torch.ones(()), atol=1e-3)
    else:
        assert torch.allclose(y.mean(dims[method]), torch.zeros(()), atol=1e-5)
        assert torch.allclose(y.var(dims[method], unbiased=False), torch.ones(()), atol=1e-3)


def test_learning_rate_scales_linearly():
    assert train.learning_rate(0.05, 32) == 0.05
    assert train.learning_rate(0.05, 2) == pytest.approx(0.003125)


def _fake_results(bn_small, gn_small):
    """Synthetic runs: BatchNorm and GroupNorm at batch 2 and 32, three seeds each."""
    runs = []
    rng = np.random.default_rng(0)
    for m, errs in (("batch", {2: bn_small, 32: 0.02}), ("group", {2: gn_small, 32: 0.03})):
        for b, e in errs.items():
            for s in range(3):
                err = e + 1e-4 * rng.normal()
                runs.append(dict(method=m, batch_size=b, seed=s, lr=0.05 * b / 32, steps=1200 // b * 6,
                                 diverged=False, test_error=err, test_error_train_mode=err + (0.05 if m == "batch" else 0),
                                 batch_dependence=0.5 if m == "batch" else 0.0, final_train_loss=0.1,
                                 loss_curve={"step": [10, 20], "loss": [1.0, 0.1]}, seconds=1.0))
    protocol = dict(methods=["batch", "group"], batch_sizes=[2, 32], seeds=[0, 1, 2])
    return dict(protocol=protocol, runs=runs)


def test_findings_follow_the_numbers():
    r = _fake_results(bn_small=0.10, gn_small=0.03)
    found = analysis.findings(r, analysis.summarize(r))
    assert found[0].startswith("The GroupNorm paper's crossover reproduces")
    assert found[1].startswith("BatchNorm's test error rises as the batch shrinks, as the paper says")
    assert "+8.00 points" in found[1]
    assert any("GroupNorm is better, as in the paper" in f for f in found)

    r = _fake_results(bn_small=0.02, gn_small=0.08)
    found = analysis.findings(r, analysis.summarize(r))
    assert found[0].startswith("The GroupNorm paper's crossover does NOT fully reproduce")
    assert "does NOT clearly rise" in found[1]
    assert any("BatchNorm is better here, unlike the paper" in f for f in found)
    assert any("NOT steadier" in f for f in found)


def test_markdown_and_html_say_the_same():
    blocks = [("h1", "t"), ("p", "a < b"), ("ul", ["x", "y"]), ("table", ["m", "batch 2"], [["BN", "1.00 ± 0.10"]])]
    md = report.render_markdown(blocks)
    html = report.render_html(blocks, ".")
    assert "| BN | 1.00 ± 0.10 |" in md and "<td>1.00 ± 0.10</td>" in html
    assert "a &lt; b" in html and "- y" in md


def test_claims_verdicts_follow_the_numbers():
    from normkit.study import claims

    def verdicts(r):
        return {row[0]: row[-1] for row in claims.claims(r, analysis.summarize(r), None)}

    small = "BatchNorm fails at small batch; GroupNorm does not"
    free = "LayerNorm, GroupNorm, InstanceNorm do not depend on the batch"
    assert verdicts(_fake_results(bn_small=0.10, gn_small=0.03))[small] == "yes"
    v = verdicts(_fake_results(bn_small=0.02, gn_small=0.08))
    assert v[small] == "no" and v[free] == "yes"
    rows = claims.claims(None, None, None)
    assert rows == []


def test_quick_runs_every_experiment(quick):
    from normkit.study import experiments

    r = json.loads((quick / "results.json").read_text())
    for name, spec in experiments.EXPERIMENTS.items():
        assert experiments.complete(r, name) is not None, name
        assert set(r["experiments"][name]["parts"]) == set(spec[0])
    assert all("train_error" in x for x in r["runs"])
    md = (quick / "report.md").read_text()
    names = [row.split("|")[1].strip() for row in md.splitlines() if row.startswith("| ")][1:]
    for claim in ("Gradients stay stable with depth", "BatchNorm allows larger learning rates",
                  "The weights' scale no longer sets the activations' scale", "Mini-batch noise regularizes mildly",
                  "InstanceNorm removes style (contrast, brightness)", "BatchNorm suits sequence models poorly",
                  "BatchNorm suits distribution drift poorly",
                  "Transformers (SigLIP) normalize each token with LayerNorm, not BatchNorm",
                  "BatchNorm cannot normalize a batch of one in training"):
        assert claim in names, claim
    assert "## Where this study disagrees with the articles" in md


@pytest.mark.parametrize("module", ["runner", "vit", "experiments", "report"])
def test_each_study_module_imports_first(module):
    # a spawned worker imports the runner first: no import cycle may depend on the order
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", f"import normkit.study.{module}"], check=True)
