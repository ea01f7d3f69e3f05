"""What a SyncBatchNorm training step costs across processes, against one process.

Run:  python benchmarks/bench_sync_batchnorm.py [--shape 32 64 28 28] [--repeats 30]

Two measurements of forward + backward of one BatchNorm2d layer on the same global batch
(fp32, NCHW):

* single: one process, 2 threads, normkit's BatchNorm2d on the whole batch;
* sync: two processes joined by gloo on 127.0.0.1, 1 thread each, each running normkit's
  SyncBatchNorm on half of the batch (one all-gather in the forward, one all-reduce in the
  backward). The time of a step is the slower rank's.

Medians over ``--repeats`` steps after 5 warm-up steps; the ratio sync / single says what
the synchronization costs on top of splitting the work. Outputs are checked equal to a
single-process torch.nn.BatchNorm2d before timing.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import normkit.nn as nkn


def _batch(shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen) * 2 + 3
    return x, torch.randn(shape, generator=gen)


def _step(layer, x, g):
    x = x.detach().requires_grad_()
    layer(x).backward(g)
    return x.grad


def _time(layer, x, g, repeats):
    for _ in range(5):
        _step(layer, x, g)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _step(layer, x, g)
        times.append(time.perf_counter() - t0)
    return times


def _rank(rank, world, port, shape, repeats, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    x, g = _batch(shape)
    part = slice(rank * shape[0] // world, (rank + 1) * shape[0] // world)
    layer = nkn.SyncBatchNorm(shape[1])
    ref = torch.nn.BatchNorm2d(shape[1])
    xr = x.clone().requires_grad_()
    ref(xr).backward(g)
    torch.testing.assert_close(_step(layer, x[part], g[part]), xr.grad[part])
    times = torch.tensor(_time(layer, x[part], g[part], repeats), dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)          # a step lasts as long as its slowest rank
    if rank == 0:
        torch.save(times, out)
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, nargs=4, default=[32, 64, 28, 28])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args(argv)
    shape = tuple(args.shape)

    torch.set_num_threads(2)
    x, g = _batch(shape)
    single = statistics.median(_time(nkn.BatchNorm2d(shape[1]), x, g, args.repeats))

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.pt")
        mp.spawn(_rank, args=(2, port, shape, args.repeats, out), nprocs=2, join=True)
        sync = statistics.median(torch.load(out).tolist())
    print(f"BatchNorm2d fwd+bwd, global batch {'x'.join(map(str, shape))} fp32, "
          f"median of {args.repeats}")
    print(f"  single process, 2 threads:         {single * 1e3:8.2f} ms")
    print(f"  SyncBatchNorm, 2 gloo processes x 1 thread: {sync * 1e3:8.2f} ms "
          f"({sync / single:.2f} x single)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
