"""``normkit.backends.cpu.stores``: streamed stores and prefetch never change a bit."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

import _cpu_cases as cases  # noqa: E402
from _cpu_cases import DTYPES, threaded  # noqa: E402,F401 -- fixture by name
from numba import errors, njit  # noqa: E402
import torch  # noqa: E402
from normkit import grouping as G  # noqa: E402
from normkit.backends.cpu import plans, rows, stores, tuning  # noqa: E402

pytestmark = pytest.mark.usefixtures("threaded")


@njit
def _store(kind, dst, xs, gs, ws, bs, scalars, prefetch, stream):
    """Each formula through its driver (``span_store``, or ``rows_store`` for the
    channels_last formulas), the way the kernels call it."""
    a, b, c, d = scalars
    if kind == 0:
        stores.store_affine_per_element(dst, (xs, ws, bs), (a, b, c), prefetch, stream)
    elif kind == 1:
        stores.store_affine_scalar(dst, (xs,), (a, b, c, d), prefetch, stream)
    elif kind == 2:                                                # one row of C = n
        stores.store_affine_per_channel(dst, (xs,), (gs, ws, bs), dst.shape[0], 0, 1, stream)
    elif kind == 3:                                                # rows: w per element
        stores.store_dx_rows_planes(dst, (gs, xs, ws), (a, c, b, d), prefetch, stream)
    elif kind == 4:                                                # planes: w[c]
        stores.store_dx_rows_planes(dst, (gs, xs), (c, a, b, d, a), prefetch, stream)
    else:
        stores.store_dx_per_channel(dst, (gs, xs), (ws, bs, gs, xs), dst.shape[0], 0, 1,
                                    stream)
    if stream:
        stores.fence()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.uint16, np.int16], ids=str)
def test_streamed_and_prefetched_spans_match_the_plain_ones(dtype):
    # vectors with non-temporal stores (plain stores at the unaligned ends), prefetched
    # or not: the same bits as the plain loop, for any start and length; half precision
    # (uint16/int16 bits) widened and narrowed on whole vectors, NaN, infinities, tiny
    # values and signed zeros included
    rng = np.random.default_rng(0)
    if dtype in (np.uint16, np.int16):                             # half values, and
        x, g = (rng.integers(0x3C00, 0x4400, 1100).astype(dtype) for _ in range(2))
        special = np.array([0x7FC1, 0xFF80, 0x0001, 0x8000, 0x7F7F], np.uint16)
        x[::7] = np.resize(special.view(dtype), x[::7].shape)      # NaN, -inf, tiny, -0
        w, bb = (rng.standard_normal(1100).astype(np.float32) for _ in range(2))
        kinds = (1, 2, 4, 5)                                       # x and g in storage
    else:
        x, g, w, bb = (rng.standard_normal(1100).astype(dtype) for _ in range(4))
        kinds = range(6)
    scalars = tuple(w.dtype.type(v) for v in (0.75, -1.5, 2.25, 0.125))
    for kind in kinds:
        for lo in (0, 1, 3, 16, 17):                               # unaligned heads
            for n in (0, 1, 15, 16, 33, 100, 1000):                # and tails
                s = slice(lo, lo + n)
                out = []
                for stream in (False, True):
                    for prefetch in (x[:0], x[s]):                 # none, the span itself
                        dst = np.zeros(1100, dtype)
                        _store(kind, dst[s], x[s], g[s], w[s], bb[s], scalars, (prefetch, g[s]),
                               stream)
                        assert not dst[:lo].any() and not dst[lo + n:].any()
                        out.append(dst.view(np.uint8))
                for other in out[1:]:
                    assert np.array_equal(out[0], other), (dtype, kind, lo, n)


@njit
def _row(kind, dst, xs, gs, ws, bs, scalars, stream):
    """A row's y (kind 0) or dx (kind 2) as the rows kernels write it (``rows._row_out``,
    ``_row_dx``: a plain loop of the formula below ``tuning.SMALL_ROW`` elements), and
    through the formula's driver (kinds 1, 3)."""
    a, b, c, d = scalars
    if kind == 0:
        rows._row_out(dst, xs, ws, bs, (a, b, c), xs[:0], stream)
    elif kind == 1:
        stores.store_affine_per_element(dst, (xs, ws, bs), (a, b, c), (xs[:0], xs[:0]), stream)
    elif kind == 2:
        rows._row_dx(dst, gs, xs, ws, (a, c, b, d), (gs[:0], xs[:0]), stream)
    else:
        stores.store_dx_rows_planes(dst, (gs, xs, ws), (a, c, b, d), (gs[:0], xs[:0]), stream)
    if stream:
        stores.fence()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.uint16], ids=str)
