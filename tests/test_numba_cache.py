"""Where numba finds no writable folder for its cache (a read-only install whose user has
no writable home: containers with a read-only root filesystem, serverless runtimes),
normkit's kernels compile without it and say so once; importing them used to raise
numba's "cannot cache function ...: no locator available"."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("numba")

_NO_FOLDER = """
import sys, warnings
from numba.core.caching import FunctionCache
FunctionCache._impl_class._locator_classes = []      # numba finds no writable folder
warnings.simplefilter("error")                       # any other warning fails the run
import numpy as np
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import normkit.preprocessing as P
    if sys.argv[1] == "torch":
        import torch
        import normkit.nn as K
        from normkit.backends.cpu import args
        args.NOTICE_AFTER_S = 0.0
        x = torch.randn(6, 40, dtype=torch.float64)
        with torch.no_grad():
            y = K.LayerNorm(40, dtype=torch.float64)(x)
        ref = torch.nn.functional.layer_norm(x, (40,))
        print("layer_norm", float((y - ref).abs().max()))
X = np.random.default_rng(0).normal(3.0, 2.0, (500, 4))
Z = P.StandardScaler().fit_transform(X)
print("scaler", float(abs(Z.mean(0)).max()), float(abs(Z.std(0) - 1).max()))
print("warnings", [str(w.message)[:60] for w in caught])
"""


def _run(which, tmp_path):
    env = dict(os.environ)
    env.pop("NUMBA_CACHE_DIR", None)
    r = subprocess.run([sys.executable, "-c", _NO_FOLDER, which], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout, r.stderr


def _values(out, name):
    line = next(line for line in out.splitlines() if line.startswith(name))
    return line[len(name):].split()


def test_scalers_fit_without_a_cache_folder_and_say_so_once(tmp_path):
    out, _ = _run("numpy", tmp_path)
    mean, std = map(float, _values(out, "scaler"))
    assert mean < 1e-12 and std < 1e-12
    assert out.count("numba finds no writable folder") == 1, out


def test_layers_run_their_kernels_without_a_cache_folder(tmp_path):
    pytest.importorskip("torch")           # (the C++ executor: conftest requires it)
    out, err = _run("torch", tmp_path)
    assert float(_values(out, "layer_norm")[0]) < 1e-12
    assert out.count("numba finds no writable folder") == 2, out   # the two kernel folders
    assert "in each process: numba finds no writable folder" in err, err


_WHERE = """
import sys
from pathlib import Path
import torch
from normkit.backends.cpu import _cache, args, entries, plans   # the stale check runs
args.callback(entries.planes_small, *plans.protos(torch.float64))
root = Path(sys.argv[1])
print(sorted({str(p.parent) for p in root.rglob(_cache.STAMP)}))
print(sorted({str(p.parent) for p in root.rglob("*.nbi")}))
"""


def test_the_stale_kernel_check_looks_where_numba_caches(tmp_path):
    """``_cache`` stamps the folder numba itself writes the kernels to (it asked numba's
    search; before, it assumed ``__pycache__`` unless ``NUMBA_CACHE_DIR`` was set, and
    missed the user's cache folder of a read-only install)."""
    pytest.importorskip("torch")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", _WHERE, str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    stamps, kernels = r.stdout.splitlines()
    assert stamps == kernels and stamps.count(str(tmp_path)) == 1, r.stdout
