"""The ``normkit`` command: help lists every subcommand; the demo runs."""

import subprocess
import sys

import pytest

from normkit.cli import SUBCOMMANDS, main


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


def test_demo_runs_and_reports_small_differences():
    pytest.importorskip("torch")
    res = subprocess.run([sys.executable, "-m", "normkit", "demo"], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "-0.2675, 1.4464, -1.1036, 0.8611, -0.9364" in res.stdout
    assert "swapped 2 module(s)" in res.stdout
    diffs = [float(line.split()[-2]) for line in res.stdout.splitlines()
             if line.strip().startswith(("BatchNorm2d(", "GroupNorm(", "LayerNorm(", "RMSNorm("))]
    assert len(diffs) == 4 and max(diffs) < 1e-4


def test_commands_start_with_docstrings_stripped():
    """``python -OO`` (PYTHONOPTIMIZE=2) removes docstrings; the commands took their
    descriptions from them and failed with an AttributeError on None."""
    for command in (["normkit", "--help"], ["normkit", "scale", "--help"],
                    ["normkit.backends.cpu", "--help"], ["normkit.conversion.sweep", "--help"]):
        res = subprocess.run([sys.executable, "-OO", "-m", *command], capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0 and "usage:" in res.stdout, (command, res.stderr[-2000:])


@pytest.mark.parametrize("command", [["explain", "layer"], ["study", "--quick", "--no-progress"]])
@pytest.mark.parametrize("below, said", [("", "is a file, not a folder"),
                                         ("/pictures", "cannot be made a folder")])
def test_an_out_that_cannot_be_a_folder_is_refused_before_any_work(tmp_path, capsys, command, below,
                                                                  said):
    # it was os.makedirs's traceback, after the text (explain) or the data's loading (study)
    taken = tmp_path / "taken"
    taken.write_text("a file")
    assert main([*command, "--out", f"{taken}{below}"]) == 2
    captured = capsys.readouterr()
    assert said in captured.err and not captured.out
    assert taken.read_text() == "a file"
