"""The scalers in a forked child process (a DataLoader worker, Linux's default): GNU
OpenMP, under numba's threads and torch's, is not fork-safe, so a forked child takes the
NumPy path (``preprocessing._kernels``)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("sklearn")
from normkit.preprocessing import MinMaxScaler, StandardScaler  # noqa: E402

_FORK_AFTER_TORCH = """
import os, sys, numpy as np, torch
from normkit.preprocessing import StandardScaler
scaler = StandardScaler.load(sys.argv[1])   # fitted elsewhere: no numba thread ran here
torch.randn(2048, 2048).sum(0)              # but torch's threads did
X = np.random.default_rng(0).normal(size=(40_000, 9))
pid = os.fork()
if pid == 0:
    scaler.transform(X)
    os._exit(0)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX's")
def test_a_forked_child_scales(tmp_path):
    # A DataLoader worker (forked) transforming with a scaler. GNU OpenMP is not fork-safe:
    # numba's OpenMP layer ended such a child at its first parallel kernel, at any size,
    # where the parent had run numba's threads ("fork() called from a process already using
    # GNU OpenMP"); it hung there where the parent had run torch's (a fresh process below).
    # A forked child takes the NumPy path: the same transform bits, the same fit to rounding.
    pytest.importorskip("numba")
    X = np.random.default_rng(3).normal(size=(40_000, 9)) * 5 + 2
    fitted = [StandardScaler().fit(X), MinMaxScaler().fit(X)]
    want = [s.transform(X[:5]) for s in fitted]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # the child: report, then leave at once
        try:
            got = [s.transform(X[:5]) for s in fitted]
            refit = StandardScaler().fit(X)
            payload = pickle.dumps((got, refit.mean_, refit.var_))
        except BaseException as error:             # noqa: BLE001 -- reported to the parent
            payload = pickle.dumps(repr(error))
        with os.fdopen(write, "wb") as out:
            out.write(payload)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as source:
        payload = source.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child was ended"
    result = pickle.loads(payload)
    assert not isinstance(result, str), result
    got, mean, var = result
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_allclose(mean, fitted[0].mean_, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(var, fitted[0].var_, rtol=1e-12)

    pytest.importorskip("torch")
    path = tmp_path / "scaler.json"
    fitted[0].save(path)
    run = subprocess.run([sys.executable, "-c", _FORK_AFTER_TORCH, str(path)], timeout=60,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
