"""The drawings and the worked example of ``normkit explain``: which numbers share one mean and
variance.

Every picture here is computed from :mod:`normkit.grouping` -- the same description the
layers use -- and never from a second, hand-written one. For a grouping with ``view`` and
``reduce`` dims, element ``x[i]`` belongs to the group numbered by its indices in the
*kept* (not reduced) dims of the view::

    ids = ravel_multi_index(indices(view)[kept dims], view[kept dims]).reshape(x.shape)

so two elements share a mean and variance exactly when they get the same id.

The worked example is the source article's LayerNorm(5) over a (2, 3, 5) tensor, computed
step by step with the float64 reference (:mod:`normkit.reference`):

.. math::

    \\mu = \\frac{1}{5}\\sum_d x_d, \\quad \\sigma^2 = \\frac{1}{5}\\sum_d (x_d - \\mu)^2, \\quad
    \\hat{x}_d = \\frac{x_d - \\mu}{\\sqrt{\\sigma^2 + \\epsilon}}, \\quad y_d = \\gamma_d \\hat{x}_d + \\beta_d
"""

from __future__ import annotations

import os
import string
from dataclasses import dataclass

import numpy as np

from normkit import grouping as G
from normkit import reference

__all__ = ["Explained", "METHODS", "resolve", "group_ids", "explain", "render_text",
           "save_png", "WORKED_INPUT", "worked_example", "render_worked_example", "save_worked_png"]

# the block drawn for the layers: N samples, C channels, H*W positions (small enough to read)
BLOCK = (4, 6, 5)
GN_GROUPS = 3
# the table drawn for the scalers: n_samples rows, n_features columns
TABLE = (6, 5)


@dataclass(frozen=True)
class Explained:
    """One method's grouping of an example block, ready to draw."""

    key: str
    title: str
    rule: str              # one line: what one statistic is taken over
    stat: str              # what is computed per group
    shape: tuple           # the block's shape
    axes: tuple            # names of the block's dims
    grouping: G.Grouping   # where the groups come from
    ids: np.ndarray        # group id of every element, shaped like the block

    @property
    def n_groups(self) -> int:
        return int(self.ids.max()) + 1

    @property
    def group_size(self) -> int:
        return self.grouping.group_size


# key: (title, rule, statistic, block shape, dim names, grouping of that shape)
METHODS = {
    "batch": ("BatchNorm", "one mean and variance per channel, over all N samples and all H*W positions",
              "mean, biased variance", BLOCK, ("N", "C", "H*W"), lambda s: G.batch(s)),
    "layer": ("LayerNorm", "one mean and variance per sample, over all C channels and all H*W positions "
              "(normalized_shape = (C, H*W))", "mean, biased variance", BLOCK, ("N", "C", "H*W"),
              lambda s: G.layer(s, 2)),
    "instance": ("InstanceNorm", "one mean and variance per (sample, channel), over the H*W positions",
                 "mean, biased variance", BLOCK, ("N", "C", "H*W"), lambda s: G.instance(s)),
    "group": (f"GroupNorm (G = {GN_GROUPS})", f"one mean and variance per (sample, group of C/G = "
              f"{BLOCK[1] // GN_GROUPS} channels), over those channels and all H*W positions",
              "mean, biased variance", BLOCK, ("N", "C", "H*W"), lambda s: G.group(s, GN_GROUPS)),
    "rms": ("RMSNorm", "one root mean square per sample, over all C channels and all H*W positions "
            "(the groups of LayerNorm, without subtracting the mean)", "root mean square",
            BLOCK, ("N", "C", "H*W"), lambda s: G.layer(s, 2)),
    "standard-scaler": ("StandardScaler", "one mean and variance per feature (column), over all samples "
                        "(axis 0)", "mean, variance", TABLE, ("sample", "feature"),
                        lambda s: G.dims(s, (0,))),
    "minmax-scaler": ("MinMaxScaler", "one minimum and maximum per feature (column), over all samples "
                      "(axis 0)", "min, max", TABLE, ("sample", "feature"), lambda s: G.dims(s, (0,))),
}

