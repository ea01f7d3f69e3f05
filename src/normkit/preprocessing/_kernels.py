"""Row-block kernels behind the scalers.

Three operations, each with two implementations of one contract:

``column_moments(X, shift, weights)``
    Per-column ``Moments`` of a 2-D array in one pass over memory, NaN ignored, float64
    accumulators whatever the input dtype.
``column_range(X)``
    Per-column ``Range`` (NaN ignored; an all-NaN column gives NaN).
``group_moments(values, groups, n_groups, shift, weights)``
    ``Moments`` of 1-D values per group index (a sparse matrix's stored values by column),
    NaN ignored: ``Moments.from_groups``, or its jitted twin, the same sums bit for bit;
    and how many values each group holds, NaN included.
``subtract_divide(X, sub, div, out)`` / ``multiply_add(X, mul, add, out, clip)``
    The fused element-wise maps of every transform: ``(x - sub) / div`` and
    ``x * mul + add`` (optionally clipped), computed in float64 and cast once into ``out``.
    They return the number of infinite input values, so callers can reject infinity
    without a separate pass.

The numba kernels (optional extra ``fast``) split the rows into fixed-size chunks that the
threads share. Inside a chunk the rows are read in blocks small enough to stay in cache; a
block's statistics come from the corrected two-pass formula (pass one: the block mean; pass
two: squared deviations from it, plus the residual sum that cancels pass one's rounding),
then the block is folded into the chunk with the Chan merge (``normkit.stats_numba``, the
one jitted merge, shared with the CPU backend). The chunks are finally merged by
``normkit.stats.merge_rows`` (a pairwise tree). The chunk size does not depend on the
number of threads, so results are the same bit for bit whatever the thread count.

The NumPy path walks the same row blocks with ``Moments.from_array`` and ``Moments.merge``;
it needs one float64 temporary of a block, never of all of ``X``.

``USE_NUMBA`` is the module-level switch between the two (tests flip it to check both).
numba has no float16 on the CPU: float16 input takes the NumPy path (``_jitted``). So does
every call in a forked child process (a DataLoader worker, say): GNU OpenMP, which runs
numba's threads and torch's, is not fork-safe. Such a child hung at its first parallel
kernel where the parent had run torch's threads, and numba ended it ("fork() called from a
process already using GNU OpenMP") where the parent had run numba's. The transforms give
the same bits on both paths.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import numpy as np

from normkit.stats import Moments, Range, merge_rows

try:  # the optional extra ``fast``
    import numba

    from normkit._numba_cache import can_cache
    from normkit.stats_numba import chan_merge
except ImportError as error:  # not installed: quiet; installed but broken: a warning
    from normkit._extras import broken

    broken(error, "the scalers' numba kernels", "the scalers take the NumPy path", "fast")
    numba = None

__all__ = [
    "USE_NUMBA",
    "column_moments",
    "column_range",
    "group_moments",
    "multiply_add",
    "subtract_divide",
]

USE_NUMBA = numba is not None

#: rows per chunk handed to one thread (numba) -- fixed, so results do not depend on threads
CHUNK_ROWS = 8192
#: bytes of one cache-resident block of rows inside a chunk (numba)
BLOCK_BYTES = 1 << 17
#: rows per float64 temporary on the NumPy path
NUMPY_BLOCK_ROWS = 8192


#: below this many elements a kernel runs on the calling thread: waking a pool costs more
PARALLEL_MIN_ELEMENTS = 1 << 18


#: whether this process is a forked child (see the module's text)
_FORKED_CHILD = False


def _forked_child():
    global _FORKED_CHILD
    _FORKED_CHILD = True


if hasattr(os, "register_at_fork"):          # (POSIX; Windows does not fork)
    os.register_at_fork(after_in_child=_forked_child)


@contextmanager
def _threads_for(X):
    """Run the enclosed numba call on as many threads as there are chunks to share (one for
    small inputs), then restore the caller's setting."""
    n_chunks = -(-X.shape[0] // CHUNK_ROWS)
    before = numba.get_num_threads()
    want = 1 if X.size < PARALLEL_MIN_ELEMENTS else max(1, min(before, n_chunks))
    if want == before:
        yield
        return
    numba.set_num_threads(want)
    try:
        yield
    finally:
        numba.set_num_threads(before)


def _jitted(a) -> bool:
    """Whether the numba kernels take the array ``a`` (float32/float64 and int indices; no
    float16, which numba cannot compile on the CPU), in a process where they can run."""
    return USE_NUMBA and a.dtype != np.float16 and not _FORKED_CHILD


def _block_rows(n_features: int, itemsize: int) -> int:
    return int(min(1024, max(8, BLOCK_BYTES // max(1, n_features * itemsize))))


# --------------------------------------------------------------------------- numba kernels
if numba is not None:
    CACHE = can_cache(__file__)   # on disk where numba finds a writable folder

    @numba.njit(parallel=True, cache=CACHE, fastmath=False)
    def _moments_nb(X, shift, w, has_w, chunk_rows, block_rows):  # pragma: no cover - jitted
        n, p = X.shape
        n_chunks = (n + chunk_rows - 1) // chunk_rows
        cnt = np.zeros((n_chunks, p))  # n_chunks, p
        mean = np.zeros((n_chunks, p))  # n_chunks, p -- of x - shift
        m2 = np.zeros((n_chunks, p))  # n_chunks, p
        for c in numba.prange(n_chunks):
            lo = c * chunk_rows
            hi = min(n, lo + chunk_rows)
            bc = np.empty(p)  # block count (total weight)
            bs = np.empty(p)  # block sum of w * (x - shift)
            bm = np.empty(p)  # block mean from pass one
            bq = np.empty(p)  # block sum of w * dev**2
            br = np.empty(p)  # block sum of w * dev (rounding residual of pass one)
            for b0 in range(lo, hi, block_rows):
                b1 = min(hi, b0 + block_rows)
                bc[:] = 0.0
                bs[:] = 0.0
                bq[:] = 0.0
                br[:] = 0.0
                # pass one: count and shifted sum (NaN adds nothing)
                for i in range(b0, b1):
                    wi = w[i] if has_w else 1.0
                    for j in range(p):
                        d = X[i, j] - shift[j]
                        ok = d == d
                        bc[j] += wi if ok else 0.0
                        bs[j] += wi * d if ok else 0.0
                for j in range(p):
                    bm[j] = bs[j] / bc[j] if bc[j] > 0.0 else 0.0
                # pass two: deviations from the block mean, while the block is in cache
                for i in range(b0, b1):
                    wi = w[i] if has_w else 1.0
                    for j in range(p):
                        d = (X[i, j] - shift[j]) - bm[j]
                        ok = d == d
                        bq[j] += wi * d * d if ok else 0.0
                        br[j] += wi * d if ok else 0.0
                # fold the block into the chunk
                for j in range(p):
                    n_new = bc[j]
                    if n_new > 0.0:
                        cnt[c, j], mean[c, j], m2[c, j] = chan_merge(
                            cnt[c, j], mean[c, j], m2[c, j], n_new,
                            bm[j] + br[j] / n_new, bq[j] - br[j] * br[j] / n_new)
        return cnt, mean, m2

    @numba.njit(parallel=True, cache=CACHE, fastmath=False)
    def _range_nb(X, chunk_rows):  # pragma: no cover - jitted
        n, p = X.shape
        n_chunks = (n + chunk_rows - 1) // chunk_rows
        mn = np.empty((n_chunks, p))  # n_chunks, p
        mx = np.empty((n_chunks, p))  # n_chunks, p
        for c in numba.prange(n_chunks):
            lo = c * chunk_rows
            hi = min(n, lo + chunk_rows)
            lmn = np.full(p, np.inf)
            lmx = np.full(p, -np.inf)
            for i in range(lo, hi):
                for j in range(p):
                    v = np.float64(X[i, j])
                    # comparisons with NaN are false: NaN never enters
                    lmn[j] = v if v < lmn[j] else lmn[j]
                    lmx[j] = v if v > lmx[j] else lmx[j]
            mn[c, :] = lmn
            mx[c, :] = lmx
        return mn, mx

    @numba.njit(parallel=True, cache=CACHE, fastmath=False)
    def _affine_nb(X, a, b, out, divide, do_clip, lo_clip, hi_clip, chunk_rows):  # pragma: no cover
        """``(x - a) / b`` (``divide``) or ``x * a + b`` per column, in float64, cast once on
        store; optionally clipped; returns the count of infinite inputs."""
        n, p = X.shape
        n_chunks = (n + chunk_rows - 1) // chunk_rows
        n_inf = np.zeros(n_chunks, dtype=np.int64)
        for c in numba.prange(n_chunks):
            lo = c * chunk_rows
            hi = min(n, lo + chunk_rows)
            k = 0
            for i in range(lo, hi):
                for j in range(p):
                    x = np.float64(X[i, j])
                    k += 1 if abs(x) == np.inf else 0
                    y = (x - a[j]) / b[j] if divide else x * a[j] + b[j]
                    if do_clip:
                        y = lo_clip if y < lo_clip else y
                        y = hi_clip if y > hi_clip else y
                    out[i, j] = y
            n_inf[c] = k
        return n_inf.sum()


    @numba.njit(cache=CACHE, fastmath=False)
    def _group_moments_nb(values, groups, n_groups, shift, w, has_w):  # pragma: no cover
        """``Moments.from_groups`` in two passes over the values, the same sums in the same
        order (bit for bit the NumPy path); and the values each group holds, NaN included."""
        held = np.zeros(n_groups, np.int64)
        count = np.zeros(n_groups)  # n_groups
        total = np.zeros(n_groups)  # n_groups: sum of w * (x - shift)
        for i in range(values.shape[0]):
            g = groups[i]
            d = values[i] - shift[g]
            held[g] += 1
            if d == d:
                wi = w[i] if has_w else 1.0
                count[g] += wi
                total[g] += wi * d if has_w else d
        mean = np.empty(n_groups)
        for g in range(n_groups):
            mean[g] = total[g] / (count[g] if count[g] != 0.0 else 1.0)
        resid = np.zeros(n_groups)  # n_groups: sum of w * dev (pass one's rounding)
        squares = np.zeros(n_groups)  # n_groups: sum of w * dev**2
        for i in range(values.shape[0]):
            g = groups[i]
            dev = (values[i] - shift[g]) - mean[g]
            if dev == dev:
                wdev = w[i] * dev if has_w else dev
                resid[g] += wdev
                squares[g] += wdev * dev
        return count, mean, resid, squares, held


# --------------------------------------------------------------------------- front ends
def group_moments(values, groups, n_groups, shift, weights=None):
    """``(Moments.from_groups(..), held)``: the moments of the 1-D ``values`` per group (the
    stored values of a sparse matrix by column), NaN ignored, and how many values each
    group holds, NaN included (int64); jitted where numba is (the counts in its first
    pass, not a pass of their own)."""
    if not _jitted(values):
        return (Moments.from_groups(values, groups, n_groups, shift, weights),
                np.bincount(groups, minlength=n_groups))
    shift = np.ascontiguousarray(shift, dtype=np.float64)
    has_w = weights is not None
    w = np.ascontiguousarray(weights, dtype=np.float64) if has_w else np.empty(0)
    count, mean, resid, squares, held = _group_moments_nb(values, groups, n_groups, shift, w,
                                                          has_w)
    safe = np.where(count == 0, 1.0, count)
    with np.errstate(invalid="ignore"):  # inf - inf where a group holds infinity (refused later)
        return Moments(count, mean + resid / safe, squares - resid * resid / safe, shift), held


def column_moments(X, shift, weights=None) -> Moments:
    """Moments of each column of the 2-D float array ``X`` relative to ``shift``.

    ``shift`` is a float64 array of length ``X.shape[1]``; ``weights`` (optional) a float64
    array of length ``X.shape[0]``. NaN is ignored. Infinite values make the mean or m2 of
    their column non-finite (the caller checks).
    """
    n, p = X.shape
    shift = np.ascontiguousarray(shift, dtype=np.float64)
    if n == 0:
        return Moments.empty(p, shift)
    if _jitted(X):
        has_w = weights is not None
        w = np.ascontiguousarray(weights, dtype=np.float64) if has_w else np.empty(0)
        with _threads_for(X):
            cnt, mean, m2 = _moments_nb(X, shift, w, has_w, CHUNK_ROWS,
                                        _block_rows(p, X.dtype.itemsize))
        count, mean, m2 = merge_rows(cnt, mean, m2)
        return Moments(count, mean, m2, shift)
    total = None
    for b0 in range(0, n, NUMPY_BLOCK_ROWS):
        b1 = min(n, b0 + NUMPY_BLOCK_ROWS)
        wb = None if weights is None else weights[b0:b1]
        part = Moments.from_array(X[b0:b1], shift=shift, weights=wb)
        total = part if total is None else total.merge(part)
    return total


def column_range(X) -> Range:
    """Per-column minimum and maximum of the 2-D array ``X`` as float64, NaN ignored."""
    n, p = X.shape
    if _jitted(X) and n:
        with _threads_for(X):
            mn, mx = _range_nb(X, CHUNK_ROWS)
        mn, mx = mn.min(axis=0), mx.max(axis=0)
        empty = (mn == np.inf) & (mx == -np.inf)  # all-NaN columns
        mn[empty] = np.nan
        mx[empty] = np.nan
        return Range(mn, mx)
    total = Range(np.full(p, np.nan), np.full(p, np.nan))
    for b0 in range(0, n, NUMPY_BLOCK_ROWS):
        part = Range.from_array(X[b0:b0 + NUMPY_BLOCK_ROWS])
        total = total.merge(Range(part.min.astype(np.float64), part.max.astype(np.float64)))
    return total


def _vec(a, p):
    return np.ascontiguousarray(np.broadcast_to(np.asarray(a, dtype=np.float64), (p,)))


def subtract_divide(X, sub, div, out) -> int:
    """``out[:] = (X - sub) / div`` column-wise, in float64; return the count of inf in X."""
    p = X.shape[1]
    sub, div = _vec(sub, p), _vec(div, p)
    if _jitted(X):
        with _threads_for(X):
            return int(_affine_nb(X, sub, div, out, True, False, 0.0, 0.0, CHUNK_ROWS))
    n_inf = 0
    for b0 in range(0, X.shape[0], NUMPY_BLOCK_ROWS):
        blk = X[b0:b0 + NUMPY_BLOCK_ROWS]
        n_inf += int(np.isinf(blk).sum())
        out[b0:b0 + NUMPY_BLOCK_ROWS] = (blk - sub) / div  # float64 temporary of one block
    return n_inf


def multiply_add(X, mul, add, out, clip=None) -> int:
    """``out[:] = X * mul + add`` (then clipped to ``clip=(lo, hi)``); return the inf count."""
    p = X.shape[1]
    mul, add = _vec(mul, p), _vec(add, p)
    if _jitted(X):
        lo, hi = (0.0, 0.0) if clip is None else (float(clip[0]), float(clip[1]))
        with _threads_for(X):
            return int(_affine_nb(X, mul, add, out, False, clip is not None, lo, hi,
                                   CHUNK_ROWS))
    n_inf = 0
    for b0 in range(0, X.shape[0], NUMPY_BLOCK_ROWS):
        blk = X[b0:b0 + NUMPY_BLOCK_ROWS]
        n_inf += int(np.isinf(blk).sum())
        y = blk * mul + add
        if clip is not None:
            np.clip(y, clip[0], clip[1], out=y)
        out[b0:b0 + NUMPY_BLOCK_ROWS] = y
    return n_inf
