"""``normkit.backends.cpu``: the interface (supports/forward/backward) and layout choice."""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("numba")

import normkit.functional as NF  # noqa: E402
from normkit import backends  # noqa: E402
from normkit import grouping as G  # noqa: E402
from normkit.backends import cpu, torch_ops  # noqa: E402
from normkit.backends.cpu import native  # noqa: E402


def test_dispatch_picks_the_numba_backend_on_cpu():
    x = torch.randn(4, 8, 5, 5)
    assert backends.select(x, G.layer(x.shape, 2)) is cpu
    assert backends.select(x, G.batch(x.shape)) is cpu
    assert backends.select(x.to(memory_format=torch.channels_last), G.group(x.shape, 2)) is cpu
    assert backends.select(x.bfloat16(), G.instance(x.shape), fixed=True) is cpu
    # what it does not handle falls back to the composite path
    assert backends.select(x, G.dims(x.shape, (0, 2))) is torch_ops
    assert backends.select(x.transpose(2, 3), G.layer(x.shape, 1)) is torch_ops
    assert backends.select(x.to(torch.int32), G.layer(x.shape, 1)) is torch_ops


def test_layout_names_the_kernel_family():
    x = torch.randn(4, 8, 5, 5)
    assert cpu.layout(x.view(-1, 5), G.layer(x.shape, 1)) == "rows"
    assert cpu.layout(x.view(4, 8, 25), G.batch(x.shape)) == "planes"
    xc = x.to(memory_format=torch.channels_last)
    assert cpu.layout(xc.view(4, 8, 25), G.instance(x.shape)) == "channels_last"
    # BatchNorm on rows of channels: channels_last, and (N, C) (one position per channel)
    assert cpu.layout(xc.view(4, 8, 25), G.batch(x.shape)) == "columns"
    assert cpu.layout(torch.randn(7, 6).view(7, 6, 1), G.batch((7, 6))) == "columns"
    rows_apart = torch.randn(6, 20)[:, :10]                        # (M, K), rows not adjacent
    assert cpu.layout(rows_apart, G.layer(rows_apart.shape, 1)) is None


def test_functional_runs_the_cpp_executor():
    # every CPU call of a supported input runs a C++ plan (recorded by its node); switched
    # off, the composite torch path
    x = torch.randn(3, 7, requires_grad=True)
    assert "NormNode" in NF.layer_norm(x, [7]).grad_fn.name()
    assert hasattr(backends.plan(x.detach(), G.layer(x.shape, 1)), "apply")
    native.switch(False)
    try:
        assert "NormNode" not in NF.layer_norm(x, [7]).grad_fn.name()
        assert not hasattr(backends.plan(x.detach(), G.layer(x.shape, 1)), "apply")
    finally:
        native.switch(True)


def test_cached_kernels_are_dropped_when_a_source_changes(tmp_path):
    """numba keys a cached kernel to its own file only; the package's digest of all its
    sources decides whether the cached kernels may be loaded."""
    from normkit.backends.cpu import _cache

    src = tmp_path / "src"
    src.mkdir()
    (src / "stores.py").write_text("A = 1\n")
    (src / "rows.py").write_text("B = 2\n")
    cache = tmp_path / "cache"
    digest = _cache.sources_digest(src.glob("*.py"))
    assert _cache.drop_stale(cache, digest) == 0           # nothing cached yet: stamp written
    for name in ("rows.rows_forward-40.py311.nbi", "rows.rows_forward-40.py311.1.nbc"):
        (cache / name).write_bytes(b"compiled")
    assert _cache.drop_stale(cache, digest) == 0           # same sources: kept
    assert len(list(cache.glob("*.nb?"))) == 2
    (src / "stores.py").write_text("A = 3\n")              # a file the kernels inline
    changed = _cache.sources_digest(src.glob("*.py"))
    assert changed != digest
    assert _cache.drop_stale(cache, changed) == 2          # stale: removed
    assert not list(cache.glob("*.nb?"))
    assert _cache.drop_stale(cache, changed) == 0


