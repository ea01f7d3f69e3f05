"""A missing optional dependency is named with the extra that installs it: importing a
torch-facing module, a scaler without scikit-learn, a command (each in a process where the
dependency cannot be imported)."""

import subprocess
import sys

import pytest

from normkit import _extras

# a process in which the top-level module BLOCKED cannot be imported, as if not installed
_RUN = """
import importlib, importlib.abc, sys
BLOCKED, WHAT = sys.argv[1], sys.argv[2]

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] == BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Block())
if WHAT.startswith("cli "):
    from normkit.cli import main
    print("exit", main(WHAT.split()[1:]))
elif WHAT == "scalers":
    import numpy as np
    from normkit.preprocessing import StandardScaler
    print("std", StandardScaler().fit_transform(np.arange(12.0).reshape(6, 2)).std(0))
else:
    try:
        importlib.import_module(WHAT) if WHAT.startswith("normkit.") else getattr(
            importlib.import_module("normkit"), WHAT)
    except ModuleNotFoundError as error:
        print("error", error.name, error)
"""


def _run(blocked, what):
    r = subprocess.run([sys.executable, "-c", _RUN, blocked, what], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout + r.stderr


@pytest.mark.parametrize("what,feature", [
    ("normkit.nn", "normkit.nn"), ("normkit.functional", "normkit.functional"),
    ("convert", "normkit.convert"), ("fold", "normkit.fold"), ("normkit.ops", "normkit.ops")])
def test_torch_facing_modules_name_the_torch_extra(what, feature):
    out = _run("torch", what)
    assert f"error torch {feature} needs torch" in out and "normkit[torch]" in out, out


def test_scalers_need_scikit_learn_not_torch():
    assert "normkit.preprocessing needs sklearn" in _run("sklearn", "normkit.preprocessing")
    assert "std [1. 1.]" in _run("torch", "scalers")


def test_a_command_says_which_extra_and_exits_2():
    out = _run("torch", "cli demo")
    assert "normkit demo needs torch" in out and "normkit[torch]" in out and "exit 2" in out


def test_other_errors_pass_through():
    error = ModuleNotFoundError("No module named 'yaml'", name="yaml")
    assert _extras.message(error, "x") is None and _extras.needs(error, "x") is error
    assert _extras.message(ModuleNotFoundError("", name="torch.fx"), "x").endswith(
        "pip install 'normkit[torch]'")
