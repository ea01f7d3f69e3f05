"""The claims of the source articles that the study tests, each with the size of the effect
in the paper it comes from, the size measured here and a verdict -- all computed from the
results, none written in advance.

``claims(results, summary, vit)`` returns rows ``[claim, source, paper, here, verdict]``; either
``results`` (the CNN grid) or ``vit`` (the transformer runs) may be None, and a claim whose
runs are missing is left out.
"""

from __future__ import annotations

import math

from normkit.study.analysis import (NAMES, PAPER, STEADIER, crossover, pct, reference_batch,
                                    steps_to_target, target_loss)
from normkit.study.experiment_claims import A1, A2, BOTH, batch_one_row, experiment_rows
from normkit.study.experiments import complete
from normkit.study.shift import movement

__all__ = ["HEADER", "claims"]

HEADER = ["claim of the articles", "from", "paper or article", "here", "reproduced?"]


def _verdict(ok) -> str:
    return "yes" if ok else "no"


def _cell(summary, m, b):
    return summary.get(m, {}).get(str(b))


def _speed(results, summary):
    bs = sorted(results["protocol"]["batch_sizes"])
    ref = reference_batch(bs)
    none, bn = _cell(summary, "none", ref), _cell(summary, "batch", ref)
    if none is None or bn is None or bn["steps_to_target"]["n"] == 0:
        return None
    s_bn, total, target = bn["steps_to_target"]["mean"], none["steps"], target_loss(results["protocol"])
    if none["steps_to_target"]["n"] == 0:
        here = (f"none never reaches loss {target} in {total} steps at batch {ref}; BatchNorm at step {s_bn:.0f} "
                f"(> {total / s_bn:.1f}x fewer)")
        ok = True
    else:
        s_none = none["steps_to_target"]["mean"]
        here = (f"loss {target} at batch {ref}: none step {s_none:.0f}, BatchNorm {s_bn:.0f} "
                f"({s_none / s_bn:.1f}x fewer)")
        ok = s_bn < s_none
    return ["Normalization speeds up training", A1, "BatchNorm paper: Inception's accuracy in 14x fewer steps", here,
            _verdict(ok)]


def _small_batch(results, summary):
    bs = sorted(results["protocol"]["batch_sizes"])
    c = crossover(summary, bs)
    if c is None:
        return None
    small, ref = c["small"], reference_batch(bs)
    bn_s, bn_r, gn_s = _cell(summary, "batch", small), _cell(summary, "batch", ref), _cell(summary, "group", small)
    here = (f"BatchNorm {pct(bn_s['test_error']['mean'])} % at {small}, {pct(bn_r['test_error']['mean'])} % at {ref} "
            f"({100 * (bn_s['test_error']['mean'] - bn_r['test_error']['mean']):+.2f} points); GroupNorm "
            f"{pct(gn_s['test_error']['mean'])} % at {small}")
    paper = (f"GroupNorm paper: BatchNorm {PAPER['batch'][2]} % at 2, {PAPER['batch'][32]} % at 32 "
             f"(+{PAPER['batch'][2] - PAPER['batch'][32]:.1f}); GroupNorm {PAPER['group'][2]} % at 2")
    return ["BatchNorm fails at small batch; GroupNorm does not", BOTH, paper, here,
            _verdict(c["ok_large"] and c["ok_group"])]


def _batch_free(results, summary):
    bs = sorted(results["protocol"]["batch_sizes"])
    per_sample = [m for m in ("group", "layer", "instance", "rms") if summary.get(m)]
    if not per_sample or not summary.get("batch"):
        return None
    dep = max(c["batch_dependence"]["mean"] for m in per_sample for c in summary[m].values())
    bn_dep = min(c["batch_dependence"]["mean"] for c in summary["batch"].values())
    gn = [summary["group"][str(b)]["test_error"]["mean"] for b in bs if str(b) in summary.get("group", {})]
    spread = (f"; GroupNorm's error spans {100 * (max(gn) - min(gn)):.2f} points over batch {bs[0]}-{bs[-1]}"
              if gn else "")
    here = (f"a sample's logits move by at most {dep:.1e} when its batch-mates change (BatchNorm: >= {bn_dep:.2f})"
            + spread)
    return ["LayerNorm, GroupNorm, InstanceNorm do not depend on the batch", A2,
            "GroupNorm paper: GroupNorm 24.0-24.2 % from 32 to 2 per GPU (0.2 points)", here,
            _verdict(dep < 1e-4 < bn_dep)]


