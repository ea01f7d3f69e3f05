"""Data-parallel training on CPU: 2 processes, gloo, DDP + normkit's SyncBatchNorm.

Each process sees 4 images per step; SyncBatchNorm normalizes over all 8, as one process
with the whole batch would. torch.nn.SyncBatchNorm refuses CPU tensors; normkit's runs on
any torch.distributed backend.

    python examples/ddp_cpu.py            # ~10-20 s on 2 cores
    python examples/ddp_cpu.py --world 3 --steps 60
"""

from __future__ import annotations

import argparse
import datetime
import gc
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import normkit.nn as nkn


def make_data(n=512, seed=0):
    """Two classes of 1x8x8 images: a bright square top-left or bottom-right, plus noise."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=gen)
    x = torch.randn(n, 1, 8, 8, generator=gen) * 0.5
    x[y == 0, :, :4, :4] += 2.0
    x[y == 1, :, 4:, 4:] += 2.0
    return TensorDataset(x, y)


def make_model():
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))


def train(rank, world, port, steps, per_rank_batch):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)                       # same initial weights on every rank
    # BatchNorm2d -> SyncBatchNorm before wrapping in DDP
    model = DDP(nkn.SyncBatchNorm.convert_sync_batchnorm(make_model()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = make_data()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=per_rank_batch, sampler=sampler, drop_last=True)
    step, epoch = 0, 0
    while step < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()                    # SyncBatchNorm: one all-reduce per layer
            opt.step()                         # DDP has averaged the parameter gradients
            step += 1
            if rank == 0 and step % 10 == 0:
                print(f"step {step:3d}  loss {loss.item():.4f}")
            if step == steps:
                break
        epoch += 1

    # the running statistics are global: identical on every rank without any broadcast
    model.eval()
    bn = model.module[1]
    stats = torch.stack([bn.running_mean, bn.running_var])
    gathered = [torch.empty_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats)
    if rank == 0:
        same = all(torch.equal(g, gathered[0]) for g in gathered)
        x, y = data.tensors
        with torch.no_grad():                  # eval never synchronizes: one rank may run it
            acc = (model.module(x).argmax(1) == y).float().mean().item()
        print(f"accuracy {acc:.3f}; running statistics identical on all ranks: {same}")
    # the process group's threads must end while Python still runs: a gloo thread that
    # frees a finished collective's tensors at interpreter exit aborts the process
    # (pytorch#190489). DDP holds the group: free it first, then destroy the group.
    del model, opt
    gc.collect()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="number of processes")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=4, help="images per process per step")
    args = parser.parse_args()
    with socket.socket() as s:                 # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(train, args=(args.world, port, args.steps, args.batch), nprocs=args.world)


if __name__ == "__main__":
    main()