def test_the_modules_whose_edits_keep_the_cache_define_no_kernel():
    """``_cache.NOT_KERNELS``, the modules whose edits keep the compiled kernels, define no
    jitted code and generate none (``args`` generates the callbacks: numba keys them to
    its own stamp)."""
    import re
    from pathlib import Path

    from normkit.backends.cpu import _cache

    here = Path(_cache.__file__).parent
    for name in _cache.NOT_KERNELS:
        text = (here / name).read_text()
        assert not re.search(r"@\s*(numba\.)?(njit|jit|cfunc|overload\w*|intrinsic|vectorize)"
                             r"|\b(njit|jit|cfunc)\s*\(", text), name


_HASH_RUN = r"""
import hashlib, sys, torch, normkit.functional as NF
from normkit.backends.cpu import compiling
compiling.ENABLED = sys.argv[1] == "helper"
torch.manual_seed(0)
out = []
for op, shape in (("layer", (64, 1280)), ("rms", (16, 300)), ("batch", (8, 16, 33, 31)),
                  ("group", (4, 32, 9, 9)), ("batch_act", (8, 16, 33, 31))):
    x = torch.randn(shape, requires_grad=True)
    c = shape[-1] if op in ("layer", "rms") else shape[1]
    w = torch.randn(c, requires_grad=True)
    y = {"layer": lambda: NF.layer_norm(x, (c,), w), "rms": lambda: NF.rms_norm(x, (c,), w),
         "batch": lambda: NF.batch_norm(x, None, None, w, training=True),
         "batch_act": lambda: NF.batch_norm_act(x, None, None, w, training=True,
                                                activation="silu"),
         "group": lambda: NF.group_norm(x, 8, w)}[op]()
    y.backward(torch.randn_like(y))
    parts = (y.detach(), x.grad, w.grad)
    out.append(op + ":" + hashlib.sha1(b"".join(t.numpy().tobytes() for t in parts)).hexdigest())
print(" ".join(out))
"""


