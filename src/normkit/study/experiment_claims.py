"""Rows of the claims table for the experiments of :mod:`normkit.study.experiments`, and the
grid's generalization gaps beside row 9: ``[claim, source, paper, here, verdict]``, every verdict
computed from the numbers with the thresholds below, none written in advance.

Each ``*_row`` function takes what it tests (an experiment's ``{"config", "parts"}``, or
the grid's results) and returns a row, or None when those numbers are missing.
"""

from __future__ import annotations

import numpy as np

from normkit.study.analysis import NAMES, pct
from normkit.study.depth import spread
from normkit.study.lr_range import rate_range, reached
from normkit.study.regularize import METHODS as REGULARIZE_METHODS
from normkit.study.sequence import PLACE_NAMES

__all__ = ["A1", "A2", "BOTH", "PLAIN_SPREAD", "SMALL_FACTOR", "SCALE_TOL", "depth_row", "lr_row", "scale_row",
           "regularize_row", "grid_gap_row", "style_row", "sequence_row", "drift_row", "batch_one_row",
           "experiment_rows", "regularize_gaps"]

A1 = "article 1"
A2 = "article 2"
BOTH = "articles 1, 2"

PLAIN_SPREAD = 100.0   # a gradient "runs out of control" over the depth: largest / smallest >= 100
SMALL_FACTOR = 10.0    # "stays within a small factor": largest / smallest <= 10
SCALE_TOL = 1e-2       # BatchNorm's output "unchanged": the logits move by less than 1 % (eps keeps it off 0)
RATIO_TOL = 0.01       # the gradient "divided by c": ratio within 1 % of c
ALONE_TOL = 1e-4       # a per-sample norm "does not care": logits move by less than this


def _name(m):
    return NAMES.get(m, m)


def depth_row(exp):
    """Row 6: per-layer gradient norms of the deep plain network (module ``depth``)."""
    if exp is None:
        return None
    parts = exp["parts"]
    s = {m: {k: spread(parts[m]["gradients"][k]["activation"]) for k in ("init", "trained")} for m in parts}
    plain = s["none"]["init"]
    normed = [m for m in parts if m != "none"]
    stable = [m for m in normed if max(s[m].values()) <= SMALL_FACTOR]
    depth = parts["none"]["depth"]
    here = (f"largest / smallest ‖dL/dh(l)‖ over {depth} layers, at init / after training: "
            + "; ".join(f"{_name(m)} {s[m]['init']:.3g} / {s[m]['trained']:.3g}" for m in parts))
    if plain >= PLAIN_SPREAD and len(stable) == len(normed):
        verdict = "yes"
    elif plain >= PLAIN_SPREAD and stable:
        verdict = (f"partly: {', '.join(map(_name, stable))} within {SMALL_FACTOR:g}x; "
                   + ", ".join(f"{_name(m)} {max(s[m].values()):.3g}x" for m in normed if m not in stable))
    else:
        verdict = "no"
    return ["Gradients stay stable with depth", A2,
            "article 2: without normalization the product over layers runs out of control (no number)",
            here, verdict]


def lr_row(exp):
    """Row 7: the learning rates at which BatchNorm and none reach the target loss."""
    if exp is None:
        return None
    none, bn = exp["parts"]["none"], exp["parts"]["batch"]
    lrs = exp["config"]["lrs"]

    def span(r):
        ok = reached(r)
        if len(ok) < 2:
            return f"{len(ok)} of {len(lrs)} rates" + (f" ({ok[0]:g} only)" if ok else "")
        return f"{len(ok)} of {len(lrs)} rates ({min(ok):g}-{max(ok):g}, {rate_range(r):.3g}x)"

    here = (f"final training loss <= {bn['target']} after {bn['steps']} steps at batch {bn['batch_size']}, rates "
            f"{min(lrs):g}-{max(lrs):g}: BatchNorm at {span(bn)}; none at {span(none)}")
    return ["BatchNorm allows larger learning rates", A2,
            "article 2: the gradient is insensitive to the learning rate (no number); BatchNorm paper: 5x and 30x "
            "the rate", here, "yes" if len(reached(bn)) > len(reached(none)) else "no"]