def _train_eval(results, summary):
    bs = sorted(results["protocol"]["batch_sizes"])
    cell = _cell(summary, "batch", bs[0])
    if cell is None:
        return None
    gap = cell["test_error_train_mode"]["mean"] - cell["test_error"]["mean"]
    here = (f"BatchNorm's test error with batch statistics minus with running averages: {100 * gap:+.2f} points "
            f"at batch {bs[0]}")
    return ["BatchNorm differs between training and eval", A2, "articles: running averages replace batch statistics "
            "at inference (no number)", here, _verdict(abs(gap) > 0.005)]


def _shift(results):
    runs = {r["method"]: r for r in results["runs"] if "shift" in r}
    if "none" not in runs or "batch" not in runs:
        return None
    none, bn = movement(runs["none"]["shift"])[50], movement(runs["batch"]["shift"])[50]
    here = (f"median of a channel's input to ReLU travels {none:.2f} spreads without normalization, {bn:.2f} "
            f"with BatchNorm")
    return ["Normalization fights the shift of each layer's input (internal covariate shift)", BOTH,
            "BatchNorm paper, Figure 1: percentiles drift without BatchNorm, stay put with it (no number)", here,
            _verdict(bn < STEADIER * none)]


def _vit(vit):
    p = vit["protocol"]
    target = p["target_loss"]
    if "layer" not in p["methods"]:
        return None

    def runs(m):
        return [r for r in vit["runs"] if r["method"] == m and not r["diverged"]]

    def reached(m):
        return sum(math.isfinite(steps_to_target(r, target)) for r in runs(m))

    def best(m):
        return min((r["test_error"] for r in runs(m)), default=float("nan"))

    def dependence(m):
        return max((r["batch_dependence"] for r in runs(m)), default=float("nan"))

    others = [m for m in p["methods"] if m != "layer"]
    here = (f"LayerNorm reaches loss {target} at {reached('layer')} of {len(p['lrs'])} learning rates, best test "
            f"error {pct(best('layer'))} %; "
            + "; ".join(f"{NAMES.get(m, m)}{' over tokens' if m == 'batch' else ''} at {reached(m)}, best "
                        f"{pct(best(m))} %" for m in others)
            + f". Batch dependence: LayerNorm {dependence('layer'):.1e}"
            + (f", BatchNorm over tokens {dependence('batch'):.1e}" if "batch" in others else ""))
    trains = reached("layer") == len(p["lrs"])
    alone = dependence("layer") < 1e-4 and ("batch" not in others or dependence("batch") > 1e-3)
    ahead = all(best("layer") <= best(m) for m in others if runs(m))
    verdict = ("yes" if trains and alone and ahead else
               "partly: LayerNorm trains at every rate and keeps tokens batch-independent, but is not the best "
               "here" if trains and alone else "no")
    return ["Transformers (SigLIP) normalize each token with LayerNorm, not BatchNorm", A1,
            "SigLIP's vision tower: LayerNorm in every block and post_layernorm (design, no number)", here,
            verdict]


def claims(results: dict | None, summary: dict | None, vit: dict | None) -> list:
    """Rows ``[claim, source, paper, here, verdict]`` for the claims the available runs can
    test: the grid's five, the experiments' (:mod:`normkit.study.experiment_claims`), the
    transformer's, and the batch of one."""
    rows = []
    if results is not None:
        rows += [_speed(results, summary), _small_batch(results, summary), _train_eval(results, summary),
                 _batch_free(results, summary), _shift(results)]
        rows += experiment_rows(results, complete)
    if vit is not None:
        rows.append(_vit(vit))
    if results is not None:
        rows.append(batch_one_row(complete(results, "robust")))
    return [r for r in rows if r is not None]
