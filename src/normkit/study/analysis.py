"""From the runs to the numbers and sentences of the report.

``summarize`` turns the runs into means and standard deviations over seeds (sample
standard deviation, ddof = 1; 0 for a single seed). ``findings`` turns those numbers into
plain sentences, each comparing what this study measured with what the GroupNorm paper
(Wu & He, 2018) reports, and saying when they disagree. Nothing here is canned: every
number and every verdict comes from the summary.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["NAMES", "PAPER", "TARGET_LOSS", "target_loss", "summarize", "steps_to_target", "reference_batch",
           "crossover", "findings", "shift_sentence", "vit_findings", "pct"]

NAMES = {"none": "no normalization", "batch": "BatchNorm", "batchrenorm": "BatchRenorm",
         "group": "GroupNorm", "layer": "LayerNorm", "instance": "InstanceNorm", "rms": "RMSNorm"}

# Wu & He 2018, ResNet-50 on ImageNet, top-1 validation error (%) by images per GPU
PAPER = {"batch": {32: 23.6, 16: 23.7, 8: 24.8, 4: 27.3, 2: 34.7},
         "group": {32: 24.1, 16: 24.2, 8: 24.0, 4: 24.2, 2: 24.1}}

TARGET_LOSS = 0.2  # training loss (cross-entropy) that "steps to reach" is measured against, by default
# per dataset: MNIST-1D's runs at batch 32 (1000 steps) end near 0.1-0.4 with normalization
TARGET_LOSSES = {"digits": 0.2, "mnist1d": 0.5}
STEADIER = 0.8    # a norm keeps a layer's input "clearly steadier" below this fraction of none's travel
PER_SAMPLE = ("group", "layer", "instance", "rms")
METRICS = ("test_error", "test_error_train_mode", "final_train_loss", "batch_dependence", "steps_to_target")


def pct(v: float) -> str:
    """A fraction as a percentage with two decimals."""
    return f"{100 * v:.2f}"


def target_loss(protocol: dict) -> float:
    """The training loss that "steps to reach" is measured against for this protocol's data."""
    return TARGET_LOSSES.get(protocol.get("dataset"), TARGET_LOSS)


def steps_to_target(run: dict, target: float = TARGET_LOSS) -> float:
    """First step at which the windowed training loss is at most ``target`` (nan: never)."""
    for step, loss in zip(run["loss_curve"]["step"], run["loss_curve"]["loss"]):
        if loss <= target:
            return float(step)
    return float("nan")


def _stat(values):
    a = np.asarray(values, dtype=np.float64)
    finite = a[np.isfinite(a)]
    if len(finite) == 0:
        return {"mean": float("nan"), "std": float("nan"), "n": 0, "values": a.tolist()}
    std = float(finite.std(ddof=1)) if len(finite) > 1 else 0.0
    return {"mean": float(finite.mean()), "std": std, "n": int(len(finite)), "values": a.tolist()}


def summarize(results: dict) -> dict:
    """``summary[method][str(batch)][metric] = {mean, std, n, values}`` over seeds, for the
    grid named in the protocol."""
    p = results["protocol"]
    wanted = {(m, b, s) for m in p["methods"] for b in p["batch_sizes"] for s in p["seeds"]}
    summary = {}
    for m in p["methods"]:
        summary[m] = {}
        for b in p["batch_sizes"]:
            runs = [r for r in results["runs"] if (r["method"], r["batch_size"], r["seed"]) in wanted
                    and r["method"] == m and r["batch_size"] == b]
            if not runs:
                continue
            cell = {k: _stat([r[k] for r in runs]) for k in METRICS if k != "steps_to_target"}
            cell["steps_to_target"] = _stat([steps_to_target(r, target_loss(p)) for r in runs])
            cell["diverged"] = int(sum(r["diverged"] for r in runs))
            cell["steps"] = int(runs[0]["steps"])
            cell["lr"] = float(runs[0]["lr"])
            summary[m][str(b)] = cell
    return summary


def reference_batch(batch_sizes) -> int:
    """Batch size used for the loss curves: 32 (the paper's) if present, else the largest
    one below it, else the smallest."""
    below = [b for b in batch_sizes if b <= 32]
    return max(below) if below else min(batch_sizes)


def _se(cell, metric):
    """Standard error of a cell's mean."""
    s = cell[metric]
    return s["std"] / math.sqrt(s["n"]) if s["n"] > 1 else 0.0