def scale_row(exp):
    """Row 8: scaling the weight before BatchNorm (module ``probes``)."""
    if exp is None:
        return None
    bn, none = exp["parts"]["batch"]["weight_scale"], exp["parts"]["none"]["weight_scale"]
    flat = all(p["logit_change"] <= SCALE_TOL for p in bn)
    divided = all(abs(p["grad_ratio"] / p["scale"] - 1) <= RATIO_TOL for p in bn)
    moves = any(p["logit_change"] > 0.1 for p in none)
    here = ("conv2's weight x " + " and x ".join(f"{p['scale']:g}" for p in bn) + " in the trained nets: BatchNorm's "
            "logits change by " + ", ".join(f"{p['logit_change']:.1e}" for p in bn)
            + ", its gradient shrinks by " + ", ".join(f"{p['grad_ratio']:.4g}" for p in bn)
            + "x; without normalization the logits change by " + ", ".join(f"{p['logit_change']:.2f}" for p in none)
            + " (relative)")
    return ["The weights' scale no longer sets the activations' scale", A2,
            "article 2: parameter scale no longer affects activation scale; gradients less sensitive (no number)",
            here, "yes" if flat and divided and moves else "no"]


def _spread(*samples):
    """Twice the larger standard deviation over seeds of ``samples`` (0 with one seed)."""
    return 2 * max(float(np.std(v, ddof=1)) if len(v) > 1 else 0.0 for v in samples)


def regularize_gaps(results, method, batch):
    """Test minus training error of ``method`` at ``batch``, per seed of the grid."""
    return [r["test_error"] - r["train_error"] for r in results["runs"]
            if r["method"] == method and r["batch_size"] == batch and "train_error" in r
            and r["seed"] in results["protocol"]["seeds"]]


def grid_gap_row(results, batch):
    """BatchNorm's generalization gap against GroupNorm's at ``batch`` in the grid's runs
    (the report's list beside row 9: the grid hardly overfits)."""
    bn, gn = regularize_gaps(results, "batch", batch), regularize_gaps(results, "group", batch)
    if not bn or not gn:
        return None
    d, thr = float(np.mean(bn) - np.mean(gn)), _spread(bn, gn)
    here = (f"test minus training error at batch {batch}: BatchNorm {100 * np.mean(bn):+.2f}, GroupNorm "
            f"{100 * np.mean(gn):+.2f} points ({100 * d:+.2f}; twice the std over seeds {100 * thr:.2f})")
    verdict = ("BatchNorm's gap smaller" if d < -thr else "BatchNorm's gap larger" if d > thr else
               "no clear difference")
    return [f"The grid at batch {batch}", A2, "", here, verdict]