def test_kernels_round_the_same_compiled_or_loaded_from_the_cache(tmp_path):
    """A process that compiles the kernels, one that has the compile helper compile its
    backward entries (``compiling``), and one that loads them all from numba's disk cache
    give the same bits (forward and backward of each family, and of a fused BatchNorm).
    They did not while a helper with a re-associable reduction was compiled on its own as
    well as inlined in a cached caller (``cpu.rows.JIT``; benchmarks/cache_rounding.py)."""
    import os
    import subprocess
    import sys

    def run(folder, helper):
        env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / folder))
        r = subprocess.run([sys.executable, "-c", _HASH_RUN, helper], env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout.split()

    compiled, aside, loaded = run("a", "off"), run("b", "helper"), run("b", "off")
    assert list((tmp_path / "a").rglob("*.nbc")), "the first run cached nothing"
    assert compiled == aside == loaded


_ASIDE_RUN = """
import sys, torch
from normkit.backends.cpu import compiling, entries, plans
if sys.argv[1] == "failing":       # a helper that leaves at once: this process compiles all
    compiling._start = lambda: compiling.subprocess.Popen(
        [sys.executable, "-c", "pass"], stdin=compiling.subprocess.PIPE,
        stdout=compiling.subprocess.PIPE, text=True)
compiling.ENABLED = True
pair = (entries.channels_fixed, entries.planes_small)
made = compiling.callbacks(pair, *plans.protos(torch.float64))
again = compiling.callbacks(pair, *plans.protos(torch.float64))
helper = compiling._helper
compiling._close()
print(*(f.cache_hits for f in made), all(f.address for f in made),
      all(a is b for a, b in zip(made, again)), helper is None or helper.poll() == 0)
"""


@pytest.mark.parametrize("helper", ["working", "failing"])
def test_a_plans_entries_compile_side_by_side_on_an_empty_cache(tmp_path, helper):
    """Of a plan's two cold entries, the first compiles in this process and the second in
    the compile helper (loaded from numba's cache after: one cache hit); a helper that
    fails leaves both to this process. The helper exits when its input is closed."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", _ASIDE_RUN, helper], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    hits = "1" if helper == "working" else "0"
    assert r.stdout.split() == ["0", hits, "True", "True", "True"]


_LEFT_OPEN = """
import torch
from normkit.backends.cpu import compiling, entries, plans
compiling.ENABLED = True
compiling.callbacks((entries.channels_fixed, entries.planes_small), *plans.protos(torch.float64))
print(compiling._helper is not None and compiling._helper.poll() is None)
"""


def test_a_helper_still_running_is_closed_at_exit(tmp_path):
    # the process ends within the helper's idle time: closed at exit, not left to the
    # interpreter's end ("ResourceWarning: subprocess ... is still running", open pipes)
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-X", "dev", "-c", _LEFT_OPEN], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.split() == ["True"], r.stderr[-3000:]
    assert "ResourceWarning" not in r.stderr, r.stderr[-3000:]


_COMPILE_RUN = """
import sys
import torch
from normkit.backends.cpu import args, entries, plans
args.NOTICE_AFTER_S = 0.0          # every compilation or load counts as slow
if sys.argv[1] == "ahead":
    plans.compile_entry("planes_small", ["float64"])
else:
    args.callback(entries.planes_small, *plans.protos(torch.float64))
    args.callback(entries.planes_small, *plans.protos(torch.float32))
"""


def test_a_compilation_says_so_once_and_compiling_ahead_says_nothing(tmp_path):
    """A kernel compiling at a call prints one line on standard error, once per process;
    ``compile_entry`` (``python -m normkit.backends.cpu``) compiles into the cache
    without it."""
    import os
    import subprocess
    import sys

    from normkit.backends.cpu import args

    def run(which, folder):
        env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / folder))
        r = subprocess.run([sys.executable, "-c", _COMPILE_RUN, which], env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stderr

    notice = args._NOTICE.format(args._CACHED)
    assert run("call", "a").count(notice) == 1
    assert notice not in run("ahead", "b")
    assert list((tmp_path / "b").rglob("*planes_small*.nbc"))


def test_compiling_ahead_from_the_command_line(monkeypatch, capsys):
    """``python -m normkit.backends.cpu``: the executor, then each entry for the dtypes
    asked for, in worker processes."""
    from normkit.backends.cpu import __main__ as ahead
    from normkit.backends.cpu import entries

    monkeypatch.setattr(entries, "__all__", ["planes_small"])
    assert ahead.main(["--dtypes", "float64", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "executor: ready" in out and "1 entries for float64" in out
    with pytest.raises(SystemExit):
        ahead.main(["--dtypes", "float8"])


def test_compiling_ahead_compiles_the_entries_while_the_executor_builds(monkeypatch, capsys,
                                                                        tmp_path):
    """The entries compile in the worker processes while the executor builds (the build
    waits here until a worker has written an entry to numba's cache); where numba finds
    no folder for its cache, the executor still builds and nothing compiles."""
    import time

    import normkit._numba_cache
    from normkit.backends.cpu import __main__ as ahead
    from normkit.backends.cpu import entries, native

    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))      # (read by the workers)
    monkeypatch.setattr(entries, "__all__", ["planes_small"])
    seen = []

    def build():
        deadline = time.time() + 120
        while not (found := list(tmp_path.rglob("*planes_small*.nbc"))) and time.time() < deadline:
            time.sleep(0.2)
        seen.append(bool(found))
        return "extension"

    monkeypatch.setattr(native, "extension", build)
    assert ahead.main(["--dtypes", "float64", "--jobs", "1"]) == 0
    assert seen == [True]
    assert "1 entries for float64" in capsys.readouterr().out
    monkeypatch.setattr(normkit._numba_cache, "can_cache", lambda where: False)
    monkeypatch.setattr(native, "extension", lambda: seen.append("built") or "extension")
    assert ahead.main(["--dtypes", "float64", "--jobs", "1"]) == 1
    out = capsys.readouterr().out
    assert seen[-1] == "built" and "executor: ready" in out and "not compiled ahead" in out


@contextlib.contextmanager
def _torch_threads(n):
    """torch (and so the CPU executor) on ``n`` threads, restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _rounding_units(y, exact):
    """|y - exact| in float32 rounding units of the result's size (at least 1)."""
    return (y.double() - exact).abs() / (torch.finfo(torch.float32).eps
                                         * exact.abs().clamp_min(1.0))


@pytest.mark.parametrize("op,shape,threads,entry", [
    ("batch", (8, 32, 32, 32), 2, "channels_fixed"),
    ("batch", (8, 32, 32, 32), 1, "channels_forward"),
    ("batch", (8, 32, 4, 4), 1, "channels_small"),
    ("instance", (8, 32, 32, 32), 1, "planes_forward"),
    ("instance", (8, 32, 4, 4), 1, "planes_small")])
def test_given_statistics_round_as_x_minus_mean(op, shape, threads, entry):
    """With given statistics (eval BatchNorm, InstanceNorm's running statistics) the NCHW
    kernels compute ``(x - mean) * (rstd * w) + b``: within 2 rounding units of its terms'
    size of the float64 result, far-off inputs included. (Shifted by x[0, c, 0] as in
    training they were up to 25-650 units off at an offset of 0; torch's ``x * a + b``
    form is 1000s of units off at an offset of 100.)"""
    from normkit.backends.cpu import plans

    with _torch_threads(threads):
        gen = torch.Generator().manual_seed(3)
        c = shape[1]
        for offset in (0.0, 100.0):
            x = torch.randn(shape, generator=gen) * 3 + offset
            mean = torch.randn(c, generator=gen) + offset
            var = torch.rand(c, generator=gen) * 2 + 0.5
            w, b = torch.randn(c, generator=gen), torch.randn(c, generator=gen)
            grouping = G.batch(shape) if op == "batch" else G.instance(shape)
            family = plans.Planes(x, grouping, True, True)
            assert family.forward_entry.__name__ == entry
            if op == "batch":
                y = NF.batch_norm(x, mean, var, w, b, training=False)
            else:
                y = NF.instance_norm(x, mean, var, w, b, use_input_stats=False)
            v = (1, c, 1, 1)
            d, s = x.double() - mean.double().view(v), w.double().view(v) / torch.sqrt(
                var.double().view(v) + 1e-5)
            exact = d * s + b.double().view(v)
            size = d.abs() * s.abs() + b.double().view(v).abs()
            units = (y.double() - exact).abs() / (size * torch.finfo(torch.float32).eps)
            assert units.max() <= 2.5, (offset, units.max().item())


@pytest.mark.parametrize("op,shape,threads,entry", [
    ("batch", (16, 8, 4, 4), 1, "channels_small"),
    ("batch", (64, 32, 8, 8), 2, "channels_small"),
    ("batch", (16, 32, 32, 32), 1, "channels_forward"),
    ("group", (16, 32, 32, 32), 2, "planes_forward"),
    ("group", (16, 32, 4, 4), 1, "planes_small"),
    ("layer", (256, 512), 2, "rows_forward")], ids=str)
def test_batch_statistics_survive_an_outlier_first_element(op, shape, threads, entry):
    """Each unit's first element an outlier (300 among N(0, 1) values): the moments
    (``moments.two_pass``: a first mean, corrected by the deviations from it) and the
    output ``((x - mean_hi) - mean_lo) * scale + shift`` (``moments.split_mean``) stay
    within 3.5 rounding units of the float64 result, as torch's do (1-4). Shifted by
    that first element, as they were, BatchNorm was 5-19 units off, GroupNorm 6-16 and
    LayerNorm 59-78."""
    from normkit.backends.cpu import plans

    with _torch_threads(threads):
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(shape, generator=gen)
        k = shape[-1] if op == "layer" else shape[1]
        w, b = torch.randn(k, generator=gen), torch.randn(k, generator=gen)
        if op == "batch":
            x[0, :, 0, 0] = 300.0                                  # each channel's first
            grouping, family = G.batch(shape), plans.Planes
            def norm(f, t, p, q):
                return f.batch_norm(t, None, None, p, q, training=True)
        elif op == "group":
            x[:, ::4, 0, 0] = 300.0                                # each group's first
            grouping, family = G.group(shape, 8), plans.Planes
            def norm(f, t, p, q):
                return f.group_norm(t, 8, p, q)
        else:
            x[:, 0] = 300.0                                        # each row's first
            grouping, family = G.layer(shape, 1), plans.Rows
            def norm(f, t, p, q):
                return f.layer_norm(t, (k,), p, q)
        assert family(x, grouping, True, False).forward_entry.__name__ == entry
        F = torch.nn.functional
        exact = norm(F, x.double(), w.double(), b.double())
        for f in (NF, F):
            assert _rounding_units(norm(f, x, w, b), exact).max() <= 3.5, f.__name__


@pytest.mark.parametrize("op,shape,per_sample", [
    ("group", (16, 32, 16, 16), True), ("group", (1, 64, 64, 64), False),
    ("instance", (16, 32, 16, 16), True), ("instance", (1, 64, 64, 64), False)], ids=str)
def test_channels_last_per_sample_norms_keep_the_mean_far_from_zero(op, shape, per_sample):
    """Group/InstanceNorm on channels_last at an offset of 1000: the rest of the mean
    that its float32 rounding left off is folded into the shift (``channels_last._coefs``),
    a sample per work item and in stages alike: within 5 rounding units of the float64
    result (about 530 without; torch's are 1,200 to 10 million)."""
    from normkit.backends.cpu import plans

    with _torch_threads(2):
        gen = torch.Generator().manual_seed(7)
        x = (torch.randn(shape, generator=gen) + 1000).to(memory_format=torch.channels_last)
        c = shape[1]
        w, b = torch.randn(c, generator=gen), torch.randn(c, generator=gen)
        grouping = G.group(shape, 8) if op == "group" else G.instance(shape)
        assert plans.ChannelsLast(x, grouping, True, False).per_sample == per_sample
        if op == "group":
            y, exact = (NF.group_norm(x, 8, w, b),
                        torch.nn.functional.group_norm(x.double(), 8, w.double(), b.double()))
        else:
            y, exact = (NF.instance_norm(x, weight=w, bias=b),
                        torch.nn.functional.instance_norm(x.double(), weight=w.double(),
                                                          bias=b.double()))
        assert _rounding_units(y, exact).max() <= 5.0


def test_the_first_calls_kernels_compile_while_the_executor_builds(monkeypatch):
    """On a machine where the executor must be built, ``native._load`` builds it in a
    thread while the caller does what it needs next (``meanwhile``: the first call's
    kernels); an error there comes out after the build ended. Already built: loaded in
    the calling thread, nothing done meanwhile."""
    import threading

    from normkit.backends.cpu import native

    started, finish, events = threading.Event(), threading.Event(), []

    def build(cpp_extension, sources, folder):
        events.append(("build", threading.current_thread() is threading.main_thread()))
        started.set()
        assert finish.wait(10), "the work meant for meanwhile did not run during the build"
        events.append("built")
        return "extension"

    def meanwhile():
        assert started.wait(10)
        events.append("meanwhile")
        finish.set()

    def failing():
        meanwhile()
        raise ValueError("a kernel failed")

    monkeypatch.setattr(native, "_build", build)
    monkeypatch.setattr(native, "_say_if_building", lambda *a: True)
    assert native._load(meanwhile) == "extension"
    assert events == [("build", False), "meanwhile", "built"]
    events.clear(), started.clear(), finish.clear()
    with pytest.raises(ValueError, match="a kernel failed"):
        native._load(failing)
    assert events == [("build", False), "meanwhile", "built"]
    events.clear(), finish.set()
    monkeypatch.setattr(native, "_say_if_building", lambda *a: False)
    assert native._load(failing) == "extension"
    assert events == [("build", True), "built"]


@pytest.mark.parametrize("kind", ["layer", "batch", "group_channels_last"])
def test_the_first_call_hands_the_build_its_own_kernels(monkeypatch, kind):
    """``supports``, the first to need the executor, gives its build the plan family of
    the call to compile meanwhile: the family ``plan`` then builds."""
    from normkit import grouping as G
    from normkit.backends import cpu
    from normkit.backends.cpu import compiling, native

    ext = native.extension()
    monkeypatch.setattr(native, "_extension", None)
    monkeypatch.setattr(native, "_load", lambda meanwhile=None: (meanwhile(), ext)[1])
    seen = []
    monkeypatch.setattr(compiling, "plan_callbacks",
                        lambda family: seen.append((type(family).__name__,
                                                    family.forward_entry.__name__)))
    x, g = {"layer": lambda: (torch.randn(6, 40), G.layer((6, 40), 1)),
            "batch": lambda: (torch.randn(4, 8, 5, 5), G.batch((4, 8, 5, 5))),
            "group_channels_last": lambda: (
                torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last),
                G.group((2, 8, 5, 5), 2))}[kind]()
    xv = x.view(g.view) if x.is_contiguous() else x
    assert cpu.supports(xv, g)
    family = cpu.FAMILIES[cpu.layout(xv.view(g.view), g)](xv, g, True, False)
    assert seen == [(type(family).__name__, family.forward_entry.__name__)]


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork here")
def test_a_forked_child_leaves_the_parents_compile_helper_alone():
    """A child forked while the compile helper runs (a DataLoader worker, say) closes its
    copies of the helper's pipes and would start its own: the helper still leaves when
    the parent closes its input, and the child's tasks never reach the parent's."""
    import os
    import subprocess
    import sys

    from normkit.backends.cpu import compiling

    fake = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    saved = compiling._helper
    compiling._helper = fake
    try:
        pid = os.fork()
        if pid == 0:                                    # the child: no helper, pipes closed
            os._exit(0 if compiling._helper is None and fake.stdin.closed else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        compiling._close()                              # the parent's close ends the helper
        assert fake.wait(timeout=30) == 0
    finally:
        compiling._helper = saved


def test_cache_lookups_and_compilations_hold_numbas_compiler_lock(monkeypatch):
    """numba's cache loads refresh its typing registries, and its own calls take its
    compiler lock for that; ``args.cached`` and ``args.callback`` do too. Without it a
    thread's lookup broke another's ("generator already executing", a TypingError) when
    threads made their first calls at once."""
    from numba.core import caching
    from numba.core.compiler_lock import global_compiler_lock

    from normkit.backends.cpu import args, entries, plans

    held = []
    load = caching.FunctionCache.load_overload

    def watched(self, *a, **k):
        held.append(global_compiler_lock.is_locked())
        return load(self, *a, **k)

    monkeypatch.setattr(caching.FunctionCache, "load_overload", watched)
    protos = plans.protos(torch.float32)
    args.cached(entries.planes_small, *protos)
    monkeypatch.setattr(args, "_CALLBACKS", {})         # compiled anew (from the cache)
    args.callback(entries.planes_small, *protos)
    assert held and all(held), held


_THREADS = """
import threading, torch, normkit.nn as nknn
made = [(nknn.LayerNorm(64), torch.nn.LayerNorm(64), (4, 64)),
        (nknn.GroupNorm(4, 16), torch.nn.GroupNorm(4, 16), (4, 16, 8, 8)),
        (nknn.BatchNorm2d(16), torch.nn.BatchNorm2d(16), (4, 16, 8, 8)),
        (nknn.RMSNorm(64), torch.nn.RMSNorm(64), (4, 64))]
errors = []
def first_call(i):
    ours, theirs, shape = made[i % 4]
    try:
        x = torch.randn(shape, requires_grad=True)
        y = ours(x)
        y.sum().backward()
        assert torch.allclose(y, theirs(x), atol=1e-5), "differs from torch"
    except Exception as error:
        errors.append(repr(error))
threads = [threading.Thread(target=first_call, args=(i,)) for i in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
print(errors)
"""


def test_threads_making_their_first_calls_at_once():
    # each process new: every thread's call is its first (the kernels in numba's cache)
    import subprocess
    import sys

    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", _THREADS], capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr)
