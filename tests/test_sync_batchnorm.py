"""SyncBatchNorm against single-process torch.nn.BatchNorm on the concatenated batch.

The distributed checks run in real processes joined by gloo on 127.0.0.1. Spawning is
slow (each process imports torch), so each world size is spawned once, by one test, and
every check runs inside those workers; each rank writes ``{check: "ok" | traceback}`` to
a JSON file and the test reads the verdicts.
Inside a check every collective runs before any comparison, so a failing comparison on
one rank cannot leave the others waiting in a collective.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn as tnn

import normkit
import normkit.nn as nkn
from normkit import stats

TOL = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=1e-5, rtol=1e-5)}

# per-rank batch sizes: uneven, and one rank with no samples at all
SPLITS = {2: [(3, 5), (4, 0)], 3: [(2, 5, 1), (3, 0, 4)]}
SHAPES = {2: (4,), 3: (4, 5), 4: (4, 3, 2), 5: (4, 2, 2, 3)}   # C and spatial dims by ndim
TORCH_BN = {2: tnn.BatchNorm1d, 3: tnn.BatchNorm1d, 4: tnn.BatchNorm2d, 5: tnn.BatchNorm3d}


# ---------------------------------------------------------------------------------------
# checks run on every rank; each returns a list of (name, compare-thunk)
# ---------------------------------------------------------------------------------------

def _close(actual, expected, dtype, what):
    # not torch.testing.assert_close: with a process group initialized, its first call
    # imports torch.distributed.tensor, seconds of start-up in every worker
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    tol = TOL[dtype]
    err = (a - e).abs() - (tol["atol"] + tol["rtol"] * e.abs())
    assert not (err > 0).any(), f"{what}: max abs error {float((a - e).abs().max()):.3g}"


def _slice(rank, sizes):
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _check_against_batchnorm(rank, world, sizes, ndim, dtype, momentum, affine, steps=2):
    """``steps`` training steps of SyncBatchNorm on this rank's slice vs one torch
    BatchNorm on the whole batch: outputs, gradients, running buffers."""
    gen = torch.Generator().manual_seed(1234 + ndim)
    c, *spatial = SHAPES[ndim]
    ref = TORCH_BN[ndim](c, momentum=momentum, affine=affine, dtype=dtype)
    sync = nkn.SyncBatchNorm(c, momentum=momentum, affine=affine, dtype=dtype)
    if affine:
        w = torch.rand(c, generator=gen, dtype=dtype) + 0.5
        b = torch.randn(c, generator=gen, dtype=dtype)
        with torch.no_grad():
            for m in (ref, sync):
                m.weight.copy_(w)
                m.bias.copy_(b)
    results = []
    for step in range(steps):
        x = (torch.randn(sum(sizes), c, *spatial, generator=gen, dtype=dtype) * 3 + 7 * step)
        g = torch.randn(x.shape, generator=gen, dtype=dtype)
        xr = x.clone().requires_grad_()
        yr = ref(xr)
        (yr * g).sum().backward()
        sl = _slice(rank, sizes)
        xs = x[sl].clone().requires_grad_()
        ys = sync(xs)
        (ys * g[sl]).sum().backward()
        results.append((ys, yr[sl], xs.grad, xr.grad[sl]))
    # the parameter gradients are each rank's share: their sum is the whole batch's
    grads = []
    if affine:
        for p in (sync.weight, sync.bias):
            total = p.grad.clone()
            dist.all_reduce(total)
            grads.append(total)

    def compare():
        for step, (ys, yref, dxs, dxref) in enumerate(results):
            _close(ys, yref, dtype, f"output, step {step}")
            _close(dxs, dxref, dtype, f"input gradient, step {step}")
        if affine:
            _close(grads[0], ref.weight.grad, dtype, "weight gradient (summed over ranks)")
            _close(grads[1], ref.bias.grad, dtype, "bias gradient (summed over ranks)")
        _close(sync.running_mean, ref.running_mean, dtype, "running_mean")
        _close(sync.running_var, ref.running_var, dtype, "running_var")
        assert int(sync.num_batches_tracked) == int(ref.num_batches_tracked) == steps
    return compare


def _check_channels_last(rank, world, sizes):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(sum(sizes), 3, 4, 5, generator=gen, dtype=torch.float64)
    ref, sync = tnn.BatchNorm2d(3, dtype=torch.float64), nkn.SyncBatchNorm(3, dtype=torch.float64)
    xs = x[_slice(rank, sizes)].contiguous(memory_format=torch.channels_last).requires_grad_()
    ys = sync(xs)
    ys.square().sum().backward()
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    yr.square().sum().backward()

    def compare():
        sl = _slice(rank, sizes)
        _close(ys, yr[sl], torch.float64, "channels_last output")
        _close(xs.grad, xr.grad[sl], torch.float64, "channels_last input gradient")
    return compare


def _check_one_collective_each_way(rank, world, sizes):
    """The forward communicates once (the moments), the backward once (the two sums)."""
    calls = []
    originals = {name: getattr(dist, name) for name in ("all_gather", "all_reduce")}

    def counting(name):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)
        return wrapper

    m = nkn.SyncBatchNorm(3, dtype=torch.float64)
    x = torch.randn(sizes[rank], 3, 4, dtype=torch.float64, requires_grad=True)
    try:
        for name in originals:
            setattr(dist, name, counting(name))
        y = m(x)
        forward_calls = list(calls)
        y.square().sum().backward()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)

    def compare():
        assert forward_calls == ["all_gather"], forward_calls
        assert calls == ["all_gather", "all_reduce"], calls
    return compare


def _check_subgroup(rank, world, sizes):
    """With ``process_group``, only the group's ranks are normalized together."""
    members = [0, 1]
    group = dist.new_group(members)                  # every rank must call new_group
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(sum(sizes), 4, 3, generator=gen, dtype=torch.float64)
    sync = nkn.SyncBatchNorm(4, process_group=group if rank in members else None,
                             dtype=torch.float64)
    if rank in members:                  # members are the first ranks: same offsets
        y = sync(x[_slice(rank, sizes)])
        together = x[:sum(sizes[r] for r in members)]
        expect = tnn.BatchNorm1d(4, dtype=torch.float64)(together)[_slice(rank, sizes)]
    else:                                # outside the group: the layer is not run
        y = expect = torch.zeros(1)
    dist.barrier()

    def compare():
        _close(y, expect, torch.float64, "subgroup output")
    return compare


