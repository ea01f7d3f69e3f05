"""The CI slice of ``python -m normkit.conversion.sweep``: transformers base models built
from small default configs, an eval forward and a training step untouched, converted and in
float64; none breaks, none differs, every norm module runs on normkit."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from normkit.conversion import sweep, sweep_models  # noqa: E402

CLASSES = dict(sweep_models.base_models())


@pytest.mark.parametrize("model_type", sweep.FAST)
def test_fast_slice_model_neither_breaks_nor_differs(model_type):
    record = sweep.run_model(model_type, CLASSES[model_type])
    assert record["status"] == "tested", record
    assert record["norms"] > 0 and record["on_normkit"] == record["norms"], record["left"]
    assert record["reverted"] is True, record["reverted"]       # convert, then revert
    for mode in ("eval", "train"):
        step = record["steps"][mode]
        assert "broken" not in step, step
        assert "different" in step, step                 # judged against float64
        assert not step["different"], (mode, step)


@pytest.mark.parametrize("model_type,adds,activations", [("llama", 2, 0), ("resnet", 0, 9)])
def test_fused_conversion_neither_breaks_nor_differs(model_type, adds, activations):
    """``--fuse``: converted with fuse_residual and fuse_activation, judged the same way."""
    record = sweep.run_model(model_type, CLASSES[model_type], fuse=True)
    assert record["status"] == "tested", record
    assert (record["fused_adds"], record["fused_activations"]) == (adds, activations)
    assert record["reverted"] is True, record["reverted"]
    for mode in ("eval", "train"):
        step = record["steps"][mode]
        assert "broken" not in step and step["different"] is False, (mode, step)
    assert "fused_adds" not in sweep.run_model(model_type, CLASSES[model_type])


def test_a_revert_that_leaves_the_conversion_is_reported(monkeypatch):
    import normkit

    monkeypatch.setattr(normkit, "revert", lambda model: None)
    record = sweep.run_model("llama", CLASSES["llama"])
    assert record["reverted"] == "module classes differ"
    assert sweep.summarize([record])["not_reverted"] == ["llama"]


def test_different_is_materially_worse_than_the_untouched_error():
    assert not sweep.different(2e-6, 1e-6)       # rounding in another order
    assert not sweep.different(5e-7, 0.0)        # within the floor
    assert sweep.different(1e-3, 1e-6)           # a wrong formula
    assert sweep.different(float("nan"), 1e-6)
    assert sweep.different(float("inf"), 1e-6)


def test_command_writes_resumable_records_and_summarizes(tmp_path, capsys):
    out = tmp_path / "sweep.jsonl"
    sweep.main(["olmo", "--out", str(out)])
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["model"] == "olmo" and record["status"] == "tested"
    printed = capsys.readouterr().out
    assert "broken: 0" in printed and "different: 0" in printed and "(100.00 %)" in printed
    assert "reverted: 1 equal to the untouched model" in printed and "; not: 0" in printed
    sweep.main(["olmo", "--out", str(out)])                  # resumed: nothing runs again
    assert len(out.read_text().splitlines()) == 1
    capsys.readouterr()
    sweep.main(["llama", "--fuse", "--out", str(tmp_path / "fused.jsonl")])
    assert "fused: 2 residual adds, 0 BatchNorm activations, in 1 models" in \
        capsys.readouterr().out
    with pytest.raises(SystemExit):
        sweep.main(["no_such_model", "--out", str(out)])


# --- timm's zoo (``--zoo timm``): timm is no dependency of the suite ----------------------

def test_timm_picks_one_small_model_per_family():
    from normkit.conversion import sweep_timm

    names = ["resnet101", "resnet18", "resnet50", "convnext_base", "convnext_tiny",
             "convnext_atto", "vit_base_patch16_224", "vit_tiny_patch16_224",
             "xcit_medium_24_p8_224", "xcit_large_24_p8_224"]
    assert sweep_timm.pick(names) == ["convnext_atto", "resnet18", "vit_tiny_patch16_224",
                                      "xcit_large_24_p8_224"]


def test_a_timm_model_that_does_not_build_is_not_tested():
    record = sweep.run_model("no_such_model", "timm")
    assert record["status"] == "not built" and record["error"], record


@pytest.mark.parametrize("name", ["resnet18", "convnext_atto"])
def test_timm_models_neither_break_nor_differ(name):
    pytest.importorskip("timm")
    record = sweep.run_model(name, "timm")
    assert record["status"] == "tested", record
    assert record["norms"] > 0 and record["on_normkit"] == record["norms"], record["left"]
    for step in record["steps"].values():
        assert "broken" not in step and step.get("different") is False, step