def _differs(a, b, metric="test_error"):
    """Is mean(a) - mean(b) larger than twice its standard error (and than 0.3 points)?"""
    d = a[metric]["mean"] - b[metric]["mean"]
    se = math.sqrt(_se(a, metric) ** 2 + _se(b, metric) ** 2)
    return abs(d) > max(2 * se, 0.003), d


def _err(cell):
    s = cell["test_error"]
    return f"{pct(s['mean'])} ± {pct(s['std'])} %"


def _apart(a, b):
    """(mean(a) - mean(b), the larger of the two standard deviations over seeds)."""
    return (a["test_error"]["mean"] - b["test_error"]["mean"],
            max(a["test_error"]["std"], b["test_error"]["std"]))


def crossover(summary: dict, batch_sizes) -> dict | None:
    """The GroupNorm paper's crossover, tested in eval-mode test error: BatchNorm at the
    smallest batch worse by more than twice the standard deviation over seeds (the larger
    of the two compared) than BatchNorm at every batch >= 16 and than GroupNorm at the
    smallest batch, while at every batch >= 16 BatchNorm is not clearly worse than GroupNorm
    (by at most twice the standard deviation). None without BatchNorm and GroupNorm at the
    smallest batch and at some batch >= 16."""
    bs = sorted(batch_sizes)
    small = bs[0]
    large = [b for b in bs if b >= 16]
    need = [small, *large]
    if not large or any(str(b) not in summary.get(m, {}) for m in ("batch", "group") for b in need):
        return None
    bn, gn = summary["batch"], summary["group"]
    vs_large = {b: _apart(bn[str(small)], bn[str(b)]) for b in large}
    vs_group = _apart(bn[str(small)], gn[str(small)])
    at_large = {b: _apart(bn[str(b)], gn[str(b)]) for b in large}
    ok_large = all(d > 2 * sd for d, sd in vs_large.values())
    ok_group = vs_group[0] > 2 * vs_group[1]
    ok_tie = all(d <= 2 * sd for d, sd in at_large.values())
    return {"small": small, "large": large, "vs_large": vs_large, "vs_group": vs_group, "at_large": at_large,
            "ok_large": ok_large, "ok_group": ok_group, "ok_tie": ok_tie,
            "holds": ok_large and ok_group and ok_tie}


def _crossover_sentence(c) -> str:
    small = c["small"]
    d, sd = c["vs_group"]
    worst = min(c["vs_large"].items(), key=lambda kv: kv[1][0] - 2 * kv[1][1])
    ties = ", ".join(f"{100 * d_:+.2f} at {b}" for b, (d_, _) in c["at_large"].items())
    head = ("The GroupNorm paper's crossover reproduces" if c["holds"] else
            "The GroupNorm paper's crossover does NOT fully reproduce")
    return (f"{head}: BatchNorm at batch {small} is {100 * d:+.2f} points from GroupNorm at batch {small} "
            f"({'more' if c['ok_group'] else 'not more'} than twice the std, {200 * sd:.2f}) and at least "
            f"{100 * worst[1][0]:+.2f} points from itself at batch {worst[0]} "
            f"({'more' if c['ok_large'] else 'not more'} than twice the std at every batch >= 16); at batch >= 16 "
            f"BatchNorm minus GroupNorm is {ties} points ({'never' if c['ok_tie'] else 'sometimes'} worse by more "
            f"than twice the std). Paper: BatchNorm 34.7 % at 2 against 23.6-23.7 % at 16-32, GroupNorm 24.1 % at 2.")


