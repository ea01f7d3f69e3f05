"""normkit layers on DTensors (tensor parallelism, ``torch.distributed.tensor``): two gloo
processes, the input sharded on the batch, the sequence or a normalized dim, the layer's
parameters replicated (``distribute_module``). Each result, gathered, must equal torch.nn's
layer on the whole tensor: the output, the input's and the weight's gradients, and
BatchNorm's running statistics (its batch statistics span both shards). One spawn for the
whole file: each process imports torch."""

from __future__ import annotations

import datetime
import json
import os
import socket
import traceback

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)
import torch.multiprocessing as mp  # noqa: E402

# (name, layer arguments, the input's shape, the dim it is sharded on)
CASES = [
    ("LayerNorm", (5,), (4, 6, 8, 5), 0),
    ("LayerNorm", ((8, 5),), (4, 6, 8, 5), 2),       # sharded on a normalized dim
    ("RMSNorm", (5,), (4, 6, 8, 5), 1),
    ("BatchNorm2d", (6,), (4, 6, 8, 5), 0),           # batch statistics across the shards
    ("GroupNorm", (2, 6), (4, 6, 8, 5), 0),
]


def _check(name, args, shape, dim):
    from torch.distributed.tensor import (Shard, distribute_module, distribute_tensor,
                                          init_device_mesh)

    import normkit.nn as nknn

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(shape, generator=gen) * 2 + 1
    ours, theirs = getattr(nknn, name)(*args), getattr(torch.nn, name)(*args)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5, generator=gen)
        theirs.weight.copy_(ours.weight)
    ours = distribute_module(ours, mesh)
    x = distribute_tensor(full.clone(), mesh, [Shard(dim)]).requires_grad_()
    y = ours(x)
    (y.to_local() ** 2).sum().backward()
    xt = full.clone().requires_grad_()
    yt = theirs(xt)
    (yt ** 2).sum().backward()
    pairs = [(y.full_tensor(), yt), (x.grad.full_tensor(), xt.grad),
             (ours.weight.grad.full_tensor(), theirs.weight.grad)]
    if name.startswith("BatchNorm"):
        pairs += [(ours.running_mean.full_tensor(), theirs.running_mean),
                  (ours.running_var.full_tensor(), theirs.running_var)]
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _worker(rank, world, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    verdicts = {}
    for case in CASES:
        try:
            _check(*case)
            verdicts[str(case)] = "ok"
        except Exception:  # report, keep going: the other rank runs the same checks
            verdicts[str(case)] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(verdicts, f)
    dist.destroy_process_group()


def test_layers_on_sharded_dtensors_equal_torch_on_the_whole(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, 2, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
        if p.is_alive():
            p.kill()
            p.join()
    for r in range(2):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no results (exit code {procs[r].exitcode})"
        verdicts = json.loads(path.read_text())
        assert set(verdicts) == {str(c) for c in CASES}
        failed = {k: v for k, v in verdicts.items() if v != "ok"}
        assert not failed, f"rank {r}: " + "\n".join(f"{k}:\n{v}" for k, v in failed.items())