_ALIASES = {
    "bn": "batch", "batchnorm": "batch", "batch-norm": "batch",
    "ln": "layer", "layernorm": "layer", "layer-norm": "layer",
    "in": "instance", "instancenorm": "instance", "instance-norm": "instance",
    "gn": "group", "groupnorm": "group", "group-norm": "group",
    "rmsnorm": "rms", "rms-norm": "rms",
    "standard": "standard-scaler", "standardscaler": "standard-scaler", "scaler": "standard-scaler",
    "minmax": "minmax-scaler", "minmaxscaler": "minmax-scaler",
}


def resolve(name: str) -> str:
    """The method key for ``name`` (``"GroupNorm"``, ``"gn"``, ``"group"`` -> ``"group"``)."""
    key = name.strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(METHODS)} "
                         f"(or leave it out to explain all of them)")
    return key


def group_ids(shape, grouping: G.Grouping) -> np.ndarray:
    """Group number of every element of an array of ``shape`` under ``grouping``.

    The view is a row-major reshape of the array, so the ids computed on the view are
    reshaped back to ``shape`` without any permutation.
    """
    view = tuple(grouping.view)
    if int(np.prod(view)) != int(np.prod(shape)):
        raise ValueError(f"grouping view {view} does not hold an array of shape {tuple(shape)}")
    index = np.indices(view)                                  # ndim(view), *view
    kept = [d for d in range(len(view)) if d not in grouping.reduce]
    if not kept:
        return np.zeros(shape, dtype=np.int64)
    ids = np.ravel_multi_index([index[d] for d in kept], [view[d] for d in kept])
    return ids.reshape(shape)


def explain(method: str) -> Explained:
    """The grouping of ``method``'s example block (see :data:`METHODS`)."""
    key = resolve(method)
    title, rule, stat, shape, axes, make = METHODS[key]
    g = make(shape)
    return Explained(key, title, rule, stat, shape, axes, g, group_ids(shape, g))


# ---------------------------------------------------------------------------------------
# text rendering
# ---------------------------------------------------------------------------------------

_SYMBOLS = string.ascii_uppercase + string.ascii_lowercase + string.digits


def _symbol(i: int) -> str:
    return _SYMBOLS[i % len(_SYMBOLS)]


def render_text(ex: Explained, color: bool = False) -> str:
    """The block as letters, one letter per group; group ``A`` (the one holding the first
    element) is highlighted when ``color`` is true (ANSI reverse video)."""
    mark = (lambda s, i: f"\x1b[7m{s}\x1b[0m" if i == 0 else s) if color else (lambda s, i: s)
    g = ex.grouping
    lines = [f"{ex.title}: {ex.rule}.",
             f"  grouping.{g.kind}: view {tuple(g.view)}, reduce dims {tuple(g.reduce)} -> "
             f"{ex.n_groups} groups of {ex.group_size} elements; {ex.stat} per group."]
    if len(ex.shape) == 3:
        n, c, s = ex.shape
        width = max(s, 3)
        lines.append("        " + "  ".join(f"n={i}".ljust(width) for i in range(n)) + "    (columns: H*W)")
        for ci in range(c):
            cells = ["".join(mark(_symbol(ex.ids[ni, ci, si]), ex.ids[ni, ci, si]) for si in range(s))
                     + " " * (width - s) for ni in range(n)]
            lines.append(f"  c={ci:<3} " + "  ".join(cells))
    else:
        rows, cols = ex.shape
        lines.append("          " + " ".join(f"f{j}" for j in range(cols)) + "    (columns: features)")
        for r in range(rows):
            cells = [mark(_symbol(ex.ids[r, j]), ex.ids[r, j]).ljust(2) if not color
                     else mark(_symbol(ex.ids[r, j]), ex.ids[r, j]) + " " for j in range(cols)]
            lines.append(f"  x{r:<6}  " + " ".join(cells))
    lines.append(f"  Same letter = same {ex.stat.split(',')[0]}; group A holds the first element "
                 f"({ex.group_size} elements).")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# pictures
# ---------------------------------------------------------------------------------------

_HIGHLIGHT = "#2a6fdb"
_OTHER = "#e8e8e8"


