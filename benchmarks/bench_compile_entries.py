"""How long each CPU kernel entry takes to compile on an empty numba cache: every entry of
``normkit.backends.cpu.entries`` for one input dtype, one after another in one new process
(the first also pays numba's start-up), a BatchNorm entry both without and with an
activation (``args.callback``'s ``fused``). docs/performance-history.md ("Compiling
BatchNorm without its activation", "First call again") quotes it.

    PYTHONPATH=src python benchmarks/bench_compile_entries.py [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32",
                    choices=("float32", "bfloat16", "float16", "float64"))
    opts = ap.parse_args(argv)
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp()        # before numba is imported
    import torch

    from normkit.backends.cpu import args, entries, plans

    args.quiet()
    protos = plans.protos(getattr(torch, opts.dtype))
    print(f"entry,fused,seconds ({opts.dtype}, empty cache)")
    for name in entries.__all__:
        entry = getattr(entries, name)
        for fused in (False, True) if "act" in args.parameters(entry) else (False,):
            start = time.perf_counter()
            args.callback(entry, *protos, fused)
            print(f"{name},{fused},{time.perf_counter() - start:.1f}", flush=True)


if __name__ == "__main__":
    main()
