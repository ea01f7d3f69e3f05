"""``normkit.backends.cpu.tuning``: every threshold chosen either way gives the same
results; the rules keep their stated properties (no constant is pinned here)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("numba")

import _cpu_cases as cases  # noqa: E402
from normkit import grouping as G  # noqa: E402
from normkit.backends.cpu import plans, tuning  # noqa: E402

OPS = [("layer", (37, 96), "contiguous"), ("rms", (37, 96), "contiguous"),
       ("group", (3, 6, 9, 11), "contiguous"), ("instance", (3, 6, 9, 11), "contiguous"),
       ("batch", (3, 6, 9, 11), "contiguous"), ("group", (4, 6, 9, 11), "channels_last"),
       ("batch", (3, 6, 9, 11), "channels_last")]


@pytest.mark.parametrize("op,shape,layout", OPS, ids=str)
def test_serial_and_threaded_runs_agree(op, shape, layout, monkeypatch):
    # below SERIAL_BELOW one thread runs everything, above it torch's thread count: the
    # outputs of independent work items (rows, NCHW units and channels) agree to a few
    # ulps; partial sums merged in another order agree to rounding
    c = shape[-1] if op in ("layer", "rms") else shape[1]
    x, w, b, dy = cases.inputs(shape, torch.float32, c, layout, offset=1.5)
    fn, ref = cases.op(op, c)
    if op == "rms":
        b = None
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    results = []
    for below in (1 << 60, 0):
        monkeypatch.setattr(tuning, "SERIAL_BELOW", below)
        results.append(cases.run(fn, x, w, b, dy))
    serial, threaded = results
    if layout == "contiguous":
        # (re-associable reductions may round differently between a range and the whole:
        # a few ulps)
        torch.testing.assert_close(serial[0], threaded[0], rtol=2e-6, atol=2e-6)
    for p, q, name in zip(serial, threaded, ("y", "dx", "dweight", "dbias")):
        if p is not None:
            cases.close(cases.np64(q), cases.np64(p), torch.float32, name)
    cases.check_against_reference(threaded, ref, x, w, b, dy, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(3, 6, 5, 7), (3, 6, 17, 17)], ids=str)   # small planes, not
def test_eval_batch_norm_serial_by_channel_threaded_by_plane(shape, dtype, monkeypatch):
    # one thread walks channels, several walk the N * C planes in memory order, ranges
    # cutting through samples: the same formula, the same bits, and torch's values
    torch.manual_seed(0)
    x = (torch.randn(shape, dtype=torch.float64) * 3 + 40).to(dtype)
    layer = torch.nn.BatchNorm2d(shape[1]).eval()
    layer.running_mean.uniform_(35, 45), layer.running_var.uniform_(5, 15)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 2), layer.bias.uniform_(-1, 1)
    layer = layer.to(dtype)
    import normkit.functional as NF
    from normkit import backends

    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    got = []
    for below in (1 << 60, 0):
        monkeypatch.setattr(tuning, "SERIAL_BELOW", below)
        backends.clear_plans()
        with torch.no_grad():
            got.append(NF.batch_norm(x, layer.running_mean, layer.running_var, layer.weight,
                                     layer.bias, False))
    assert torch.equal(got[0], got[1])
    with torch.no_grad():
        want = layer(x)
    cases.close(cases.np64(got[1]), cases.np64(want), dtype, "y")


def test_threads_rule(monkeypatch):
    # from SERIAL_BELOW elements torch's thread count, one thread below it (and without
    # torch's OpenMP runtime, where the C++ plan would run the ranges one by one); every
    # family's plan follows the rule
    from normkit.backends import _parallel, cpu

    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    small, large = torch.zeros(3, 6, 9, 11), torch.zeros(3, 6, 10, 11)   # 1782, 1980 elements
    monkeypatch.setattr(tuning, "SERIAL_BELOW", 1800)
    team = 4 if _parallel.backend() == "openmp" else 1
    assert tuning.threads(small) == 1 and tuning.threads(large) == team
    for x in (large, large.to(memory_format=torch.channels_last)):
        for grouping in (G.instance(x.shape), G.batch(x.shape), G.group(x.shape, 3)):
            assert cpu.plan(x, grouping).threads == team
        assert cpu.plan(x, G.instance(x.shape), fixed=True).threads == team
    assert cpu.plan(small, G.batch(small.shape)).threads == 1
    monkeypatch.setattr(_parallel, "backend", lambda: "serial")
    assert tuning.threads(large) == 1


def test_stream_bytes_rule(monkeypatch):
    # outputs of every storage dtype from STREAM_BYTES up may stream (half precision is
    # converted on the vectors), as the value stood when the plan was built
    monkeypatch.setattr(tuning, "STREAM_BYTES", 1 << 20)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        x = torch.zeros(2, 2, dtype=dtype)
        assert plans.Rows(x, G.layer((2, 2), 1), True, False).stream_bytes == 1 << 20
    monkeypatch.setattr(tuning, "STREAM_BYTES", 1 << 30)
    assert plans.Rows(x, G.layer((2, 2), 1), True, False).stream_bytes == 1 << 30


def test_last_level_cache_bytes(tmp_path):
    # the largest of the caches sysfs lists, in bytes; the default where it lists none
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "105M")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    (tmp_path / "uevent").write_text("")
    assert tuning.last_level_cache_bytes(base=str(tmp_path)) == 105 << 20
    assert tuning.last_level_cache_bytes(7, base=str(tmp_path / "none")) == 7
    (tmp_path / "index3" / "size").write_text("lots\n")
    assert tuning.last_level_cache_bytes(7, base=str(tmp_path)) == 7


@pytest.mark.parametrize("k", [1, 96, 768, 2048, 4096, 56 * 56, 1 << 20])
def test_rows_ahead_rule(k):
    # half precision prefetches nothing; float32/float64 at least the next row, and no
    # further than AHEAD_BYTES unless one row is longer than that
    assert tuning.rows_ahead(k, 2) == 0
    for itemsize in (4, 8):
        ahead = tuning.rows_ahead(k, itemsize)
        assert ahead >= 1
        assert ahead == 1 or ahead * k * itemsize <= tuning.AHEAD_BYTES


@pytest.mark.parametrize("c", [1, 3, 12, 256, 700, 5000])
@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_channels_last_blocks_rule(c, itemsize):
    # a block is a whole number of runs; a run holds about RUN_LANES elements (at least
    # one row), a block about BLOCK_BYTES (at least one run)
    block, run = tuning.cl_blocks(c, itemsize)
    assert run >= 1 and block >= run and block % run == 0
    assert run == 1 or run * c <= tuning.RUN_LANES
    assert block == run or block * c * itemsize <= tuning.BLOCK_BYTES


def test_parts_and_channel_block_rules():
    for n, s, threads in ((1, 100, 2), (2, 1, 8), (64, 50, 2), (3, 7, 16)):
        parts = tuning.parts(n, s, threads)
        assert 1 <= parts <= s
        assert n * parts >= min(2 * threads, n * s)                # work for every thread
    assert tuning.channel_block(1) >= 1 and tuning.channel_block(1 << 40) == 1
