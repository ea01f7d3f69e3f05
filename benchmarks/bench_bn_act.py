"""BatchNorm2d followed by ReLU, per call, float32: fused
(``normkit.nn.BatchNorm2d(c, activation="relu")``), unfused (normkit's BatchNorm, then
``F.relu``) and torch (``torch.nn.BatchNorm2d``, then ``F.relu``); forward (no grad) and
forward + backward, training and eval; interleaved, best of two rounds. Figures in
docs/performance.md ("BatchNorm fused with its activation").

    python benchmarks/bench_bn_act.py                # (16, 64, 56, 56)
    python benchmarks/bench_bn_act.py 16 512 7 7     # any (N, C, H, W)
"""
import sys
import time

import torch
import torch.nn.functional as F

import normkit.nn as nn

shape = tuple(int(a) for a in sys.argv[1:5]) if len(sys.argv) > 4 else (16, 64, 56, 56)
torch.manual_seed(0)
c = shape[1]
x = torch.randn(shape)
fused = nn.BatchNorm2d(c, activation="relu")
plain = nn.BatchNorm2d(c)
tbn = torch.nn.BatchNorm2d(c)
small = x.numel() < 1 << 20
REPS = 300 if small else 30


def t(fn, reps=REPS):
    for _ in range(5):
        fn()
    best = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best.append((time.perf_counter() - t0) / reps * 1e3)
    return min(best)


xg = x.clone().requires_grad_()
g = torch.randn_like(x)


def fwd(m, act):
    with torch.no_grad():
        return act(m(x))


def fb(m, act):
    y = act(m(xg))
    y.backward(g)


def ident(y):
    return y


print(f"{shape}, {torch.get_num_threads()} threads, ms per call")
for mode in ["train", "eval"]:
    for m in (fused, plain, tbn):
        m.train(mode == "train")
    r = {}
    for _ in range(2):   # interleaved, two rounds
        r.setdefault("fused fwd", []).append(t(lambda: fwd(fused, ident)))
        r.setdefault("unfused fwd", []).append(t(lambda: fwd(plain, F.relu)))
        r.setdefault("torch fwd", []).append(t(lambda: fwd(tbn, F.relu)))
        r.setdefault("fused fwd+bwd", []).append(t(lambda: fb(fused, ident), REPS // 2))
        r.setdefault("unfused fwd+bwd", []).append(t(lambda: fb(plain, F.relu), REPS // 2))
        r.setdefault("torch fwd+bwd", []).append(t(lambda: fb(tbn, F.relu), REPS // 2))
    for k, v in r.items():
        print(f"{mode:5s} {k:16s} {min(v):7.3f}")