def _check_convert_and_ddp(rank, world, steps=3, fused=False):
    """A small CNN with BatchNorm: DDP + convert_sync_batchnorm over equal shards equals
    single-process training on the whole batch; ``fused``: of the model converted with
    ``fuse_activation=True`` (its two ReLUs then applied by the SyncBatchNorms)."""
    dtype = torch.float64

    def make(bn2d):
        torch.manual_seed(0)
        return tnn.Sequential(
            tnn.Conv2d(3, 6, 3, padding=1), tnn.BatchNorm2d(6), tnn.ReLU(),
            tnn.Conv2d(6, 4, 3, stride=2), bn2d(4), tnn.ReLU(),
            tnn.AdaptiveAvgPool2d(1), tnn.Flatten(), tnn.Linear(4, 5), tnn.BatchNorm1d(5),
        ).to(dtype)

    per_rank = 2
    gen = torch.Generator().manual_seed(99)
    xs = [torch.randn(world * per_rank, 3, 7, 7, generator=gen, dtype=dtype)
          for _ in range(steps)]
    ts = [torch.randint(0, 5, (world * per_rank,), generator=gen) for _ in range(steps)]

    ref = make(tnn.BatchNorm2d)                          # the oracle: torch only
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for x, t in zip(xs, ts):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), t).backward()
        opt.step()

    model = make(nkn.BatchNorm2d)
    if fused:
        normkit.convert(model, fuse_activation=True)
    model = nkn.SyncBatchNorm.convert_sync_batchnorm(model)
    n_sync = sum(isinstance(m, nkn.SyncBatchNorm) for m in model.modules())
    n_act = sum(getattr(m, "activation", None) == "relu" for m in model.modules())
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    sl = slice(rank * per_rank, (rank + 1) * per_rank)
    for x, t in zip(xs, ts):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x[sl]), t[sl]).backward()
        opt.step()

    def compare():
        assert n_sync == 3, f"converted {n_sync} of 3 BatchNorm layers"
        assert n_act == (2 if fused else 0), f"{n_act} SyncBatchNorms apply a ReLU"
        got, want = model.state_dict(), ref.state_dict()
        assert got.keys() == want.keys()
        for k in want:
            if want[k].is_floating_point():
                _close(got[k], want[k], dtype, k)
            else:
                assert torch.equal(got[k], want[k]), k
    return compare


def _check_double_backward_refused(rank, world):
    """A backward that would be differentiated (create_graph) is refused on every rank,
    before any collective, with what to do; the rank's layer still trains after it."""
    sync = nkn.SyncBatchNorm(3, dtype=torch.float64)
    x = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    try:
        torch.autograd.grad(sync(x).square().sum(), x, create_graph=True)
        said = None
    except RuntimeError as error:
        said = str(error)
    sync(x).square().sum().backward()                  # the ranks still in step

    def compare():
        assert said is not None and "use create_graph=False" in said, said
        assert x.grad is not None and torch.isfinite(x.grad).all()
    return compare


