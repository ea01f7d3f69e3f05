"""``normkit bench`` end to end on small shapes, and ``benchmarks/bench_table.py`` on its
report."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("numba")


def test_bench_quick_json(capsys):
    from normkit.cli import main

    rc = main(["bench", "--quick", "--json", "--no-progress", "--repeats", "1",
               "--ops", "layer_norm", "batch_norm", "--dtypes", "float32"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["allocators"]) == {"default", "no-mmap"}
    assert report["allocators"]["no-mmap"]["environment"]["malloc_mmap_max"] == "0"
    rows = report["allocators"]["default"]["results"]
    assert {r["op"] for r in rows} == {"layer_norm", "batch_norm"}
    assert {r["layout"] for r in rows} == {"contiguous", "channels_last"}
    for r in rows:
        assert r["normkit_s"] > 0 and r["torch_s"] > 0 and r["copy_s"] > 0
        assert r["normkit_over_torch"] == pytest.approx(r["normkit_s"] / r["torch_s"])

    # benchmarks/bench_table.py turns such reports into the README's tables and summary
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_table.py"
    spec = importlib.util.spec_from_file_location("bench_table", path)
    bench_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_table)
    for full in (False, True):
        lines = bench_table.table([report, report], full=full).splitlines()
        assert len(lines) == 2 + len(report["allocators"]["no-mmap"]["results"])
        assert all(line.count("|") == lines[0].count("|") for line in lines)
    r = report["allocators"]["no-mmap"]["results"][0]
    assert f"{r['normkit_over_torch']:.2f}" in lines[2]
    text = bench_table.summary([report])
    assert "layer_norm" in text and "targets" in text


@pytest.mark.parametrize("args, said", [
    (["--threads", "0"], "--threads must be at least 1, got 0"),  # a child's traceback
    (["--repeats", "0"], "--repeats must be at least 1, got 0"),  # read as the default
    (["--models", "mlp-bn1d", "--repeats", "-1"], "--repeats must be at least 1"),
    (["--control"], "add --models"),  # ignored
])
def test_arguments_it_cannot_measure_are_refused(capsys, args, said):
    from normkit.cli import main

    assert main(["bench", "--quick", "--no-progress", *args]) == 2
    captured = capsys.readouterr()
    assert said in captured.err and not captured.out


# --- bytes saved for backward (normkit bench --models) ------------------------------------

def _saved_bytes(model, x):
    from normkit.bench.models import saved_bytes

    return saved_bytes(model, x)


def test_saved_bytes_counts_a_storage_once_and_leaves_the_parameters_out():
    torch = pytest.importorskip("torch")

    class Square(torch.nn.Module):        # x * x saves x twice; x.t() is a view of it
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))

        def forward(self, x):
            h = x * self.weight                    # saves x and the weight (a parameter)
            return h * h + h.t() @ h               # h saved four times, twice as a view

    x = torch.randn(8, 8, requires_grad=True)
    # x, h and the output (the loss squares it): 256 bytes each, once; not the weight
    assert _saved_bytes(Square(), x) == 3 * 8 * 8 * 4


def test_saved_bytes_sees_a_model_that_saves_an_extra_tensor():
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self, extra):
            super().__init__()
            self.lin, self.extra = torch.nn.Linear(16, 32), extra

        def forward(self, x):
            y = self.lin(x)                        # saves x
            y = y.sin() if self.extra else y       # sin saves its input: 5 x 32 floats more
            return y

    x = torch.randn(5, 16)
    plain, extra = Net(False), Net(True)
    # the loss (_output: the mean of the squares) saves the output it squares
    assert _saved_bytes(plain, x) == (5 * 16 + 5 * 32) * 4
    assert _saved_bytes(extra, x) - _saved_bytes(plain, x) == 5 * 32 * 4


def test_train_rows_report_saved_bytes_of_both_models(monkeypatch):
    pytest.importorskip("torch")
    from normkit.bench import models

    monkeypatch.setattr(models, "_time_steps", lambda fn, model, opt, x, steps: 1e-3)
    train = models.measure_model("study-cnn-b2", "train", repeats=1)
    infer = models.measure_model("study-cnn-b2", "infer", repeats=1)
    assert train["untouched_saved_bytes"] > 0 and train["converted_saved_bytes"] > 0
    assert train["saved_ratio"] == pytest.approx(train["converted_saved_bytes"] /
                                                 train["untouched_saved_bytes"])
    assert infer["saved_ratio"] is None
    lines = models.format_models([train, infer]).splitlines()
    assert "saved MiB" in lines[0]
    assert f"{train['saved_ratio']:6.3f}" in lines[1]
    assert len(lines[2].split()) == len(lines[1].split()) - 3     # infer: no saved columns


def test_the_help_names_every_model(capsys):
    import re

    from normkit.bench.models import MODELS
    from normkit.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    named = set(re.findall(r"[\w-]+", capsys.readouterr().out))
    assert set(MODELS) <= named, set(MODELS) - named


def test_decode_rows_generate_the_same_tokens_and_are_timed(monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from normkit.bench import models

    plain, converted, count = models._pair(models.MODELS["llama-decode"][1])
    x = models.MODELS["llama-decode"][2]()
    want = models.decode_step(plain.eval(), None, x)
    assert want.shape == (1, x.shape[1] + models.DECODE_TOKENS)
    assert count == 9 and torch.equal(models.decode_step(converted.eval(), None, x), want)
    monkeypatch.setattr(models, "_time_steps", lambda fn, model, opt, x, steps: 1e-3)
    row = models.measure_model("llama-decode", "decode", repeats=1)
    assert row["mode"] == "decode" and row["ratio"] == 1.0 and row["saved_ratio"] is None
    assert models.format_models([row]).splitlines()[1].split()[:3] == [
        "llama-decode", "decode", "9"]
