"""``normkit explain [METHOD]``: which elements share one mean and variance, as letters in
the terminal and (with --out) as PNG pictures, plus the source article's LayerNorm example
worked step by step."""

from __future__ import annotations

import os
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "explain", help="show which elements share statistics for each method; walk a LayerNorm example",
        description="Draw an (N, C, H*W) block (or an (n_samples, n_features) table for the scalers) with "
                    "the elements that share one mean and variance marked, taken from normkit.grouping; "
                    "then compute the source article's LayerNorm(5) example step by step.")
    p.add_argument("method", nargs="?", help="batch, layer, instance, group, rms, standard-scaler or "
                                             "minmax-scaler (default: all)")
    p.add_argument("--out", help="also write the pictures as PNG files into this folder")
    p.set_defaults(func=run)


def run(args) -> int:
    from normkit.cli import out_folder_refusal
    from normkit.cli.explain import drawing as ex

    try:
        keys = [ex.resolve(args.method)] if args.method else list(ex.METHODS)
    except ValueError as e:
        print(f"normkit explain: {e}", file=sys.stderr)
        return 2
    refusal = args.out and out_folder_refusal("explain", args.out)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    for key in keys:
        print(ex.render_text(ex.explain(key), color=color))
        print()
    if "layer" in keys:
        print(ex.render_worked_example())
    if args.out:
        try:
            paths = ex.write_all(args.out, keys)
        except ImportError as e:
            print(f"normkit explain: pictures need matplotlib ({e}); install it with "
                  f"pip install 'normkit[study]'", file=sys.stderr)
            return 2
        print()
        print("Wrote " + ", ".join(paths))
    return 0
