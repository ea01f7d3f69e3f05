"""One training step of a Llama-style and a Gemma-style model, untouched vs with
``normkit.convert``: `python benchmarks/bench_llm_train.py [--hidden 1024 --layers 2
--seq 512 --batch 2 --repeats 5 --dtype float32]`.

Both models are built from configs (no download) with the same weights; each repeat times
one step (forward, loss, backward, SGD update) of the untouched and of the converted model,
interleaved, after one warm-up step each (numba compiles its kernels on first use). Prints
one line per model: the median step time of each and the ratio converted / untouched.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import normkit
from normkit.bench.models import llm


def build(family, hidden, layers, dtype):
    torch.manual_seed(0)
    return llm(family, hidden, layers).to(dtype)


def step(model, opt, ids):
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    ids = torch.randint(0, 8192, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(0))
    print(f"training step, hidden {args.hidden}, {args.layers} layers, seq {args.seq}, "
          f"batch {args.batch}, {args.dtype}, torch threads {torch.get_num_threads()}")
    for family in ("llama", "gemma"):
        plain = build(family, args.hidden, args.layers, dtype)
        converted = build(family, args.hidden, args.layers, dtype)
        report = normkit.convert(converted)
        runs = {"untouched": (plain, []), "converted": (converted, [])}
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, (m, _) in runs.items()}
        for key, (model, _) in runs.items():
            step(model, opts[key], ids)                         # warm-up
        for _ in range(args.repeats):
            for key, (model, times) in runs.items():
                times.append(step(model, opts[key], ids))
        a = statistics.median(runs["untouched"][1])
        b = statistics.median(runs["converted"][1])
        print(f"{family:6s} norms swapped {len(report.swapped):2d}  untouched {a * 1e3:8.1f} ms  "
              f"converted {b * 1e3:8.1f} ms  ratio {b / a:.3f}  "
              f"(min {min(runs['untouched'][1]) * 1e3:.1f} / "
              f"{min(runs['converted'][1]) * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
