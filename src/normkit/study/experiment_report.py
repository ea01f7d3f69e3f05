"""The report's blocks for the experiments (see :mod:`normkit.study.report` for the block
format): per claim, how it was measured, what came out and the verdict, with its figure;
and the list of the claims this study does not reproduce."""

from __future__ import annotations

from normkit.study import depth, sequence
from normkit.study import experiment_claims as ec
from normkit.study.experiments import complete

__all__ = ["experiment_blocks", "disagreements"]


def _how(results) -> dict:
    """How each experiment measures, from its config (one sentence each)."""
    def cfg(name):
        exp = complete(results, name)
        return exp["config"] if exp else None

    out = {}
    c = cfg("depth")
    if c:
        out["depth"] = (f"A plain network of {depth.DEPTH} hidden layers (Linear {depth.WIDTH} -> norm -> ReLU, "
                        f"PyTorch's default "
                        f"initialisation) on the 40 values of a signal. The gradient of the loss with respect to "
                        f"each layer's output, on 256 training signals, at initialisation and after {c['steps']} "
                        f"SGD steps at batch {c['batch_size']} (peak rate {c['base_lr']:g}, the study's schedule).")
    c = cfg("lr_range")
    if c:
        out["lr_range"] = (f"The study's CNN without normalization and with BatchNorm, {c['steps']} SGD steps at batch "
                           f"32 at each peak rate of {', '.join(f'{v:g}' for v in c['lrs'])}; a rate is usable when "
                           f"the final training loss is at most 0.5.")
    c = cfg("robust")
    if c:
        out["robust"] = ("The grid's seed-0 networks at batch 32 (none, BatchNorm, GroupNorm, LayerNorm, "
                         "InstanceNorm), retrained with the same protocol. In eval mode their test signals are "
                         "changed: each signal its own contrast and brightness (style), or all signals the same "
                         "shift or rescaling (drift). On the same networks: conv2's weight multiplied by 0.1 and 10 "
                         "(training mode, one batch of 32), and single signals in training mode.")
    c = cfg("regularize")
    if c:
        out["regularize"] = (f"The study's CNN on the first {' and '.join(map(str, c['sizes']))} training signals "
                             f"only, {c['steps']} SGD steps at batch {c['batch_size']} (the grid's rate and "
                             f"schedule), seeds {', '.join(map(str, c['seeds']))}: BatchNorm; BatchNorm with the "
                             f"statistics of each {c['ghost']} consecutive signals of a batch (ghost batches: more "
                             "batch noise at the same batch, rate and steps); GroupNorm (no batch noise). Compared: "
                             "the test error, with the training error on those signals beside it (about 0 once "
                             "fitted).")
    c = cfg("sequence")
    if c:
        cells = {"sum": "h(t) = tanh(norm(W_x x(t) + W_h h(t-1))) (the LayerNorm paper's cell)",
                 "recurrent": "h(t) = tanh(W_x x(t) + b + norm(W_h h(t-1))) (the input enters as it is)"}
        out["sequence"] = (f"A recurrent network with {sequence.HIDDEN} units, reading a signal left to right in "
                           f"{40 // c['chunk']} steps of {c['chunk']} values, one norm shared by all steps: "
                           + "; ".join(f"the norm of the {sequence.PLACE_NAMES[q]}, {cells[q]}"
                                       for q in c.get("places", ["sum"]))
                           + f". {c['steps']} AdamW steps (rate {c['lr']:g}) at batch 32, seeds "
                           f"{', '.join(map(str, c['seeds']))}.")
    return out


def _rows(results):
    robust = complete(results, "robust")
    return {"depth": [ec.depth_row(complete(results, "depth"))],
            "lr_range": [ec.lr_row(complete(results, "lr_range"))],
            "regularize": [ec.regularize_row(complete(results, "regularize"))]
            + [ec.grid_gap_row(results, b) for b in sorted(results["protocol"]["batch_sizes"])],
            "robust": [ec.scale_row(robust), ec.style_row(robust), ec.drift_row(robust), ec.batch_one_row(robust)],
            "sequence": [ec.sequence_row(complete(results, "sequence"))]}


def experiment_blocks(results, plots) -> list:
    """The section of the report on rows 6-12 and 14 (the transformer, row 13, has its own)."""
    how = _how(results)
    rows = _rows(results)
    titles = {"depth": "Gradients through depth", "lr_range": "Learning rates",
              "regularize": "Mini-batch noise as a regularizer",
              "robust": "Trained networks under changed inputs, scaled weights and a batch of one",
              "sequence": "A recurrent network"}
    figures = {"depth": [("depth", "Gradient norm per layer at initialisation (left) and after training (right).")],
               "lr_range": [("lr_range", "Final training loss against the peak learning rate; x = diverged.")],
               "robust": [("style", "Test error against the size of per-signal contrast and brightness changes."),
                          ("drift", "Test error when every test input is shifted (left) or rescaled (right).")]}
    blocks = []
    for key, title in titles.items():
        found = [r for r in rows[key] if r is not None]
        if not found:
            continue
        blocks.append(("h2", title))
        if key in how:
            blocks.append(("p", how[key]))
        if key == "regularize":
            blocks.append(("p", "Beside it, the grid's runs: test error minus eval-mode error on 5000 training "
                                "signals, per seed, BatchNorm against GroupNorm at the same batch size. On 24,000 "
                                "signals the networks hardly overfit, so these gaps are small."))
        blocks.append(("ul", [f"{r[0]}: {r[3]} -- {r[4]}" for r in found]))
        error = complete(results, "robust")["parts"]["batch"]["batch_of_one"].get("error") if key == "robust" else None
        if error:
            blocks.append(("p", f"The error normkit's BatchNorm1d raises for a batch of one (N, D) in training "
                                f"mode: {error}"))
        for plot, caption in figures.get(key, []):
            if plot in plots:
                blocks.append(("img", plots[plot], caption))
    return blocks


def disagreements(rows) -> list:
    """Blocks listing the claims table's rows whose verdict is not a plain "yes"."""
    off = [r for r in rows if r[-1] != "yes"]
    if not off:
        return [("h2", "Where this study disagrees with the articles"),
                ("p", "Nowhere: every claim tested reproduces here.")]
    return [("h2", "Where this study disagrees with the articles"),
            ("ul", [f"{r[0]} ({r[1]}): {r[-1]}. Measured: {r[3]}." for r in off])]
