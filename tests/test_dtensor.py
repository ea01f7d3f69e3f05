"""normkit layers on DTensors: tensor parallelism (``torch.distributed.tensor``) and FSDP.
Two gloo processes, one spawn for the whole file (each process imports torch).

Tensor parallelism: the input sharded on the batch, the sequence or a normalized dim, the
layer's parameters replicated (``distribute_module``). Each result, gathered, must equal
torch.nn's layer on the whole tensor: the output, the input's and the weight's gradients,
and BatchNorm's running statistics (its batch statistics span both shards).

FSDP: a converted model and torch.nn's, sharded alike, trained alike on each rank's own
batches, must end with the same parameters, running statistics and outputs; under a bf16
mixed-precision policy, normkit's BatchNorm takes bf16 parameters and fp32 running
statistics; FSDP1's mixed precision keeps normkit's BatchNorm in fp32, as it keeps torch's."""

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


def _model():
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.GroupNorm(2, 8), nn.Flatten(), nn.Linear(8 * 6 * 6, 32),
                         nn.LayerNorm(32), nn.Linear(32, 16), nn.RMSNorm(16), nn.Linear(16, 4))


def _twins():
    import copy

    import normkit

    torch.manual_seed(0)
    theirs = _model()
    ours = copy.deepcopy(theirs)
    normkit.convert(ours)
    return ours, theirs


def _train(model, policy, steps=3):
    """Shard every layer with parameters and the root (FSDP2), then take SGD steps on
    this rank's own batches; returns the model and a last batch."""
    from torch.distributed.fsdp import fully_shard

    kwargs = {} if policy is None else {"mp_policy": policy}
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 3, 6, 6, generator=gen)).float().square().mean().backward()
        opt.step()
    return model, torch.randn(8, 3, 6, 6, generator=gen)


def _check_fsdp2(policy_dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = None if policy_dtype is None else MixedPrecisionPolicy(
        param_dtype=policy_dtype, reduce_dtype=torch.float32)
    ours, theirs = _twins()
    if policy is not None:     # torch.nn's BatchNorm on the CPU refuses bf16 parameters with
        for m in (ours, theirs):  # fp32 running statistics; _check_fsdp2_batchnorm covers ours
            m[1] = torch.nn.Identity()
    ours, x = _train(ours, policy)
    theirs, _ = _train(theirs, policy)
    # bf16 rounds differently in the two: measured after 3 steps, the fp32 parameters up to
    # 5e-4 apart, the outputs up to 6e-3 (a bf16 ulp at 1 is 7.8e-3)
    tol = {} if policy is None else {"rtol": 0, "atol": 2e-3}
    out_tol = {} if policy is None else {"rtol": 0, "atol": 2e-2}
    for (name, got), (_, want) in zip(ours.named_parameters(), theirs.named_parameters()):
        torch.testing.assert_close(got.full_tensor(), want.full_tensor(), msg=name, **tol)
    for (name, got), (_, want) in zip(ours.named_buffers(), theirs.named_buffers()):
        torch.testing.assert_close(got, want, msg=name)
    torch.testing.assert_close(ours(x), theirs(x), **out_tol)
    ours.eval(), theirs.eval()
    torch.testing.assert_close(ours(x), theirs(x), **out_tol)


def _check_fsdp2_batchnorm():
    """normkit's BatchNorm under a bf16 policy, against torch's functional batch norm with
    the same bf16 input, the policy's bf16-rounded parameters in fp32, fp32 statistics."""
    import torch.nn.functional as F
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import normkit.nn as nknn

    gen = torch.Generator().manual_seed(1)
    ours = nknn.BatchNorm2d(6)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5, generator=gen)
        ours.bias.uniform_(-1, 1, generator=gen)
    w, b = ours.weight.detach().bfloat16().float(), ours.bias.detach().bfloat16().float()
    mean, var = torch.zeros(6), torch.ones(6)
    fully_shard(ours, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    x = torch.randn(4, 6, 5, 5, generator=gen) * 2 + 1
    y = ours(x)
    assert y.dtype == torch.bfloat16, y.dtype
    want = F.batch_norm(x.bfloat16(), mean, var, w, b, training=True)
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(ours.running_mean, mean)
    torch.testing.assert_close(ours.running_var, var)


def _check_fsdp1_keeps_batchnorm_fp32():
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    ours, theirs = _twins()
    seen = {}
    for name, m in (("ours", ours), ("theirs", theirs)):
        m[1].register_forward_hook(lambda mod, args, out, name=name: seen.update(
            {name: (args[0].dtype, mod.weight.dtype, out.dtype)}))
    wrap = ModuleWrapPolicy({torch.nn.Conv2d, torch.nn.Linear})
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ours, theirs = (FullyShardedDataParallel(m, device_id=torch.device("cpu"), auto_wrap_policy=wrap,
                                             mixed_precision=policy, use_orig_params=True)
                    for m in (ours, theirs))
    x = torch.randn(8, 3, 6, 6)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
    assert seen["ours"] == seen["theirs"] == (torch.float32,) * 3, seen


# name -> (check, its arguments)
FSDP_CASES = {"FSDP2": (_check_fsdp2, None), "FSDP2 bf16": (_check_fsdp2, torch.bfloat16),
              "FSDP2 bf16 BatchNorm": (_check_fsdp2_batchnorm,),
              "FSDP1 bf16": (_check_fsdp1_keeps_batchnorm_fp32,)}


def _worker(rank, world, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    verdicts = {}
    checks = [(str(case), _check, case) for case in CASES]
    checks += [(name, check, args) for name, (check, *args) in FSDP_CASES.items()]
    for name, check, args in checks:
        try:
            check(*args)
            verdicts[name] = "ok"
        except Exception:  # report, keep going: the other rank runs the same checks
            verdicts[name] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(verdicts, f)
    dist.destroy_process_group()


def test_layers_on_sharded_dtensors_and_under_fsdp_equal_torch(tmp_path):
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
        assert set(verdicts) == {str(c) for c in CASES} | set(FSDP_CASES)
        failed = {k: v for k, v in verdicts.items() if v != "ok"}
        assert not failed, f"rank {r}: " + "\n".join(f"{k}:\n{v}" for k, v in failed.items())