def _worker(rank, world, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    verdicts = {}

    def run(name, check, *args, **kwargs):
        try:
            compare = check(rank, world, *args, **kwargs)
            compare()
            verdicts[name] = "ok"
        except Exception:  # report, keep going: the other ranks run the same checks
            verdicts[name] = traceback.format_exc()

    for sizes in SPLITS[world]:
        for ndim in (2, 3, 4, 5):
            for dtype in (torch.float64, torch.float32):
                run(f"bn{ndim}d-{dtype}-{sizes}", _check_against_batchnorm, sizes, ndim, dtype,
                    0.1, True)
        run(f"no_affine-momentum_none-{sizes}", _check_against_batchnorm, sizes, 3,
            torch.float64, None, False, steps=3)
        run(f"channels_last-{sizes}", _check_channels_last, sizes)
        run(f"one_collective_each_way-{sizes}", _check_one_collective_each_way, sizes)
    if world >= 3:
        run("subgroup", _check_subgroup, SPLITS[world][0])
    run("ddp_cnn", _check_convert_and_ddp)
    run("ddp_cnn_fused_activation", _check_convert_and_ddp, fused=True)
    run("double_backward_refused", _check_double_backward_refused)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(verdicts, f)
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world, out_dir):
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, str(out_dir)))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    verdicts = []
    for r in range(world):
        path = out_dir / f"rank{r}.json"
        assert path.exists(), f"rank {r} of {world} wrote no results (exit code " \
                              f"{procs[r].exitcode})"
        verdicts.append(json.loads(path.read_text()))
    return verdicts


def _expected_checks(world):
    names = []
    for sizes in SPLITS[world]:
        names += [f"bn{ndim}d-{dtype}-{sizes}" for ndim in (2, 3, 4, 5)
                  for dtype in (torch.float64, torch.float32)]
        names += [f"no_affine-momentum_none-{sizes}", f"channels_last-{sizes}",
                  f"one_collective_each_way-{sizes}"]
    return names + (["subgroup"] if world >= 3 else []) + [
        "ddp_cnn", "ddp_cnn_fused_activation", "double_backward_refused"]


@pytest.mark.parametrize("world", [2, 3])
def test_distributed(world, tmp_path):
    """One spawn per world size (one test, so that pytest-xdist never spawns a world
    twice); the message lists every failing check of every rank."""
    verdicts = _spawn(world, tmp_path)
    failures = [f"rank {rank}/{world}, {check}:\n{v.get(check, 'not run')}"
                for rank, v in enumerate(verdicts) for check in _expected_checks(world)
                if v.get(check) != "ok"]
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------------------
# single process
# ---------------------------------------------------------------------------------------

def _torch_and_normkit_net():
    return tnn.Sequential(tnn.Conv2d(3, 4, 3), tnn.BatchNorm2d(4, momentum=0.3, eps=1e-3),
                          tnn.Sequential(nkn.BatchNorm2d(4, affine=False)),
                          tnn.BatchNorm1d(4, track_running_stats=False, bias=False),
                          nkn.BatchRenorm2d(4), tnn.SyncBatchNorm(4))


def test_convert_keeps_parameters_buffers_and_flags():
    net = _torch_and_normkit_net().to(torch.float64)
    net[1].weight.requires_grad_(False)
    net[1].running_mean.fill_(0.5)
    net[2][0].eval()
    before = {k: v for k, v in net.state_dict().items()}
    params = {k: p for k, p in net.named_parameters()}
    out = nkn.SyncBatchNorm.convert_sync_batchnorm(net, process_group=None)
    assert out is net
    for idx in (1, 3, 5):
        assert type(out[idx]) is nkn.SyncBatchNorm, idx
    assert type(out[2][0]) is nkn.SyncBatchNorm
    assert type(out[4]) is nkn.BatchRenorm2d                 # not BatchNorm: left alone
    assert (out[1].momentum, out[1].eps) == (0.3, 1e-3)
    assert out[1].weight.requires_grad is False and out[1].bias.requires_grad
    assert out[2][0].training is False and out[1].training is True
    assert out[2][0].weight is None and out[3].bias is None and out[3].running_mean is None
    assert out[1].running_mean.dtype == torch.float64
    after = out.state_dict()
    assert after.keys() == before.keys()
    for k in before:
        assert after[k] is before[k] or torch.equal(after[k], before[k]), k
    for k, p in out.named_parameters():
        assert p is params[k], k                             # the same Parameter objects
    single = nkn.SyncBatchNorm.convert_sync_batchnorm(tnn.BatchNorm3d(2))
    assert type(single) is nkn.SyncBatchNorm


