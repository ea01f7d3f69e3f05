"""``report.md`` and a self-contained ``report.html`` from one list of blocks.

The report is built once as a list of blocks -- ``("h1"|"h2"|"p", text)``,
``("ul", items)``, ``("table", header, rows)``, ``("img", file, caption)`` -- and rendered
twice, so the Markdown and the HTML always say the same thing. The HTML embeds every image
as base64 and needs no other file.
"""

from __future__ import annotations

import base64
import html
import json
import os

from normkit.study import analysis
from normkit.study.analysis import NAMES, PAPER, TARGET_LOSS, pct, reference_batch

__all__ = ["build", "render_markdown", "render_html", "write_report", "error_table"]


def _cell(stat) -> str:
    """A test-error cell: mean ± std in percent (the same string in both reports)."""
    return f"{pct(stat['mean'])} ± {pct(stat['std'])}"


def error_table(summary, protocol, metric="test_error"):
    """(header, rows) of ``metric`` in percent, one row per method, one column per batch."""
    bs = sorted(protocol["batch_sizes"])
    header = ["method"] + [f"batch {b}" for b in bs]
    rows = []
    for m in protocol["methods"]:
        rows.append([NAMES.get(m, m)] + [_cell(summary[m][str(b)][metric]) if str(b) in summary[m] else "--"
                                         for b in bs])
    return header, rows


def build(results, summary, found, plots) -> list:
    p = results["protocol"]
    t = p["train"]
    bs = sorted(p["batch_sizes"])
    ref = reference_batch(bs)
    n_seeds = len(p["seeds"])
    blocks = [("h1", "normkit study: what normalization does, and when each kind fails")]
    if p.get("quick"):
        blocks.append(("p", "This is a --quick run (a few hundred images, one epoch): it checks that the "
                            "pipeline works and its numbers mean nothing. Run `normkit study` for the real one."))
    blocks += [
        ("h2", "Findings"),
        ("p", "Computed from the numbers below; where this small study disagrees with the GroupNorm paper "
              "(Wu & He 2018, ResNet-50 on ImageNet) it says so."),
        ("ul", found),
        ("h2", "Test error (%) by method and batch size"),
        ("p", f"Eval mode (BatchNorm uses its running averages); mean ± std over {n_seeds} seed(s), "
              f"{p['test_images']} test images."),
        ("table", *error_table(summary, p)),
        ("img", plots["batch_size"], "Test error against batch size (x axis from large to small batches, "
                                     "as in the GroupNorm paper's Figure 1)."),
        ("p", "The GroupNorm paper, for comparison (ResNet-50, ImageNet, top-1 error % by images per GPU):"),
        ("table", ["method"] + [f"batch {b}" for b in sorted(PAPER["batch"], reverse=True)],
         [[NAMES[m]] + [f"{PAPER[m][b]}" for b in sorted(PAPER[m], reverse=True)] for m in ("batch", "group")]),
        ("h2", "Training with and without normalization"),
        ("img", plots["loss_curves"], f"Training loss at batch {ref}, mean over seeds; the triangles mark the "
                                      f"first step at which the loss is at most {TARGET_LOSS}."),
        ("img", plots["train_loss"], "Final training loss against batch size."),
        ("h2", "BatchNorm in training mode and in eval mode"),
        ("p", "Training mode normalizes each test batch (of the training batch size) with its own statistics; "
              "eval mode uses the running averages collected during training. Only the batch-dependent "
              "methods can differ."),
        ("table", *error_table(summary, p, "test_error_train_mode")),
        ("img", plots["train_eval"], "Left: BatchNorm's test error in both modes. Right: the gap for every "
                                     "method."),
        ("h2", "Protocol"),
        ("ul", [
            f"Data: {p['dataset']} (bundled with scikit-learn, nothing downloaded), 8 x 8 grey images, 10 classes; "
            f"a fixed split of {p['train_images']} training and {p['test_images']} test images, inputs scaled "
            f"by one mean and standard deviation from the training images.",
            f"Model: {p['model']}; the normalization after every convolution is the only difference. "
            f"Layers from {p['layer_source']}. LayerNorm and RMSNorm normalize (C, H, W) per image, GroupNorm "
            f"uses min(8, C) groups, InstanceNorm has affine=True.",
            f"Budget: {t['epochs']} epochs for every batch size, so batch B takes {t['epochs']} x "
            f"floor({p['train_images']} / B) steps (from "
            + ", ".join(f"{summary[p['methods'][0]][str(b)]['steps']} at {b}" for b in bs
                        if str(b) in summary[p['methods'][0]]) + ").",
            f"Optimizer: SGD, momentum {t['momentum']}, weight decay {t['weight_decay']}; learning rate by the "
            f"linear scaling rule lr = {t['base_lr']} x B / {t['reference_batch']} (Goyal et al. 2017, as the "
            f"GroupNorm paper does), {t['warmup_epochs']:g} epoch linear warm-up, cosine decay to 0.",
            f"Seeds: {', '.join(map(str, p['seeds']))}; a seed fixes the initial weights and the shuffling. "
            f"Standard deviations are over seeds (ddof = 1).",
            "Measured: test error in eval mode and in training mode, final training loss, steps to reach "
            f"training loss {TARGET_LOSS}, and how much one image's logits move when its batch-mates change.",
            f"Wall time of all runs: {results['elapsed_seconds']:.0f} s. Every number is in results.json.",
        ]),
    ]
    return blocks