def regularize_row(exp):
    """Row 9: test error after fitting small training sets with BatchNorm, BatchNorm in
    ghost batches (more batch noise) and GroupNorm (none); module ``regularize``. One error
    is below another when their means differ by more than twice the larger std over seeds.
    (Test error, not the gap to the training error: a method that does not fit its
    training set would show a small gap without generalizing better.)"""
    if exp is None:
        return None
    cfg, parts = exp["config"], exp["parts"]

    def errors(m, n, key="test_error"):
        return [r[key] for r in parts[m]["runs"] if r["n_train"] == n]

    held, words = {"group": [], "ghost": []}, []
    for n in cfg["sizes"]:
        bn, ghost, gn = errors("batch", n), errors("ghost", n), errors("group", n)
        if np.mean(bn) - np.mean(gn) < -_spread(bn, gn):
            held["group"].append(n)
        if np.mean(ghost) - np.mean(bn) < -_spread(ghost, bn):
            held["ghost"].append(n)
        fit = {m: pct(np.mean(errors(m, n, "train_error"))) for m in REGULARIZE_METHODS}
        words.append(f"{n} signals: BatchNorm {pct(np.mean(bn))} %, in ghost batches of {cfg['ghost']} signals "
                     f"{pct(np.mean(ghost))} %, GroupNorm {pct(np.mean(gn))} % (thresholds: against GroupNorm "
                     f"{100 * _spread(bn, gn):.2f}, ghost against BatchNorm {100 * _spread(ghost, bn):.2f} points; "
                     "training error " + " / ".join(fit.values()) + " %)")
    here = (f"test error, mean of {len(cfg['seeds'])} seeds, after {cfg['steps']} steps at batch "
            f"{cfg['batch_size']} on the first " + "; ".join(words))

    def at(sizes):
        return " and ".join(map(str, sizes)) + " signals"

    if all(len(v) == len(cfg["sizes"]) for v in held.values()):
        verdict = "yes"
    elif held["group"] or held["ghost"]:
        verdict = "partly: " + "; ".join(
            ([f"BatchNorm's test error below GroupNorm's at {at(held['group'])}"] if held["group"] else [])
            + [f"more batch noise (ghost batches) lowers it at {at(held['ghost'])}" if held["ghost"] else
               "more batch noise (ghost batches) does not lower it"])
    else:
        verdict = "no"
    return ["Mini-batch noise regularizes mildly", A2,
            "article 2: BatchNorm's batch noise regularizes mildly; BatchNorm paper: dropout can be removed",
            here, verdict]


def _increase(curve):
    return curve["test_error"][-1] - curve["test_error"][0]


def style_row(exp):
    """Row 10: test error under per-signal contrast and brightness (module ``robust``)."""
    if exp is None:
        return None
    parts = exp["parts"]
    inc = {m: _increase(parts[m]["style"]) for m in parts}
    size = parts["instance"]["style"]["size"][-1]
    here = (f"test error rise at size {size:g} (contrast up to e^{size:g}, brightness up to {size:g} std): "
            + "; ".join(f"{_name(m)} {100 * v:+.1f} points" for m, v in sorted(inc.items(), key=lambda kv: kv[1])))
    return ["InstanceNorm removes style (contrast, brightness)", A2,
            "article 2: style = mean / variance, InstanceNorm erases it (no number)", here,
            "yes" if min(inc, key=inc.get) == "instance" else "no"]


def sequence_row(exp):
    """Row 11: the recurrent network with BatchNorm and LayerNorm at each place of its norm
    (module ``sequence``). LayerNorm is ahead at a place when BatchNorm's mean test error is
    above its own by more than twice the larger std over seeds; "yes" at every place,
    "partly" at some. Runs stored before the places were recorded count as ``"sum"``."""
    if exp is None:
        return None
    parts = exp["parts"]

    def errs(m, place, key="test_error"):
        return [r[key] for r in parts[m]["runs"] if r.get("place", "sum") == place]

    places = exp["config"].get("places", ["sum"])
    ahead, behind, words = [], [], []
    for place in places:
        bn, ln = errs("batch", place), errs("layer", place)
        d, thr = float(np.mean(bn) - np.mean(ln)), max(0.01, _spread(bn, ln))
        (ahead if d > thr else behind if d < -thr else []).append(place)
        words.append(f"norm of the {PLACE_NAMES[place]}: BatchNorm {pct(np.mean(bn))} % (with batch statistics "
                     f"{pct(np.mean(errs('batch', place, 'test_error_train_mode')))} %), LayerNorm "
                     f"{pct(np.mean(ln))} %; difference {100 * d:+.2f} points, threshold {100 * thr:.2f}")
    p = parts["batch"]
    here = (f"recurrent net, {p['steps']} steps at batch {p['batch_size']}, {len(errs('layer', places[0]))} seed(s), "
            f"test error without a norm {pct(np.mean(errs('none', places[0])))} %; " + "; ".join(words))
    if len(ahead) == len(places):
        verdict = "yes"
    elif ahead:
        verdict = ("partly: LayerNorm ahead with the norm of the " + " and ".join(PLACE_NAMES[q] for q in ahead)
                   + ", not of the " + " and ".join(PLACE_NAMES[q] for q in places if q not in ahead))
    elif behind:
        verdict = "no: BatchNorm is better with the norm of the " + " and ".join(PLACE_NAMES[q] for q in behind)
    else:
        verdict = "no clear difference"
    return ["BatchNorm suits sequence models poorly", BOTH,
            "articles: poor in RNNs; LayerNorm paper: LayerNorm trains RNNs faster (no number here)", here, verdict]