def test_not_distributed_is_batchnorm():
    """torch.distributed not initialized: training falls back to plain BatchNorm (as
    torch.nn.SyncBatchNorm does), on CPU too."""
    assert not dist.is_initialized()
    torch.manual_seed(0)
    x = torch.randn(6, 3, 4, dtype=torch.float64)
    ref, sync = tnn.BatchNorm1d(3, dtype=torch.float64), nkn.SyncBatchNorm(3, dtype=torch.float64)
    xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xr).sin().sum().backward()
    sync(xs).sin().sum().backward()
    torch.testing.assert_close(xs.grad, xr.grad)
    torch.testing.assert_close(sync.weight.grad, ref.weight.grad)
    torch.testing.assert_close(sync.running_var, ref.running_var)
    sync.eval(), ref.eval()
    torch.testing.assert_close(sync(x), ref(x))


def test_signature_and_state_dict_match_torch():
    import inspect
    ours = dict(inspect.signature(nkn.SyncBatchNorm.__init__).parameters)
    theirs = inspect.signature(tnn.SyncBatchNorm.__init__).parameters
    # normkit's own options after torch's, keyword-only, as BatchNorm2d's (test_nn.py)
    assert [(k, ours.pop(k).kind) for k in ("activation", "negative_slope")] == \
        [(k, inspect.Parameter.KEYWORD_ONLY) for k in ("activation", "negative_slope")]
    assert list(ours) == list(theirs)
    assert [(p.default, p.kind) for p in ours.values()] == \
        [(p.default, p.kind) for p in theirs.values()]
    a, b = nkn.SyncBatchNorm(5, bias=False), tnn.SyncBatchNorm(5, bias=False)
    assert a.state_dict().keys() == b.state_dict().keys()


def test_errors(monkeypatch):
    m = nkn.SyncBatchNorm(3)
    with pytest.raises(ValueError, match="at least 2D"):
        m(torch.randn(3))
    with pytest.raises(ValueError, match="at least one channel"):
        nkn.SyncBatchNorm(0)(torch.randn(2, 0))
    grouped = nkn.SyncBatchNorm(3, process_group=object())
    with pytest.raises(ValueError, match="init_process_group"):
        grouped(torch.randn(4, 3))
    grouped.eval()                                 # eval never synchronizes: no error
    x = torch.randn(4, 3)
    ref = tnn.BatchNorm1d(3).eval()
    ref.running_mean.copy_(grouped.running_mean), ref.running_var.copy_(grouped.running_var)
    torch.testing.assert_close(grouped(x), ref(x))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE=2"):
        m(torch.randn(4, 3))
    m.eval()                                       # eval never synchronizes: no error
    assert m(torch.randn(4, 3)).shape == (4, 3)
    monkeypatch.setenv("WORLD_SIZE", "1")
    m.train()
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        m(torch.randn(1, 3))


def test_world_size_one_is_batchnorm():
    """An initialized group of one rank does not synchronize: plain BatchNorm."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    try:
        torch.manual_seed(1)
        x = torch.randn(5, 2, 3, 3)
        ref, sync = tnn.BatchNorm2d(2), nkn.SyncBatchNorm(2)
        torch.testing.assert_close(sync(x), ref(x), **TOL[torch.float32])
        torch.testing.assert_close(sync.running_var, ref.running_var, **TOL[torch.float32])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("act", [tnn.ReLU(), tnn.LeakyReLU(0.0), tnn.LeakyReLU(0.2), tnn.SiLU()],
                         ids=["relu", "leaky0", "leaky0.2", "silu"])
def test_convert_sync_batchnorm_keeps_a_fused_activation(act):
    """A BatchNorm given its activation by ``convert(fuse_activation=True)`` becomes a
    SyncBatchNorm that applies it (unsynchronized here: the distributed checks run the
    synchronized path); ``revert`` gives the activation module back."""
    import copy

    torch.manual_seed(0)
    untouched = tnn.Sequential(tnn.Conv2d(3, 4, 3), tnn.BatchNorm2d(4), act).double()
    model = copy.deepcopy(untouched)
    normkit.convert(model, fuse_activation=True)
    model = nkn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert type(model[1]) is nkn.SyncBatchNorm and model[1].activation is not None
    x = torch.randn(5, 3, 6, 6, dtype=torch.float64)
    for mode in (True, False):
        untouched.train(mode), model.train(mode)
        _close(model(x), untouched(x), torch.float64, f"training={mode}")
    _close(model[1].running_var, untouched[1].running_var, torch.float64, "running_var")
    normkit.revert(model)
    assert [type(m) for m in model] == [tnn.Conv2d, tnn.SyncBatchNorm, type(act)]
    _close(model(x), untouched(x), torch.float64, "reverted")


def test_the_ddp_example_trains_and_keeps_the_ranks_equal():
    """``examples/ddp_cpu.py`` (README, docs/distributed.md) runs as written: 2 processes,
    gloo, DDP + SyncBatchNorm; the running statistics equal on every rank."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "ddp_cpu.py"
    out = subprocess.run([sys.executable, str(script), "--steps", "5"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.endswith("running statistics identical on all ranks: True"), out.stdout
