"""The study's pictures (matplotlib, Agg backend), each drawn from the summary alone."""

from __future__ import annotations

import os

import numpy as np

from normkit.study.analysis import NAMES, reference_batch, target_loss
from normkit.study.shift import movement

__all__ = ["plot_all", "plot_vit", "PLOTS", "SHIFT_PLOT", "VIT_PLOT"]

PLOTS = {
    "batch_size": "study-batch-size.png",
    "loss_curves": "study-loss-curves.png",
    "train_eval": "study-bn-train-eval.png",
    "train_loss": "study-train-loss.png",
}
SHIFT_PLOT = "study-covariate-shift.png"
VIT_PLOT = "study-vit.png"
STYLE = {"none": ("#777777", "--"), "batch": ("#d62728", "-"), "batchrenorm": ("#ff7f0e", "-"),
         "group": ("#1f77b4", "-"), "layer": ("#2ca02c", "-"), "instance": ("#9467bd", "-"),
         "rms": ("#8c564b", "-")}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def matplotlib_ticker():
    import matplotlib.ticker

    return matplotlib.ticker


def _save(plt, fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _label_and_save(plt, fig, axes, ylabel, title, path):
    """A row of panels: y label and legend on the first, one title over all, then save."""
    axes[0][0].set_ylabel(ylabel)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    _save(plt, fig, path)


def _series(summary, method, batch_sizes, metric):
    bs = [b for b in batch_sizes if str(b) in summary[method]]
    mean = np.array([summary[method][str(b)][metric]["mean"] for b in bs])
    std = np.array([summary[method][str(b)][metric]["std"] for b in bs])
    return np.array(bs), mean, std


def _batch_axis(ax, batch_sizes):
    ax.set_xscale("log", base=2)
    ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
    ax.minorticks_off()
    ax.invert_xaxis()  # large to small, as in the GroupNorm paper's figure
    ax.set_xlabel("batch size (images per step)")
    ax.grid(alpha=0.3)


def _per_method(ax, summary, protocol, bs, key, scale):
    """One errorbar line per method of ``key`` (mean ± std over seeds, times ``scale``)
    against batch size, on the batch-size axis."""
    for m in protocol["methods"]:
        x, mean, std = _series(summary, m, bs, key)
        color, ls = STYLE.get(m, ("black", "-"))
        ax.errorbar(x, scale * mean, yerr=scale * std, color=color, ls=ls, marker="o", ms=4,
                    capsize=3, label=NAMES.get(m, m))
    _batch_axis(ax, bs)


def plot_batch_size(summary, protocol, path):
    """Test error against batch size per method (mean ± std over seeds), the paper's figure."""
    plt = _plt()
    bs = sorted(protocol["batch_sizes"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _per_method(ax, summary, protocol, bs, "test_error", 100)
    ax.set_yscale("log")  # methods at 1 % and at 40 % on one readable axis
    plain = matplotlib_ticker().FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)  # a range within one decade is labelled by minor ticks only
    ax.set_ylabel("test error (%), eval mode, log scale")
    n = len(protocol["seeds"])
    t = protocol["train"]
    floor = f", >= {t['min_steps']} steps" if t.get("min_steps") else ""
    epochs = f"{t['epochs']} epoch{'s' if t['epochs'] != 1 else ''}"
    ax.set_title(f"Test error vs batch size ({protocol['dataset']}, {epochs}{floor}, "
                 f"mean ± std of {n} seed{'s' if n > 1 else ''})", fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    _save(plt, fig, path)


def plot_loss_curves(results, summary, protocol, path):
    """Training loss against steps at the reference batch, mean over seeds, with the step at
    which each method first reaches the target loss marked."""
    target = target_loss(protocol)
    plt = _plt()
    ref = reference_batch(protocol["batch_sizes"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in protocol["methods"]:
        runs = [r for r in results["runs"] if r["method"] == m and r["batch_size"] == ref
                and r["seed"] in protocol["seeds"] and not r["diverged"]]
        if not runs:
            continue
        steps = np.array(runs[0]["loss_curve"]["step"])
        length = min(len(r["loss_curve"]["loss"]) for r in runs)
        loss = np.mean([r["loss_curve"]["loss"][:length] for r in runs], axis=0)
        color, ls = STYLE.get(m, ("black", "-"))
        ax.plot(steps[:length], loss, color=color, ls=ls, label=NAMES.get(m, m))
        s = summary[m][str(ref)]["steps_to_target"]["mean"]
        if np.isfinite(s):
            ax.plot([s], [target], marker="v", color=color, ms=7)
    ax.axhline(target, color="black", lw=0.8, ls=":")
    ax.text(ax.get_xlim()[1], target, f" target {target}", va="bottom", ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel(f"step (batch {ref})")
    ax.set_ylabel("training loss (cross-entropy, windowed mean)")
    ax.set_title(f"Training loss with and without normalization, batch {ref}; ▼ = first step at loss "
                 f"≤ {target}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    _save(plt, fig, path)


def plot_train_eval(summary, protocol, path):
    """BatchNorm in eval mode (running averages) against training mode (each test batch's
    own statistics), next to the same gap for every method."""
    plt = _plt()
    bs = sorted(protocol["batch_sizes"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.3))
    for m in ("batch", "batchrenorm"):
        if m not in summary:
            continue
        color, _ = STYLE[m]
        for metric, ls, what in (("test_error", "-", "eval mode"), ("test_error_train_mode", "--", "train mode")):
            x, mean, std = _series(summary, m, bs, metric)
            ax1.errorbar(x, 100 * mean, yerr=100 * std, color=color, ls=ls, marker="o", ms=4, capsize=3,
                         label=f"{NAMES[m]}, {what}")
    _batch_axis(ax1, bs)
    ax1.set_ylabel("test error (%)")
    ax1.set_title("BatchNorm: running averages (eval) vs batch statistics (train)", fontsize=10)
    if ax1.get_legend_handles_labels()[0]:      # a grid without BatchNorm leaves it empty
        ax1.legend(fontsize=8)
    for m in protocol["methods"]:
        x, ev, _ = _series(summary, m, bs, "test_error")
        _, tr, _ = _series(summary, m, bs, "test_error_train_mode")
        color, ls = STYLE.get(m, ("black", "-"))
        ax2.plot(x, 100 * (tr - ev), color=color, ls=ls, marker="o", ms=4, label=NAMES.get(m, m))
    _batch_axis(ax2, bs)
    ax2.axhline(0, color="black", lw=0.8)
    ax2.set_ylabel("train-mode minus eval-mode test error (points)")
    ax2.set_title("Train/eval gap of every method (0 = batch-independent)", fontsize=10)
    ax2.legend(fontsize=8, ncol=2)
    _save(plt, fig, path)


def plot_train_loss(summary, protocol, path):
    """Final training loss against batch size: how well each method fits the training set."""
    plt = _plt()
    bs = sorted(protocol["batch_sizes"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _per_method(ax, summary, protocol, bs, "final_train_loss", 1)
    ax.set_yscale("log")
    ax.set_ylabel("final training loss (last window)")
    ax.set_title("Training loss at the end of the budget vs batch size", fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    _save(plt, fig, path)


def plot_shift(runs, path):
    """The BatchNorm paper's Figure 1 (b, c): the 15th, 50th and 85th percentiles of one
    channel's pre-activation over training, one panel per method."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(runs), figsize=(3.2 * len(runs), 3.4), sharex=True, squeeze=False)
    for ax, r in zip(axes[0], runs):
        v = np.asarray(r["shift"]["values"])  # T,3,C
        color, _ = STYLE.get(r["method"], ("black", "-"))
        for i, p in enumerate(r["shift"]["percentiles"]):
            ax.plot(r["shift"]["step"], v[:, i, 0], color=color, lw=2 if p == 50 else 1,
                    ls="-" if p == 50 else "--", label=f"{p}th")
        travel = movement(r["shift"])
        ax.set_title(f"{NAMES.get(r['method'], r['method'])}\nmedian moves {travel[50]:.2f} spreads",
                     fontsize=9)
        ax.set_xlabel(f"step (batch {r['batch_size']})")
        ax.grid(alpha=0.3)
    _label_and_save(plt, fig, axes, "pre-activation, channel 0 of block 3",
                    "Internal covariate shift: 15th / 50th / 85th percentile of one channel's input to ReLU "
                    "over training", path)


def plot_vit(vit, path):
    """Training loss of the small ViT with each norm, one panel per learning rate; an x marks
    the last step of a run that diverged."""
    plt = _plt()
    p = vit["protocol"]
    lrs = p["lrs"]
    fig, axes = plt.subplots(1, len(lrs), figsize=(4 * len(lrs), 3.6), sharey=True, squeeze=False)
    for ax, lr in zip(axes[0], lrs):
        for m in p["methods"]:
            runs = [r for r in vit["runs"] if r["method"] == m and r["lr"] == lr]
            if not runs:
                continue
            r = runs[0]
            color, ls = STYLE.get(m, ("black", "-"))
            label = NAMES.get(m, m) + (" (over tokens)" if m == "batch" else "")
            ax.plot(r["loss_curve"]["step"], r["loss_curve"]["loss"], color=color, ls=ls, label=label)
            if r["diverged"]:
                ax.plot([r["steps"]], [r["loss_curve"]["loss"][-1] if r["loss_curve"]["loss"] else 2.3],
                        marker="x", color=color, ms=10, mew=2)
        ax.axhline(p["target_loss"], color="black", lw=0.8, ls=":")
        ax.set_yscale("log")
        ax.set_title(f"peak learning rate {lr:g}", fontsize=10)
        ax.set_xlabel(f"step (batch {p['batch_size']})")
        ax.grid(alpha=0.3)
    _label_and_save(plt, fig, axes, "training loss (windowed mean)",
                    "Small SigLIP-style ViT on MNIST-1D: the norm in every block and at the end (x = diverged)",
                    path)


def plot_all(results, summary, out_dir) -> dict:
    """Draw every plot into ``out_dir``; return ``{key: file name}`` (``shift`` only when
    some run recorded the covariate shift)."""
    p = results["protocol"]
    plot_batch_size(summary, p, os.path.join(out_dir, PLOTS["batch_size"]))
    plot_loss_curves(results, summary, p, os.path.join(out_dir, PLOTS["loss_curves"]))
    plot_train_eval(summary, p, os.path.join(out_dir, PLOTS["train_eval"]))
    plot_train_loss(summary, p, os.path.join(out_dir, PLOTS["train_loss"]))
    plots = dict(PLOTS)
    shift_runs = [r for r in results["runs"] if "shift" in r]
    if shift_runs:
        plot_shift(shift_runs, os.path.join(out_dir, SHIFT_PLOT))
        plots["shift"] = SHIFT_PLOT
    return plots