def drift_row(exp):
    """Row 12: test error when every test input is shifted or rescaled (module ``robust``)."""
    if exp is None:
        return None
    parts = exp["parts"]
    kinds = list(parts["batch"]["drift"])
    worse = {k: all(_increase(parts["batch"]["drift"][k]) > _increase(parts[m]["drift"][k])
                    for m in ("layer", "group")) for k in kinds}
    size = parts["batch"]["drift"][kinds[0]]["size"][-1]
    here = (f"test error rise when every input drifts by {size:g} (shift x + d / rescale x (1 + d)): "
            + "; ".join(f"{_name(m)} " + " / ".join(f"{100 * _increase(parts[m]['drift'][k]):+.1f}" for k in kinds)
                        for m in ("batch", "layer", "group", "instance", "none") if m in parts) + " points")
    n = sum(worse.values())
    verdict = ("yes" if n == len(kinds) else
               f"partly: BatchNorm worst under {', '.join(k for k in kinds if worse[k])} only" if n else "no")
    return ["BatchNorm suits distribution drift poorly", A2,
            "article 2: poor under strong distribution drift (no number)", here, verdict]


def batch_one_row(exp):
    """Row 14: a batch of one in training mode (module ``probes``)."""
    if exp is None:
        return None
    parts = exp["parts"]
    one = {m: parts[m]["batch_of_one"] for m in ("batch", "group", "layer")}
    raises = one["batch"].get("error") is not None
    calm = [m for m in ("group", "layer") if one[m].get("error") is None and one[m]["alone_change"] <= ALONE_TOL]
    err = one["batch"].get("error") or "no error"
    kind, _, message = err.partition(": ")
    here = (f"BatchNorm1d on one sample of (N, D) features: {kind} (\"{message.split(', got')[0]}\"); "
            f"the CNN's BatchNorm (10 positions per channel) runs, but with each signal alone its test error is "
            f"{pct(one['batch']['alone_error'])} % ({pct(one['batch']['eval_error'])} % in eval mode); GroupNorm, "
            f"LayerNorm: logits move by at most {max(one[m]['alone_change'] for m in ('group', 'layer')):.1e} "
            f"between a batch of one and of 32")
    return ["BatchNorm cannot normalize a batch of one in training", A1,
            "article 1: at batch size 1 the batch's distribution cannot be estimated at all", here,
            "yes" if raises and len(calm) == 2 else "no"]


def experiment_rows(results, complete) -> list:
    """Rows 6-12 of the claims table (see docs/study.md) that ``results`` can test (the
    transformer's row is :func:`normkit.study.claims._vit`); ``complete(results, name)``
    returns an experiment when all its parts are done."""
    rows = [depth_row(complete(results, "depth")), lr_row(complete(results, "lr_range")),
            scale_row(complete(results, "robust")), regularize_row(complete(results, "regularize")),
            style_row(complete(results, "robust")), sequence_row(complete(results, "sequence")),
            drift_row(complete(results, "robust"))]
    return [r for r in rows if r is not None]