def test_short_rows_plain_loops_match_the_drivers(dtype):
    # rows shorter than tuning.SMALL_ROW skip the store driver for a plain loop of the same
    # formula: the same bits as the driver, plain or streamed, on either side of the bound
    rng = np.random.default_rng(1)
    n_max = tuning.SMALL_ROW + 9
    if dtype == np.uint16:                                         # bfloat16 bits
        x, g = (rng.integers(0x3C00, 0x4400, n_max).astype(dtype) for _ in range(2))
        w, bb = (rng.standard_normal(n_max).astype(np.float32) for _ in range(2))
    else:
        x, g, w, bb = (rng.standard_normal(n_max).astype(dtype) for _ in range(4))
    scalars = tuple(w.dtype.type(v) for v in (0.75, -1.5, 2.25, 0.125))
    for n in (0, 1, 7, 8, 17, 64, tuning.SMALL_ROW - 1, tuning.SMALL_ROW, n_max):
        for kernel, driver in ((0, 1), (2, 3)):
            out = []
            for kind, stream in ((kernel, False), (driver, False), (driver, True)):
                dst = np.zeros(n, dtype)
                _row(kind, dst, x[:n], g[:n], w[:n], bb[:n], scalars, stream)
                out.append(dst.view(np.uint8))
            assert np.array_equal(out[0], out[1]) and np.array_equal(out[0], out[2]), (n, kernel)


def test_streamed_stores_reject_other_arrays():
    @njit
    def strided(dst, src):
        stores.store_affine_scalar(dst[::2], (src,), (0.0, 0.0, 1.0, 0.0), (src[:0], src[:0]),
                                    True)

    @njit
    def mixed(dst, src):
        stores.store_affine_scalar(dst, (src,), (0.0, 0.0, 1.0, 0.0), (src[:0], src[:0]),
                                    True)

    @njit
    def fine(dst, src):
        stores.store_affine_scalar(dst, (src,), (0.0, 0.0, 1.0, 0.0), (src[:0], src[:0]),
                                   True)

    dst = np.zeros(4, np.float32)
    fine(dst, np.arange(4, dtype=np.float32))                      # the same call, typed
    assert dst.tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(errors.TypingError):
        strided(np.zeros(8, np.float32), np.zeros(4, np.float32))
    with pytest.raises(errors.TypingError):
        mixed(np.zeros(8, np.float32), np.zeros(8, np.float64))


STREAM_CASES = [  # op, shape, layout: rows and planes longer than a prefetch piece,
    # rows of odd byte length (unaligned heads and tails)
    ("layer", (3, 4099), "contiguous"),
    ("rms", (5, 3, 777), "contiguous"),
    ("group", (2, 4, 47, 45), "contiguous"),
    ("instance", (2, 3, 2111), "contiguous"),
    ("batch", (3, 5, 41, 53), "contiguous"),
    ("group", (3, 12, 7, 9), "channels_last"),                     # one sample per thread
    ("instance", (2, 7, 33, 65), "channels_last"),                 # (n, c) coefficients
    ("batch", (3, 5, 7, 9), "channels_last"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op,shape,layout", STREAM_CASES, ids=str)
def test_streamed_outputs(op, shape, layout, dtype, monkeypatch):
    # y and dx of every kernel family written with non-temporal stores are the same bits
    # as written plainly, and match the reference; both outputs ask to be streamed
    c = shape[-1] if op in ("layer", "rms") else shape[1]
    x, w, b, dy = cases.inputs(shape, dtype, c, layout, offset=1.5)
    fn, ref = cases.op(op, c)
    if op == "rms":
        b = None
    monkeypatch.setattr(tuning, "STREAM_BYTES", 1 << 62)                   # never
    plain = cases.run(fn, x, w, b, dy)
    monkeypatch.setattr(tuning, "STREAM_BYTES", 1)                         # always
    monkeypatch.setattr(tuning, "STREAM_FRESH", True)
    streamed = cases.run(fn, x, w, b, dy)
    assert plans.Rows(torch.zeros(2, 2, dtype=dtype), G.layer((2, 2), 1), True,
                      False).stream_bytes == 1
    cases.same_bits(plain, streamed, "streamed")
    cases.check_against_reference(streamed, ref, x, w, b, dy, dtype)