def _md_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def render_markdown(blocks) -> str:
    out = []
    for b in blocks:
        kind = b[0]
        if kind == "h1":
            out.append(f"# {b[1]}")
        elif kind == "h2":
            out.append(f"## {b[1]}")
        elif kind == "p":
            out.append(b[1])
        elif kind == "ul":
            out.append("\n".join(f"- {item}" for item in b[1]))
        elif kind == "table":
            out.append(_md_table(b[1], b[2]))
        elif kind == "img":
            out.append(f"![{b[2]}]({b[1]})\n\n*{b[2]}*")
    return "\n\n".join(out) + "\n"


def render_html(blocks, out_dir) -> str:
    esc = html.escape
    body = []
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2", "p"):
            body.append(f"<{kind}>{esc(b[1])}</{kind}>")
        elif kind == "ul":
            body.append("<ul>" + "".join(f"<li>{esc(i)}</li>" for i in b[1]) + "</ul>")
        elif kind == "table":
            head = "".join(f"<th>{esc(h)}</th>" for h in b[1])
            rows = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in b[2])
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif kind == "img":
            with open(os.path.join(out_dir, b[1]), "rb") as f:
                data = base64.b64encode(f.read()).decode("ascii")
            body.append(f'<figure><img alt="{esc(b[2])}" src="data:image/png;base64,{data}">'
                        f"<figcaption>{esc(b[2])}</figcaption></figure>")
    style = ("body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;"
             "line-height:1.45;color:#222}table{border-collapse:collapse;margin:1rem 0;font-size:.9rem}"
             "td,th{border:1px solid #ccc;padding:.25rem .5rem;text-align:right}td:first-child,"
             "th:first-child{text-align:left}img{max-width:100%}figcaption{font-size:.85rem;color:#555}")
    title = esc(blocks[0][1]) if blocks and blocks[0][0] == "h1" else "normkit study"
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title}</title>"
            f"<style>{style}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")


def write_report(results, out_dir) -> dict:
    """Summarize, plot and write results.json (with summary and findings), report.md and
    report.html into ``out_dir``; return the results dict as written."""
    from normkit.study.plots import plot_all

    summary = analysis.summarize(results)
    found = analysis.findings(results, summary)
    plots = plot_all(results, summary, out_dir)
    results = dict(results, summary=summary, findings=found)
    with open(os.path.join(out_dir, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, allow_nan=True)
    blocks = build(results, summary, found, plots)
    with open(os.path.join(out_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write(render_markdown(blocks))
    with open(os.path.join(out_dir, "report.html"), "w", encoding="utf-8") as f:
        f.write(render_html(blocks, out_dir))
    return results
