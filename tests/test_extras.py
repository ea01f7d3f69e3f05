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


@pytest.mark.parametrize("command", ["demo", "bench --quick"])
def test_a_command_says_which_extra_and_exits_2(command):
    # bench times in child processes: without torch it gave their traceback
    out = _run("torch", f"cli {command}")
    name = command.split()[0]
    assert f"normkit {name} needs torch" in out and "normkit[torch]" in out and "exit 2" in out


@pytest.mark.parametrize("blocked", ["pyarrow", "sklearn"])
def test_scale_names_both_extras_it_needs_once(blocked, tmp_path):
    data = tmp_path / "t.csv"
    data.write_text("a,b\n1,2\n3,5\n")
    out = _run(blocked, f"cli scale fit {data} -o {tmp_path / 's.json'}")
    assert f"error: it needs {blocked}," in out and out.count("pip install") == 1, out
    assert "normkit[io,sklearn]" in out and "exit 2" in out, out


def test_other_errors_pass_through():
    error = ModuleNotFoundError("No module named 'yaml'", name="yaml")
    assert _extras.message(error, "x") is None and _extras.needs(error, "x") is error
    assert _extras.message(ModuleNotFoundError("", name="torch.fx"), "x").endswith(
        "pip install 'normkit[torch]'")


# a layer's call in a process where BLOCKED is missing, or installed but failing to import
_KERNELS = """
import importlib.abc, importlib.util, sys, warnings
BLOCKED, HOW = sys.argv[1], sys.argv[2]

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] == BLOCKED:
            if HOW != "broken":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            raise ImportError("Numba needs NumPy 2.3 or less. Got NumPy 2.4.")

sys.meta_path.insert(0, Block())
if HOW == "absent":                  # not found at all (find_spec None), as pip leaves it
    find_spec = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a: None if name == BLOCKED else find_spec(name, *a)
import numpy as np
import torch
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from normkit.preprocessing import StandardScaler
    import normkit.nn as K
    print("std", StandardScaler().fit_transform(np.arange(12.0).reshape(6, 2)).std(0))
    x = torch.randn(3, 16)
    y = K.LayerNorm(16)(x)
    K.LayerNorm(16)(x)
print("max", float((y - torch.nn.functional.layer_norm(x, (16,))).abs().max()))
print("warned", [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)])
"""


@pytest.mark.parametrize("blocked,how,warned", [
    ("numba", "missing", 0), ("triton", "missing", 0), ("triton", "absent", 0),
    ("numba", "broken", 2)])
def test_kernels_not_installed_are_left_out_quietly_but_broken_ones_warn(blocked, how,
                                                                        warned):
    """Without the extra the composite torch path (the scalers' NumPy path) runs, as
    documented; an extra that is installed but fails to import (numba refusing a newer
    NumPy) said nothing before."""
    r = subprocess.run([sys.executable, "-c", _KERNELS, blocked, how], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert float(r.stdout.split("max ")[1].split()[0]) < 1e-5, r.stdout
    assert "std [1. 1.]" in r.stdout, r.stdout
    messages = r.stdout.split("warned ")[1]
    assert messages.count("kernels failed to import") == warned, r.stdout   # layers, scalers
    if warned:
        assert "Numba needs NumPy" in messages and "normkit[fast]" in messages, r.stdout
