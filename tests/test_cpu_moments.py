"""``normkit.stats_numba.chan_merge`` and the moment loops of ``normkit.backends.cpu.
moments`` against NumPy's two-pass moments in float64."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from numba import njit  # noqa: E402
from normkit.backends.cpu import moments  # noqa: E402
from normkit.stats_numba import chan_merge  # noqa: E402


def _moments(a):
    a = np.asarray(a, dtype=np.float64)
    return float(a.size), a.mean(), ((a - a.mean()) ** 2).sum()


@njit
def _merge(a, b):
    return chan_merge(a[0], a[1], a[2], b[0], b[1], b[2])


def test_chan_merge_equals_the_moments_of_the_union():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1000) * 3 + 1e4
    for cut in (1, 10, 500, 999):
        n, mean, m2 = _merge(_moments(x[:cut]), _moments(x[cut:]))
        want = _moments(x)
        assert n == want[0]
        np.testing.assert_allclose(mean, want[1], rtol=1e-14)
        np.testing.assert_allclose(m2, want[2], rtol=1e-11)


def test_chan_merge_with_nothing_is_exact():
    part = (7.0, 1.0 / 3.0, 2.0 / 7.0)
    assert _merge((0.0, 0.0, 0.0), part) == part


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=3, max_size=40), st.data())
def test_chan_merge_is_associative(values, data):
    i = data.draw(st.integers(1, len(values) - 2))
    j = data.draw(st.integers(i + 1, len(values) - 1))
    a, b, c = (_moments(values[:i]), _moments(values[i:j]), _moments(values[j:]))
    left = _merge(_merge(a, b), c)
    right = _merge(a, _merge(b, c))
    scale = max(1.0, _moments(values)[2])
    assert left[0] == right[0]
    np.testing.assert_allclose(left[1], right[1], rtol=1e-12, atol=1e-9)
    assert abs(left[2] - right[2]) <= 1e-9 * scale


def test_the_scalers_merge_with_the_same_function():
    kernels = pytest.importorskip("normkit.preprocessing._kernels")
    assert kernels.chan_merge is chan_merge


@njit
def _planes(x, inv_s):
    count, mean_x0, m2 = 0.0, 0.0, 0.0
    x0 = x[0, 0]
    for p in range(x.shape[0]):
        count, mean_x0, m2 = moments.plane_merge(x[p], x0, inv_s, x[0], count, mean_x0, m2)
    return count, x0 + mean_x0, m2


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("offset", [0.0, 1e3])
def test_plane_merge_over_planes(dtype, offset):
    # the first plane by two-pass, the others shifted by the running mean
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((5, 97)) + offset).astype(dtype)
    x[2, 0] = offset + 50.0                                        # an outlier
    count, mean, m2 = _planes(x, x.dtype.type(1.0 / x.shape[1]))
    want = _moments(x.astype(np.float64))
    rtol = 1e-6 if dtype == np.float32 else 1e-12
    assert count == want[0]
    np.testing.assert_allclose(mean, want[1], rtol=rtol)
    np.testing.assert_allclose(m2, want[2], rtol=10 * rtol)


@njit
def _cl_moments(xn, c_, s0, s1, block, run, mean, m2, fetch):
    scratch = moments.lane_scratch(c_, run, xn)
    moments.cl_range_moments(xn, c_, s0, s1, block, run, mean, m2, scratch, fetch)


@pytest.mark.parametrize("fetch", [False, True])
@pytest.mark.parametrize("block,run", [(1, 1), (4, 2), (16, 4), (1000, 8)])
def test_channels_last_range_moments(block, run, fetch):
    # per-channel moments of rows [s0, s1) of an (S, C) sample, in blocks of rows read
    # as runs of rows (partial blocks and runs at the end), prefetching ahead or not
    rng = np.random.default_rng(2)
    c_, s_ = 5, 53
    x = (rng.standard_normal((s_, c_)) * np.arange(1, c_ + 1) + 1e2).astype(np.float32)
    mean, m2 = np.empty(c_), np.empty(c_)
    _cl_moments(x.reshape(-1), c_, 3, 50, block, run, mean, m2, fetch)
    rows = x[3:50].astype(np.float64)
    np.testing.assert_allclose(mean, rows.mean(0), rtol=1e-6)
    np.testing.assert_allclose(m2, ((rows - rows.mean(0)) ** 2).sum(0), rtol=1e-4)


def test_merge_channels():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 40)) + np.arange(6)[:, None]       # 6 channels of 40
    mean = x.mean(1)
    m2 = ((x - mean[:, None]) ** 2).sum(1)
    gm, gq = njit(lambda m, q: moments.merge_channels(m, q, 40.0, 2, 5))(mean, m2)
    want = _moments(x[2:5])
    np.testing.assert_allclose((gm, gq), want[1:], rtol=1e-12)


def test_fold_lanes():
    lanes = np.arange(12, dtype=np.float32)                        # 3 runs of 4 channels
    out = np.empty(4, np.float32)
    njit(lambda lanes, out: moments.fold_lanes(lanes, out, 4, 3))(lanes, out)
    np.testing.assert_array_equal(out, lanes.reshape(3, 4).sum(0))


@njit
def _cl_grad_sums(gn, xn, c_, s0, s1, block, run, mean, rstd, sg, sgx, fetch):
    lanes = moments.grad_lanes(c_, run, xn)
    for r in range(run):
        lanes[2][r * c_:(r + 1) * c_] = mean
    moments.cl_range_grad_sums(gn, xn, c_, s0, s1, block, run, lanes, rstd, sg, sgx, fetch)


@pytest.mark.parametrize("fetch", [False, True])
@pytest.mark.parametrize("block,run", [(1, 1), (4, 2), (16, 4), (1000, 8)])
def test_channels_last_range_grad_sums(block, run, fetch):
    # sums of g and g * xhat per channel over rows [s0, s1), two runs per pass and the
    # runs and rows left at the end, prefetching ahead or not
    rng = np.random.default_rng(4)
    c_, s_ = 5, 53
    x = (rng.standard_normal((s_, c_)) + 10.0).astype(np.float32)
    g = rng.standard_normal((s_, c_)).astype(np.float32)
    mean = x.mean(0).astype(np.float32)
    rstd = (1.0 / x.std(0)).astype(np.float32)
    sg, sgx = np.zeros(c_), np.zeros(c_)
    _cl_grad_sums(g.reshape(-1), x.reshape(-1), c_, 3, 50, block, run, mean, rstd, sg, sgx,
                  fetch)
    rows, grows = x[3:50].astype(np.float64), g[3:50].astype(np.float64)
    np.testing.assert_allclose(sg, grows.sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sgx, (grows * (rows - mean) * rstd).sum(0), rtol=1e-4, atol=1e-4)


def test_from_memory_threshold():
    # the reductions prefetch over inputs of at least AHEAD_FROM_BYTES (the last-level
    # cache's size), counted over the whole input whatever its shape
    from normkit.backends.cpu import tuning

    n = tuning.AHEAD_FROM_BYTES // 4
    f = njit(lambda a: moments.from_memory(a))
    assert f(np.zeros(n, np.float32)) and not f(np.zeros(n - 1, np.float32))
    assert f(np.zeros((2, n // 2), np.float32)) and not f(np.zeros((2, n // 4), np.float32))
    assert tuning.AHEAD_FROM_BYTES == tuning.STREAM_BYTES