def _draw_block(ax, ex: Explained):
    """The (N, C, H*W) block as cubes, like Fig. 2 of the GroupNorm paper: C across, N in
    depth, H*W up; the group of the first element in blue."""
    n, c, s = ex.shape
    filled = np.ones((c, n, s), dtype=bool)                      # x = C, y = N, z = H*W
    ids = np.transpose(ex.ids, (1, 0, 2))                        # C,N,S
    colors = np.where(ids == 0, _HIGHLIGHT, _OTHER).astype(object)
    ax.voxels(filled, facecolors=colors, edgecolors="#555555", linewidth=0.4)
    ax.set_xlabel("C")
    ax.set_ylabel("N")
    ax.set_zlabel("H*W")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_zticks([])
    ax.set_box_aspect((c, n, s))
    ax.view_init(elev=22, azim=-58)
    ax.set_title(ex.title, fontsize=11)


def _draw_table(ax, ex: Explained):
    """The (n_samples, n_features) table with the first column's cells in blue."""
    from matplotlib.patches import Rectangle

    rows, cols = ex.shape
    for r in range(rows):
        for j in range(cols):
            color = _HIGHLIGHT if ex.ids[r, j] == 0 else _OTHER
            ax.add_patch(Rectangle((j, rows - 1 - r), 1, 1, facecolor=color, edgecolor="#555555", linewidth=0.6))
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.set_xticks(np.arange(cols) + 0.5, [f"f{j}" for j in range(cols)])
    ax.set_yticks(np.arange(rows) + 0.5, [f"x{r}" for r in reversed(range(rows))])
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(ex.title, fontsize=11)


def _figure(explained):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(3.4 * len(explained), 3.9))
    for i, ex in enumerate(explained, start=1):
        if len(ex.shape) == 3:
            _draw_block(fig.add_subplot(1, len(explained), i, projection="3d"), ex)
        else:
            _draw_table(fig.add_subplot(1, len(explained), i), ex)
    return fig, plt


def save_png(explained, path) -> str:
    """Draw one or several :class:`Explained` side by side into the PNG ``path``."""
    explained = [explained] if isinstance(explained, Explained) else list(explained)
    fig, plt = _figure(explained)
    blocks = [ex for ex in explained if len(ex.shape) == 3]
    note = (f"blue: the elements that share one statistic (the group of the first element); "
            f"block N={BLOCK[0]}, C={BLOCK[1]}, H*W={BLOCK[2]}" if blocks else
            "blue: the elements that share one statistic (one column)")
    fig.text(0.5, 0.02, note, ha="center", fontsize=9, color="#333333")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return str(path)


# ---------------------------------------------------------------------------------------
# the worked LayerNorm example of the source article
# ---------------------------------------------------------------------------------------

WORKED_INPUT = np.array([[[49, 90, 29, 76, 33], [86, 42, 20, 56, 79], [40, 49, 72, 16, 85]],
                         [[44, 62, 14, 46, 5], [22, 45, 8, 47, 78], [96, 17, 7, 56, 60]]], dtype=np.float64)
WORKED_EPS = 1e-5


def worked_example(x=WORKED_INPUT, eps: float = WORKED_EPS) -> dict:
    """LayerNorm(5) over the last dim of ``x`` with gamma = 1, beta = 0 (a fresh layer).

    Returns ``x``, ``mean`` and ``var`` (one per row, shaped ``x.shape[:-1]``), ``std`` =
    sqrt(var + eps), ``xhat`` and ``out`` (= xhat, since gamma = 1 and beta = 0), all in
    float64 from :func:`normkit.reference.layer_norm_forward`.
    """
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    gamma, beta = np.ones(d), np.zeros(d)
    out, cache = reference.layer_norm_forward(x, (d,), gamma, beta, eps)
    mean = cache["mean"].reshape(x.shape[:-1])
    rstd = cache["rstd"].reshape(x.shape[:-1])
    var = ((x - mean[..., None]) ** 2).mean(axis=-1)
    return dict(x=x, gamma=gamma, beta=beta, eps=eps, mean=mean, var=var, std=1.0 / rstd,
                xhat=(x - mean[..., None]) * rstd[..., None], out=out)


def _fmt_tensor(a, decimals=4) -> str:
    """A (2, 3, 5) array printed in the layout torch uses."""
    width = decimals + 3
    blocks = []
    for block in a:
        rows = ["[" + ", ".join(f"{v:{width}.{decimals}f}" for v in row) + "]" for row in block]
        blocks.append("[" + ",\n  ".join(rows) + "]")
    return "[" + ",\n\n ".join(blocks) + "]"


def _num(v) -> str:
    return f"{v:g}"


