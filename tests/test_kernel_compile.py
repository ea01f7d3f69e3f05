"""What a kernel entry compiles on an empty numba cache: one function, its helpers inlined
into it. A helper inlined after typing (``register_jitable(inline="always")``) is first
compiled whole on its own, once per call site, and a nest of them made LayerNorm's
backward compile for 43 s (now 9 s; docs/performance.md, "First call"). The times are
not asserted (they belong to the machine); what was compiled is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("numba")

# compiles one entry in a fresh process, listing each function numba compiled on its own
_COMPILE = """
import json, sys
import numpy as np
from numba.core import compiler, dispatcher

compiled = []
original = compiler.compile_extra

def listed(typingctx, targetctx, func, *rest, **kw):
    compiled.append([getattr(func, "__module__", ""), getattr(func, "__qualname__", str(func))])
    return original(typingctx, targetctx, func, *rest, **kw)

compiler.compile_extra = dispatcher.compiler.compile_extra = listed
from normkit.backends.cpu import args, entries
args.quiet()
args.callback(getattr(entries, sys.argv[1]), np.empty(0, np.float32), np.empty(0, np.float32))
print(json.dumps(compiled))
"""


def _compiled(entry, cache):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    r = subprocess.run([sys.executable, "-c", _COMPILE, entry], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return [tuple(f) for f in json.loads(r.stdout.splitlines()[-1])]


#: the kernels' helpers with loops, inlined into the entries before typing
_INLINED = {"normkit.backends.cpu.rows": ("_rows_forward", "_rows_backward", "_row_backward",
                                          "_grad_run"),
            "normkit.backends.cpu.planes": ("_plane_sums", "_unit_coefs"),
            "normkit.backends.cpu.moments": ("_deviation_sums", "split_mean", "_plane_shifted",
                                             "plane_merge", "_fetch_ahead")}


@pytest.mark.parametrize("entry", ["rows_backward", "channels_forward", "planes_backward"])
def test_an_entry_compiles_its_helpers_inlined(entry, tmp_path):
    compiled = _compiled(entry, tmp_path)
    names = [name for _, name in compiled]
    assert names.count(f"make.<locals>.{entry}") == 1, names           # the entry itself
    alone = [f for f in compiled if f[1] in _INLINED.get(f[0], ())]
    assert not alone, alone
    # no array assignment: it brings numba's shape-mismatch error and its string formatting
    assert not [n for n in names if "raise_with_shape_context" in n], names


def test_the_listed_helpers_are_inlined_before_typing():
    import importlib

    for module, names in _INLINED.items():
        for name in names:
            helper = getattr(importlib.import_module(module), name)
            assert helper.targetoptions.get("inline") == "always", (module, name)
