"""normkit study: the --quick run end to end, resuming, and the findings' logic."""

import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")
pytest.importorskip("sklearn")

from normkit.study import analysis, model, report, train  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("study-batch-size.png", "study-loss-curves.png", "study-bn-train-eval.png", "study-train-loss.png")


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
    keys = {(x["method"], x["batch_size"], x["seed"]) for x in r["runs"]}
    assert keys == {(m, b, s) for m in p["methods"] for b in p["batch_sizes"] for s in p["seeds"]}
    for x in r["runs"]:
        assert 0.0 <= x["test_error"] <= 1.0
        assert x["lr"] == pytest.approx(p["train"]["base_lr"] * x["batch_size"] / 32)
        assert x["steps"] == p["train"]["epochs"] * (p["train_images"] // x["batch_size"])
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

    first = run_study(tmp_path, methods=["none"], batch_sizes=[16], seeds=[0], quick=True, progress=False)
    again = run_study(tmp_path, methods=["none"], batch_sizes=[16], seeds=[0, 1], quick=True, progress=False)
    assert len(again["runs"]) == 2
    assert again["runs"][0] == first["runs"][0]           # reused, not retrained
    assert again["runs"][1]["seed"] == 1
    with pytest.raises(ValueError, match="--fresh"):
        run_study(tmp_path, methods=["none"], batch_sizes=[16], seeds=[0], epochs=2, quick=True, progress=False)


def test_same_seed_same_numbers():
    from normkit.study import data

    d = data.load(96, 32)
    cfg = train.TrainConfig(epochs=1)
    a = train.train_one(d, "group", 4, 3, cfg)
    b = train.train_one(d, "group", 4, 3, cfg)
    assert a["loss_curve"] == b["loss_curve"] and a["test_error"] == b["test_error"]


def test_bad_arguments_say_what_to_do(tmp_path, capsys):
    from normkit.cli import main

    assert main(["study", "--quick", "--out", str(tmp_path), "--methods", "weightnorm"]) == 2
    assert "choose from" in capsys.readouterr().err
    assert main(["study", "--quick", "--out", str(tmp_path), "--batch-sizes", "1,4"]) == 2
    assert "at least 2" in capsys.readouterr().err


@pytest.mark.parametrize("method", model.available_methods())
def test_make_norm_statistics(method):
    # right after construction (weight 1, bias 0), each layer normalizes the groups it claims to
    torch.manual_seed(0)
    x = torch.randn(4, 16, 4, 4) * 3 + 1
    layer = model.make_norm(method, 16, (4, 4)).train()
    y = layer(x).detach()
    if method == "none":
        assert torch.equal(y, x)
        return
    dims = {"batch": (0, 2, 3), "batchrenorm": (0, 2, 3), "layer": (1, 2, 3), "instance": (2, 3),
            "rms": (1, 2, 3)}
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
    assert found[0].startswith("BatchNorm's test error rises as the batch shrinks, as the paper says")
    assert "+8.00 points" in found[0]
    assert any("GroupNorm is better, as in the paper" in f for f in found)

    r = _fake_results(bn_small=0.02, gn_small=0.08)
    found = analysis.findings(r, analysis.summarize(r))
    assert "does NOT clearly rise" in found[0]
    assert any("BatchNorm is better here, unlike the paper" in f for f in found)
    assert any("NOT steadier" in f for f in found)


def test_markdown_and_html_say_the_same():
    blocks = [("h1", "t"), ("p", "a < b"), ("ul", ["x", "y"]), ("table", ["m", "batch 2"], [["BN", "1.00 ± 0.10"]])]
    md = report.render_markdown(blocks)
    html = report.render_html(blocks, ".")
    assert "| BN | 1.00 ± 0.10 |" in md and "<td>1.00 ± 0.10</td>" in html
    assert "a &lt; b" in html and "- y" in md