def findings(results: dict, summary: dict) -> list:
    """Plain sentences, computed from ``summary``; each claim of the source articles / the
    GroupNorm paper gets a verdict: seen here, or not."""
    p = results["protocol"]
    bs = sorted(p["batch_sizes"])
    small, large = bs[0], bs[-1]
    ref = reference_batch(bs)
    out = []
    name = lambda m: NAMES.get(m, m)  # noqa: E731

    def have(m, *batches):
        """Has ``m`` been trained at ``batches`` (default: every batch size)?"""
        return m in summary and all(str(b) in summary[m] for b in (batches or bs))

    # 0. the crossover, all three parts at once
    c = crossover(summary, bs)
    if c is not None:
        out.append(_crossover_sentence(c))

    # 1. BatchNorm as the batch shrinks
    if have("batch") and small != large:
        a, b = summary["batch"][str(small)], summary["batch"][str(ref if ref != small else large)]
        big = ref if ref != small else large
        sig, d = _differs(a, b)
        paper = ""
        if small in PAPER["batch"] and big in PAPER["batch"]:
            paper = (f" The paper reports {PAPER['batch'][big]} % at {big} and {PAPER['batch'][small]} % at "
                     f"{small} images per GPU (+{PAPER['batch'][small] - PAPER['batch'][big]:.1f} points).")
        verdict = ("BatchNorm's test error rises as the batch shrinks, as the paper says"
                   if sig and d > 0 else
                   "BatchNorm's test error does NOT clearly rise as the batch shrinks here, unlike in the paper"
                   if not sig else
                   "BatchNorm's test error is LOWER at the small batch here, the opposite of the paper")
        out.append(f"{verdict}: {_err(a)} at batch {small} against {_err(b)} at batch {big} "
                   f"({100 * d:+.2f} points).{paper}")
        la, lb = a["final_train_loss"]["mean"], b["final_train_loss"]["mean"]
        out.append(f"BatchNorm's final training loss is {la:.3f} at batch {small} and {lb:.3f} at batch {big}: "
                   + ("the noisy statistics of small batches make it fit the training set worse."
                      if la > 1.5 * lb else "training itself is not visibly hurt by small batches here."))

    # 2. GroupNorm's stability against BatchNorm's spread
    if have("group") and have("batch"):
        g = [summary["group"][str(b)]["test_error"]["mean"] for b in bs]
        bn = [summary["batch"][str(b)]["test_error"]["mean"] for b in bs]
        out.append(f"Across batch sizes {small}-{large}, GroupNorm's mean test error spans "
                   f"{pct(min(g))}-{pct(max(g))} % (range {100 * (max(g) - min(g)):.2f} points) and "
                   f"BatchNorm's {pct(min(bn))}-{pct(max(bn))} % (range {100 * (max(bn) - min(bn)):.2f} points); "
                   + ("GroupNorm is the steadier of the two, as in the paper (24.0-24.2 % there)."
                      if max(g) - min(g) < max(bn) - min(bn) else
                      "here GroupNorm is NOT steadier than BatchNorm, unlike in the paper (24.0-24.2 % there)."))
        a, b = summary["group"][str(small)], summary["batch"][str(small)]
        sig, d = _differs(a, b)
        out.append(f"At batch {small}: GroupNorm {_err(a)}, BatchNorm {_err(b)} -> "
                   + ("GroupNorm is better, as in the paper (24.1 % vs 34.7 % at 2 per GPU)." if sig and d < 0 else
                      "BatchNorm is better here, unlike the paper (24.1 % vs 34.7 % at 2 per GPU)." if sig else
                      "no clear difference, unlike the paper (24.1 % vs 34.7 % at 2 per GPU)."))
        a, b = summary["group"][str(ref)], summary["batch"][str(ref)]
        sig, d = _differs(a, b)
        out.append(f"At batch {ref}: GroupNorm {_err(a)}, BatchNorm {_err(b)} -> "
                   + ("BatchNorm is better, as in the paper (23.6 % vs 24.1 % at 32)." if sig and d > 0 else
                      "GroupNorm is better here; in the paper BatchNorm wins slightly (23.6 % vs 24.1 % at 32)."
                      if sig else "no clear difference (the paper: BatchNorm 23.6 %, GroupNorm 24.1 % at 32)."))

    # 3. speed: steps to reach the target loss at the reference batch
    if "none" in summary and str(ref) in summary["none"]:
        def steps(m):
            s = summary[m][str(ref)]["steps_to_target"]
            return s["mean"], s["n"]
        total = summary["none"][str(ref)]["steps"]
        n_none, k_none = steps("none")
        normed = [(m, *steps(m)) for m in p["methods"] if m != "none" and str(ref) in summary[m]]
        reached = [f"{name(m)} {v:.0f}" + ("" if k == len(p["seeds"]) else f" ({k}/{len(p['seeds'])} seeds)")
                   for m, v, k in normed if k > 0]
        never = [name(m) for m, v, k in normed if k == 0]
        none_txt = (f"without normalization it takes {n_none:.0f} steps" if k_none else
                    f"without normalization it never gets there in the {total} steps")
        faster = [m for m, v, k in normed if k and (not k_none or v < n_none)]
        out.append(f"Steps to reach training loss {target_loss(p)} at batch {ref} (of {total}): {none_txt}; "
                   + ("; ".join(reached) if reached else "no normalized network reaches it either")
                   + (f"; never reached: {', '.join(never)}" if never else "") + ". "
                   + (f"{len(faster)} of {len(normed)} normalizations train faster than none, as the articles say."
                      if faster else "Normalization does NOT speed up training here."))

    # 4. stability: the unnormalized net at the largest learning rate
    if have("none", large):
        c = summary["none"][str(large)]
        others = [summary[m][str(large)]["test_error"]["mean"] for m in p["methods"]
                  if m != "none" and have(m, large)]
        div = c["diverged"]
        msg = (f"At the largest batch ({large}, learning rate {c['lr']:g}) the network without normalization "
               f"{'diverged in ' + str(div) + ' of ' + str(c['test_error']['n'] + div) + ' seeds and ' if div else ''}"
               f"ends at {_err(c)}")
        if others:
            msg += (f", against {pct(min(others))}-{pct(max(others))} % with normalization"
                    + (": normalization makes the larger learning rate usable." if c["test_error"]["mean"] > max(others)
                       else ": here it keeps up with the normalized networks."))
        out.append(msg)

    # 5. train mode vs eval mode
    for m in ("batch", "batchrenorm"):
        if have(m):
            gaps = {b: summary[m][str(b)]["test_error_train_mode"]["mean"] - summary[m][str(b)]["test_error"]["mean"]
                    for b in bs}
            out.append(f"{name(m)} gives different answers in training and eval mode: test error with each test "
                       f"batch's own statistics minus error with the running averages is "
                       + ", ".join(f"{100 * gaps[b]:+.2f}" for b in bs)
                       + f" points at batch {', '.join(map(str, bs))}; the gap is largest at batch "
                       f"{max(gaps, key=lambda b: abs(gaps[b]))}.")
    if have("batch") and have("batchrenorm"):
        gap = lambda m: (summary[m][str(small)]["test_error_train_mode"]["mean"]  # noqa: E731
                         - summary[m][str(small)]["test_error"]["mean"])
        out.append(f"At batch {small} BatchRenorm's train/eval gap is {100 * gap('batchrenorm'):+.2f} points "
                   f"against BatchNorm's {100 * gap('batch'):+.2f}: "
                   + ("its correction toward the running statistics makes training mode behave like eval mode, "
                      "which is what it was designed for." if abs(gap("batchrenorm")) < abs(gap("batch")) else
                      "here its correction does NOT bring training mode closer to eval mode."))
    per_sample = [m for m in PER_SAMPLE if m in summary and summary[m]]
    if per_sample:
        cells = [c for m in per_sample for c in summary[m].values()]
        gap = max(abs(c["test_error_train_mode"]["mean"] - c["test_error"]["mean"]) for c in cells)
        dep = max(c["batch_dependence"]["mean"] for c in cells)
        bn_dep = (min(summary["batch"][str(b)]["batch_dependence"]["mean"] for b in bs) if have("batch") else None)
        out.append(f"{', '.join(name(m) for m in per_sample)} do not depend on the batch: their train/eval "
                   f"error gap is at most {100 * gap:.2f} points and changing an image's batch-mates moves its "
                   f"logits by at most {dep:.1e}"
                   + (f" (BatchNorm: at least {bn_dep:.2f})." if bn_dep is not None else "."))

    # 6. who wins where
    best = []
    for b in bs:
        ranked = [m for m in p["methods"] if have(m, b)]
        if ranked:
            m = min(ranked, key=lambda m: summary[m][str(b)]["test_error"]["mean"])
            best.append(f"{b}: {name(m)} ({pct(summary[m][str(b)]['test_error']['mean'])} %)")
    if best:
        out.append("Lowest mean test error at each batch size -- " + "; ".join(best) + ".")
    if have("instance", ref):
        e = summary["instance"][str(ref)]["test_error"]["mean"]
        others = [summary[m][str(ref)]["test_error"]["mean"] for m in p["methods"]
                  if m not in ("none", "instance") and have(m, ref)]
        if others and e > max(others):
            out.append(f"InstanceNorm is the worst normalization at batch {ref} ({pct(e)} %): it takes each "
                       f"channel's mean and variance per sample, erasing how strongly a channel responds -- "
                       f"information a classifier needs.")
    return out


