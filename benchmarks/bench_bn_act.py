"""BatchNorm2d(64) on (16, 64, 56, 56) float32 followed by ReLU, per call: fused
(``normkit.nn.BatchNorm2d(64, activation="relu")``), unfused (normkit's BatchNorm, then
``F.relu``) and torch (``torch.nn.BatchNorm2d``, then ``F.relu``); forward (no grad) and
forward + backward, training and eval; interleaved, best of two rounds. Figures in
docs/performance.md ("BatchNorm fused with its activation").

    python benchmarks/bench_bn_act.py
"""
import time, torch, torch.nn.functional as F
import normkit.nn as nn
torch.manual_seed(0)
x = torch.randn(16, 64, 56, 56)
fused = nn.BatchNorm2d(64, activation="relu")
plain = nn.BatchNorm2d(64)
tbn = torch.nn.BatchNorm2d(64)
def t(fn, reps=30):
    for _ in range(5): fn()
    best = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps): fn()
        best.append((time.perf_counter() - t0) / reps * 1e3)
    return min(best)
xg = x.clone().requires_grad_()
g = torch.randn_like(x)
def fwd(m, act):
    with torch.no_grad(): return act(m(x))
def fb(m, act):
    y = act(m(xg)); y.backward(g)
ident = lambda y: y
for mode in ["train", "eval"]:
    for m in (fused, plain, tbn): m.train(mode == "train")
    r = {}
    for _ in range(2):   # interleaved, two rounds
        r.setdefault("fused fwd", []).append(t(lambda: fwd(fused, ident)))
        r.setdefault("unfused fwd", []).append(t(lambda: fwd(plain, F.relu)))
        r.setdefault("torch fwd", []).append(t(lambda: fwd(tbn, F.relu)))
        r.setdefault("fused fwd+bwd", []).append(t(lambda: fb(fused, ident), 15))
        r.setdefault("unfused fwd+bwd", []).append(t(lambda: fb(plain, F.relu), 15))
        r.setdefault("torch fwd+bwd", []).append(t(lambda: fb(tbn, F.relu), 15))
    for k, v in r.items():
        print(f"{mode:5s} {k:16s} {min(v):7.2f} ms  ({torch.get_num_threads()} threads)")