def render_worked_example(w: dict | None = None) -> str:
    """The worked example as text: the first row in full, then every row's mu, sigma^2
    and output, then the whole output tensor."""
    w = worked_example() if w is None else w
    x, d = w["x"], w["x"].shape[-1]
    r0, mu0, var0, std0 = x[0, 0], w["mean"][0, 0], w["var"][0, 0], w["std"][0, 0]
    dev = r0 - mu0
    lines = [
        f"Worked example: LayerNorm({d}) over the last dim of x, shape {x.shape} "
        f"(2 sequences, 3 tokens, {d} features).",
        f"A fresh layer has gamma = 1, beta = 0; eps = {w['eps']:g} sits inside the square root.",
        "Each row of 5 numbers gets its own mean and (biased) variance:",
        "",
        f"  row x[0, 0] = [{', '.join(_num(v) for v in r0)}]",
        f"  mu      = ({' + '.join(_num(v) for v in r0)}) / {d} = {_num(r0.sum())} / {d} = {mu0:.4f}",
        f"  sigma^2 = (({') ^ 2 + ('.join(f'{v:.1f}' for v in dev)}) ^ 2) / {d}",
        f"          = ({' + '.join(f'{v:.2f}' for v in dev ** 2)}) / {d} = {var0:.4f}",
        f"  sqrt(sigma^2 + eps) = {std0:.4f}",
        f"  x_hat   = (x - mu) / sqrt(sigma^2 + eps) = [{', '.join(f'{v:.4f}' for v in w['xhat'][0, 0])}]",
        "  y       = gamma * x_hat + beta = x_hat",
        "",
        "  row        mu         sigma^2     y",
    ]
    for i in range(x.shape[0]):
        for t in range(x.shape[1]):
            y = ", ".join(f"{v:7.4f}" for v in w["out"][i, t])
            lines.append(f"  x[{i}, {t}]  {w['mean'][i, t]:8.4f}  {w['var'][i, t]:10.4f}    [{y}]")
    lines += ["", "Output (4 decimals):", _fmt_tensor(w["out"])]
    return "\n".join(lines)


def save_worked_png(path, w: dict | None = None) -> str:
    """The worked example as two heat maps, input and output, with each row's mu and sigma^2."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = worked_example() if w is None else w
    x, out = w["x"].reshape(-1, w["x"].shape[-1]), w["out"].reshape(-1, w["x"].shape[-1])
    labels = [f"x[{i},{t}]" for i in range(w["x"].shape[0]) for t in range(w["x"].shape[1])]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for ax, a, title, fmt in ((axes[0], x, "input x  (row: mu, sigma^2)", "{:.0f}"),
                              (axes[1], out, "LayerNorm(5)(x)", "{:.4f}")):
        ax.imshow(a, cmap="RdBu_r" if a is out else "Greys", vmin=-2 if a is out else 0,
                  vmax=2 if a is out else 120, aspect="auto")
        for r in range(a.shape[0]):
            for c in range(a.shape[1]):
                ax.text(c, r, fmt.format(a[r, c]), ha="center", va="center", fontsize=8)
        ax.set_xticks(range(a.shape[1]), [f"d={c}" for c in range(a.shape[1])])
        ax.set_yticks(range(a.shape[0]), labels if a is x else [""] * a.shape[0])
        ax.set_title(title, fontsize=10)
    stats = [f"{m:.1f}, {v:.1f}" for m, v in zip(w["mean"].ravel(), w["var"].ravel())]
    axes[0].set_yticks(range(x.shape[0]), [f"{lab}  ({s})" for lab, s in zip(labels, stats)], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def write_all(out_dir, methods=None) -> list:
    """Write one PNG per method, one with all of them and the worked example into
    ``out_dir``; return the paths."""
    os.makedirs(out_dir, exist_ok=True)
    keys = [resolve(m) for m in methods] if methods else list(METHODS)
    paths = []
    explained = [explain(k) for k in keys]
    for ex in explained:
        paths.append(save_png(ex, os.path.join(out_dir, f"explain-{ex.key}.png")))
    if len(explained) > 1:
        layers = [ex for ex in explained if len(ex.shape) == 3 and ex.key != "rms"]
        if layers:
            paths.append(save_png(layers, os.path.join(out_dir, "explain-layers.png")))
    if "layer" in keys:
        paths.append(save_worked_png(os.path.join(out_dir, "layernorm-example.png")))
    return paths
