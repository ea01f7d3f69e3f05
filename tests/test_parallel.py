"""Threads of the C++ executor: torch's OpenMP team found (``normkit.backends._parallel``),
calls from several Python threads at once, and a forked child that runs threaded plans."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from normkit.backends import _parallel


def test_torch_openmp_team_is_used_when_torch_runs_on_openmp():
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch is not built with OpenMP here")
    if sys.platform != "linux":
        pytest.skip("the OpenMP runtime is found through /proc/self/maps")
    assert _parallel.backend() == "openmp"
    addresses = _parallel.team_addresses()
    assert len(addresses) == 3 and all(isinstance(a, int) and a > 0 for a in addresses)


def test_launches_from_several_python_threads_at_once():
    # each Python thread is the master of its own OpenMP team; the results must not mix
    import numpy as np

    import normkit.functional as NF

    xs = [torch.randn(256, 512, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    want = [torch.nn.functional.layer_norm(x, (512,)) for x in xs]
    got = [None] * 4

    def work(i):
        for _ in range(5):
            got[i] = NF.layer_norm(xs[i], (512,))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-5)


def test_forked_child_runs_threaded_kernels():
    # GNU OpenMP is not fork-safe: a child of a process that opened a parallel region
    # runs the plan's ranges one after the other instead of hanging
    script = textwrap.dedent("""
        import os, sys, torch
        import normkit.functional as NF
        x = torch.randn(512, 1024)
        y = NF.layer_norm(x, (1024,))          # threaded: 512 * 1024 elements
        pid = os.fork()
        if pid == 0:
            y2 = NF.layer_norm(x, (1024,))
            os._exit(0 if (y2.numpy() == y.numpy()).all() else 3)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    done = subprocess.run([sys.executable, "-c", script], timeout=120)
    assert done.returncode == 0
