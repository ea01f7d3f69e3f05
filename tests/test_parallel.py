"""``normkit.backends._parallel.launch``: every range runs once, on torch's OpenMP team
where torch has one, errors reach the caller, nested and forked launches work."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from normkit.backends import _parallel


def _recorder():
    seen, lock = [], threading.Lock()

    def kernel(tag, lo, hi):
        with lock:
            seen.append((tag, lo, hi, threading.get_ident()))
    return kernel, seen


@pytest.mark.parametrize("total,threads", [(10, 3), (7, 7), (5, 9), (100, 2), (1, 4)])
def test_every_range_runs_once(total, threads):
    kernel, seen = _recorder()
    _parallel.launch(kernel, total, threads, "t")
    ranges = sorted((lo, hi) for _, lo, hi, _ in seen)
    covered = [i for lo, hi in ranges for i in range(lo, hi)]
    assert covered == list(range(total))
    assert len(ranges) == min(threads, total) or ranges[-1][1] == total


def test_ranges_run_on_several_threads():
    kernel, seen = _recorder()
    # one range per thread: the ranges wait for each other, so they must run at once
    barrier = threading.Barrier(3, timeout=20)

    def waiting(tag, lo, hi):
        barrier.wait()
        kernel(tag, lo, hi)

    _parallel.launch(waiting, 3, 3, "t")
    assert len({ident for *_, ident in seen}) == 3


def test_torch_openmp_team_is_used_when_torch_runs_on_openmp():
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch is not built with OpenMP here")
    if sys.platform != "linux":
        pytest.skip("the OpenMP runtime is found through /proc/self/maps")
    assert _parallel.backend() == "openmp"


def test_an_error_in_a_range_reaches_the_caller():
    def kernel(lo, hi):
        if lo > 0:
            raise ZeroDivisionError(f"range {lo}")

    with pytest.raises(ZeroDivisionError, match="range"):
        _parallel.launch(kernel, 4, 2)


def test_nested_launch_covers_every_range():
    inner_kernel, seen = _recorder()

    def outer(lo, hi):
        _parallel.launch(inner_kernel, 6, 3, lo)

    _parallel.launch(outer, 2, 2)
    for tag in (0, 1):
        covered = sorted(i for t, lo, hi, _ in seen if t == tag for i in range(lo, hi))
        assert covered == list(range(6))


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
    # falls back to normkit's own threads instead of hanging
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
