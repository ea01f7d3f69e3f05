"""How the C++ executor is built and loaded (``normkit.backends.cpu.native``): a build
killed midway, a build in progress in another process, no compiler, the switch off."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("numba")
import normkit.functional as NF  # noqa: E402
from normkit.backends.cpu import native  # noqa: E402

if not native.enabled():
    pytest.skip("NORMKIT_NATIVE=0: the C++ node is switched off", allow_module_level=True)


pytestmark = pytest.mark.usefixtures("native_on")


_LOAD = "from normkit.backends.cpu import native; assert native.extension() is not None"


def _load_from(folder):
    """A new process loading the executor from a copy of this one's build folder."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(folder.parent))
    return subprocess.Popen([sys.executable, "-c", _LOAD], env=env, stderr=subprocess.PIPE,
                            text=True)


def _copy_of_the_build(tmp_path):
    built = Path(native.extension().__file__).parent
    return Path(shutil.copytree(built, tmp_path / built.name, symlinks=True,
                                ignore=shutil.ignore_patterns("lock", "normkit.lock")))


def test_a_build_killed_midway_does_not_stop_the_next_process(tmp_path):
    # torch's lock file, as a process killed during the build leaves it: every later
    # process waited for it forever
    folder = _copy_of_the_build(tmp_path)
    (folder / "lock").touch()
    loading = _load_from(folder)
    try:
        _, err = loading.communicate(timeout=60)
    finally:
        loading.kill()
    assert loading.returncode == 0, err
    if native._lock_file_blocks():      # torch's FileBaton: the file is the lock
        assert "removing" in err and "did not finish" in err, err
        assert not (folder / "lock").exists()
    else:                               # torch >= 2.14.1 locks the file: nothing to remove
        assert "removing" not in err, err


def test_torchs_os_lock_file_is_left_alone(tmp_path, monkeypatch, capsys):
    # torch 2.14.1 and later hold an OS lock on its file and keep the file: taking it for
    # a dead build's said "did not finish" at every start (and could remove it under a
    # live holder)
    from torch.utils import cpp_extension

    monkeypatch.delattr(cpp_extension, "FileBaton", raising=False)
    (tmp_path / "lock").touch()
    with native._sole_builder(tmp_path):
        pass
    assert (tmp_path / "lock").exists() and "removing" not in capsys.readouterr().err


def test_a_build_in_progress_is_waited_for(tmp_path):
    # a live builder holds the OS lock: its lock file stays, the next process waits
    import fcntl

    folder = _copy_of_the_build(tmp_path)
    with open(folder / "normkit.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (folder / "lock").touch()
        loading = _load_from(folder)
        with pytest.raises(subprocess.TimeoutExpired):
            loading.wait(timeout=8)
        (folder / "lock").unlink()        # the build finishes: torch removes its file
    try:
        _, err = loading.communicate(timeout=60)
    finally:
        loading.kill()
    assert loading.returncode == 0, err
    assert "removing" not in err, err


_FOLDER = "from normkit.backends.cpu import native; print(native.build_folder())"


def test_each_install_builds_in_a_folder_of_its_own(tmp_path):
    # one folder for every install on a machine: a checkout and a wheel (two environments)
    # each rebuilt the executor, 20-40 s, at every switch between them
    assert Path(native.extension().__file__).parent == native.build_folder()
    src = Path(native.__file__).parents[3]
    other = tmp_path / "other-install"
    shutil.copytree(src / "normkit", other / "normkit",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    folders = {}
    for name, where in [("this", src), ("again", src), ("other", other)]:
        env["PYTHONPATH"] = str(where)
        folders[name] = subprocess.run([sys.executable, "-c", _FOLDER], env=env, check=True,
                                       capture_output=True, text=True, timeout=120).stdout.strip()
    assert folders["this"] == folders["again"] != folders["other"], folders
    assert all(Path(f).parent == tmp_path / "extensions" for f in folders.values()), folders


_NO_COMPILER = """
import warnings, torch, normkit.nn as nknn
x = torch.randn(3, 8, requires_grad=True)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    ys = [nknn.LayerNorm(8)(x) for _ in range(2)]
ref = torch.nn.LayerNorm(8)(x)
assert all(torch.allclose(y, ref, atol=1e-6) for y in ys)
print(ys[0].grad_fn.name())
for w in seen:
    print(w.category.__name__, w.filename, " ".join(str(w.message).split()))
"""


@pytest.mark.parametrize("missing", ["compiler", "build folder"])
def test_without_a_compiler_the_composite_path_runs_with_one_warning(tmp_path, missing):
    if missing == "compiler":
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), CXX=str(tmp_path / "no-c++"))
    else:                               # a folder that cannot be made: below a plain file
        (tmp_path / "file").touch()
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "file" / "extensions"))
    out = subprocess.run([sys.executable, "-c", _NO_COMPILER], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "NormNode" not in lines[0], lines
    built = [line for line in lines[1:] if "could not build its C++ executor" in line]
    assert len(built) == 1 and built[0].startswith("RuntimeWarning"), lines
    assert "composite torch path" in built[0] and "concurrent" not in built[0], built
    assert ("compiler" if missing == "compiler" else "TORCH_EXTENSIONS_DIR") in built[0], built


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("NORMKIT_NATIVE", "0")
    native.switch(True)
    with pytest.warns(RuntimeWarning, match="switched off"):
        assert not native.enabled() and native.extension() is None
    y = NF.layer_norm(torch.randn(3, 8, requires_grad=True), (8,))
    assert y.grad_fn is None or "NormNode" not in y.grad_fn.name()
    monkeypatch.delenv("NORMKIT_NATIVE")
    native.switch(True)
    assert native.extension() is not None


def test_a_file_system_without_locks_leaves_torchs_lock_alone(tmp_path, monkeypatch):
    # flock refused (an NFS mount without a lock service, say): the build goes on under
    # torch's lock alone rather than failing, and removes nothing it cannot prove stale
    import errno
    import fcntl

    def refused(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refused)
    (tmp_path / "lock").touch()
    with native._sole_builder(tmp_path):
        entered = True
    assert entered and (tmp_path / "lock").exists()
