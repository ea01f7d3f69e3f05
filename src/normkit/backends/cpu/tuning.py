"""Every tuning number of the CPU kernels, each with its reason, and the rules built on them.

None of these changes a result: thresholds and block sizes chosen either way give the
same values (the tests run both sides of each), only the time changes. The measurements
behind each number are in ``docs/performance.md``.
"""

from __future__ import annotations

import os

import torch

from normkit.backends import _memory, _parallel

# ---- threads --------------------------------------------------------------------------

#: elements: a smaller input runs on the calling thread only. The C++ plan opens the
#: parallel region itself (no Python, no GIL: a few microseconds), and every call measured
#: (forward, and forward and backward) gains from threads at 2^16 elements and the
#: backward loses at 2^15
SERIAL_BELOW = 1 << 16


def threads(x) -> int:
    """Ranges (threads) to split the work on ``x`` into: torch's thread count, or 1 (a
    small input, or no OpenMP runtime of torch's to run them on)."""
    if x.numel() < SERIAL_BELOW or _parallel.backend() != "openmp":
        return 1
    return max(1, torch.get_num_threads())


def parts(n, s, threads):
    """Ranges of the S positions per sample (channels_last kernels), so that there are
    at least two work items per thread even when N is small."""
    return max(1, min(s, -(-2 * threads // n)))


# ---- streaming stores -----------------------------------------------------------------

def last_level_cache_bytes(default=32 << 20, base="/sys/devices/system/cpu/cpu0/cache"):
    """The largest CPU cache's size (Linux sysfs: ``index*/size`` under ``base``), else
    ``default``."""
    sizes = []
    try:
        for entry in os.listdir(base):
            if entry.startswith("index"):
                with open(os.path.join(base, entry, "size")) as f:
                    text = f.read().strip()
                scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
                sizes.append(int(text.rstrip("KMG")) * scale)
    except (OSError, ValueError):
        return default
    return max(sizes, default=default)


#: bytes from which a kernel's output is written with non-temporal (streaming) stores: an
#: output this large is out of cache by the end of the op anyway. A plain store first
#: reads the destination line into the cache; a streaming store skips that read, a third
#: of the traffic of a one-input elementwise op. Where the output's memory is already
#: mapped (a block the allocator reuses; the C++ plan asks ``mincore`` per call, as
#: ``_memory.resident`` does) or ``STREAM_FRESH``; every storage dtype (half precision is
#: converted on the vectors, ``stores``)
STREAM_BYTES = last_level_cache_bytes()


#: whether a freshly mapped output streams too: each of its pages is zeroed as it faults
#: in, which leaves its lines in cache, and there plain stores measured faster
STREAM_FRESH = False


#: bytes of x, the residual, h and y together from which the residual-add norms take the
#: rows kernels' one pass (h written and normalized from L1: one pass over memory fewer)
#: instead of torch's add and then the norm. Below the last-level cache the pass saves
#: nothing and its calls cost more Python (an autograd Function; 20-40 us on small rows);
#: at (8192, 768) fp32, four times 25 MB, it took 0.72 (forward) and 0.86 (with backward)
#: of the add and then the norm (docs/performance.md)
ONE_PASS_ADD = STREAM_BYTES


# ---- prefetching ahead (rows and NCHW planes) -------------------------------------------

#: bytes: how far ahead the rows and planes kernels prefetch while writing an output. A
#: row (plane) is read from memory once and then worked on in L1, with no miss in flight,
#: and the hardware prefetcher stops at each 4 KiB page: this keeps memory busy meanwhile
AHEAD_BYTES = 8 << 10

#: bytes: the channels_last reductions prefetch ahead over inputs from this size (the
#: last-level cache's: they come from memory); below it they are in cache, where the
#: prefetches only cost (``moments.from_memory``)
AHEAD_FROM_BYTES = STREAM_BYTES

#: elements: rows (LayerNorm, RMSNorm) shorter than this are written by a plain loop of
#: their formula, not through its store driver, whose fixed cost per row (a call with its
#: arrays, the prefetch pieces, a streamed store's unaligned ends) outweighs a short row's
#: arithmetic, in cache and from memory alike; longer rows read from memory gain from the
#: driver's prefetching and streaming (docs/performance.md, "Short rows")
SMALL_ROW = 128

#: elements: the output of a row or plane is written in pieces of this many, each followed
#: by the prefetch of the same piece ahead (spread out: a whole row at once gained nothing)
PREFETCH_PIECE = 512


def rows_ahead(k, itemsize):
    """Rows (or planes of k elements) ahead to prefetch: about ``AHEAD_BYTES``, at least
    the next one, for float32/float64; 0 (none) for half precision, whose pace is the
    conversion in registers (prefetching measured slower there)."""
    if itemsize < 4:
        return 0
    return max(1, AHEAD_BYTES // (k * itemsize))


# ---- blocks ---------------------------------------------------------------------------

#: bytes of x per block of channels of BatchNorm on NCHW: the block is normalized (or its
#: dx written) right after its statistics, so it should still be in the last-level cache
CHANNEL_BLOCK_BYTES = 4 << 20


#: elements: NCHW planes smaller than this run ``planes.channels_small*`` (BatchNorm) and
#: ``planes_small*`` (Instance/GroupNorm), plain loops per channel or unit, instead of the
#: per-plane kernels, whose fixed cost per plane
#: (moment merge, store driver) outweighs the arithmetic of a plane of a few dozen elements
SMALL_PLANE = 256


def channel_block(channel_bytes):
    """Channels per block of the NCHW BatchNorm kernels: about ``CHANNEL_BLOCK_BYTES``."""
    return max(1, CHANNEL_BLOCK_BYTES // channel_bytes)


#: bytes of rows per block of lane sums (channels_last reductions; a chunk of the
#: ``columns`` kernels): the block's first pass is read again from L2 (for the block's own
#: mean), so it must fit there
BLOCK_BYTES = 256 * 1024

#: elements per run of lanes (channels_last reductions): a run of rows is read into this
#: many accumulators, one sequential stream per input; longer runs (more lanes) crowd L1
RUN_LANES = 512


def cl_blocks(c, itemsize):
    """Rows of C channels per block of lane sums (about ``BLOCK_BYTES``) and per run of
    lanes (about ``RUN_LANES`` elements); the block is a whole number of runs."""
    run = max(1, RUN_LANES // c)
    return max(1, BLOCK_BYTES // (c * itemsize) // run) * run, run