def shift_sentence(results: dict) -> str | None:
    """How far the recorded pre-activation percentiles travel over training, per method
    (see :func:`normkit.study.shift.movement`), compared with no normalization."""
    from normkit.study.shift import movement

    runs = [r for r in results["runs"] if "shift" in r]
    if not runs:
        return None
    travel = {r["method"]: movement(r["shift"]) for r in runs}
    parts = [f"{NAMES.get(m, m)} {t[50]:.2f} (15th {t[15]:.2f}, 85th {t[85]:.2f})" for m, t in travel.items()]
    text = (f"Internal covariate shift (last block's input to ReLU, {runs[0]['steps']} steps at batch "
            f"{runs[0]['batch_size']}, seed {runs[0]['seed']}): over training the median of a channel moves by "
            + "; ".join(parts) + " times the channel's 15-85 spread (median over channels).")
    if "none" in travel and len(travel) > 1:
        normed = {m: t[50] for m, t in travel.items() if m != "none"}
        calmer = [m for m, v in normed.items() if v < STEADIER * travel["none"][50]]
        text += (f" {len(calmer)} of {len(normed)} normalizations keep it clearly steadier than none (below "
                 f"{STEADIER:g} of its travel)"
                 + (f": {', '.join(NAMES.get(m, m) for m in calmer)}" if calmer else "")
                 + (", as the BatchNorm paper's Figure 1 shows." if len(calmer) == len(normed) else
                    "; the BatchNorm paper's Figure 1 shows BatchNorm steadier, and says nothing of the others."))
    return text


