"""``python -m normkit.backends.cpu [--dtypes ...] [--jobs N]``: build the C++ executor of
the CPU calls (``normkit.backends.cpu.native``) and compile every kernel entry for the
given input dtypes (float32 and bfloat16 by default; ``all``: the four) now, rather than
at the first calls (1-11 s per entry and dtype on an empty cache). ``make setup`` runs it.
The entries compile in ``--jobs`` processes (default: one per core) while this process
builds the executor, each entry in one process for all its dtypes (they share numba's cache
index), a BatchNorm entry both without and with an activation. Without a compiler it says
so (the composite torch path then runs every CPU call, and ``make test`` fails at once);
where numba finds no writable folder for its cache (``normkit._numba_cache``), it says so
and compiles nothing (the executor still builds)."""

import argparse
import os
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

DTYPES = ("float32", "bfloat16", "float64", "float16")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m normkit.backends.cpu",
                                     description=(__doc__ or "").replace("``", ""))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=(*DTYPES, "all"), help="input dtypes to compile for")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="processes that compile (default: one per core)")
    opts = parser.parse_args(argv)
    dtypes = DTYPES if "all" in opts.dtypes else tuple(dict.fromkeys(opts.dtypes))

    from normkit._numba_cache import can_cache
    from normkit.backends.cpu import entries, native, plans

    cacheable = can_cache(entries.__file__)  # (else the entries compiled now are lost at exit)
    # the entries compile in worker processes while this one builds the executor (spawned,
    # not forked: this process loads torch and its OpenMP runtime)
    with ProcessPoolExecutor(max(1, opts.jobs), mp_context=get_context("spawn")) as pool:
        names, start = entries.__all__, time.time()
        done = pool.map(plans.compile_entry, names, [dtypes] * len(names)) if cacheable else ()
        ready = native.extension() is not None
        print(f"normkit C++ executor: {'ready' if ready else 'unavailable'} "
              f"({time.time() - start:.0f} s)", flush=True)
        if not cacheable:
            print("normkit CPU kernels: not compiled ahead: numba finds no writable folder "
                  "to cache them; set NUMBA_CACHE_DIR to one", flush=True)
            return 1
        done = list(done)
    print(f"normkit CPU kernels: {len(done)} entries for {', '.join(dtypes)} "
          f"({time.time() - start:.0f} s, beside the executor's build)", flush=True)
    return 0 if ready else 1


if __name__ == "__main__":
    raise SystemExit(main())
