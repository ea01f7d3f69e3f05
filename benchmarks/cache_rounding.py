"""Why normkit's kernels inline their helpers (``cpu.rows.JIT``): a jitted function with
a re-associable reduction, compiled on its own *and* linked into a cached caller, rounds
one way in the process that compiled it and another in a process that loads the caller
from numba's disk cache. Runs the same reduction both ways in two child processes that
share an empty ``NUMBA_CACHE_DIR`` (the first compiles and saves, the second loads).

    python benchmarks/cache_rounding.py

Seen with numba 0.68 on an AVX-512 machine: the separately compiled helper differs, the
inlined one does not; under ``NUMBA_CPU_NAME=generic`` or ``NUMBA_OPT=0`` neither does.
``tests/test_cpu_tuning.py`` checks the real kernels the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

CHILD = r'''
import hashlib
import numpy as np
from numba import njit
from normkit.backends.cpu.half import accumulate, like, load


def two_pass(xs, x0, inv_n, sdt):      # the rows' moments as they were (half.accumulate)
    s = like(sdt, 0.0)
    for i in range(xs.shape[0]):
        s = accumulate(s, load(xs, i) - x0)
    mean_x0 = s * inv_n
    q = like(sdt, 0.0)
    for i in range(xs.shape[0]):
        d = (load(xs, i) - x0) - mean_x0
        q = accumulate(q, d * d)
    return mean_x0, q


separate = njit(two_pass)                   # compiled on its own and linked in
inlined = njit(inline="always")(two_pass)   # inlined in numba's IR: one compilation


@njit(cache=True)
def rows_separate(x, out):
    for r in range(x.shape[0]):
        out[r] = separate(x[r], x[r, 0], np.float32(1.0 / x.shape[1]), out)[1]


@njit(cache=True)
def rows_inlined(x, out):
    for r in range(x.shape[0]):
        out[r] = inlined(x[r], x[r, 0], np.float32(1.0 / x.shape[1]), out)[1]


x = np.random.default_rng(0).standard_normal((64, 1280)).astype(np.float32)
for f in (rows_separate, rows_inlined):
    out = np.empty(64, np.float32)
    f(x, out)
    print(hashlib.sha1(out.tobytes()).hexdigest()[:10])
'''


def main() -> int:
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache,
                   PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH"))
                                              if p))
        with tempfile.NamedTemporaryFile("w", suffix=".py", dir=cache, delete=False) as f:
            f.write(CHILD)
        runs = [subprocess.run([sys.executable, f.name], env=env, capture_output=True,
                               text=True, check=True).stdout.split() for _ in range(2)]
    for k, name in enumerate(("helper compiled on its own", "helper inlined")):
        fresh, loaded = runs[0][k], runs[1][k]
        print(f"{name:28s} compiled {fresh}, loaded {loaded}: "
              f"{'same' if fresh == loaded else 'DIFFERENT'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