def vit_findings(vit: dict) -> list:
    """Sentences on the transformer runs: which train and which diverge at each learning
    rate, how fast each reaches the target loss, and which depend on the batch."""
    p = vit["protocol"]
    target = p["target_loss"]
    name = lambda m: NAMES.get(m, m) + (" over tokens" if m == "batch" else "")  # noqa: E731
    out = []
    for lr in p["lrs"]:
        runs = [r for r in vit["runs"] if r["lr"] == lr]
        parts = []
        for r in runs:
            if r["diverged"]:
                parts.append(f"{name(r['method'])} diverged at step {r['steps']}")
                continue
            s = steps_to_target(r, target)
            parts.append(f"{name(r['method'])} " + (f"reaches loss {target} at step {s:.0f}" if math.isfinite(s)
                                                   else f"never reaches loss {target}")
                         + f", ends at {r['final_train_loss']:.3f} ({pct(r['test_error'])} % test error)")
        out.append(f"Peak learning rate {lr:g}: " + "; ".join(parts) + ".")
    ok = {m: [r["lr"] for r in vit["runs"] if r["method"] == m and not r["diverged"]
              and math.isfinite(steps_to_target(r, target))] for m in p["methods"]}
    diverged = [f"{name(r['method'])} at {r['lr']:g}" for r in vit["runs"] if r["diverged"]]
    n_runs = len(vit["runs"])
    out.append(f"Reach loss {target} within {p['steps']} steps: "
               + "; ".join(f"{name(m)} at {len(v)} of {len(p['lrs'])} rates" for m, v in ok.items())
               + ". Diverged: " + (", ".join(diverged) if diverged else f"none of the {n_runs} runs") + ".")
    dep = {m: max((r["batch_dependence"] for r in vit["runs"] if r["method"] == m and not r["diverged"]),
                  default=float("nan")) for m in p["methods"]}
    bn = [r for r in vit["runs"] if r["method"] == "batch" and not r["diverged"]]
    if bn:
        gaps = ", ".join(f"{100 * (r['test_error_train_mode'] - r['test_error']):+.2f}" for r in bn)
        rates = ", ".join(f"{r['lr']:g}" for r in bn)
        out.append(f"BatchNorm over tokens in training mode (each test batch's own statistics) minus eval mode "
                   f"(running averages): {gaps} points of test error at learning rate {rates}.")
    out.append("Batch dependence (largest change of a sample's logits when its batch-mates change): "
               + "; ".join(f"{name(m)} {v:.1e}" for m, v in dep.items())
               + ". Only BatchNorm over tokens makes a sample's output depend on the rest of its batch; LayerNorm "
                 "and RMSNorm normalize each token by itself, which is why a transformer can use them with any "
                 "batch, including one sequence at inference.")
    return out
