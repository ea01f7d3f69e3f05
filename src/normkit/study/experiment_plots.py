"""The experiments' pictures (matplotlib, Agg backend), each drawn from results.json alone:
gradient norm per layer, final loss against learning rate, test error against per-signal
style changes and against drift."""

from __future__ import annotations

import os

import numpy as np

from normkit.study.analysis import NAMES
from normkit.study.plots import STYLE, _plt, _save, matplotlib_ticker

__all__ = ["EXPERIMENT_PLOTS", "plot_experiments", "plot_depth", "plot_lr_range", "plot_style", "plot_drift"]

EXPERIMENT_PLOTS = {"depth": "study-depth-gradients.png", "lr_range": "study-lr-range.png",
                    "style": "study-style.png", "drift": "study-drift.png"}


def _line(ax, x, y, m, **kw):
    color, ls = STYLE.get(m, ("black", "-"))
    ax.plot(x, y, color=color, ls=ls, marker="o", ms=4, label=NAMES.get(m, m), **kw)


def plot_depth(exp, path):
    """‖dL/dh(l)‖ against layer l, at initialisation and after training, per method."""
    plt = _plt()
    parts = exp["parts"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, when, title in zip(axes, ("init", "trained"), ("at initialisation", "after training")):
        for m, r in parts.items():
            g = r["gradients"][when]["activation"]
            _line(ax, np.arange(1, len(g) + 1), g, m)
        ax.set_yscale("log")
        ax.set_xlabel("hidden layer l (1 = next to the input)")
        steps = next(iter(parts.values()))["steps"]
        ax.set_title(title if when == "init" else f"{title} ({steps} SGD steps)", fontsize=10)
        ax.set_xticks(range(1, len(g) + 1, 2))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("gradient norm ‖dL/dh(l)‖ (log scale)")
    axes[0].legend(fontsize=8)
    depth = next(iter(parts.values()))["depth"]
    fig.suptitle(f"Gradient of the loss at each layer of a {depth}-layer plain network: a flat line is stable, "
                 f"a slope means the gradient vanishes or explodes", fontsize=10)
    _save(plt, fig, path)


def plot_lr_range(exp, path):
    """Final training loss against peak learning rate, BatchNorm and none; x for diverged."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    target = None
    for m, r in exp["parts"].items():
        lrs = [x["lr"] for x in r["runs"]]
        loss = [x["final_train_loss"] if not x["diverged"] else np.nan for x in r["runs"]]
        _line(ax, lrs, loss, m)
        for x in r["runs"]:
            if x["diverged"]:
                ax.plot([x["lr"]], [2.3], marker="x", color=STYLE[m][0], ms=10, mew=2)
        target = r["target"]
        steps, batch = r["steps"], r["batch_size"]
    ax.axhline(target, color="black", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain = matplotlib_ticker().FuncFormatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_major_formatter(plain)
    lo, hi = ax.get_ylim()
    ax.set_yticks([v for v in (0.1, 0.2, 0.3, 0.5, 1, 2, 3) if lo <= v <= hi], minor=False)
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(matplotlib_ticker().NullFormatter())
    ax.text(ax.get_xlim()[0], target, f" target loss {target}", va="bottom", ha="left", fontsize=8)
    ax.set_xlabel("peak learning rate (SGD, log scale)")
    ax.set_ylabel("final training loss (log scale)")
    ax.set_title(f"Learning-rate sweep, {steps} steps at batch {batch}: a rate is usable where the line\n"
                 f"is below the dotted target; the wider that stretch, the wider the usable range", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(plt, fig, path)


def plot_style(exp, path):
    """Test error against the size of per-signal contrast and brightness changes."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, r in exp["parts"].items():
        c = r["style"]
        _line(ax, c["size"], 100 * np.asarray(c["test_error"]), m)
    ax.set_xlabel("size s of the change: contrast x e^(±s), brightness ± s std, drawn per signal")
    ax.set_ylabel("test error (%), eval mode")
    ax.set_title("Each test signal gets its own contrast and brightness: the flattest line ignores "
                 "'style' best", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(plt, fig, path)


def plot_drift(exp, path):
    """Test error when every test input is shifted (left) or rescaled (right)."""
    plt = _plt()
    parts = exp["parts"]
    kinds = list(next(iter(parts.values()))["drift"])
    fig, axes = plt.subplots(1, len(kinds), figsize=(11, 4.2), sharey=True)
    labels = {"shift": "shift d: every input x + d (d in data std)", "rescale": "rescale d: every input x (1 + d)"}
    for ax, k in zip(axes, kinds):
        for m, r in parts.items():
            c = r["drift"][k]
            _line(ax, c["size"], 100 * np.asarray(c["test_error"]), m)
        ax.set_xlabel(labels.get(k, k))
        ax.set_title(f"all test inputs: {k}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test error (%), eval mode")
    axes[0].legend(fontsize=8)
    fig.suptitle("The test data drift after training, the same change for every input: BatchNorm's running "
                 "averages no longer fit;\nper-sample norms re-measure each input, which undoes a rescaling but not "
                 "a shift (except InstanceNorm's, per channel)", fontsize=10)
    _save(plt, fig, path)


def plot_experiments(results, out_dir, complete) -> dict:
    """Draw the figures of the complete experiments into ``out_dir``; ``{key: file}``."""
    out = {}
    for key, name, fn in (("depth", "depth", plot_depth), ("lr_range", "lr_range", plot_lr_range),
                          ("style", "robust", plot_style), ("drift", "robust", plot_drift)):
        exp = complete(results, name)
        if exp is not None:
            fn(exp, os.path.join(out_dir, EXPERIMENT_PLOTS[key]))
            out[key] = EXPERIMENT_PLOTS[key]
    return out
